// Inspect: an architecture (a transformers model type, built tiny offline) or a checkpoint folder under
// the server's --root, read off its dataflow. POST /api/inspect starts (or joins) a job; the page polls
// GET /api/inspect/job/ID, shows its phase and the seconds so far, retries a busy or unreachable server with
// backoff, and draws the report: the first layer's placement with every norm site a button that opens the
// site's arithmetic (drawPlacement, the same drawing the Placements view uses).
import {drawPlacement} from "./placements.js";
import {fmt, h, mount, once, status, writeHash} from "./util.js";

const SUMMARY = ["operator", "eps", "gain_convention", "bias", "cast_order", "placement", "placement_attention",
  "placement_mlp", "residual_scale", "branch_scale", "qk_norm", "qk_norm_rope", "v_norm", "attn_softcap",
  "final_norm", "final_logit_softcap", "embedding_scale", "embedding_norm", "layers", "hidden_size"];
const PHASES = ["queued", "building", "tracing", "reading"];
const PHASE_WORDS = {queued: "waiting for the inspection before it", building: "building the model",
  tracing: "tracing its forward pass", reading: "reading the design off the dataflow"};
const POLL_MS = 400, RETRIES = 8;
let runs = 0;  // a newer run (or leaving the view) stops an older run's polling

export async function render(root, params) {
  const [models, where] = await Promise.all([once("/api/models"), once("/api/inspect")]);
  const types = [...new Set(models.models.flatMap((m) => m.hf_model_types))].sort();
  const typeInput = h("input", {id: "inspect-type", list: "inspect-types", placeholder: "llama, gpt2, qwen3…",
    "aria-label": "transformers model type", value: params.get("model_type") || ""});
  const folderSel = h("select", {id: "inspect-folder", "aria-label": "checkpoint folder under the root"},
    h("option", {value: ""}, where.folders.length ? "a folder under the root…" : "no checkpoint folder under the root"),
    where.folders.map((f) => h("option", {value: f}, f)));
  folderSel.value = params.get("folder") || "";
  const out = h("div", {id: "inspect-out"});
  const go = h("button", {type: "button", class: "primary", id: "inspect-go", onclick: run}, "Inspect");
  const form = h("form", {class: "controls wrap", onsubmit: (e) => { e.preventDefault(); run(); }},
    h("label", {class: "filter"}, h("span", {}, "model type"), typeInput,
      h("datalist", {id: "inspect-types"}, types.map((t) => h("option", {value: t})))),
    h("span", {class: "muted"}, "or"),
    h("label", {class: "filter"}, h("span", {}, `folder in ${where.root}`), folderSel), go);
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "Inspect a model"),
      h("p", {class: "lede"}, "The model is built (tiny, random weights, offline) or loaded, traced, and its normalization ",
        "design read off the dataflow, never off parameter names. Its cost is measured, not promised: on a 2-core machine ",
        "at load 2, the first inspection in a fresh process took 2.8 s until the report was drawn (qwen3; mostly importing ",
        "transformers), then gpt2 1.4 s and llava 5.8 s (5–6 s and 9–12 s at load 5); qwen2_5_vl took 104 s at load 5 ",
        "(its tower is fitted); a type inspected before, nothing (cached). The phases and seconds show as they run.")),
    form, out);
  if (typeInput.value || folderSel.value) run();

  async function run() {
    const folder = folderSel.value, type = typeInput.value.trim();
    if (!folder && !type) { mount(out, status("choose a model type or a folder", "error")); return; }
    const body = folder ? {folder} : {model_type: type};
    const name = folder || type;
    writeHash("inspect", body);
    const me = ++runs;
    const live = () => me === runs && out.isConnected;
    go.disabled = true;
    const view = progress(name);
    mount(out, view.el);
    try {
      const job = await runJob("/api/inspect", body, view, live);
      if (!job) return;
      if (job.state === "failed") mount(out, failure(`${job.error} (after ${fmt(job.elapsed)} s)`, run));
      else mount(out, report(job.result, job));
    } catch (e) {
      if (live()) mount(out, failure(e.message, run));
    } finally {
      if (me === runs) go.disabled = false;
    }
  }
}

export class HttpError extends Error {
  constructor(message, status, retryAfter) { super(message); this.status = status; this.retryAfter = retryAfter; }
}

/** One API call: the JSON answer of a 2xx, else an HttpError with the status (0: the server is unreachable). */
export async function request(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
  };
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    throw new HttpError(`the server did not answer (${e.message})`, 0, null);
  }
  let doc = {};
  try { doc = await res.json(); } catch { /* a body that is not JSON: its status speaks */ }
  if (!res.ok) throw new HttpError(doc.error || `${res.status} ${res.statusText}`, res.status, res.headers.get("Retry-After"));
  return doc;
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** call() again after a 503 or a network error, waiting Retry-After or 0.5, 1, 2, 4 … 8 s, at most RETRIES times. */
// POST `body` to `path` (a job-starting endpoint), then poll the job until it is done or failed, showing each state
// in `view`: the finished job, or null once the view is no longer live (another run began, the page moved on)
export async function runJob(path, body, view, live) {
  let job = await retrying(() => request(path, body), view, live);
  while (live() && !["done", "failed"].includes(job.state)) {
    view.show(job);
    await sleep(job.elapsed > 10 ? 4 * POLL_MS : POLL_MS);  // a long build is polled less often
    if (!live()) return null;
    try {
      job = await retrying(() => request(`/api/inspect/job/${job.job}`), view, live);
    } catch (e) {
      if (e.status !== 404) throw e;
      job = await retrying(() => request(path, body), view, live);  // the server forgot it: ask again
    }
  }
  return live() ? job : null;
}

export async function retrying(call, view, live) {
  for (let attempt = 1; ; attempt++) {
    try {
      const doc = await call();
      view.note(null);
      return doc;
    } catch (e) {
      if (!(e.status === 503 || e.status === 0) || attempt > RETRIES || !live()) throw e;
      const wait = e.retryAfter && /^\d+$/.test(e.retryAfter) ? Number(e.retryAfter) * 1000 : Math.min(8000, 500 * 2 ** (attempt - 1));
      view.note(`${e.status === 503 ? "the server is busy" : "the server did not answer"}; retrying in ${fmt(wait / 1000)} s (attempt ${attempt} of ${RETRIES})`);
      await sleep(wait);
    }
  }
}

/** The job's progress: its phase in words, the seconds so far (the server's, ticking between polls), each phase. */
export function progress(name, {verb = "Inspecting", words = PHASE_WORDS, id = "inspect-job"} = {}) {
  const phase = h("span", {class: "phase"}, "asking the server");
  const elapsed = h("span", {class: "elapsed"}, "0.0 s");
  const steps = h("ol", {class: "phases", "aria-label": "phases"});
  const retry = h("p", {class: "retry-note", hidden: true});
  const el = h("section", {class: "card job", id, "aria-busy": "true"},
    h("p", {class: "job-line", role: "status", "aria-live": "polite"}, `${verb} ${name}: `, phase),
    h("p", {class: "job-line muted"}, "elapsed ", elapsed, " (measured by the server)"), steps, retry);
  let base = 0, at = performance.now(), state = "queued";
  const draw = () => { elapsed.textContent = `${(base + (performance.now() - at) / 1000).toFixed(1)} s`; };
  const tick = setInterval(() => { if (el.isConnected) draw(); else clearInterval(tick); }, 100);
  return {
    el,
    show(job) {
      base = job.elapsed; at = performance.now();
      draw();
      el.dataset.state = state = job.state;
      phase.textContent = job.state === "queued" && job.ahead ? `waiting for ${job.ahead} ${words.ahead || "inspection(s)"} before it`
        : words[job.state] || job.state;
      const secs = Object.fromEntries(job.phases.map((p) => [p.phase, p.seconds]));
      mount(steps, PHASES.map((p) => h("li", {class: p === state ? "current" : p in secs ? "passed" : "",
        "aria-current": p === state ? "step" : null}, p, p in secs && p !== state ? h("span", {class: "secs"}, `${fmt(secs[p])} s`) : null)));
    },
    note(text) {
      retry.hidden = !text;
      retry.textContent = text || "";
    },
  };
}

export function failure(message, again, id = "inspect-retry") {
  return h("div", {class: "failure"}, status(message, "error"),
    h("button", {type: "button", id, onclick: again}, "Retry"));
}

export function timing(job) {
  const parts = job.phases.filter((p) => p.phase !== "queued" || p.seconds >= 0.05).map((p) => `${p.phase} ${fmt(p.seconds)} s`);
  return `measured by the server: ${fmt(job.elapsed)} s in all (${parts.join(", ")})` +
    (job.cached ? "; this report was cached, so it cost nothing now" : "");
}

function report(rep, job) {
  const rows = SUMMARY.filter((k) => k in rep).map((k) => h("tr", {}, h("th", {scope: "row"}, k.replaceAll("_", " ")),
    h("td", {}, typeof rep[k] === "number" ? fmt(rep[k]) : String(rep[k] ?? "–"))));
  const subs = (rep.sublayers || []).map((sl) => h("tr", {}, [sl.layer, sl.kind, sl.placement, sl.pre.length, sl.out.length,
    sl.post.length, sl.skip_scale ?? "–", sl.branch_scale ?? "–"].map((v) => h("td", {}, String(v)))));
  const sites = rep.sites || [];
  const panel = h("div", {class: "site-panel", id: "site-panel", "aria-live": "polite"},
    h("p", {class: "muted small"}, sites.length ? `${sites.length} norm sites drawn. Click one (or Tab to it and press Enter) for its arithmetic and its numbers.` : "no norm site found"));
  let root = null;  // the report, built below: its site buttons (in the drawing and off it) show which one is open
  const onSite = (site) => {
    for (const g of root.querySelectorAll(".site[aria-pressed='true']")) g.setAttribute("aria-pressed", "false");
    for (const g of root.querySelectorAll(`.site[data-site='${site.index}']`)) g.setAttribute("aria-pressed", "true");
    mount(panel, sitePanel(site, rep));
  };
  const others = sites.filter((x) => x.branch === "other");
  const otherRow = others.length ? h("p", {class: "other-sites small"}, h("span", {class: "muted"}, "off the block's main path: "),
    others.map((x) => h("button", {type: "button", class: "site site-chip", "data-site": x.index, "data-slot": x.slot,
      "aria-pressed": "false", onclick: () => onSite(x)}, `${x.slot} N${x.size ? " · " + x.size : ""} (site ${x.index})`))) : null;
  const first = (rep.attention || []).find((a) => a.layer === (rep.sublayers || [])[0]?.layer);
  const diagram = rep.drawing
    ? drawPlacement(rep.drawing, {label: `${rep.model}: the placement of its first layer, every norm site a button`,
      sites: sites.filter((x) => x.branch !== "other"), onSite, rope: first ? first.qk_norm_rope : null})
    : status("no residual add found");
  root = h("div", {class: "report"},
    h("section", {class: "card"},
      h("div", {class: "panel-head"}, h("h2", {}, rep.model), h("span", {class: "pill"}, rep.placement)),
      h("div", {class: "inspect-diagram"}, h("div", {},
        h("div", {class: "diagram-scroll", tabindex: 0, role: "region", "aria-label": "the block diagram (scrolls sideways on a narrow screen)"}, diagram),
        h("p", {class: "scroll-hint diagram-hint"}, "the diagram scrolls sideways ›"),
        h("p", {class: "muted small"}, "the first layer as traced, with the norms before and after the stack",
          sites.some((x) => x.slot === "qk" || x.slot === "v") ? "; QK- and V-norms hang under the attention" : ""), otherRow),
      panel),
      h("p", {class: "muted small", id: "inspect-timing"}, timing(job))),
    h("div", {class: "two"},
      h("section", {class: "card"}, h("h2", {}, "design"), h("table", {class: "kv"}, h("tbody", {}, rows))),
      h("section", {class: "card"}, h("h2", {}, "sublayers"), h("div", {class: "table-wrap"}, h("table", {class: "grid"},
        h("thead", {}, h("tr", {}, ["layer", "sublayer", "placement", "pre", "out", "post", "residual ×", "branch ×"].map((c) => h("th", {}, c)))),
        h("tbody", {}, subs))))),
    rep.notes && rep.notes.length ? h("section", {class: "card"}, h("h2", {}, "notes"), h("ul", {}, rep.notes.map((n) => h("li", {}, n)))) : null);
  return root;
}

const SLOT_TITLES = {pre: "on the branch input", out: "on the branch output, before the add",
  post: "on the stream, after the add", qk: "QK-norm: on queries or keys", v: "V-norm: on values",
  embedding: "after the embedding", final: "the final norm, after the last layer",
  other: "off the block's main path (a side path)", pooled: "on a token subset (CLS) of the last stream value",
  merger: "on rows then merged (k tokens to one)", head: "inside a pooling head or connector"};
const BRANCHES = {attn: "attention", ffn: "MLP", stream: "stream", other: "elsewhere"};

/** A site's arithmetic (the server's lines from its typed fields) and its numbers. */
function sitePanel(site, rep) {
  const lines = site.arithmetic.filter((l) => l.step !== "in all");
  const all = site.arithmetic.find((l) => l.step === "in all");
  const numbers = [["operator", site.operator], ["over d values", site.size], ["eps", site.eps],
    ["gain convention", site.gain_convention], ["output scale", site.output_scale], ["fused kernel", site.fused]];
  if (site.slot === "qk") numbers.push(["QK-norm", rep.qk_norm], ["order with RoPE", rep.qk_norm_rope]);
  const probe = site.probe && Object.keys(site.probe).length
    ? Object.entries(site.probe).map(([k, v]) => `${k.replaceAll("_", " ")} ${typeof v === "number" ? fmt(v) : String(v)}`).join(", ")
    : null;
  return [
    h("h3", {}, `${BRANCHES[site.branch]} · ${SLOT_TITLES[site.slot]}`),
    h("p", {class: "muted small"}, `site ${site.index}, layer ${site.layer ?? "–"}; ran in `, h("code", {}, site.module),
      " (a label: nothing is read from the name)"),
    all ? h("code", {class: "formula"}, all.expr) : null,
    h("ol", {class: "lines"}, lines.map((l) => h("li", {}, h("span", {class: "muted"}, l.step), h("code", {}, l.expr)))),
    h("table", {class: "kv"}, h("caption", {class: "sr-only"}, "the site's numbers"), h("tbody", {}, numbers.map(([k, v]) =>
      h("tr", {}, h("th", {scope: "row"}, k), h("td", {}, v === null || v === undefined ? "not measured" : typeof v === "number" ? fmt(v) : String(v)))))),
    probe ? h("p", {class: "muted small"}, `perturbation probe of the module: ${probe}`) : null,
  ];
}
