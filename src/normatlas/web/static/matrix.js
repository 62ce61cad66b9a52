// Matrix: every model record (GET /api/models). Typed facets (the API's `facets`: one spelling per value), a
// search over the record's values (never its field names, never an unset field), sortable columns, one
// provenance badge per row (a cell carries its own only where it differs from the row's), and a detail row per
// model linking its papers, its inspection and its placement.
import {extLink, h, mount, once, status, writeHash} from "./util.js";

// the facets shown at once; the API's other facets sit under "more filters"
const MAIN_FACETS = ["family", "kind", "operator", "placement", "qk_norm"];
// the record fields the search reads besides the design fields: what a row and its detail show (the `notes`
// are bookkeeping about how the fields were filled, and name fields, so they are not searched)
const SEARCHED = ["name", "family", "kind", "year", "vision_tower", "hf_model_types", "papers", "source", "essay_differs"];
// short column labels (the API's field names are snake_case)
const LABELS = {
  kind: "modality", qk_norm: "QK-norm", qk_norm_rope: "QK-norm vs RoPE", gain_convention: "gain",
  final_norm: "final norm", attn_softcap: "attn soft-cap", final_logit_softcap: "logit soft-cap",
  embedding_scale: "embed scale", vision_tower_norm: "tower norm", connector_norm: "connector norm",
};
// columns a phone hides (each is a facet, and the detail row states them): the design columns come first there
const META = ["family", "kind", "year"];
const BADGE_TEXT = {code: "code", paper: "paper", guide: "guide", unclear: "unclear"};

export const label = (k) => LABELS[k] || k.replaceAll("_", " ");

// a record's value against a facet's spelling (the API writes a soft-cap of 50 as "50.0")
const same = (v, want) => v !== null && v !== undefined && (String(v) === want || (typeof v === "number" && v === Number(want)));

/** Every value of a record a reader sees, lowercased and joined: never a field name, never an unset field. */
export function searchText(m, designFields) {
  const out = [];
  for (const k of [...SEARCHED, ...designFields]) {
    const v = m[k];
    if (v === null || v === undefined) continue;
    out.push(Array.isArray(v) ? v.join(" ") : String(v));
  }
  return out.join(" \u0000 ").toLowerCase();
}

// the provenance most of a row's set fields share: the row's badge
function rowProvenance(m, designFields) {
  const n = {};
  for (const f of designFields) {
    const p = m.provenance[f];
    if (p && p !== "unclear") n[p] = (n[p] || 0) + 1;
  }
  return Object.entries(n).sort((a, b) => b[1] - a[1])[0]?.[0] || null;
}

function badge(kind) {
  return h("span", {class: `badge ${kind}`, title: `provenance: ${kind}`}, BADGE_TEXT[kind] || kind);
}

let onResize = () => {};

export async function render(root, params) {
  mount(root, status("loading the matrix…"));
  const data = await once("/api/models");
  const design = data.design_fields;
  const columns = ["name", "family", "kind", "year", ...design, "provenance"];
  const facetKeys = Object.keys(data.facets);
  const facetCount = (key, v) => data.models.filter((m) => same(m[key], v)).length;
  const selects = facetKeys.map((key) => {
    const sel = h("select", {id: `filter-${key}`, "data-key": key, "aria-label": `filter by ${label(key)}`},
      h("option", {value: ""}, "any"),
      data.facets[key].map((v) => h("option", {value: v}, `${v} (${facetCount(key, v)})`)));
    sel.value = params.get(key) || "";
    sel.addEventListener("change", update);
    return {key, sel, el: h("label", {class: "filter"}, h("span", {}, label(key)), sel)};
  });
  const search = h("input", {type: "search", id: "matrix-search", placeholder: "search the values…",
    "aria-label": "search the matrix's values", value: params.get("q") || ""});
  search.addEventListener("input", update);
  const count = h("p", {class: "count", id: "matrix-count", "aria-live": "polite"});
  const hint = h("p", {class: "scroll-hint", id: "matrix-hint", hidden: true});
  let sort = params.get("sort") || "";
  let open = params.get("open") || "";
  const rows = data.models.map((m) => {
    const prov = rowProvenance(m, design);
    const tr = row(m, design, prov, toggle);
    const detail = h("tr", {class: "detail", hidden: true}, h("td", {colspan: columns.length}, details(m)));
    return {m, tr, detail, prov, text: searchText(m, design)};
  });
  const body = h("tbody");
  const heads = columns.map((c) => {
    const btn = h("button", {type: "button", class: "sort", "data-col": c, onclick: () => setSort(c)}, label(c));
    return h("th", {scope: "col", "data-col": c, class: c === "name" ? "sticky-col" : META.includes(c) ? "meta" : null}, btn);
  });
  const more = selects.filter((s) => !MAIN_FACETS.includes(s.key));
  const moreOpen = more.some((s) => s.sel.value);
  const wrap = h("div", {class: "table-wrap matrix-wrap", id: "matrix-wrap", tabindex: "0", "aria-label": "the model matrix (scrolls)"},
    h("table", {class: "grid matrix", id: "matrix"}, h("thead", {}, h("tr", {}, heads)), body));
  wrap.addEventListener("scroll", updateHint, {passive: true});
  removeEventListener("resize", onResize);  // one listener, the latest render's
  onResize = updateHint;
  addEventListener("resize", onResize);
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "What did each model ship?"),
      h("p", {class: "lede"}, "The model matrix as data. A row's badge says where its values come from: ",
        badge("code"), " read off the reference code (checked by ", h("code", {}, "matrix --check"), "), ", badge("paper"),
        " a paper, ", badge("guide"), " the guide's own words; a cell with its own badge comes from elsewhere. ",
        "Click a model for its source, papers and inspection; a marked row is where the code says otherwise than the guide.")),
    h("div", {class: "controls wrap"}, selects.filter((s) => MAIN_FACETS.includes(s.key)).map((s) => s.el), search),
    h("details", {class: "more-filters", open: moreOpen}, h("summary", {}, `more filters (${more.length})`),
      h("div", {class: "controls wrap"}, more.map((s) => s.el))),
    count, hint, wrap);

  function toggle(name) {
    open = open === name ? "" : name;
    for (const r of rows) {
      const on = r.m.name === open;
      r.detail.hidden = !on || r.tr.hidden;
      r.tr.querySelector("button.model").setAttribute("aria-expanded", String(on));
    }
    save();
  }

  function setSort(c) {
    sort = sort === c ? `-${c}` : sort === `-${c}` ? "" : c;
    update();
  }

  function key(r, c) {
    if (c === "provenance") return r.prov;
    const v = r.m[c];
    return v === null || v === undefined || v === "unclear" ? null : v;
  }

  function update() {
    const want = Object.fromEntries(selects.map((s) => [s.key, s.sel.value]));
    const q = search.value.trim().toLowerCase();
    const col = sort.replace(/^-/, ""), dir = sort.startsWith("-") ? -1 : 1;
    const order = [...rows];
    if (col && columns.includes(col)) {
      order.sort((a, b) => {
        const x = key(a, col), y = key(b, col);
        if (x === null || y === null) return (x === null) - (y === null);  // unset / unclear last either way
        const c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y), "en", {numeric: true});
        return dir * c;
      });
    }
    for (const th of heads) {
      const c = th.dataset.col;
      th.setAttribute("aria-sort", c === col ? (dir > 0 ? "ascending" : "descending") : "none");
    }
    let shown = 0;
    body.replaceChildren();
    for (const r of order) {
      const ok = facetKeys.every((k) => !want[k] || same(r.m[k], want[k])) && (!q || r.text.includes(q));
      r.tr.hidden = !ok;
      r.detail.hidden = !ok || r.m.name !== open;
      r.tr.querySelector("button.model").setAttribute("aria-expanded", String(r.m.name === open));
      body.append(r.tr, r.detail);
      shown += ok ? 1 : 0;
    }
    count.textContent = `${shown} of ${rows.length} records`;
    save();
    updateHint();
  }

  function save() {
    const want = Object.fromEntries(selects.map((s) => [s.key, s.sel.value]));
    writeHash("matrix", {...want, q: search.value.trim(), sort, open});
  }

  function updateHint() {
    const hidden = [...heads].filter((th) => {
      const r = th.getBoundingClientRect(), w = wrap.getBoundingClientRect();
      return r.left >= w.right - 4;
    }).length;
    hint.hidden = hidden === 0;
    hint.textContent = `${hidden} more column${hidden === 1 ? "" : "s"} to the right: scroll the table sideways →`;
  }
  update();
  if (open) rows.find((r) => r.m.name === open)?.tr.scrollIntoView({block: "center"});
}

function row(m, design, prov, toggle) {
  const cells = design.map((c) => {
    const v = m[c];
    if (v === null) return h("td", {class: "design unset"}, h("span", {class: "muted", "aria-label": "unset"}, "–"));
    const p = m.provenance[c];
    const text = String(v);
    return h("td", {class: `design${v === "unclear" ? " unclear" : ""}`, title: text.length > 24 ? text : null},
      h("span", {class: "val"}, text), p && p !== prov && p !== "unclear" ? [" ", badge(p)] : null);
  });
  const name = h("button", {type: "button", class: "model", "aria-expanded": "false", onclick: () => toggle(m.name)}, m.name);
  return h("tr", {class: m.essay_differs ? "has-differs" : null, "data-name": m.name},
    h("th", {scope: "row", class: "sticky-col"}, name, m.essay_differs ? h("span", {class: "differs-mark", title: "differs from the guide"}, " ≠") : null),
    h("td", {class: "meta"}, m.family), h("td", {class: "meta"}, m.kind), h("td", {class: "num meta"}, m.year ?? "–"), cells,
    h("td", {}, prov ? badge(prov) : h("span", {class: "muted"}, "–")));
}

function details(m) {
  const file = m.source_link ? (m.source_link.split("/src/transformers/")[1] || m.source_link) : null;
  const links = [];
  for (const k of m.papers) links.push(h("a", {href: `#/papers?q=${encodeURIComponent(k)}`, class: "chip"}, k));
  const inspect = m.hf_model_types.map((t) => h("a", {href: `#/inspect?model_type=${encodeURIComponent(t)}`, class: "chip"}, t));
  const placement = m.placement && m.placement !== "unclear"
    ? h("a", {href: `#/placements?kind=${encodeURIComponent(m.placement)}`, class: "chip"}, m.placement) : null;
  return h("div", {class: "record"},
    h("dl", {class: "facts"},
      h("dt", {}, "model"), h("dd", {}, [m.family, m.kind, m.year].filter((v) => v !== null).join(" · ")),
      h("dt", {}, "source"), h("dd", {}, m.source, file ? [" · ", extLink(m.source_link, file)] : null),
      links.length ? [h("dt", {}, "papers"), h("dd", {class: "chips"}, links)] : null,
      inspect.length ? [h("dt", {}, "inspect"), h("dd", {class: "chips"}, inspect)] : null,
      placement ? [h("dt", {}, "placement"), h("dd", {class: "chips"}, placement)] : null,
      m.residual ? [h("dt", {}, "residual"), h("dd", {}, m.residual)] : null,
      m.vision_tower ? [h("dt", {}, "vision tower"), h("dd", {}, m.vision_tower)] : null,
      m.essay_differs ? [h("dt", {class: "differs"}, "differs from the guide"), h("dd", {}, m.essay_differs)] : null,
      m.notes ? [h("dt", {}, "notes"), h("dd", {class: "muted"}, m.notes)] : null));
}
