// Small helpers shared by every view: element builders, the JSON API client, the URL-hash state.
// Nothing here knows the taxonomy, a placement or a record: those come from the API.

const SVG_NS = "http://www.w3.org/2000/svg";

/** An HTML element: h("a", {href: "#x", class: "btn"}, "text", child, ...). Attributes, never inline styles. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

/** An SVG element, same calling convention as h. */
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** Replace the children of el. */
export function mount(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** GET or POST the JSON API; throws an Error carrying the server's message on a non-2xx answer. */
export async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
  };
  const res = await fetch(path, init);
  const doc = await res.json();
  if (!res.ok) throw new Error(doc.error || `${res.status}`);
  return doc;
}

const cache = new Map();
/** A GET of a read-only view, fetched once per page load. */
export function once(path) {
  if (!cache.has(path)) cache.set(path, api(path));
  return cache.get(path);
}

/** The view and its parameters from the URL hash: "#/matrix?family=Gemma&q=rms". */
export function readHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [view, query = ""] = raw.split("?");
  return {view: view || "axes", params: new URLSearchParams(query)};
}

/** Write the current view's parameters into the hash without adding a history entry per keystroke. */
export function writeHash(view, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
  const text = q.toString();
  history.replaceState(null, "", `#/${view}${text ? "?" + text : ""}`);
}

/** A number for display: 4 significant digits, exponent only when needed. */
export function fmt(x) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (x === 0) return "0";
  const a = Math.abs(x);
  if (a >= 1e-3 && a < 1e5) return String(Number(x.toPrecision(4)));
  return x.toExponential(2);
}

/** An external link (opens in a new tab, no referrer). */
export function extLink(href, text) {
  return h("a", {href, target: "_blank", rel: "noopener noreferrer"}, text);
}

/** A standard "loading" / error block. */
export function status(text, kind = "info") {
  return h("p", {class: `status ${kind}`, role: kind === "error" ? "alert" : "status"}, text);
}

/** A small bar-chart histogram as SVG: {lo, hi, counts}. */
export function histogram(hist, {label, cls = "bars", width = 260, height = 120} = {}) {
  const pad = {l: 30, r: 8, t: 18, b: 26};
  const w = width - pad.l - pad.r, hh = height - pad.t - pad.b;
  const max = Math.max(1, ...hist.counts);
  const bw = w / hist.counts.length;
  const bars = hist.counts.map((c, i) => s("rect", {
    class: cls, x: pad.l + i * bw + 0.5, y: pad.t + hh * (1 - c / max), width: Math.max(0.5, bw - 1), height: hh * c / max,
  }));
  return s("svg", {viewBox: `0 0 ${width} ${height}`, class: "hist", role: "img", "aria-label": `${label} histogram`},
    s("text", {x: pad.l, y: 12, class: "hist-title"}, label),
    ...bars,
    s("line", {x1: pad.l, x2: pad.l + w, y1: pad.t + hh, y2: pad.t + hh, class: "axis"}),
    s("text", {x: pad.l, y: height - 8, class: "tick"}, fmt(hist.lo)),
    s("text", {x: pad.l + w, y: height - 8, class: "tick end"}, fmt(hist.hi)),
    s("text", {x: pad.l - 4, y: pad.t + 8, class: "tick end"}, String(max)),
  );
}
