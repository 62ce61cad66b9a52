// Matrix: every model record (GET /api/models), filtered by family, operator, placement, QK-norm and
// modality, searched over every field; each design field carries its provenance badge.
import {extLink, h, mount, once, status, writeHash} from "./util.js";

const FILTERS = [["family", "family"], ["operator", "operator"], ["placement", "placement"], ["qk_norm", "QK-norm"], ["kind", "modality"]];
const COLUMNS = ["operator", "placement", "qk_norm", "gain_convention", "residual", "vision_tower_norm", "connector_norm"];
const BADGE_TEXT = {code: "code", paper: "paper", guide: "guide", unclear: "unclear"};

export async function render(root, params) {
  mount(root, status("loading the matrix…"));
  const data = await once("/api/models");
  const selects = FILTERS.map(([key, label]) => {
    const sel = h("select", {id: `filter-${key}`, "data-key": key, "aria-label": `filter by ${label}`},
      h("option", {value: ""}, `any ${label}`), data.facets[key].map((v) => h("option", {value: v}, v)));
    sel.value = params.get(key) || "";
    sel.addEventListener("change", update);
    return h("label", {class: "filter"}, h("span", {}, label), sel);
  });
  const search = h("input", {type: "search", id: "matrix-search", placeholder: "search every field…",
    "aria-label": "search the matrix", value: params.get("q") || ""});
  search.addEventListener("input", update);
  const count = h("p", {class: "count", id: "matrix-count", "aria-live": "polite"});
  const body = h("tbody");
  const rows = data.models.map((m) => ({m, tr: row(m), text: JSON.stringify(m).toLowerCase()}));
  body.append(...rows.map((r) => r.tr));
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "What did each model ship?"),
      h("p", {class: "lede"}, "The model matrix as data. Each design field says where its value comes from: ",
        badge("code"), " read off the reference code, ", badge("paper"), " a paper, ", badge("guide"),
        " the guide's own words, ", badge("unclear"), " not known. Rows marked “differs” are where the code says otherwise than the guide.")),
    h("div", {class: "controls wrap"}, selects, search),
    count,
    h("div", {class: "table-wrap"}, h("table", {class: "grid matrix", id: "matrix"},
      h("thead", {}, h("tr", {}, ["model", "family", "modality", "year", ...COLUMNS.map((c) => c.replaceAll("_", " ")), "source"]
        .map((c) => h("th", {scope: "col"}, c)))),
      body)));

  function update() {
    const want = Object.fromEntries(selects.map((l) => l.querySelector("select")).map((sel) => [sel.dataset.key, sel.value]));
    const q = search.value.trim().toLowerCase();
    let shown = 0;
    for (const r of rows) {
      const ok = FILTERS.every(([key]) => !want[key] || String(r.m[key]) === want[key]) && (!q || r.text.includes(q));
      r.tr.hidden = !ok;
      shown += ok ? 1 : 0;
    }
    count.textContent = `${shown} of ${rows.length} records`;
    writeHash("matrix", {...want, q: search.value.trim()});
  }
  update();
}

function badge(kind) {
  return h("span", {class: `badge ${kind}`, title: `provenance: ${kind}`}, BADGE_TEXT[kind] || kind);
}

function row(m) {
  const cells = COLUMNS.map((c) => h("td", {class: "design"},
    m[c] === null ? h("span", {class: "muted"}, "–") : h("span", {class: "pair"}, h("span", {class: "val"}, String(m[c])), " ", badge(m.provenance[c]))));
  const inspect = m.hf_model_types.map((t) => h("a", {href: `#/inspect?model_type=${encodeURIComponent(t)}`, class: "chip"}, t));
  const file = m.source_link ? m.source_link.split("/src/transformers/")[1] : null;
  const source = h("td", {class: "source"},
    file ? extLink(m.source_link, file) : h("span", {}, m.source.split(":")[0].slice(0, 60)),
    h("details", {}, h("summary", {}, "source"), h("p", {}, m.source), m.notes ? h("p", {class: "muted"}, m.notes) : null),
    m.essay_differs ? h("details", {class: "differs"}, h("summary", {}, "differs from the guide"), h("p", {}, m.essay_differs)) : null,
    inspect.length ? h("div", {class: "chips"}, "inspect: ", inspect) : null);
  return h("tr", {class: m.essay_differs ? "has-differs" : null},
    h("th", {scope: "row"}, m.name), h("td", {}, m.family), h("td", {}, m.kind), h("td", {}, m.year ?? "–"), cells, source);
}
