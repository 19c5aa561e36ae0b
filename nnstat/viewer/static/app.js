/* nnstat recorder viewer: selectors, graph, details, plot and the tabs. No external resources. */
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const fmt = (v) => window.NNPlot.fmt(v);
  const S = { data: null, trial: 0, step: 0, iteration: 0, sample: -1, stream: "forward",
    stat: "norm", compare: "none", selected: null, rel: null };

  function showError(msg) { const e = $("error"); e.hidden = false; e.textContent = msg; }
  window.addEventListener("error", (ev) => showError(String(ev.message)));

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
      '"': "&quot;", "'": "&#39;" }[c]));
  }
  function options(sel, items, value) {
    sel.innerHTML = items.map(([v, label]) =>
      `<option value="${esc(v)}">${esc(label)}</option>`).join("");
    sel.value = String(value);
  }
  const trial = () => S.data.trials[S.trial];
  const step = () => trial().steps[S.step];

  function rowIndex(st) {
    if (!st._idx) {
      st._idx = new Map();
      const r = st.rows;
      for (let i = 0; i < r.tensor.length; i++) {
        st._idx.set(`${r.tensor[i]}|${r.iteration[i]}|${r.stream[i]}|${r.sample[i]}`, i);
      }
    }
    return st._idx;
  }
  function value(st, name, iteration, stream, sample, stat) {
    if (!st) return null;
    const idx = rowIndex(st);
    const col = S.data.stat_names.indexOf(stat);
    let i = idx.get(`${name}|${iteration}|${stream}|${sample}`);
    if (i === undefined) i = idx.get(`${name}|-1|${stream}|${sample}`);
    return i === undefined ? null : st.stats[i][col];
  }
  function graphDoc(st, it) {
    const digest = st.graphs && st.graphs[String(it)];
    if (digest && S.data.graphs[digest]) return S.data.graphs[digest];
    const nodes = Object.entries(st.roles || {}).filter(([, r]) => r === "parameter");
    return { nodes: nodes.map(([n, r]) => [n, r]), edges: [] };
  }
  function compareStep() {
    const [kind, v] = S.compare.split(":");
    if (kind === "trial") {
      const other = S.data.trials.find((t) => t.id === S.compare.slice(6));
      return other && other.steps.find((x) => x.step === step().step &&
        x.type_of_execution === step().type_of_execution);
    }
    if (kind === "step") return trial().steps[Number(v)];
    return null;
  }

  function fillSelectors() {
    options($("sel-trial"), S.data.trials.map((t, i) => [i, t.id]), S.trial);
    const steps = trial().steps;
    if (!steps.length) { options($("sel-step"), [], ""); return false; }
    S.step = Math.min(S.step, steps.length - 1);
    options($("sel-step"), steps.map((s, i) => [i, `${s.type_of_execution} ${s.step}` +
      (s.anomalies && s.anomalies.length ? " ⚠" : "")]), S.step);
    const n = Math.max(step().iterations, 1);
    S.iteration = Math.min(S.iteration, n - 1);
    options($("sel-iteration"), [...Array(n).keys()].map((i) => [i, String(i)]), S.iteration);
    const k = step().rows.sample.reduce((m, s) => Math.max(m, s), -1) + 1;
    if (S.sample >= k) S.sample = -1;
    options($("sel-scope"), [[-1, "batch"], ...[...Array(k).keys()].map((i) => [i, `sample ${i}`])],
      S.sample);
    $("sel-stream").value = S.stream;
    options($("sel-stat"), S.data.stat_names.map((s) => [s, s]), S.stat);
    const cmp = [["none", "none"]];
    S.data.trials.forEach((t, i) => { if (i !== S.trial) cmp.push([`trial:${t.id}`, `trial ${t.id}`]); });
    steps.forEach((s, i) => { if (i !== S.step) cmp.push([`step:${i}`, `step ${s.type_of_execution} ${s.step}`]); });
    if (!cmp.some(([v]) => v === S.compare)) S.compare = "none";
    options($("sel-compare"), cmp, S.compare);
    return true;
  }

  function renderGraph() {
    const st = step();
    const doc = graphDoc(st, S.iteration);
    S.rel = window.NNGraph.render($("graph"), doc, {
      value: (n) => `${S.stat} ${fmt(value(st, n, S.iteration, S.stream, S.sample, S.stat))}`,
      onSelect: (n) => { S.selected = n; renderSelection(); },
    });
    const off = st.first_offender;
    document.querySelectorAll("#graph .node").forEach((g) => {
      g.classList.toggle("offender", !!off && g.getAttribute("data-name") === off.tensor);
    });
    if (S.selected && !doc.nodes.some(([n]) => n === S.selected)) S.selected = null;
  }

  function renderSelection() {
    const nb = window.NNGraph.highlight($("graph"), S.selected, S.rel);
    const box = $("details");
    if (!S.selected) {
      box.innerHTML = '<p class="hint">Click a node of the graph.</p>';
      renderPlot();
      return;
    }
    const st = step(), other = compareStep(), n = S.selected;
    const role = (st.roles || {})[n] || "";
    const head = ["statistic", "forward", "gradient"];
    if (other) head.push("compare fwd", "compare grad");
    const rows = S.data.stat_names.map((s) => {
      const cells = [value(st, n, S.iteration, "forward", S.sample, s),
        value(st, n, S.iteration, "gradient", S.sample, s)];
      if (other) cells.push(value(other, n, S.iteration, "forward", S.sample, s),
        value(other, n, S.iteration, "gradient", S.sample, s));
      return `<tr data-stat="${esc(s)}"><td>${esc(s)}</td>` +
        cells.map((v) => `<td>${fmt(v)}</td>`).join("") + "</tr>";
    }).join("");
    const parents = S.rel.parents[n] || [], children = S.rel.children[n] || [];
    box.innerHTML = `<h3 id="sel-name">${esc(n)} <small>(${esc(role)})</small></h3>` +
      `<div class="neighbours">inputs: ${parents.map((p) => `<span>${esc(p)}</span>`).join("") || "–"}` +
      `<br>consumers: ${children.map((c) => `<span>${esc(c)}</span>`).join("") || "–"}</div>` +
      `<p class="hint">${nb.length} neighbour(s); scope ${S.sample < 0 ? "batch" : "sample " + S.sample}</p>` +
      `<table id="stats-table"><tr>${head.map((h) => `<th>${esc(h)}</th>`).join("")}</tr>${rows}</table>` +
      rawValues(st, n);
    renderPlot();
  }

  // raw values of small tensors (Recorder(raw_max_numel=...)), for the selected stream
  function rawValues(st, n) {
    const vals = st.values || {};
    const v = vals[`${S.iteration}/${S.stream}/${n}`] || vals[`-1/${S.stream}/${n}`];
    if (!v) return "";
    const cols = v.shape.length ? v.shape[v.shape.length - 1] : 1;
    const cells = v.data.map((x) => `<td>${fmt(x)}</td>`);
    const rows = [];
    for (let i = 0; i < cells.length; i += cols) rows.push(`<tr>${cells.slice(i, i + cols).join("")}</tr>`);
    return `<h3>${esc(S.stream)} values, shape [${v.shape.join(", ")}]</h3>` +
      `<table id="raw-values">${rows.join("")}</table>`;
  }

  function renderPlot() {
    const svg = $("plot");
    if (!S.selected) { window.NNPlot.draw(svg, [], null); return; }
    const type = step().type_of_execution;
    const series = (t, cls) => ({ label: t.id, cls, points: t.steps
      .filter((s) => s.type_of_execution === type)
      .map((s) => [s.step, value(s, S.selected, S.iteration, S.stream, S.sample, S.stat)]) });
    const list = [series(trial(), "series-a")];
    if (S.compare.startsWith("trial:")) {
      const other = S.data.trials.find((t) => t.id === S.compare.slice(6));
      if (other) list.push(series(other, "series-b"));
    }
    window.NNPlot.draw(svg, list, step().step);
  }

  function jump(stepIndex, tensor, iteration, stream) {
    S.step = stepIndex;
    if (iteration >= 0) S.iteration = iteration;
    S.stream = stream;
    S.selected = tensor;
    renderAll();
  }

  function renderTabs() {
    const t = trial();
    const items = [];
    t.steps.forEach((s, i) => {
      const off = s.first_offender;
      if (off) items.push(`<li>${esc(s.type_of_execution)} ${s.step}: first non-finite ` +
        `<a class="jump offender-link" data-i="${i}" data-t="${esc(off.tensor)}" data-it="${off.iteration}" ` +
        `data-s="${esc(off.stream)}">${esc(off.tensor)} (${esc(off.stream)})</a></li>`);
      (s.anomalies || []).forEach((a) => items.push(`<li>${esc(s.type_of_execution)} ${s.step}: ` +
        `${esc(a.rule)} on <a class="jump" data-i="${i}" data-t="${esc(a.tensor)}" data-it="${a.iteration}" ` +
        `data-s="${esc(a.stream)}">${esc(a.indicator)}</a> (value ${fmt(a.value)})</li>`));
    });
    $("tab-anomalies").innerHTML = items.length ? `<ul>${items.join("")}</ul>` :
      '<p class="hint">No anomaly rule fired in the recorded steps.</p>';
    $("tab-anomalies").querySelectorAll("a.jump").forEach((a) => a.addEventListener("click", () =>
      jump(Number(a.dataset.i), a.dataset.t, Number(a.dataset.it), a.dataset.s)));
    renderKpis(t);
    $("tab-notes").innerHTML = t.notes.length ? "<ul>" + t.notes.map((n) =>
      `<li>${n.step === null ? "" : "step " + n.step + ": "}${esc(n.text)}</li>`).join("") + "</ul>" :
      '<p class="hint">No notes.</p>';
    const mods = t.modules || [];
    $("tab-network").innerHTML = mods.length ? "<table><tr><th>module</th><th>type</th>" +
      "<th>own parameters</th><th>total parameters</th></tr>" + mods.map((m) =>
      `<tr><td>${esc(m.name)}</td><td>${esc(m.type)}</td><td>${m.params_own}</td>` +
      `<td>${m.params_total}</td></tr>`).join("") + "</table>" : '<p class="hint">No module tracked.</p>';
  }

  // KPIs of every step (kpis.jsonl), one small plot per KPI, the compared trial dashed
  function renderKpis(t) {
    const log = t.kpis && t.kpis.length ? t.kpis : t.steps.map((s) =>
      ({ type: s.type_of_execution, step: s.step, kpis: s.kpis || {} }));
    const type = step() ? step().type_of_execution : (log[0] || {}).type;
    const names = [...new Set(log.flatMap((r) => Object.keys(r.kpis)))].sort();
    const box = $("tab-kpis");
    if (!names.length) { box.innerHTML = '<p class="hint">No KPIs recorded.</p>'; return; }
    box.innerHTML = names.map((n, i) => `<div class="kpi"><h3>${esc(n)}</h3>` +
      `<svg class="kpi-plot" id="kpi-${i}"></svg></div>`).join("");
    const other = S.compare.startsWith("trial:") ? S.data.trials.find((x) => x.id === S.compare.slice(6)) : null;
    const pts = (tr, n) => (tr.kpis || []).filter((r) => r.type === type && n in r.kpis)
      .map((r) => [r.step, r.kpis[n]]);
    names.forEach((n, i) => {
      const series = [{ label: t.id, cls: "series-a", points: pts(t, n) }];
      if (other) series.push({ label: other.id, cls: "series-b", points: pts(other, n) });
      window.NNPlot.draw($(`kpi-${i}`), series, step() ? step().step : null);
    });
  }

  function renderLegend() {
    const roles = ["input", "target", "output", "loss", "intermediate", "parameter"];
    $("legend").innerHTML = roles.map((r) =>
      `<span><i style="background: var(--${r})"></i>${r}</span>`).join("");
  }

  function renderAll() {
    if (!fillSelectors()) {
      $("details").innerHTML = '<p class="hint">This trial has no recorded step yet.</p>';
      renderTabs();
      return;
    }
    renderGraph();
    renderSelection();
    renderTabs();
  }

  function bind() {
    const on = (id, f) => $(id).addEventListener("change", (ev) => { f(ev.target.value); renderAll(); });
    on("sel-trial", (v) => {
      const cur = step();
      S.trial = Number(v);
      const i = cur ? trial().steps.findIndex((s) => s.step === cur.step) : -1;
      S.step = i >= 0 ? i : 0;
    });
    on("sel-step", (v) => { S.step = Number(v); });
    on("sel-iteration", (v) => { S.iteration = Number(v); });
    on("sel-scope", (v) => { S.sample = Number(v); });
    on("sel-stream", (v) => { S.stream = v; });
    on("sel-stat", (v) => { S.stat = v; });
    on("sel-compare", (v) => { S.compare = v; });
    document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => {
      document.querySelectorAll("#tabs button, .tab").forEach((x) => x.classList.remove("active"));
      b.classList.add("active");
      $(`tab-${b.dataset.tab}`).classList.add("active");
      if (b.dataset.tab === "kpis") renderKpis(trial());  // plots need a visible box to size
    }));
  }

  function start(data) {
    S.data = data;
    if (!data.stat_names.includes(S.stat)) S.stat = data.stat_names[0];
    renderLegend();
    bind();
    renderAll();
    document.body.setAttribute("data-ready", "1");
  }

  function fetchData() {
    return fetch("api/data").then((r) => {
      if (!r.ok) throw new Error(`api/data: HTTP ${r.status}`);
      return r.json();
    });
  }

  const inline = $("nnstat-data").textContent.trim();
  if (inline) start(JSON.parse(inline));
  else {
    fetchData().then(start).catch((e) => showError(String(e)));
    // served mode: re-read the folder while training writes it, keeping the selection
    $("refresh").hidden = false;
    $("refresh").addEventListener("click", () => fetchData().then((data) => {
      const id = trial().id;
      S.data = data;
      S.trial = Math.max(0, data.trials.findIndex((t) => t.id === id));
      renderAll();
      document.body.setAttribute("data-refreshed", String(Date.now()));
    }).catch((e) => showError(String(e))));
  }
})();
