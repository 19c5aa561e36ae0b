/* A statistic over steps: one or two polylines with min/max labels, plain SVG. */
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined || v === "") return "–";
    const x = Number(v);
    if (!Number.isFinite(x)) return String(v);
    return Number.isInteger(x) && Math.abs(x) < 1e7 ? String(x) : x.toPrecision(4);
  }

  // series: [{label, cls, points: [[step, value|null], ...]}], cursor: step or null
  function draw(svg, series, cursor) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const W = svg.clientWidth || 360, H = svg.clientHeight || 200, L = 56, R = 8, T = 8, B = 22;
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null));
    if (!pts.length) {
      el("text", { x: L, y: H / 2 }, svg).textContent = "no finite values for this selection";
      return;
    }
    let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
    let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    el("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }, svg);
    el("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }, svg);
    el("text", { x: 2, y: T + 8 }, svg).textContent = fmt(y1);
    el("text", { x: 2, y: H - B }, svg).textContent = fmt(y0);
    el("text", { x: L, y: H - 6 }, svg).textContent = `step ${x0}`;
    el("text", { x: W - R - 60, y: H - 6 }, svg).textContent = `step ${x1}`;
    if (cursor !== null && cursor >= x0 && cursor <= x1) {
      el("line", { class: "cursor", x1: sx(cursor), y1: T, x2: sx(cursor), y2: H - B }, svg);
    }
    series.forEach((s, i) => {
      const ly = T + 10 + 12 * i;
      el("line", { class: s.cls, x1: W - R - 110, y1: ly - 3, x2: W - R - 92, y2: ly - 3 }, svg);
      el("text", { x: W - R - 88, y: ly }, svg).textContent = s.label;
    });
    series.forEach((s) => {
      // a null breaks the line instead of drawing through a missing value
      let run = [];
      const flush = () => {
        if (run.length) el("polyline", { class: s.cls, points: run.join(" ") }, svg);
        if (run.length === 1) {
          const [x, y] = run[0].split(",");
          el("circle", { cx: x, cy: y, r: 2.5, class: s.cls }, svg);
        }
        run = [];
      };
      s.points.forEach(([x, y]) => { if (y === null) flush(); else run.push(`${sx(x)},${sy(y)}`); });
      flush();
    });
  }
  window.NNPlot = { draw, fmt };
})();
