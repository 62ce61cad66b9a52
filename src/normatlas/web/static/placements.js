// Placements: every preset drawn from its Placement value (GET /api/placements), with its equation,
// its docstring drawing and, where the depth experiments ran, its measured profile by depth.
// drawPlacement is also what the Inspect view draws an inspected model with.
import {fmt, h, mount, once, s, status, writeHash} from "./util.js";

const BW = 46, BH = 26, GAP = 14, STREAM_Y = 34, ROW = 52, INNER = 38;

/** A block diagram of one block from drawing data: {attn, ffn: {pre, post, after_add}, parallel, ...}.
 * With `sites` (an inspected model's norm sites: {index, branch, slot, ...}) every norm is drawn from its own
 * site, QK- and V-norms hang under the attention box, the embedding and final norms sit on the stream, and each
 * is a button: a click (or Enter / Space) calls onSite(site, element). */
export function drawPlacement(p, {label = "placement", sites = null, onSite = null, rope = null} = {}) {
  const ctx = {p, at: siteMap(sites), onSite, rope, items: [], inner: false};
  const items = ctx.items;
  let x = 16;
  items.push(s("text", {x: 4, y: STREAM_Y - 10, class: "d-label"}, "x"));
  if (ctx.at) for (const site of ctx.at.stream.embedding) x = siteBox(ctx, x, STREAM_Y, site, "embedding") + 4;
  const subs = p.parallel ? [["A", "F"]] : [["A"], ["F"]];
  ctx.inner = Boolean(ctx.at && (ctx.at.attn.qk.length || ctx.at.attn.v.length));
  let rows = 1;
  for (const names of subs) {
    const r = sublayer(ctx, x, names);
    x = r.x;
    rows = Math.max(rows, names.length);
  }
  const blockEnd = x;
  items.push(arrowLine(x, STREAM_Y, x + 18, STREAM_Y), s("text", {x: x + 22, y: STREAM_Y + 4, class: "d-label"}, "x′"));
  x += 40;
  if (ctx.at && ctx.at.stream.final.length) {  // the later layers elided, then the final norm
    items.push(s("text", {x: x + 2, y: STREAM_Y + 4, class: "d-label"}, "⋯"));
    x += 26;
    for (const site of ctx.at.stream.final) {
      items.push(arrowLine(x - 8, STREAM_Y, x, STREAM_Y));
      x = siteBox(ctx, x, STREAM_Y, site, "final") + 8;
    }
  }
  const width = x, height = rowY(ctx, rows - 1) + BH / 2 + (ctx.inner ? INNER : 0) + 12;
  const defs = s("defs", {}, s("marker", {id: "arr", viewBox: "0 0 8 8", refX: 7, refY: 4, markerWidth: 6, markerHeight: 6,
    orient: "auto"}, s("path", {d: "M0,0 L8,4 L0,8 z", class: "arrowhead"})));
  return s("svg", {viewBox: `0 0 ${width} ${height}`, width, height, class: "diagram",
    role: ctx.at ? "group" : "img", "aria-label": label}, defs,
    s("line", {x1: 12, x2: blockEnd, y1: STREAM_Y, y2: STREAM_Y, class: "stream"}), ...items);
}

// the sites by branch and slot; null without sites (a preset: its booleans are drawn)
function siteMap(sites) {
  if (!sites) return null;
  const at = {attn: {}, ffn: {}, stream: {embedding: [], final: []}};
  for (const b of ["attn", "ffn"]) for (const slot of ["pre", "out", "post", "qk", "v"]) at[b][slot] = [];
  for (const site of sites) at[site.branch]?.[site.slot]?.push(site);
  return at;
}

function rowY(ctx, row) {
  return STREAM_Y + ROW * (row + 1) + (ctx.inner ? INNER * row : 0);
}

function box(items, x, y, text, cls, caption = null) {
  const w = Math.max(BW, text.length * 7 + 12);
  items.push(s("rect", {x, y: y - BH / 2, width: w, height: BH, rx: 6, class: `d-box ${cls}`}),
    s("text", {x: x + w / 2, y: y + 4, class: "d-text", "text-anchor": "middle"}, text));
  if (caption) items.push(s("text", {x: x + w / 2, y: y - BH / 2 - 4, class: "d-caption", "text-anchor": "middle"}, caption));
  return x + w;
}

const SLOT_WORDS = {pre: "on the branch input", out: "on the branch output", post: "on the stream after the add",
  qk: "on queries or keys inside attention", v: "on values inside attention", embedding: "after the embedding",
  final: "after the last layer"};

/** One norm site as a focusable button: its box, its caption, its handlers. */
function siteBox(ctx, x, y, site, caption = null, text = "N") {
  const parts = [];
  const end = box(parts, x, y, text, `norm${site.slot === "post" || site.branch === "stream" ? " on-stream" : ""}`, caption);
  const where = {attn: "attention", ffn: "MLP", stream: "stream"}[site.branch];
  const name = `${site.operator} ${SLOT_WORDS[site.slot]} (${where}, site ${site.index}): its arithmetic`;
  const open = () => ctx.onSite && ctx.onSite(site);
  const g = s("g", {class: "site", tabindex: 0, role: "button", "aria-label": name, "aria-pressed": "false",
    "data-site": site.index, "data-slot": site.slot, onclick: open,
    onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); open(); } }},
  s("title", {}, name), ...parts);
  ctx.items.push(g);
  return end;
}

function arrowLine(x1, y1, x2, y2, cls = "wire") {
  return s("line", {x1, y1, x2, y2, class: cls, "marker-end": "url(#arr)"});
}

// the boxes of one branch, in order: [text, class, site or null]
function branchItems(ctx, name, slots) {
  const p = ctx.p, out = [];
  const branch = name === "A" ? "attn" : "ffn";
  // a parallel block's shared pre-norm is drawn on both branches (the attention's site)
  const pre = ctx.at ? (ctx.at[branch].pre.length || !p.parallel ? ctx.at[branch].pre : ctx.at.attn.pre) : [];
  if (ctx.at) for (const site of pre) out.push(["N", "norm", site]);
  else if (slots.pre) out.push(["N", "norm", null]);
  if (slots.pre && p.pre_norm_scale && p.pre_norm_scale !== "none") out.push([`×${p.pre_norm_scale}`, "scale", null]);
  out.push([name === "A" && p.qkv_norm ? "A (QKV-N)" : name, "fn", null]);
  if (ctx.at) for (const site of ctx.at[branch].out) out.push(["N", "norm", site]);
  else if (slots.post) out.push([p.post_gain_init && p.post_gain_init !== "none" ? `N·c/√L` : "N", "norm", null]);
  if (p.gate === "scalar") out.push(["×α", "scale", null]);
  if (p.gate === "vector") out.push(["×diag(g)", "scale", null]);
  if (p.branch_scale !== undefined && p.branch_scale !== 1) out.push([`×${fmt(p.branch_scale)}`, "scale", null]);
  if (p.branch_label) out.push([`×${p.branch_label}`, "scale", null]);  // an inspected model's branch scaling
  return out;
}

// the QK- and V-norm sites under the attention box at (x, y), joined to it by a dashed line; the QK-norms' order
// with RoPE (the report's typed field) beside them
function innerSites(ctx, x, y) {
  const {qk, v} = ctx.at.attn;
  if (!qk.length && !v.length) return;
  const y2 = y + INNER;
  ctx.items.push(s("line", {x1: x + 12, x2: x + 12, y1: y + BH / 2, y2: y2 - BH / 2, class: "wire inner"}));
  let cx = x;
  for (const site of qk) cx = siteBox(ctx, cx, y2, site, null, "QK-N") + 6;
  if (qk.length && ctx.rope && !["n/a", "mixed"].includes(ctx.rope)) {
    const words = ctx.rope.replace("-rope", " RoPE");
    ctx.items.push(s("text", {x: cx, y: y2 + 4, class: "d-label small"}, words));
    cx += words.length * 6.6 + 10;
  }
  for (const site of v) cx = siteBox(ctx, cx, y2, site, null, "V-N") + 6;
}

/** One residual add: branches from a fork on the stream, joining at (+); the after-add norm on the stream. */
function sublayer(ctx, x0, names) {
  const {p, items} = ctx;
  const fork = x0 + 8;
  items.push(s("circle", {cx: fork, cy: STREAM_Y, r: 3, class: "dot"}));
  let end = fork;
  const ends = [];
  names.forEach((name, row) => {
    const slots = name === "A" ? p.attn : p.ffn;
    const y = rowY(ctx, row);
    let x = fork + 16;
    items.push(s("polyline", {points: `${fork},${STREAM_Y} ${fork},${y} ${x},${y}`, class: "wire"}));
    for (const [text, cls, site] of branchItems(ctx, name, slots)) {
      const nx = site ? siteBox(ctx, x, y, site) : box(items, x, y, text, cls);
      if (ctx.at && name === "A" && cls === "fn") innerSites(ctx, x, y);
      items.push(arrowLine(nx, y, nx + GAP, y));
      x = nx + GAP;
    }
    ends.push([x, y]);
    end = Math.max(end, x);
  });
  let add = end + 16;
  if (p.residual_alpha !== undefined && p.residual_alpha !== 1) {
    const bx = fork + 18;
    items.push(s("rect", {x: bx, y: STREAM_Y - BH / 2, width: BW + 8, height: BH, rx: 6, class: "d-box scale"}),
      s("text", {x: bx + (BW + 8) / 2, y: STREAM_Y + 4, class: "d-text", "text-anchor": "middle"}, `×${fmt(p.residual_alpha)}`));
    add = Math.max(add, bx + BW + 30);
  }
  for (const [x, y] of ends) items.push(s("polyline", {points: `${x},${y} ${add},${y} ${add},${STREAM_Y + 10}`, class: "wire"}));
  items.push(s("circle", {cx: add, cy: STREAM_Y, r: 10, class: "add"}),
    s("text", {x: add, y: STREAM_Y + 5, class: "d-text", "text-anchor": "middle"}, "+"));
  let x = add + 10;
  if (ctx.at) {
    const after = names.flatMap((n) => ctx.at[n === "A" ? "attn" : "ffn"].post);
    for (const site of after) x = siteBox(ctx, x + 12, STREAM_Y, site);
  } else if (names.some((n) => (n === "A" ? p.attn : p.ffn).after_add)) {
    x = box(items, x + 12, STREAM_Y, "N", "norm on-stream");
  }
  return {x: x + 14};
}

// values spanning more than 100x (all positive) are drawn on a log scale, said on the axis
function yDomain(ys) {
  const log = ys.every((v) => v > 0) && Math.max(...ys) / Math.min(...ys) > 100;
  const f = log ? Math.log10 : (v) => v;
  return {log, lo: Math.min(...ys.map(f)), hi: Math.max(...ys.map(f))};
}

// one chart per card; `domain` (the y range of every placement measured by the experiment) puts all cards on
// one y scale, so their profiles compare
export function lineChart(points, columns, title, domain = null, xLabel = "layer") {
  const W = 260, H = 130 + 12 * columns.length, pad = {l: 48, r: 8, t: 18 + 12 * columns.length, b: 24};
  const xs = points.map((q) => q[0]);
  const ys = points.flatMap((q) => q.slice(1));
  const {log, lo: y0, hi: y1} = domain || yDomain(ys);
  const f = log ? Math.log10 : (v) => v;
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const X = (v) => pad.l + ((v - x0) / (x1 - x0 || 1)) * (W - pad.l - pad.r);
  const Y = (v) => pad.t + (1 - (f(v) - y0) / (y1 - y0 || 1)) * (H - pad.t - pad.b);
  const lines = columns.map((c, i) => s("polyline", {class: `series s${i % 4}`,
    points: points.map((q) => `${X(q[0])},${Y(q[i + 1])}`).join(" ")}));
  const keys = columns.map((c, i) => s("g", {},
    s("line", {x1: pad.l, x2: pad.l + 14, y1: 20 + 12 * i, y2: 20 + 12 * i, class: `series s${i % 4}`}),
    s("text", {x: pad.l + 18, y: 23 + 12 * i, class: "tick"}, c)));
  const top = log ? 10 ** y1 : y1, bottom = log ? 10 ** y0 : y0;
  return s("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": `${title}: ${columns.join(", ")}`},
    s("text", {x: pad.l, y: 10, class: "hist-title"}, `${title}${log ? " (log scale)" : ""}`), ...keys, ...lines,
    s("text", {x: pad.l - 4, y: pad.t + 6, class: "tick end"}, fmt(top)),
    s("text", {x: pad.l - 4, y: H - pad.b, class: "tick end"}, fmt(bottom)),
    s("text", {x: pad.l, y: H - 6, class: "tick"}, fmt(x0)),
    s("text", {x: W - pad.r, y: H - 6, class: "tick end"}, `${fmt(x1)} (${xLabel})`));
}

// per profile experiment: the placements it measured, each by the column they all have, on one y scale
function comparisons(data, params) {
  const out = [];
  for (const exp of data.profile_experiments) {
    const measured = data.placements.filter((p) => p.profiles && p.profiles[exp]);
    if (measured.length < 2) continue;
    const cols = measured[0].profiles[exp].columns.filter((c) => measured.every((p) => p.profiles[exp].columns.includes(c)));
    if (!cols.length) continue;
    const col = cols.includes(params.get(exp)) ? params.get(exp) : cols[0];
    const series = measured.map((p) => {
      const prof = p.profiles[exp], i = prof.columns.indexOf(col) + 1;
      return {name: p.preset, points: prof.points.map((q) => [q[0], q[i]])};
    });
    out.push({exp, col, cols, series, holds: measured[0].profiles[exp].holds});
  }
  return out;
}

function compareChart({exp, col, series}) {
  const W = innerWidth < 600 ? 340 : 560, H = innerWidth < 600 ? 240 : 300, pad = {l: 52, r: 12, t: 24, b: 34};
  const xs = series.flatMap((q) => q.points.map((p) => p[0]));
  const {log, lo: y0, hi: y1} = yDomain(series.flatMap((q) => q.points.map((p) => p[1])));
  const f = log ? Math.log10 : (v) => v;
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const X = (v) => pad.l + ((v - x0) / (x1 - x0 || 1)) * (W - pad.l - pad.r);
  const Y = (v) => pad.t + (1 - (f(v) - y0) / (y1 - y0 || 1)) * (H - pad.t - pad.b);
  const ticks = [0, 0.5, 1].map((t) => y0 + t * (y1 - y0));
  return s("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart compare", role: "img",
    "aria-label": `${exp}, ${col}, by layer, one line per placement: ${series.map((q) => q.name).join(", ")}`},
    s("text", {x: pad.l, y: 14, class: "hist-title"}, `${col} by layer${log ? " (log scale)" : ""}`),
    ticks.map((t) => [
      s("line", {x1: pad.l, x2: W - pad.r, y1: Y(log ? 10 ** t : t), y2: Y(log ? 10 ** t : t), class: "gridline"}),
      s("text", {x: pad.l - 5, y: Y(log ? 10 ** t : t) + 3, class: "tick end"}, fmt(log ? 10 ** t : t))]),
    series.map((q, i) => s("polyline", {class: `series c${i % 8}`, "data-placement": q.name,
      points: q.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ")})),
    s("line", {x1: pad.l, x2: W - pad.r, y1: H - pad.b, y2: H - pad.b, class: "axis"}),
    s("text", {x: pad.l, y: H - 12, class: "tick"}, fmt(x0)),
    s("text", {x: W - pad.r, y: H - 12, class: "tick end"}, `${fmt(x1)} (layer)`));
}

function compareSection(found, params) {
  if (!found.length) return null;
  return h("section", {class: "card", id: "depth-compare"},
    h("h2", {}, "Depth profiles compared, on one y scale"),
    h("p", {class: "muted small"}, "Each line is one placement as the depth experiments measured it; every card below ",
      "draws its own profile on the same y scale as this chart."),
    h("div", {class: "compare-grid"}, found.map((c) => {
      const pick = c.cols.length > 1 ? h("select", {"aria-label": `${c.exp}: the measured column`, onchange: (e) => {
        params.set(c.exp, e.target.value);
        location.hash = `#/placements?${params.toString()}`;
      }}, c.cols.map((k) => h("option", {value: k, selected: k === c.col}, k))) : null;
      return h("figure", {class: "compare-fig", "data-exp": c.exp},
        compareChart(c),
        h("figcaption", {}, h("span", {class: "legend"}, c.series.map((q, i) => h("span", {class: `key c${i % 8}`}, q.name))),
          h("span", {class: "small muted"}, `${c.exp}; claim ${c.holds ? "holds" : "does not hold"} `), pick));
    })));
}

function card(p, domains = {}) {
  const profiles = Object.entries(p.profiles || {});
  return h("article", {class: "card placement", id: `placement-${p.preset}`},
    h("div", {class: "panel-head"}, h("h2", {}, p.preset), h("span", {class: "pill"}, p.kinds.join(" / "))),
    drawPlacement(p, {label: `${p.preset} block diagram`}),
    h("p", {}, h("code", {class: "equation"}, p.equation)),
    p.parallel ? h("p", {class: "muted"}, p.shared_pre_norm ? "one shared pre-norm feeds both branches" : "each branch has its own pre-norm") : null,
    profiles.length
      ? h("div", {class: "profiles"}, profiles.map(([exp, prof]) => h("figure", {},
        lineChart(prof.points, prof.columns, exp, domains[exp] || null),
        h("figcaption", {}, `${exp} (${prof.series}.csv); claim ${prof.holds ? "holds" : "does not hold"}`))))
      : h("p", {class: "muted small"}, "no depth profile measured (run the variance-depth / gradient-depth experiments)"),
    h("details", {}, h("summary", {}, "docstring"), h("pre", {class: "doc"}, p.doc)));
}

export async function render(root, params) {
  mount(root, status("loading placements…"));
  const data = await once("/api/placements");
  const legend = h("p", {class: "legend"},
    h("span", {class: "key norm"}, "N norm"), h("span", {class: "key fn"}, "A / F attention, FFN"),
    h("span", {class: "key scale"}, "× scaling"), h("span", {class: "key add"}, "+ residual add"));
  // ?kind=pre (a model record's placement, linked from the matrix): the presets of that kind
  const kind = params.get("kind") || "";
  const found = comparisons(data, params);
  // one y scale per experiment across every card: each experiment's values over all placements and columns
  const domains = {};
  for (const exp of data.profile_experiments) {
    const ys = data.placements.flatMap((p) => (p.profiles && p.profiles[exp] ? p.profiles[exp].points.flatMap((q) => q.slice(1)) : []));
    if (ys.length) domains[exp] = yDomain(ys);
  }
  const shown = kind ? data.placements.filter((p) => p.kind === kind || p.kinds.includes(kind)) : data.placements;
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "Where does the norm sit?"),
      h("p", {class: "lede"}, `${data.placements.length} schemes, each drawn from its Placement value: the same data the `,
        "Block reads, the docstring draws and the inspector reads back."), legend),
    kind ? h("p", {class: "status info", id: "placements-kind"}, `${shown.length} of ${data.placements.length} schemes of kind “${kind}” · `,
      h("a", {href: "#/placements"}, "show all")) : null,
    kind ? null : compareSection(found, params),
    h("div", {class: "cards"}, shown.map((p) => card(p, domains))));
  const focus = params.get("focus");
  if (focus) document.getElementById(`placement-${focus}`)?.scrollIntoView();
  writeHash("placements", {kind, focus: focus || "", ...Object.fromEntries(found.filter((c) => c.col !== c.cols[0]).map((c) => [c.exp, c.col]))});
}
