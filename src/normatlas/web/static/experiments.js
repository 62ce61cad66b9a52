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

// a measured value: a number, a list, or a table of named values (nested one level more at most)
function value(v) {
  if (Array.isArray(v)) return v.map(value).join(", ");
  if (v !== null && typeof v === "object") return Object.entries(v).map(([k, x]) => `${k}: ${value(x)}`).join("; ");
  return fmt(v);
}

function card(r) {
  const measured = Object.entries(r.measured || {}).map(([k, v]) => h("tr", {}, h("th", {scope: "row"}, k),
    h("td", {}, value(v))));
  const fig = r.figures.svg || r.figures.png;
  return h("article", {class: "card experiment", id: `exp-${r.name}`},
    h("div", {class: "panel-head"}, h("h2", {}, `${r.number}. ${r.title}`),
      h("span", {class: `pill ${r.verdict === "holds" ? "ok" : r.verdict === "inconclusive" ? "" : "warn"}`},
        r.verdict || (r.holds ? "holds" : "does not hold"))),
    h("p", {class: "claim"}, r.claim),
    h("blockquote", {}, r.guide_words),
    fig ? h("img", {src: fig, alt: `figure of ${r.name}: ${r.claim}`, class: "figure"}) : null,
    h("p", {class: "small"}, h("strong", {}, "expected: "), r.expected),
    h("table", {class: "kv"}, h("tbody", {}, measured)),
    (r.reasons || []).length ? h("ul", {class: "small"}, r.reasons.map((why) => h("li", {}, why))) : null,
    r.notes ? h("p", {class: "muted small"}, r.notes) : null,
    h("p", {class: "muted small"}, `anchor ${r.anchor}: ${r.anchor_reports} · seeds ${(r.seeds || []).join(", ")}`,
      ` · ${r.scale || (r.quick ? "quick" : "default")} scale · `,
      `${fmt(r.seconds)} s on ${r.machine}`),
    h("p", {}, h("code", {}, r.command)));
}
