// Geometry: in D = 3, RMSNorm maps onto the sphere of radius sqrt(D); LayerNorm onto the circle where
// that sphere meets the hyperplane orthogonal to the ones vector. The points and the gradient are the
// library's (POST /api/normalize with an explicit input and upstream gradient); this file rotates and draws.
import {api, fmt, h, mount, status, writeHash} from "./util.js";

const R = Math.sqrt(3);

function rng(seed) {  // a small seeded generator, so a linked view shows the same x
  let t = seed >>> 0;
  return () => {
    t = (t + 0x6d2b79f5) >>> 0;
    let r = Math.imul(t ^ (t >>> 15), 1 | t);
    r = (r + Math.imul(r ^ (r >>> 7), 61 | r)) ^ r;
    return ((r ^ (r >>> 14)) >>> 0) / 4294967296 - 0.5;
  };
}

export async function render(root, params) {
  let seed = Number(params.get("seed") || 3);
  const view = {yaw: 0.7, pitch: 0.35};
  const canvas = h("canvas", {id: "geometry-canvas", width: 640, height: 520, tabindex: 0,
    "aria-label": "3-D view of the images of LayerNorm and RMSNorm; drag or use the arrow keys to rotate"});
  const readout = h("dl", {class: "facts", id: "geometry-readout"});
  const again = h("button", {type: "button", onclick: () => { seed += 1; load(); }}, "another x");
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "The geometry of the two images"),
      h("p", {class: "lede"}, "For D = 3: RMSNorm puts every vector on the sphere of radius √D; LayerNorm first removes the ",
        "mean (projects onto the plane orthogonal to the ones vector), so its image is the circle where that sphere meets ",
        "the plane. Its gradient is projected too: orthogonal to the ones vector and to x̂.")),
    h("div", {class: "two geometry"},
      h("section", {class: "card canvas-card"}, canvas,
        h("p", {class: "legend"}, h("span", {class: "key sphere"}, "RMSNorm image (sphere)"),
          h("span", {class: "key circle"}, "LayerNorm image (circle)"), h("span", {class: "key ones"}, "ones vector"),
          h("span", {class: "key grad"}, "upstream g (dashed) and σ·∂L/∂x, its projection")),
        h("div", {class: "controls"}, again, h("span", {class: "muted small"}, "drag to rotate · arrow keys when focused"))),
      h("section", {class: "card"}, h("h2", {}, "computed by the library"), readout)));
  let scene = null;
  drag(canvas, view, () => draw(canvas, view, scene));
  await load();

  async function load() {
    writeHash("geometry", {seed});
    const r = rng(seed);
    const x = [r() * 3 + 1.6, r() * 3 + 0.6, r() * 3 - 0.2];  // a clear mean, so the two images differ
    const g = [r(), r(), r()];
    try {
      const [ln, rms] = await Promise.all([true, false].map((center) => api("/api/normalize", {
        layout: "BTD", reduce: ["feature"], center, input: [[x]], upstream: [[g]],
      })));
      scene = {x, g, ln: ln.output[0][0], rms: rms.output[0][0], grad: ln.input_grad[0][0]};
      draw(canvas, view, scene);
      fill(readout, scene);
      root.dataset.ready = "1";
    } catch (e) {
      mount(readout, status(e.message, "error"));
    }
  }
}

const dot = (a, b) => a.reduce((acc, v, i) => acc + v * b[i], 0);
const norm = (a) => Math.sqrt(dot(a, a));

function fill(el, sc) {
  const row = (k, v) => [h("dt", {}, k), h("dd", {class: "mono", "data-k": k}, v)];
  const vec = (v) => `(${v.map(fmt).join(", ")})`;
  mount(el,
    row("x", vec(sc.x)), row("RMSNorm(x)", `${vec(sc.rms)}, |·| = ${fmt(norm(sc.rms))} (√3 = ${fmt(R)})`),
    row("LayerNorm(x)", `${vec(sc.ln)}, |·| = ${fmt(norm(sc.ln))}, sum = ${fmt(sc.ln.reduce((a, b) => a + b, 0))}`),
    row("upstream g", vec(sc.g)), row("∂L/∂x", vec(sc.grad)),
    row("∂L/∂x · 1", fmt(dot(sc.grad, [1, 1, 1]))), row("∂L/∂x · x̂", fmt(dot(sc.grad, sc.ln))));
}

function drag(canvas, view, redraw) {
  let last = null;
  canvas.addEventListener("pointerdown", (e) => { last = [e.clientX, e.clientY]; canvas.setPointerCapture(e.pointerId); });
  canvas.addEventListener("pointermove", (e) => {
    if (!last) return;
    view.yaw += (e.clientX - last[0]) * 0.01;
    view.pitch = Math.max(-1.5, Math.min(1.5, view.pitch + (e.clientY - last[1]) * 0.01));
    last = [e.clientX, e.clientY];
    redraw();
  });
  canvas.addEventListener("pointerup", () => { last = null; });
  canvas.addEventListener("keydown", (e) => {
    const step = {ArrowLeft: [-0.1, 0], ArrowRight: [0.1, 0], ArrowUp: [0, -0.1], ArrowDown: [0, 0.1]}[e.key];
    if (!step) return;
    e.preventDefault();
    view.yaw += step[0];
    view.pitch = Math.max(-1.5, Math.min(1.5, view.pitch + step[1]));
    redraw();
  });
}

function projector(canvas, view) {
  const cy = Math.cos(view.yaw), sy = Math.sin(view.yaw), cp = Math.cos(view.pitch), sp = Math.sin(view.pitch);
  const scale = Math.min(canvas.width, canvas.height) / 6;
  return ([x, y, z]) => {
    const x1 = cy * x + sy * z, z1 = -sy * x + cy * z;   // yaw about the vertical axis
    const y2 = cp * y - sp * z1, z2 = sp * y + cp * z1;  // pitch about the horizontal axis
    return [canvas.width / 2 + scale * x1, canvas.height / 2 - scale * y2, z2];
  };
}

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

function draw(canvas, view, sc) {
  const ctx = canvas.getContext("2d");
  const P = projector(canvas, view);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const curve = (pts, color, width, depthFade) => {
    for (let i = 0; i + 1 < pts.length; i++) {
      const a = P(pts[i]), b = P(pts[i + 1]);
      ctx.globalAlpha = depthFade ? (a[2] > 0 ? 0.18 : 0.55) : 1;
      ctx.strokeStyle = color;
      ctx.lineWidth = width;
      ctx.beginPath(); ctx.moveTo(a[0], a[1]); ctx.lineTo(b[0], b[1]); ctx.stroke();
    }
    ctx.globalAlpha = 1;
  };
  const circle = (u, v, r, n = 96) => Array.from({length: n + 1}, (_, i) => {
    const t = (2 * Math.PI * i) / n;
    return [0, 1, 2].map((k) => r * (Math.cos(t) * u[k] + Math.sin(t) * v[k]));
  });
  const sphere = css("--sphere");
  for (let lat = -60; lat <= 60; lat += 30) {  // the RMSNorm image: a wireframe sphere of radius sqrt(3)
    const phi = (lat * Math.PI) / 180;
    curve(circle([1, 0, 0], [0, 0, 1], R * Math.cos(phi)).map((p) => [p[0], R * Math.sin(phi), p[2]]), sphere, 1, true);
  }
  for (let lon = 0; lon < 180; lon += 30) {
    const t = (lon * Math.PI) / 180;
    curve(circle([Math.cos(t), 0, Math.sin(t)], [0, 1, 0], R), sphere, 1, true);
  }
  for (const axis of [[1, 0, 0], [0, 1, 0], [0, 0, 1]]) curve([axis.map((v) => -2.4 * v), axis.map((v) => 2.4 * v)], css("--line"), 1, false);
  const u = [1, -1, 0].map((v) => v / Math.SQRT2), w = [1, 1, -2].map((v) => v / Math.sqrt(6));
  curve(circle(u, w, R), css("--circle"), 3, false);  // the LayerNorm image: sphere ∩ {sum = 0}
  const ones = [1, 1, 1].map((v) => v / Math.sqrt(3));
  curve([[0, 0, 0], ones.map((v) => 2.6 * v)], css("--ones"), 2, false);
  if (!sc) return;
  const pt = (p, color, r, label, dy = -8) => {
    const q = P(p);
    ctx.fillStyle = color; ctx.beginPath(); ctx.arc(q[0], q[1], r, 0, 2 * Math.PI); ctx.fill();
    ctx.fillStyle = css("--text"); ctx.font = "13px system-ui, sans-serif"; ctx.fillText(label, q[0] + 8, q[1] + dy);
  };
  const xs = sc.x.map((v) => (v * 2.8) / norm(sc.x));  // x's ray, beyond the sphere: RMSNorm only rescales along it
  curve([[0, 0, 0], xs], css("--muted"), 1, false);
  pt(xs, css("--muted"), 4, "x (ray)", 18);
  pt(sc.rms, css("--sphere-strong"), 5, "RMSNorm(x)");
  pt(sc.ln, css("--circle"), 5, "LayerNorm(x)", 16);
  // sigma from the library's own output: x_hat = (x - mean) / sigma, so sigma * dL/dx = P g, the upstream
  // gradient with its components along the ones vector and along x_hat removed (the tangent of the circle)
  const mean = sc.x.reduce((a, b) => a + b, 0) / 3;
  const sigma = norm(sc.x.map((v) => v - mean)) / norm(sc.ln);
  const k = 1.4 / Math.max(1e-9, norm(sc.g));
  const gTip = sc.ln.map((v, i) => v + k * sc.g[i]);
  const pTip = sc.ln.map((v, i) => v + k * sigma * sc.grad[i]);
  ctx.setLineDash([5, 4]);
  curve([sc.ln, gTip], css("--grad"), 1.5, false);
  curve([gTip, pTip], css("--muted"), 1, false);
  ctx.setLineDash([]);
  curve([sc.ln, pTip], css("--grad"), 3, false);
  pt(gTip, css("--grad"), 2.5, "g (upstream)");
}
