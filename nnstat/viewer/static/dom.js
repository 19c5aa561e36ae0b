/* DOM building shared by the page's views (app.js, explorer.js, home.js), loaded before them.
   Every value from the folder enters the DOM as a text node or an attribute value, never parsed
   as markup: a hostile folder shows odd text, runs nothing. */
"use strict";
(function () {
  // h("p", { class: "x" }, "text", child, [more]): an element with its attributes and children;
  // a child that is not a Node becomes text, null and undefined are skipped, arrays are flattened
  function h(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, String(attrs[k]));
    children.flat().forEach((c) => {
      if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
    });
    return e;
  }
  const hint = (text) => h("p", { class: "hint" }, text);

  window.NNDom = Object.freeze({ h, hint });
})();
