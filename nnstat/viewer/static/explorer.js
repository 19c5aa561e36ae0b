/* Influence explorer: pick a query, see its most helpful and harmful training examples with
   their scores (served: api/influence, computed and cached by the server; export: the results
   the file carries), and the self-influence ranking of the training examples. */
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const fmt = (v) => window.NNChart.fmt(v);
  const E = { data: null, served: false, store: 0, set: null, k: 10, q: 0, bound: false, seq: 0,
    source: "here:dot" };

  const { h, hint } = window.NNDom;  // static/dom.js
  const store = () => E.data.stores[E.store];

  function get(path, params) {
    const q = new URLSearchParams(params).toString();
    return fetch(`api/${path}?${q}`).then((r) => (r.ok ? r.json() : r.text().then((t) => {
      throw new Error(`${path}: ${t}`);
    })));
  }

  // one example: its image (a PNG data: URL made by the server), id, label, text, score
  function card(ex, onPick) {
    const c = h("div", { class: "card", "data-id": JSON.stringify(ex.id) });
    // an export carries each image once (store.export.images) and names it by image_ref
    const shared = E.served || ex.image_ref === undefined ? undefined :
      Object.prototype.hasOwnProperty.call(exported().images || {}, ex.image_ref) ?
        exported().images[ex.image_ref] : undefined;
    const image = ex.image !== undefined ? ex.image : shared;
    if (typeof image === "string" && image.startsWith("data:image/png;base64,")) {
      c.append(h("img", { src: image, alt: `example ${ex.id}` }));
    }
    const line = [`id ${ex.id}`];
    if (ex.label !== undefined) line.push(`label ${ex.label}`);
    c.append(h("div", { class: "cap" }, line.join(" · ")));
    if (ex.score !== undefined) c.append(h("div", { class: "score" }, fmt(ex.score)));
    if (ex.text !== undefined) c.append(h("div", { class: "text" }, ex.text));
    if (onPick) { c.classList.add("pick"); c.addEventListener("click", onPick); }
    return c;
  }

  function about() {
    const s = store();
    const sets = s.query_sets.map((x) => x.name).filter(Boolean);
    // examples refused (not bound to these ids, or ids moved between examples): say which file
    // and the fix; the cards show ids only
    const problems = [s.examples_problem].concat(s.query_sets.map((x) => x.examples_problem))
      .filter((m) => typeof m === "string")
      .map((m) => h("span", { class: "examples-problem" }, `Examples not shown: ${m}`))
      .concat((s.scores_problems || []).map((m) => h("span", { class: "examples-problem" },
        `Saved scores not offered: ${m}`)));
    const saved = (s.score_sets || []).map((x) => `${x.name}${x.label ? ` (${x.label})` : ""}`);
    $("inf-about").replaceChildren(`${s.rows} training rows · ${s.modules.length} modules · ` +
      `computed here: g_qᵀ(H+λI)⁻¹g_i (mode dot, or RelatIF) with the store's default ` +
      `preconditioner (${s.preconditioner}), not refined; ` +
      "positive = helpful (upweighting the training example lowers the query's loss). " +
      (saved.length ? `Scores saved beside the store (pick them under "scores"): ` +
        `${saved.join(", ")}. ` : "") +
      (sets.length ? `Query sets saved beside the store: ${sets.join(", ")}.` :
        "No query set saved beside the store (nnstat.viewer.save_queries): the training " +
        "examples are the queries.") +
      (s.examples || problems.length ? "" :
        " No examples saved (nnstat.viewer.save_examples): ids only."), ...problems);
  }

  function fillControls() {
    $("inf-store").replaceChildren(...E.data.stores.map((s, i) => h("option", { value: i }, s.id)));
    $("inf-store").value = String(E.store);
    const sets = store().query_sets;
    if (E.set === null || !sets.some((x) => x.name === E.set)) {
      // a saved query set first: it is what the run wanted explained
      E.set = (sets.find((x) => x.name) || sets[0]).name;
      E.q = 0;
    }
    $("inf-set").replaceChildren(...sets.map((x) => h("option", { value: x.name },
      `${x.label} (${x.n})`)));
    $("inf-set").value = E.set;
    $("inf-k").value = String(E.k);
    fillSources();
  }

  // where the lists come from: computed here (mode dot or relatif), or scores saved beside the
  // store for this query set (nnstat.viewer.save_scores)
  function fillSources() {
    const opts = [["here:dot", `computed here: dot (${store().preconditioner})`],
      ["here:relatif", `computed here: RelatIF (${store().preconditioner})`]];
    for (const x of store().score_sets || []) {
      if (x.queries === E.set) {
        opts.push([`saved:${x.name}`, `saved: ${x.name}${x.label ? ` (${x.label})` : ""}`]);
      }
    }
    if (!opts.some(([v]) => v === E.source)) E.source = "here:dot";
    $("inf-source").replaceChildren(...opts.map(([v, t]) => h("option", { value: v }, t)));
    $("inf-source").value = E.source;
  }

  // "the saved scores "refined" (the report's lists)" / "the lists computed here (mode dot)"
  function sourceName(c) {
    return c.source === "here" ? "the lists computed here from the store (mode dot)" :
      `the saved scores "${c.source}"${c.label ? ` (${c.label})` : ""}`;
  }

  // for each other source of this query: do its top k hold the same training examples?
  function comparisons(res, k) {
    const ids = (list) => new Set(list.slice(0, k).map((x) => JSON.stringify(x)));
    return (res.compare || []).map((c) => {
      const hs = ids(c.helpful_ids), rs = ids(c.harmful_ids);
      const mh = res.helpful.slice(0, k).filter((ex) => !hs.has(JSON.stringify(ex.id))).length;
      const mr = res.harmful.slice(0, k).filter((ex) => !rs.has(JSON.stringify(ex.id))).length;
      if (mh + mr === 0) {
        return h("p", { class: "compare same", "data-source": c.source },
          `Same top ${k} as ${sourceName(c)}.`);
      }
      return h("p", { class: "compare differs", "data-source": c.source },
        `These lists differ from ${sourceName(c)}: ${mh} of the ${k} most helpful and ${mr} of ` +
        `the ${k} most harmful shown here are not in its top ${k}. Why: ${c.why}. ` +
        `Its lists come from: ${c.line}.`);
    });
  }

  function exported() { return store().export || { sets: {}, self: null }; }

  function renderQueries() {
    const box = $("inf-query-list");
    const show = (res) => {
      const n = store().query_sets.find((x) => x.name === E.set).n;
      const cards = res.items.map((ex, i) => {
        const c = card(ex, () => { E.q = i; renderQueries(); renderResult(); });
        c.setAttribute("data-q", i);
        if (i === E.q) c.classList.add("selected");
        return c;
      });
      const more = [];
      if (n > res.items.length) {
        more.push(hint(E.served ? `${res.items.length} of ${n} listed; pick any by number:` :
          `${res.items.length} of ${n} queries listed (the export carries the first ones scored)`));
        if (E.served) {
          const input = h("input", { type: "number", min: 0, max: n - 1, value: E.q, id: "inf-q" });
          input.addEventListener("change", () => { E.q = Number(input.value); renderResult(); });
          more.push(input);
        }
      }
      box.replaceChildren(...cards, ...more);
    };
    if (E.served) {
      get("queries", { store: store().id, set: E.set }).then(show)
        .catch((e) => box.replaceChildren(hint(String(e))));
    } else {
      const s = exported().sets[E.set];
      if (s) show(s.queries); else box.replaceChildren(hint("Not in this export."));
    }
  }

  function renderResult() {
    const box = $("inf-result");
    const key = `${E.set}:${E.q}`;
    const source = E.source;
    const seq = ++E.seq;  // a slower earlier answer must not overwrite a later one
    box.setAttribute("data-loading", "1");
    box.removeAttribute("data-query");  // set again once this query's result is shown
    box.setAttribute("data-source", source);
    box.replaceChildren(hint(`scoring query ${E.q} against ${store().rows} training rows…`));
    const show = (res) => {
      if (seq !== E.seq) return;
      const k = Math.min(E.k, res.helpful.length);
      const m = res.method || {};
      const from = m.source && m.source !== "here" ?
        `saved scores "${m.source}"${m.label ? ` (${m.label})` : ""}` : "computed here";
      box.replaceChildren(
        h("p", { class: "method" }, `Method (${from}): ${m.line || "?"}`),
        ...comparisons(res, k),
        h("div", { class: "query" }, h("h3", {}, "Query"), card(res.query)),
        h("div", { class: "side helpful" }, h("h3", {}, `Most helpful (top ${k})`),
          h("div", { class: "cards" }, res.helpful.slice(0, k).map((ex) => card(ex)))),
        h("div", { class: "side harmful" }, h("h3", {}, `Most harmful (top ${k})`),
          h("div", { class: "cards" }, res.harmful.slice(0, k).map((ex) => card(ex)))),
        hint(`preconditioner ${res.preconditioner}` + (E.served ?
          ` · ${fmt(res.seconds)} s (cached for this session)` : "")));
      box.removeAttribute("data-loading");
      box.setAttribute("data-query", key);
    };
    const fail = (msg) => {
      if (seq !== E.seq) return;
      box.replaceChildren(hint(msg));
      box.removeAttribute("data-loading");
      box.setAttribute("data-query", key);
    };
    const [kind, name] = [source.slice(0, source.indexOf(":")), source.slice(source.indexOf(":") + 1)];
    if (E.served) {
      const params = { store: store().id, set: E.set, q: E.q, k: 50 };
      if (kind === "saved") params.scores = name; else params.mode = name;
      get("influence", params).then(show).catch((e) => fail(String(e)));
    } else {
      const s = exported().sets[E.set];
      const scored = !s ? undefined : source === "here:dot" ? s.scored : (s.sources || {})[source];
      const res = scored && scored[String(E.q)];
      if (res) show(res);
      else fail("This query was not scored in the export: open the folder with nnstat view.");
    }
  }

  function renderSelf() {
    const box = $("inf-self");
    box.removeAttribute("data-ready");
    const pick = (ex) => () => { E.set = ""; E.q = ex.index; fillControls(); renderQueries(); renderResult(); };
    const show = (res) => {
      const k = Math.min(E.k, res.highest.length);
      box.replaceChildren(h("h3", {}, "Self-influence g_iᵀ(H+λI)⁻¹g_i"),
        h("p", { class: "method" }, `Method: ${(res.method || {}).line || "?"}`),
        hint("Highest: examples the model bent most to fit (often unusual or mislabeled). " +
          "Click one to see what it influences."),
        h("div", { class: "cards", id: "self-highest" },
          res.highest.slice(0, k).map((ex) => card(ex, pick(ex)))),
        h("h3", {}, "Lowest"),
        h("div", { class: "cards", id: "self-lowest" },
          res.lowest.slice(0, k).map((ex) => card(ex, pick(ex)))));
      box.setAttribute("data-ready", "1");
    };
    if (E.served) {
      get("self", { store: store().id, k: 50 }).then(show).catch((e) => box.replaceChildren(hint(String(e))));
    } else if (exported().self) show(exported().self);
  }

  function renderAll() {
    if (!E.data.stores.length) {
      $("inf-about").textContent = "";
      $("inf-query-list").replaceChildren();
      $("inf-result").replaceChildren(hint("No gradient store under this folder."));
      $("inf-self").replaceChildren();
      return;
    }
    fillControls();
    about();
    renderQueries();
    renderResult();
    renderSelf();
  }

  function bind() {
    $("inf-store").addEventListener("change", (ev) => {
      E.store = Number(ev.target.value); E.set = null; renderAll();
    });
    $("inf-set").addEventListener("change", (ev) => {
      E.set = ev.target.value; E.q = 0; fillSources(); renderQueries(); renderResult();
    });
    $("inf-source").addEventListener("change", (ev) => { E.source = ev.target.value; renderResult(); });
    $("inf-k").addEventListener("change", (ev) => {
      E.k = Number(ev.target.value); renderResult(); renderSelf();
    });
  }

  function show(data, served, hash) {
    E.data = data;
    E.served = served;
    if (!E.bound) { bind(); E.bound = true; }
    const m = /^#stores\/(\d+)$/.exec(hash || "");
    const i = m ? Number(m[1]) : E.store;
    if (E.rendered && i === E.store) return;
    if (i < data.stores.length) { if (i !== E.store) E.set = null; E.store = i; }
    E.rendered = true;
    renderAll();
  }

  window.NNExplorer = { show };
})();
