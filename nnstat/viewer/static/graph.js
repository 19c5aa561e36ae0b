/* Dependency graph: layered layout (longest path from the sources) drawn as plain SVG. */
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 150, H = 36, DX = 200, DY = 48, PAD = 16;

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  // maps keyed by tensor names from the recorder folder: without a prototype, a tensor named
  // "constructor" or "__proto__" is an ordinary key instead of Object's member
  const dict = () => Object.create(null);

  function layout(doc) {
    const names = doc.nodes.map((n) => n[0]);
    const parents = dict(), children = dict();
    names.forEach((n) => { parents[n] = []; children[n] = []; });
    doc.edges.forEach(([a, b]) => {
      if (a in parents && b in parents) { children[a].push(b); parents[b].push(a); }
    });
    const layer = dict(), indeg = dict();
    names.forEach((n) => { indeg[n] = parents[n].length; layer[n] = 0; });
    const queue = names.filter((n) => indeg[n] === 0);
    while (queue.length) {
      const n = queue.shift();
      children[n].forEach((c) => {
        layer[c] = Math.max(layer[c], layer[n] + 1);
        if (--indeg[c] === 0) queue.push(c);
      });
    }
    // a parameter sits in the layer just before its first consumer, not at the far left
    names.forEach((n) => {
      if (parents[n].length === 0 && children[n].length) {
        layer[n] = Math.max(0, Math.min(...children[n].map((c) => layer[c])) - 1);
      }
    });
    const layers = [];
    names.forEach((n) => { (layers[layer[n]] = layers[layer[n]] || []).push(n); });
    const pos = dict();
    layers.forEach((col, li) => {
      if (!col) return;
      const bary = (n) => {
        const ps = parents[n].filter((p) => p in pos);
        return ps.length ? ps.reduce((s, p) => s + pos[p].y, 0) / ps.length : Infinity;
      };
      col.sort((a, b) => bary(a) - bary(b) || names.indexOf(a) - names.indexOf(b));
      col.forEach((n, i) => { pos[n] = { x: PAD + li * DX, y: PAD + i * DY }; });
    });
    return { pos, parents, children };
  }

  function render(svg, doc, opts) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const { pos, parents, children } = layout(doc);
    const xs = Object.values(pos);
    const width = Math.max(...xs.map((p) => p.x), 0) + W + PAD;
    const height = Math.max(...xs.map((p) => p.y), 0) + H + PAD;
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const defs = el("defs", {}, svg);
    const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
    el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#888" }, marker);
    const edgeLayer = el("g", { class: "edges" }, svg);
    doc.edges.forEach(([a, b]) => {
      if (!(a in pos) || !(b in pos)) return;
      const x1 = pos[a].x + W, y1 = pos[a].y + H / 2, x2 = pos[b].x, y2 = pos[b].y + H / 2;
      const mx = (x1 + x2) / 2;
      el("path", { class: "edge", "data-src": a, "data-dst": b, "marker-end": "url(#arrow)",
        d: `M ${x1} ${y1} C ${mx} ${y1}, ${mx} ${y2}, ${x2} ${y2}` }, edgeLayer);
    });
    const nodeLayer = el("g", { class: "nodes" }, svg);
    doc.nodes.forEach(([name, role]) => {
      const g = el("g", { class: "node", "data-name": name, "data-role": role,
        transform: `translate(${pos[name].x},${pos[name].y})` }, nodeLayer);
      el("title", {}, g).textContent = `${name} (${role})`;
      el("rect", { class: `role-${role}`, width: W, height: H, rx: 5 }, g);
      const label = name.length > 22 ? name.slice(0, 10) + "…" + name.slice(-11) : name;
      el("text", { x: 7, y: 15 }, g).textContent = label;
      el("text", { x: 7, y: 29, class: "value" }, g).textContent = opts.value(name);
      g.addEventListener("click", (ev) => { ev.stopPropagation(); opts.onSelect(name); });
    });
    svg.onclick = () => opts.onSelect(null);
    return { parents, children };
  }

  function highlight(svg, name, rel) {
    const nb = new Set(name ? [...rel.parents[name] || [], ...rel.children[name] || []] : []);
    nb.delete(name);
    svg.querySelectorAll(".node").forEach((g) => {
      const n = g.getAttribute("data-name");
      g.classList.toggle("selected", n === name);
      g.classList.toggle("neighbour", nb.has(n));
      g.classList.toggle("dim", !!name && n !== name && !nb.has(n));
    });
    svg.querySelectorAll(".edge").forEach((e) => {
      const on = !!name && (e.getAttribute("data-src") === name || e.getAttribute("data-dst") === name);
      e.classList.toggle("active", on);
    });
    return [...nb];
  }

  window.NNGraph = { render, highlight, layout };
})();
