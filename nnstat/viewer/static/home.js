/* The page's entry: loads the data (inline in an export, api/data when served), routes between
   the views by the URL's #hash, and draws the home page and the Tracker runs view. */
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const C = window.NNChart;
  let DATA = null;
  const served = !$("nnstat-data").textContent.trim();

  function showError(msg) { const e = $("error"); e.hidden = false; e.textContent = msg; }
  window.addEventListener("error", (ev) => showError(String(ev.message)));

  const { h, hint } = window.NNDom;  // static/dom.js

  // ------------------------------------------------------------------------------ routing
  const VIEWS = ["home", "runs", "recorder", "stores"];
  const shown = {};
  function route() {
    let view = (location.hash || "").slice(1).split("/")[0];
    if (!VIEWS.includes(view)) view = defaultView();
    VIEWS.forEach((v) => {
      $(`view-${v}`).classList.toggle("active", v === view);
      document.querySelector(`#nav a[data-view='${v}']`).classList.toggle("active", v === view);
    });
    // charts size to their box: a view is drawn when it is first visible
    const first = !shown[view];
    shown[view] = true;
    if (view === "home" && first) renderHome();
    if (view === "recorder" && first) window.NNRecorder.start(DATA);
    if (view === "runs") renderRuns();  // #runs/<i> picks the run
    if (view === "stores") window.NNExplorer.show(DATA, served, location.hash);
  }
  // a folder of recorder trials only opens on the recorder, as before; anything else at home
  function defaultView() {
    const other = DATA.runs.length + DATA.stores.length + DATA.reports.length;
    return !other && (DATA.trials.length || DATA.problems.length) ? "recorder" : "home";
  }

  function renderProblems() {
    const list = DATA.problems || [];
    const box = $("problems");
    box.hidden = !list.length;
    box.replaceChildren(h("h3", {}, `${list.length} file(s) or record(s) skipped`),
      h("ul", {}, list.map((p) => h("li", {}, h("code", {}, p.file), `: ${p.message}`))));
  }

  // ------------------------------------------------------------------------------ home
  function renderHome() {
    $("home-root").textContent = DATA.root;
    const sec = (title, items, empty) => h("section", { class: "home-section" },
      h("h2", {}, title), items.length ? h("ul", {}, items) : hint(empty));
    const link = (hash, text) => h("a", { href: hash }, text);
    const runs = DATA.runs.map((r, i) => h("li", {}, link(`#runs/${i}`, r.id),
      ` — ${r.steps.length} steps, ${Object.keys(r.series).length} series` +
      (Object.keys(r.hists).length ? `, ${Object.keys(r.hists).length} histograms` : "")));
    const trials = DATA.trials.map((t) => h("li", {}, link("#recorder", t.id),
      ` — ${t.steps.length} recorded steps`));
    const stores = DATA.stores.map((s, i) => h("li", {}, link(`#stores/${i}`, s.id),
      ` — ${s.rows} training rows, ${s.modules.length} modules, ${s.preconditioner} ` +
      `preconditioner, ${s.query_sets.length - 1} query set(s)` +
      (s.examples ? `, ${s.examples} examples saved` : "")));
    // served: a link to report/<id> (a sandbox CSP header); exported: the report's HTML in a
    // frame with every sandbox restriction (no script, no origin) under the page's own CSP
    // (nothing loads), or why it was left out
    const reports = DATA.reports.map((r) => {
      if (typeof r.srcdoc === "string") {
        return h("li", {}, h("details", { class: "report" }, h("summary", {}, r.id),
          h("iframe", { sandbox: "", class: "report-frame", title: r.id, srcdoc: r.srcdoc })));
      }
      if (typeof r.href !== "string") return h("li", {}, r.id, ` — ${r.omitted || "not in this export"}`);
      return h("li", {}, h("a", { href: r.href, target: "_blank", rel: "noopener",
        class: "report-link" }, r.id));
    });
    $("home-body").replaceChildren(
      sec("Reports", reports, "No HTML report (nnstat demo writes report.html)."),
      sec("Tracker runs", runs, "No Tracker run (nnstat.integrations.JsonlLogger writes metrics.jsonl)."),
      sec("Influence: gradient stores", stores, "No gradient store."),
      sec("Recorder trials", trials, "No recorder trial."));
  }

  // ------------------------------------------------------------------------------ runs
  const R = { run: 0, compare: -1, filter: "", log: false, top: 0, open: Object.create(null) };

  // "<group>/<layer>/<stat>" keys (the Tracker's) become one chart per group and statistic with
  // a line per layer; "train/loss" and "test/loss" one chart with a line per split; other keys
  // one chart each, the loss first
  const SPLITS = new Set(["train", "test", "val", "valid", "validation", "eval"]);
  function chartsOf(run) {
    const single = [], grouped = new Map(), splits = new Map();
    Object.keys(run.series).forEach((key) => {
      const parts = key.split("/");
      if (parts.length === 2 && SPLITS.has(parts[0].toLowerCase())) {
        const id = `*/${parts[1]}`;
        if (!splits.has(id)) splits.set(id, { id, section: "scalars", lines: [] });
        splits.get(id).lines.push({ label: parts[0], key });
        return;
      }
      // "trust_ratio/<layer>" (the Tracker's ratios): a layer name holds a "."
      if (parts.length === 2 && parts[1].includes(".")) parts.push("");
      if (parts.length >= 3) {
        const stat = parts[parts.length - 1];
        const id = stat ? `${parts[0]}/*/${stat}` : `${parts[0]}/*`;
        if (!grouped.has(id)) grouped.set(id, { id, section: parts[0], lines: [] });
        grouped.get(id).lines.push({ label: parts.slice(1, -1).join("/"), key });
      } else {
        single.push({ id: key, section: "scalars", lines: [{ label: key, key }] });
      }
    });
    const loss = (c) => (/loss/i.test(c.id) ? 0 : 1);
    single.push(...splits.values());
    single.sort((a, b) => loss(a) - loss(b) || (a.id < b.id ? -1 : 1));
    return single.concat([...grouped.values()].sort((a, b) => (a.id < b.id ? -1 : 1)));
  }

  // the filter's words must all appear in a chart's name, or in its name with a line's label:
  // "weight l2" keeps weight/*/l2, "l2 0.weight" keeps the 0.weight line of every l2 chart
  function filtered(chart) {
    const words = R.filter.toLowerCase().split(/\s+/).filter(Boolean);
    const has = (text) => words.every((w) => text.toLowerCase().includes(w));
    if (has(chart.id)) return chart;
    const lines = chart.lines.filter((l) => has(`${chart.id} ${l.label}`));
    return lines.length ? { ...chart, lines } : null;
  }
  const matches = (chart) => filtered(chart) !== null;

  // "lines: top k by change": a chart with more than k lines keeps the k whose value moved most
  // over the run, relative to where it started (|last - first| / |first|, finite values only)
  function change(run, key) {
    const vals = run.series[key].filter((v) => v !== null && Number.isFinite(v));
    if (vals.length < 2) return -1;
    const first = vals[0], last = vals[vals.length - 1];
    return Math.abs(last - first) / Math.max(Math.abs(first), 1e-12);
  }
  function topLines(run, chart) {
    if (!(R.top > 0) || chart.lines.length <= R.top) return chart;
    const ranked = chart.lines.map((l) => [change(run, l.key), l]).sort((a, b) => b[0] - a[0]);
    return { ...chart, lines: ranked.slice(0, R.top).map(([, l]) => l) };
  }

  // the chart's lines of this run, and dashed the same keys of the compared run, on the union
  // of both runs' steps
  function drawChart(box, run, chart) {
    const other = R.compare >= 0 && R.compare !== R.run ? DATA.runs[R.compare] : null;
    const has = (r, key) => Object.prototype.hasOwnProperty.call(r.series, key);
    let x = run.steps;
    const lines = chart.lines.map((l) => ({ label: l.label, run, key: l.key, dash: false }));
    if (other) {
      x = [...new Set([...run.steps, ...other.steps])].sort((a, b) => a - b);
      chart.lines.filter((l) => has(other, l.key)).forEach((l) => lines.push(
        { label: `${other.id}: ${l.label}`, run: other, key: l.key, dash: true }));
    }
    // NaN (a logged NaN/Inf: the chart breaks the line there and counts it) apart from
    // undefined, "not logged at this step", across which the line is drawn: series logged at
    // other cadences, or the other run's steps
    const at = (r, key) => {
      const gaps = new Set((r.nonfinite && r.nonfinite[key]) || []);
      const own = r.series[key].map((v, i) => (gaps.has(i) ? NaN : v === null ? undefined : v));
      if (r.steps === x) return own;
      const m = new Map(r.steps.map((s, i) => [s, own[i]]));
      return x.map((s) => m.get(s));
    };
    C.line(box, { title: chart.id, x, log: R.log, sync: "run",
      series: lines.map((l) => ({ label: l.label, dash: l.dash, values: at(l.run, l.key) })) });
  }

  function drawHist(box, run, key, index) {
    const hh = run.hists[key];
    const sel = h("select", { class: "hist-step" },
      hh.steps.map((s, i) => h("option", { value: i }, `step ${s}`)));
    sel.value = String(index);
    const chart = h("div", { class: "chart" });
    box.replaceChildren(sel, chart);
    sel.addEventListener("change", () => drawHist(box, run, key, Number(sel.value)));
    C.histogram(chart, { title: `${key} (step ${hh.steps[index]})`, edges: hh.edges[index],
      counts: hh.counts[index] });
  }

  function renderRuns() {
    const sel = $("run-sel");
    sel.replaceChildren(...DATA.runs.map((r, i) => h("option", { value: i }, r.id)));
    const m = /^#runs\/(\d+)$/.exec(location.hash);
    if (m && Number(m[1]) < DATA.runs.length) R.run = Number(m[1]);
    sel.value = String(R.run);
    const cmp = $("run-compare");
    cmp.replaceChildren(h("option", { value: -1 }, "none"), ...DATA.runs.map((r, i) =>
      (i === R.run ? null : h("option", { value: i }, r.id))).filter(Boolean));
    if (R.compare === R.run) R.compare = -1;
    cmp.value = String(R.compare);
    const body = $("run-body");
    if (!DATA.runs.length) { body.replaceChildren(hint("No Tracker run under this folder.")); return; }
    const run = DATA.runs[R.run];
    const charts = chartsOf(run).map(filtered).filter(Boolean).map((c) => topLines(run, c));
    const sections = new Map();
    charts.forEach((c) => {
      if (!sections.has(c.section)) sections.set(c.section, []);
      sections.get(c.section).push(c);
    });
    const out = [];
    let first = true;
    sections.forEach((list, name) => {
      const grid = h("div", { class: "grid" });
      const summary = h("summary", {}, `${name} (${list.length} chart${list.length > 1 ? "s" : ""})`);
      const det = h("details", { class: "run-section", "data-section": name }, summary, grid);
      // a section opened or closed by hand stays so when the run is drawn again (refresh)
      summary.addEventListener("click", () => { R.open[name] = !det.open; });
      // the first section (the loss and other scalars) and any filtered result open at once;
      // the others draw their charts when opened
      const draw = () => {
        if (grid.childElementCount) return;
        list.forEach((c) => {
          const box = h("div", { class: "chart", "data-key": c.id });
          grid.append(box);
          drawChart(box, run, c);
        });
      };
      det.addEventListener("toggle", () => { if (det.open) draw(); });
      out.push(det);
      det.open = R.filter ? true : name in R.open ? R.open[name] : first;
      first = false;
    });
    const hists = Object.keys(run.hists).filter((k) => matches({ id: k, lines: [] }));
    if (hists.length) {
      const grid = h("div", { class: "grid" });
      const summary = h("summary", {}, `histograms (${hists.length})`);
      const det = h("details", { class: "run-section", "data-section": "histograms" }, summary, grid);
      summary.addEventListener("click", () => { R.open.histograms = !det.open; });
      det.open = !!R.open.histograms;
      det.addEventListener("toggle", () => {
        if (!det.open || grid.childElementCount) return;
        hists.forEach((k) => {
          const box = h("div", { class: "chart hist", "data-key": k });
          grid.append(box);
          drawHist(box, run, k, run.hists[k].steps.length - 1);
        });
      });
      out.push(det);
    }
    body.replaceChildren(h("p", { class: "hint" }, `${run.steps.length} steps, ` +
      `${Object.keys(run.series).length} series in ${charts.length} charts`), ...out);
    // opened after insertion so the charts have a width to size to
    out.forEach((d) => { if (d.open) d.dispatchEvent(new Event("toggle")); });
  }

  function bindRuns() {
    $("run-sel").addEventListener("change", (ev) => {
      R.run = Number(ev.target.value);
      history.replaceState(null, "", `#runs/${R.run}`);
      renderRuns();
    });
    $("run-compare").addEventListener("change", (ev) => {
      R.compare = Number(ev.target.value);
      renderRuns();
    });
    $("run-filter").addEventListener("input", (ev) => { R.filter = ev.target.value; renderRuns(); });
    $("run-log").addEventListener("change", (ev) => { R.log = ev.target.checked; renderRuns(); });
    $("run-top").addEventListener("change", (ev) => { R.top = Number(ev.target.value); renderRuns(); });
    // served: read the runs again while training appends to them
    $("run-refresh").hidden = !served;
    $("run-refresh").addEventListener("click", () => window.NNRecorder.fetchData().then((data) => {
      DATA.runs = data.runs;
      DATA.problems = data.problems;
      renderProblems();
      R.run = Math.min(R.run, Math.max(0, DATA.runs.length - 1));
      renderRuns();
      document.body.setAttribute("data-runs-refreshed", String(Date.now()));
    }).catch((e) => showError(String(e))));
  }

  function start(data) {
    DATA = data;
    $("nav-root").textContent = data.root;
    renderProblems();
    bindRuns();
    window.addEventListener("hashchange", route);
    route();
    if (served) window.NNRecorder.enableRefresh();
    document.body.setAttribute("data-ready", "1");
  }

  if (!served) start(JSON.parse($("nnstat-data").textContent));
  else window.NNRecorder.fetchData().then(start).catch((e) => showError(String(e)));
})();
