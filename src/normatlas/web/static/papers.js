// Papers: the bibliography grouped by the question each paper answers (GET /api/papers), searchable;
// each confirmed title links to the paper, with an arXiv title search as the fallback.
import {extLink, h, mount, once, status, writeHash} from "./util.js";

// the fields a reader sees on a paper (its derived URLs `link` / `search` and the bookkeeping of its
// verification are not searched: "arxiv" or "link" would match every paper)
const SEARCHED = ["key", "title", "first_author", "year", "venue", "arxiv", "doi", "group", "question", "named_as",
  "essay_differs", "implemented_by"];

/** A paper's values a reader sees, lowercased: never a field name, never an unset field. */
function searchText(p) {
  return SEARCHED.map((k) => p[k]).filter((v) => v !== null && v !== undefined)
    .map((v) => (Array.isArray(v) ? v.join(" ") : String(v))).join(" \u0000 ").toLowerCase();
}

export async function render(root, params) {
  mount(root, status("loading the papers…"));
  const data = await once("/api/papers");
  const search = h("input", {type: "search", id: "papers-search", placeholder: "search titles, authors, questions…",
    "aria-label": "search the papers", value: params.get("q") || ""});
  const count = h("p", {class: "count", id: "papers-count", "aria-live": "polite"});
  const items = [];
  const sections = data.groups.map((g) => {
    const list = h("ol", {class: "papers"}, g.papers.map((p) => {
      const li = paper(p);
      items.push({li, text: searchText(p)});
      return li;
    }));
    return h("section", {class: "card group"}, h("h2", {}, g.question), list);
  });
  search.addEventListener("input", update);
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "The papers, by the question they answer"),
      h("p", {class: "lede"}, `${data.count} records. A title is shown only where a public page confirmed it with its id; `,
        "the others keep the guide's own words until confirmed.")),
    h("div", {class: "controls"}, search), count, sections);

  function update() {
    const q = search.value.trim().toLowerCase();
    let shown = 0;
    for (const it of items) {
      it.li.hidden = Boolean(q) && !it.text.includes(q);
      shown += it.li.hidden ? 0 : 1;
    }
    for (const sec of sections) sec.hidden = !sec.querySelector("li:not([hidden])");
    count.textContent = `${shown} of ${items.length} papers`;
    writeHash("papers", {q: search.value.trim()});
  }
  update();
}

function paper(p) {
  const who = [p.first_author, p.year, p.venue].filter(Boolean).join(" · ");
  const title = p.title
    ? (p.link ? extLink(p.link, p.title) : p.title)
    : h("span", {class: "unconfirmed"}, p.named_as || p.key);
  return h("li", {class: "paper", id: `paper-${p.key}`},
    h("p", {class: "paper-title"}, title, p.title ? null : h("span", {class: "badge unclear"}, "unconfirmed")),
    who ? h("p", {class: "muted small"}, who) : null,
    h("p", {class: "small"}, p.question),
    h("p", {class: "links small"}, p.search ? extLink(p.search, "arXiv title search") : null),
    p.implemented_by && p.implemented_by.length
      ? h("details", {class: "small"}, h("summary", {}, `in normatlas (${p.implemented_by.length})`),
        h("p", {class: "mono muted"}, p.implemented_by.join(", ")))
      : null,
    p.essay_differs ? h("details", {class: "differs"}, h("summary", {}, "differs from the guide"), h("p", {}, p.essay_differs)) : null);
}
