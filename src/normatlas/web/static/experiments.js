// Experiments: each result.json the runner wrote (GET /api/experiments), its figure and its verdict.
import {fmt, h, mount, once, status} from "./util.js";

export async function render(root) {
  mount(root, status("loading the experiments…"));
  const data = await once("/api/experiments");
  const head = h("header", {class: "view-head"}, h("h1", {}, "The guide's claims, measured"),
    h("p", {class: "lede"}, "Each experiment states a claim of the guide, runs seeded on this machine, and reports what it ",
      "measured against a relation fixed before the run."));
  if (!data.results.length) {
    mount(root, head, h("section", {class: "card"}, h("p", {}, data.folder
      ? `No result.json under ${data.folder} yet.` : "No experiments folder: start the server with --experiments DIR."),
    h("p", {class: "muted"}, "Run them with ", h("code", {}, "normatlas experiments run"), ", then reload.")));
    return;
  }
  mount(root, head,
    data.errors.length ? status(`unreadable results: ${data.errors.map((e) => e.name).join(", ")}`, "error") : null,
    h("div", {class: "cards wide"}, [...data.results].sort((a, b) => a.number - b.number).map(card)));
}

// a field name as words: "pre_last_over_first" -> "pre last over first"
const words = (k) => String(k).replaceAll("_", " ");

// a measured value as table rows [label, text]: a number, a list of numbers, or named values nested (the label
// then reads "outer › inner")
function rows(label, v, depth = 0) {
  if (v !== null && typeof v === "object" && !Array.isArray(v) && depth < 2) {
    return Object.entries(v).flatMap(([k, x]) => rows(label ? `${label} › ${words(k)}` : words(k), x, depth + 1));
  }
  if (Array.isArray(v)) return [[label, v.map((x) => (x !== null && typeof x === "object" ? JSON.stringify(x) : fmt(x))).join(", ")]];
  if (v !== null && typeof v === "object") return [[label, JSON.stringify(v)]];
  return [[label, fmt(v)]];
}

const PILL = {holds: "ok", inconclusive: "info", "does not hold": "warn"};

function verdictPill(v) {
  return h("span", {class: `pill ${PILL[v] || "warn"}`}, v);
}

// each clause of the verdict rule: what it says, the relation wanted, what the seeds measured, its verdict
function clauseTable(r) {
  const clauses = r.clauses || [];
  if (!clauses.length) return null;
  const seeds = (c) => Object.keys(c.per_seed || {}).length;
  return h("div", {class: "table-wrap"}, h("table", {class: "grid clauses"},
    h("caption", {}, "the verdict, clause by clause"),
    h("thead", {}, h("tr", {}, ["clause", "wanted", "measured", "verdict"].map((c) => h("th", {scope: "col"}, c)))),
    h("tbody", {}, clauses.map((c) => h("tr", {class: c.verdict === "holds" ? null : "failed"},
      h("th", {scope: "row"}, c.says),
      h("td", {class: "mono", "data-label": "wanted"}, `${c.statistic} ${c.direction} ${fmt(c.threshold)}`),
      h("td", {class: "mono", "data-label": "measured"}, seeds(c) > 1 ? `median ${fmt(c.median)} (${fmt(c.min)} to ${fmt(c.max)}, ${seeds(c)} seeds)` : fmt(c.median)),
      h("td", {}, verdictPill(c.verdict)))))));
}

function card(r) {
  const verdict = r.verdict || (r.holds ? "holds" : "does not hold");
  const measured = rows("", r.measured || {}).map(([k, v]) => h("tr", {}, h("th", {scope: "row"}, k), h("td", {}, v)));
  const shown = r.figures.svg || r.figures.png;
  const full = r.figures.png || r.figures.svg;
  const reasons = r.reasons || [];
  return h("article", {class: "card experiment", id: `exp-${r.name}`},
    h("div", {class: "panel-head"}, h("h2", {}, `${r.number}. ${r.title}`), verdictPill(verdict)),
    h("p", {class: "claim"}, r.claim),
    h("blockquote", {}, r.guide_words),
    verdict !== "holds"
      ? h("div", {class: `why ${PILL[verdict] || "warn"}`, role: "note"}, h("strong", {}, `Why it ${verdict === "inconclusive" ? "is inconclusive" : "does not hold"}:`),
        reasons.length ? h("ul", {}, reasons.map((why) => h("li", {}, why))) : h("p", {}, "no clause gave a reason"))
      : null,
    shown ? h("figure", {class: "exp-figure"},
      h("a", {href: full, target: "_blank", class: "figure-link", title: "open the figure full size"},
        h("img", {src: shown, alt: `figure of ${r.name}: ${r.claim}`, class: "figure"})),
      h("figcaption", {class: "small"}, "open full size: ",
        [r.figures.png ? h("a", {href: r.figures.png, target: "_blank", class: "full-png"}, "PNG") : null,
          r.figures.svg ? h("a", {href: r.figures.svg, target: "_blank", class: "full-svg"}, "SVG (zoomable)") : null]
          .filter(Boolean).flatMap((a, i) => (i ? [" · ", a] : [a]))))
      : null,
    h("p", {class: "small"}, h("strong", {}, "expected: "), r.expected),
    clauseTable(r),
    measured.length ? h("table", {class: "kv measured"}, h("caption", {}, "measured"), h("tbody", {}, measured)) : null,
    r.notes ? h("p", {class: "muted small"}, r.notes) : null,
    h("p", {class: "muted small"}, `anchor ${r.anchor}: ${r.anchor_reports} · seeds ${(r.seeds || []).join(", ")}`,
      ` · ${r.scale || (r.quick ? "quick" : "default")} scale · `,
      `${fmt(r.seconds)} s on ${r.machine}`),
    h("p", {class: "command"}, h("code", {}, r.command)));
}
