/* Charts through the vendored uPlot (static/vendor): line charts with hover values in the
   legend, drag-to-zoom (double-click resets), a log-scale option and one line per layer.
   The only drawing done here is the dashed marker of the selected step (a uPlot draw hook). */
"use strict";
(function () {
  const PALETTE = ["#4c78a8", "#e45756", "#54a24b", "#f58518", "#b279a2", "#72b7b2",
    "#ff9da6", "#9d755d", "#bab0ac", "#eeca3b"];

  // the i-th line's colour: the palette, then hues a golden angle apart (a 28-layer chart gets
  // 28 distinguishable lines, not the palette's 10 three times over)
  function color(i) {
    if (i < PALETTE.length) return PALETTE[i];
    const k = i - PALETTE.length;
    return `hsl(${Math.round((k * 137.508 + 20) % 360)}, ${[70, 50, 85][k % 3]}%, ` +
      `${[42, 32, 55][Math.floor(k / 3) % 3]}%)`;
  }

  const STEP_INCRS = [];
  for (let e = 1; e <= 1e12; e *= 10) STEP_INCRS.push(e, 2 * e, 5 * e);

  function fmt(v) {
    if (v === null || v === undefined || v === "") return "–";
    const x = Number(v);
    if (!Number.isFinite(x)) return String(v);
    return Number.isInteger(x) && Math.abs(x) < 1e7 ? String(x) : x.toPrecision(4);
  }

  // exponent of the last significant digit of a tick increment: 0.25 -> -2, 25 -> 0, 2e6 -> 6
  function lastDigit(incr) {
    let e = Math.floor(Math.log10(incr));
    for (let k = 0; k < 16; k += 1, e -= 1) {
      const q = incr / Math.pow(10, e);
      if (Math.abs(q - Math.round(q)) < 1e-9 * Math.max(1, q)) return e;
    }
    return e;
  }

  // One tick label. Ticks are multiples of the increment, so the increment's last significant
  // digit is the last digit every label needs: 0.25, 0.5, 0.75 -> "0.25" "0.50" "0.75" (not
  // "0.3" "0.5" "0.8", which taking the digits from the increment's order of magnitude gave)
  // and 0.0010-0.0013 -> "0.0010" ... (uPlot's default repeats "0.001").
  function tickLabel(v, incr) {
    if (v === null || v === undefined) return "";
    if (v === 0 || !(incr > 0)) return String(v);
    const e = lastDigit(incr);
    const a = Math.abs(v);
    if (a < 1e-4 || a >= 1e6) {
      const p = Math.min(Math.max(Math.floor(Math.log10(a)) - e + 1, 1), 16);
      return v.toExponential(p - 1);
    }
    return v.toFixed(Math.min(Math.max(-e, 0), 16));
  }

  function ticks(u, vals, axis, space, incr) {
    return vals.map((v) => tickLabel(v, incr));
  }

  function note(text) {
    const p = document.createElement("p");
    p.className = "hint";
    p.textContent = text;
    return p;
  }

  // a dashed vertical line at x = marker (the recorder's selected step)
  function markerPlugin(marker) {
    return { hooks: { draw: [(u) => {
      if (marker === null || marker === undefined) return;
      const x = u.valToPos(marker, "x", true);
      if (!(x >= u.bbox.left && x <= u.bbox.left + u.bbox.width)) return;
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = "#111";
      ctx.setLineDash([3, 3]);
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
      ctx.restore();
    }] } };
  }

  /* A line chart in `box` (emptied first).
     opts: {title, x: [numbers ascending], series: [{label, values: [number|null], dash}],
            log: bool, marker: x|null, height, xLabel, sync: key}
     Returns the uPlot instance, or null when no series has a finite value (a note says so). */
  function line(box, opts) {
    box.replaceChildren();
    const log = !!opts.log;
    let hidden = 0;
    let nonfinite = 0;  // Inf/NaN values: not drawable, counted and said below the chart
    // uPlot breaks a line at null and draws across undefined: null = a gap the data has (NaN,
    // a value a log axis cannot place), undefined = nothing logged at that x
    const ys = opts.series.map((s) => s.values.map((v) => {
      if (v === undefined) return undefined;
      if (v === null) return null;
      if (!Number.isFinite(v)) { nonfinite += 1; return null; }
      if (log && v <= 0) { hidden += 1; return null; }  // no place on a log axis
      return v;
    }));
    const drawn = (v) => v !== null && v !== undefined;
    if (!ys.some((vals) => vals.some(drawn))) {
      box.append(note(`${opts.title ? opts.title + ": " : ""}no finite values` +
        (log && hidden ? " above 0 (log scale)" : "") +
        (nonfinite ? ` (${nonfinite} non-finite)` : "")));
      return null;
    }
    const width = Math.max(260, Math.floor(box.clientWidth || box.parentElement.clientWidth || 400));
    const series = [{ label: opts.xLabel || "step", value: (u, v) => fmt(v) }];
    opts.series.forEach((s, i) => series.push({
      label: s.label,
      stroke: s.color || color(i),
      width: 1.5,
      dash: s.dash ? [6, 4] : undefined,
      spanGaps: false,
      points: { show: ys[i].filter(drawn).length < 3 },
      value: (u, v) => fmt(v),
    }));
    const plot = new window.uPlot({
      title: opts.title,
      width,
      height: opts.height || 220,
      scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
      // steps are integers: no tick at step 0.5
      axes: [{ label: opts.xLabel || "step", incrs: STEP_INCRS },
        log ? { size: 64 } : { size: 64, values: ticks }],
      cursor: opts.sync ? { sync: { key: opts.sync } } : {},
      legend: { live: true },
      series,
      plugins: [markerPlugin(opts.marker)],
    }, [opts.x, ...ys], box);
    if (hidden) box.append(note(`${hidden} value(s) ≤ 0 not drawn on the log scale`));
    if (nonfinite) {
      box.append(note(`${nonfinite} non-finite value${nonfinite === 1 ? "" : "s"} ` +
        "(Inf/NaN) not drawn"));
    }
    box.nnChart = plot;  // for tests and the console: the chart of this box
    return plot;
  }

  /* A histogram as a filled step line: counts[i] over [edges[i], edges[i+1]). */
  function histogram(box, opts) {
    box.replaceChildren();
    const edges = opts.edges, counts = opts.counts;
    if (!edges.length || edges.some((e) => e === null)) {
      box.append(note(`${opts.title}: no finite range`));
      return null;
    }
    const width = Math.max(260, Math.floor(box.clientWidth || 400));
    return new window.uPlot({
      title: opts.title,
      width,
      height: opts.height || 180,
      scales: { x: { time: false } },
      axes: [{ label: "value", values: ticks }, { size: 64, values: ticks }],
      legend: { live: true },
      series: [{ label: "value", value: (u, v) => fmt(v) }, {
        label: "count", stroke: PALETTE[0], fill: "rgba(76,120,168,0.25)", width: 1,
        paths: window.uPlot.paths.stepped({ align: 1 }), value: (u, v) => fmt(v),
      }],
    }, [edges, [...counts, counts[counts.length - 1]]], box);
  }

  window.NNChart = { line, histogram, fmt, tickLabel, color, PALETTE };
})();
