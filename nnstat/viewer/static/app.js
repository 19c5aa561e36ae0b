/* nnstat recorder view: selectors, graph, details, charts (static/charts.js) and the tabs. */
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const fmt = (v) => window.NNChart.fmt(v);
  const S = { data: null, trial: 0, step: 0, iteration: 0, sample: -1, stream: "forward",
    stat: "norm", compare: "none", selected: null, rel: null, log: false };

  function showError(msg) { const e = $("error"); e.hidden = false; e.textContent = msg; }

  const { h, hint } = window.NNDom;  // static/dom.js
  // names come from the folder: "constructor" or "__proto__" must not find Object's members
  const own = (obj, key) =>
    (obj && Object.prototype.hasOwnProperty.call(obj, key) ? obj[key] : undefined);
  function options(sel, items, value) {
    sel.replaceChildren(...items.map(([v, label]) => h("option", { value: v }, label)));
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
    const digest = own(st.graphs, String(it));
    if (digest && own(S.data.graphs, digest)) return own(S.data.graphs, digest);
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
    // nothing clicked yet: show the loss (else the output, else the first tensor) instead of
    // an empty panel
    if (!S.selected && doc.nodes.length) {
      const byRole = (r) => doc.nodes.find(([, role]) => role === r);
      S.selected = (byRole("loss") || byRole("output") || doc.nodes[0])[0];
    }
  }

  function renderSelection() {
    const nb = window.NNGraph.highlight($("graph"), S.selected, S.rel);
    const box = $("details");
    if (!S.selected) {
      box.replaceChildren(hint("Click a node of the graph."));
      renderPlot();
      return;
    }
    const st = step(), other = compareStep(), n = S.selected;
    const role = own(st.roles, n) || "";
    const head = ["statistic", "forward", "gradient"];
    if (other) head.push("compare fwd", "compare grad");
    const rows = S.data.stat_names.map((s) => {
      const cells = [value(st, n, S.iteration, "forward", S.sample, s),
        value(st, n, S.iteration, "gradient", S.sample, s)];
      if (other) cells.push(value(other, n, S.iteration, "forward", S.sample, s),
        value(other, n, S.iteration, "gradient", S.sample, s));
      return h("tr", { "data-stat": s }, h("td", {}, s), cells.map((v) => h("td", {}, fmt(v))));
    });
    const names = (list) => (list.length ? list.map((x) => h("span", {}, x)) : "–");
    box.replaceChildren(
      h("h3", { id: "sel-name" }, n, " ", h("small", {}, `(${role})`)),
      h("div", { class: "neighbours" }, "inputs: ", names(own(S.rel.parents, n) || []), h("br"),
        "consumers: ", names(own(S.rel.children, n) || [])),
      hint(`${nb.length} neighbour(s); scope ${S.sample < 0 ? "batch" : "sample " + S.sample}`),
      h("table", { id: "stats-table" }, h("tr", {}, head.map((x) => h("th", {}, x))), rows),
      ...rawValues(st, n));
    renderPlot();
  }

  // raw values of small tensors (Recorder(raw_max_numel=...)), for the selected stream
  function rawValues(st, n) {
    const v = own(st.values, `${S.iteration}/${S.stream}/${n}`) ||
      own(st.values, `-1/${S.stream}/${n}`);
    if (!v) return [];
    const cols = Math.max(v.shape.length ? v.shape[v.shape.length - 1] : 1, 1);
    const rows = [];
    for (let i = 0; i < v.data.length; i += cols) {
      rows.push(h("tr", {}, v.data.slice(i, i + cols).map((x) => h("td", {}, fmt(x)))));
    }
    return [h("h3", {}, `${S.stream} values, shape [${v.shape.join(", ")}]`),
      h("table", { id: "raw-values" }, rows)];
  }

  // series on one x axis: the union of their steps, null where a trial has no such step
  function aligned(list) {
    const xs = [...new Set(list.flatMap((s) => s.points.map((p) => p[0])))].sort((a, b) => a - b);
    return { x: xs, series: list.map((s) => {
      const m = new Map(s.points);
      return { label: s.label, dash: s.dash, values: xs.map((x) => (m.has(x) ? m.get(x) : null)) };
    }) };
  }

  function renderPlot() {
    const box = $("plot");
    if (!S.selected) { box.replaceChildren(hint("No tensor in this step.")); return; }
    const type = step().type_of_execution;
    const series = (t, dash) => ({ label: t.id, dash, points: t.steps
      .filter((s) => s.type_of_execution === type)
      .map((s) => [s.step, value(s, S.selected, S.iteration, S.stream, S.sample, S.stat)]) });
    const list = [series(trial(), false)];
    if (S.compare.startsWith("trial:")) {
      const other = S.data.trials.find((t) => t.id === S.compare.slice(6));
      if (other) list.push(series(other, true));
    }
    $("plot-title").textContent = `${S.stat} of ${S.selected} (${S.stream}) over steps`;
    const a = aligned(list);
    window.NNChart.line(box, { x: a.x, series: a.series, log: S.log, marker: step().step,
      height: 200 });
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
      const where = `${s.type_of_execution} ${s.step}: `;
      const link = (cls, target, text) => {
        const a = h("a", { class: cls }, text);
        a.addEventListener("click", () => jump(i, target.tensor, target.iteration, target.stream));
        return a;
      };
      const off = s.first_offender;
      if (off) items.push(h("li", {}, where, "first non-finite ",
        link("jump offender-link", off, `${off.tensor} (${off.stream})`)));
      s.anomalies.forEach((a) => items.push(h("li", {}, where, `${a.rule} on `,
        link("jump", a, a.indicator), ` (value ${fmt(a.value)})`)));
    });
    $("tab-anomalies").replaceChildren(items.length ? h("ul", {}, items) :
      hint("No anomaly rule fired in the recorded steps."));
    $("tab-notes").replaceChildren(t.notes.length ? h("ul", {}, t.notes.map((n) =>
      h("li", {}, n.step === null ? "" : `step ${n.step}: `, n.text))) : hint("No notes."));
    const head = ["module", "type", "own parameters", "total parameters"];
    $("tab-network").replaceChildren(t.modules.length ? h("table", {},
      h("tr", {}, head.map((x) => h("th", {}, x))),
      t.modules.map((m) => h("tr", {}, [m.name, m.type, m.params_own, m.params_total]
        .map((x) => h("td", {}, x))))) : hint("No module tracked."));
  }

  // KPIs of every step (kpis.jsonl), one chart per KPI up front (the loss first), the compared
  // trial dashed (the steps' own KPIs for a trial written before kpis.jsonl existed)
  const kpiLog = (tr) => (tr.kpis.length ? tr.kpis : tr.steps.map((s) =>
    ({ type: s.type_of_execution, step: s.step, kpis: s.kpis })));
  function renderKpis(t) {
    const log = kpiLog(t);
    const type = step() ? step().type_of_execution : (log[0] || {}).type;
    const loss = (n) => (/loss/i.test(n) ? 0 : 1);
    const names = [...new Set(log.flatMap((r) => Object.keys(r.kpis)))]
      .sort((a, b) => loss(a) - loss(b) || (a < b ? -1 : a > b ? 1 : 0));
    const box = $("kpis");
    if (!names.length) { box.replaceChildren(hint("No KPIs recorded.")); return; }
    const boxes = names.map(() => h("div", { class: "chart" }));
    box.replaceChildren(...names.map((n, i) => h("div", { class: "kpi" }, h("h3", {}, n), boxes[i])));
    const other = S.compare.startsWith("trial:") ?
      S.data.trials.find((x) => x.id === S.compare.slice(6)) : null;
    const pts = (tr, n) => kpiLog(tr).filter((r) => r.type === type && own(r.kpis, n) !== undefined)
      .map((r) => [r.step, own(r.kpis, n)]);
    names.forEach((n, i) => {
      const list = [{ label: t.id, dash: false, points: pts(t, n) }];
      if (other) list.push({ label: other.id, dash: true, points: pts(other, n) });
      const a = aligned(list);
      window.NNChart.line(boxes[i], { x: a.x, series: a.series, log: S.log,
        marker: step() ? step().step : null, height: 200, sync: "kpis" });
    });
  }

  function renderLegend() {
    const roles = ["input", "target", "output", "loss", "intermediate", "parameter"];
    $("legend").replaceChildren(...roles.map((r) => {
      const swatch = h("i");
      // through CSSOM: the page's Content-Security-Policy refuses style="..." attributes
      swatch.style.setProperty("background", `var(--${r})`);
      return h("span", {}, swatch, r);
    }));
  }

  // files the server refused (wrong format, outside the folder): listed, never silently dropped
  function renderProblems() {
    const list = S.data.problems || [];
    const box = $("problems");
    box.hidden = !list.length;
    box.replaceChildren(h("h3", {}, `${list.length} file(s) or record(s) skipped`),
      h("ul", {}, list.map((p) => h("li", {}, h("code", {}, p.file), `: ${p.message}`))));
  }

  function renderAll() {
    renderProblems();
    if (!S.data.trials.length) {
      ["sel-trial", "sel-step", "sel-iteration", "sel-scope", "sel-stat", "sel-compare"]
        .forEach((id) => $(id).replaceChildren());
      $("graph").replaceChildren();
      $("details").replaceChildren(hint("No readable trial: see the skipped files above."));
      ["anomalies", "notes", "network"].forEach((tab) => $(`tab-${tab}`).replaceChildren());
      $("kpis").replaceChildren();
      $("plot").replaceChildren();
      return;
    }
    if (!fillSelectors()) {
      $("graph").replaceChildren();
      $("details").replaceChildren(hint("This trial has no recorded step yet."));
      $("plot").replaceChildren();
      renderKpis(trial());
      renderTabs();
      return;
    }
    renderGraph();
    renderSelection();
    renderKpis(trial());
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
    $("rec-log").addEventListener("change", (ev) => { S.log = ev.target.checked; renderAll(); });
    document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => {
      document.querySelectorAll("#tabs button, .tab").forEach((x) => x.classList.remove("active"));
      b.classList.add("active");
      $(`tab-${b.dataset.tab}`).classList.add("active");
    }));
  }

  let started = false;
  // called by home.js when the recorder view is first shown (charts need a visible box)
  function start(data) {
    S.data = data;
    if (!data.stat_names.includes(S.stat)) S.stat = data.stat_names[0] || "";
    if (!started) { renderLegend(); bind(); started = true; }
    renderAll();
  }

  function fetchData() {
    return fetch("api/data").then((r) => (r.ok ? r.json() : r.text().then((text) => {
      throw new Error(`api/data: HTTP ${r.status}: ${text}`);
    })));
  }

  // served mode: re-read the folder while training writes it, keeping the selection
  function enableRefresh() {
    $("refresh").hidden = false;
    $("refresh").addEventListener("click", () => fetchData().then((data) => {
      $("error").hidden = true;
      const id = S.data && S.data.trials.length ? trial().id : null;
      S.data = data;
      if (!data.stat_names.includes(S.stat)) S.stat = data.stat_names[0] || "";
      S.trial = Math.max(0, data.trials.findIndex((t) => t.id === id));
      if (!started) start(data); else renderAll();
      document.body.setAttribute("data-refreshed", String(Date.now()));
    }).catch((e) => showError(String(e))));
  }

  window.NNRecorder = { start, enableRefresh, fetchData, render: () => started && renderAll() };
})();
