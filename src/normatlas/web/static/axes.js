// Axes: one decision (which axes the statistics reduce over) drawn in both conventions at once.
// The names, shapes, statistics and histograms come from POST /api/normalize (the library's classify
// and normalize); this file only draws them.
import {api, fmt, h, histogram, mount, once, s, status, writeHash} from "./util.js";

const ROLES = ["sample", "feature", "position"];
const ROLE_WORD = {sample: "sample", feature: "channel / feature", position: "position"};
const GRID = {sample: 5, feature: 6, position: 4};  // cells drawn per axis (a schematic, not the tensor)

let seq = 0;  // ignore answers to superseded requests

export async function render(root, params) {
  const tax = await once("/api/taxonomy");
  const state = {
    reduce: new Set((params.get("reduce") || "feature").split(",").filter((a) => ROLES.includes(a))),
    groups: Number(params.get("groups") || 1),
    center: params.get("center") !== "0",
  };
  if (!state.reduce.size) state.reduce.add("feature");
  const channels = tax.layouts[0].default_shape[1];
  const toggles = ROLES.map((role) => h("button", {
    type: "button", class: "toggle", id: `axis-${role}`, "data-axis": role,
    "aria-pressed": state.reduce.has(role) ? "true" : "false",
    onclick: () => toggle(role),
  }, h("span", {class: "toggle-letters"}, tax.layouts.map((l) => l.letters[role]).join(" · ")),
  h("span", {class: "toggle-word"}, ROLE_WORD[role])));
  const groupSel = h("select", {id: "groups", "aria-label": "channel groups"},
    divisors(channels).map((g) => h("option", {value: g, selected: g === state.groups}, `G = ${g}`)));
  groupSel.addEventListener("change", () => { state.groups = Number(groupSel.value); update(); });
  const centerBtn = h("button", {type: "button", class: "toggle small", id: "center",
    "aria-pressed": state.center ? "true" : "false", onclick: () => { state.center = !state.center; update(); }},
  "subtract the mean");
  const panels = Object.fromEntries(tax.layouts.map((l) => [l.layout, h("section", {class: "card panel", id: `panel-${l.layout}`})]));
  const table = taxonomyTable(tax);
  mount(root,
    h("header", {class: "view-head"},
      h("h1", {}, "Which axes do you reduce over?"),
      h("p", {class: "lede"}, "Take a tensor and choose the axes the statistics are computed over: that single decision ",
        "names your normalization layer. The same choice is drawn in the vision (N, C, H, W) and the sequence (B, T, D) ",
        "conventions side by side; the names, shapes and histograms are computed by the library.")),
    h("div", {class: "controls", role: "group", "aria-label": "axes to reduce over"},
      h("span", {class: "controls-label"}, "reduce over"), toggles,
      h("label", {class: "inline"}, "groups ", groupSel), centerBtn),
    h("div", {class: "panels"}, Object.values(panels)),
    h("section", {class: "card"}, h("h2", {}, "The taxonomy"), table));

  function toggle(role) {
    if (state.reduce.has(role) && state.reduce.size === 1) return;  // at least one axis
    state.reduce.has(role) ? state.reduce.delete(role) : state.reduce.add(role);
    update();
  }

  async function update() {
    const reduce = ROLES.filter((r) => state.reduce.has(r));
    if (!state.reduce.has("feature")) state.groups = 1;
    groupSel.value = String(state.groups);
    groupSel.disabled = !state.reduce.has("feature");
    for (const b of toggles) b.setAttribute("aria-pressed", state.reduce.has(b.dataset.axis) ? "true" : "false");
    centerBtn.setAttribute("aria-pressed", state.center ? "true" : "false");
    writeHash("axes", {reduce: reduce.join(","), groups: state.groups > 1 ? state.groups : "", center: state.center ? "" : "0"});
    const mine = ++seq;
    const answers = await Promise.all(tax.layouts.map((l) => api("/api/normalize", {
      layout: l.layout, reduce, groups: state.groups, center: state.center,
    }).catch((e) => ({error: e.message}))));
    if (mine !== seq) return;
    tax.layouts.forEach((l, i) => drawPanel(panels[l.layout], l, answers[i], state));
    for (const tr of table.querySelectorAll("tbody tr")) {
      tr.classList.toggle("current", answers[0].name !== undefined && tr.dataset.vision === answers[0].name);
    }
    root.dataset.ready = "1";
  }
  await update();
}

function divisors(n) {
  return Array.from({length: n}, (_, i) => i + 1).filter((g) => n % g === 0);
}

function drawPanel(panel, layout, res, state) {
  if (res.error) {
    mount(panel, h("h2", {}, `${layout.layout} · ${layout.convention}`), status(res.error, "error"));
    return;
  }
  const batch = res.batch_dependent;
  mount(panel,
    h("div", {class: "panel-head"},
      h("h2", {}, h("span", {class: "mono"}, layout.layout), " ", h("span", {class: "muted"}, layout.convention)),
      h("span", {class: `pill ${batch ? "warn" : "ok"}`}, batch ? "depends on the batch" : "batch-independent")),
    cuboid(layout, state),
    h("p", {class: "layer-name", id: `name-${layout.layout}`, "aria-live": "polite"}, res.name),
    h("p", {class: "muted"}, res.note),
    h("dl", {class: "facts"},
      fact("one statistic per", res.per),
      fact("statistics", `${res.statistics} of ${res.per_statistic} values each`),
      fact("sample tensor", `(${res.shape.join(", ")}), seed ${res.seed}`),
      fact("batch effect", res.batch_effect === null ? "sample 0 alone: undefined (one value per statistic)"
        : `sample 0 alone vs in the batch: max |Δy| = ${fmt(res.batch_effect)}`)),
    h("ol", {class: "arith"}, res.arithmetic.map((line) => h("li", {},
      h("span", {class: "step"}, line.step), h("code", {}, line.expr),
      line.shape ? h("span", {class: "shape"}, `→ (${line.shape.join(", ")})`) : null))),
    h("div", {class: "hists"},
      histogram(res.hist.before, {label: `before: mean ${fmt(res.stats.before.mean)}, std ${fmt(res.stats.before.std)}`, cls: "bars before"}),
      histogram(res.hist.after, {label: `after: mean ${fmt(res.stats.after.mean)}, std ${fmt(res.stats.after.std)}`, cls: "bars after"})));
}

function fact(k, v) {
  return [h("dt", {}, k), h("dd", {}, v)];
}

/** The x[n, c, s] block as an oblique cuboid; the cells one statistic covers are shaded. */
function cuboid(layout, state) {
  const N = GRID.sample, C = GRID.feature, S = GRID.position;
  const cw = 24, ch = 20, kx = 10, ky = 8, ox = 54, oy = 24 + C * ky;
  const P = (i, j, k) => `${ox + i * cw + k * kx},${oy + j * ch - k * ky}`;
  const groupSize = C / (state.reduce.has("feature") ? state.groups : C);
  const inSlice = (n, c, sp) =>
    (state.reduce.has("sample") || n === N - 1) &&
    (state.reduce.has("feature") ? c < groupSize : c === 0) &&
    (state.reduce.has("position") || sp === 0);
  const cell = (pts, on) => s("polygon", {points: pts.join(" "), class: on ? "cell on" : "cell"});
  const cells = [];
  for (let n = 0; n < N; n++) for (let sp = 0; sp < S; sp++) {
    cells.push(cell([P(n, sp, 0), P(n + 1, sp, 0), P(n + 1, sp + 1, 0), P(n, sp + 1, 0)], inSlice(n, 0, sp)));
  }
  for (let n = 0; n < N; n++) for (let c = 0; c < C; c++) {
    cells.push(cell([P(n, 0, c), P(n + 1, 0, c), P(n + 1, 0, c + 1), P(n, 0, c + 1)], inSlice(n, c, 0)));
  }
  for (let c = 0; c < C; c++) for (let sp = 0; sp < S; sp++) {
    cells.push(cell([P(N, sp, c), P(N, sp, c + 1), P(N, sp + 1, c + 1), P(N, sp + 1, c)], inSlice(N - 1, c, sp)));
  }
  const lab = (role, x, y, extra = {}) => s("text", {
    x, y, class: `axis-label${state.reduce.has(role) ? " on" : ""}`, "aria-hidden": "true", ...extra,
    onclick: () => document.getElementById(`axis-${role}`).click(),
  }, layout.letters[role]);
  const w = ox + N * cw + C * kx + 40, hgt = oy + S * ch + 34;
  return s("svg", {viewBox: `0 0 ${w} ${hgt}`, class: "cuboid", role: "img",
    "aria-label": `${layout.layout} block; shaded: the values one statistic is computed over`},
  ...cells,
  lab("sample", ox + (N * cw) / 2, oy + S * ch + 24, {"text-anchor": "middle"}),
  lab("position", ox - 10, oy + (S * ch) / 2 + 5, {"text-anchor": "end"}),
  lab("feature", ox + (C * kx) / 2 - 8, oy - (C * ky) / 2 - 4, {"text-anchor": "end"}));
}

function taxonomyTable(tax) {
  const cols = Object.keys(tax.rows[0]);
  return h("div", {class: "table-wrap"}, h("table", {class: "grid"},
    h("thead", {}, h("tr", {}, cols.map((c) => h("th", {scope: "col"}, c)))),
    h("tbody", {}, tax.rows.map((r) => h("tr", {"data-vision": r["vision name"]}, cols.map((c) => h("td", {}, r[c])))))));
}
