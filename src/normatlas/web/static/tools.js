// Tools: the practitioner tools (normatlas lens / outliers / prune / embeddings / absorb) on a checkpoint folder under
// the server's --root, and the cost of normalization around attention (no folder). Each tool's options are drawn
// from GET /api/tools (kind, default, bounds), never typed here. POST /api/tools starts (or joins) a job in the
// inspection queue; the page polls GET /api/inspect/job/ID with the Inspect view's client (progress, backoff, retry)
// and then shows the tool's tables, and its chart drawn with the Placements view's line chart. The page never writes
// a checkpoint.
import {failure, progress, runJob, timing} from "./inspect.js";
import {lineChart} from "./placements.js";
import {fmt, h, mount, once, status, writeHash} from "./util.js";

const WORDS = {queued: "waiting for the jobs before it", building: "loading the checkpoint",
  tracing: "tracing its forward pass", reading: "running the tool", ahead: "job(s)"};
let runs = 0;  // a newer run (or leaving the view) stops an older run's polling

export async function render(root, params) {
  const [tools, where] = await Promise.all([once("/api/tools"), once("/api/inspect")]);
  const toolSel = h("select", {id: "tools-tool", "aria-label": "tool"},
    tools.tools.map((t) => h("option", {value: t.tool}, t.tool)));
  toolSel.value = tools.tools.some((t) => t.tool === params.get("tool")) ? params.get("tool") : "lens";
  const folderSel = h("select", {id: "tools-folder", "aria-label": "checkpoint folder under the root"},
    h("option", {value: ""}, where.folders.length ? "a folder under the root…" : "no checkpoint folder under the root"),
    where.folders.map((f) => h("option", {value: f}, f)));
  folderSel.value = where.folders.includes(params.get("folder")) ? params.get("folder") : "";
  const folderLabel = h("label", {class: "filter"}, h("span", {}, `folder in ${where.root}`), folderSel);
  const textInput = h("textarea", {id: "tools-text", maxlength: tools.max_text, rows: 2, placeholder: "a prompt, e.g. import os",
    "aria-label": "text (the prompt)"});
  textInput.value = params.get("text") || "";
  const textLabel = h("label", {class: "filter tools-text"}, h("span", {}, "text"), textInput);
  const opts = h("fieldset", {class: "tools-options", id: "tools-options"});
  const about = h("p", {class: "muted small", id: "tools-about"});
  const out = h("div", {id: "tools-out"});
  const go = h("button", {type: "button", class: "primary", id: "tools-go", onclick: run}, "Run");
  let fields = [];  // [option spec, its input] of the chosen tool, drawn from GET /api/tools
  const sync = (from = null) => {
    const t = tools.tools.find((x) => x.tool === toolSel.value);
    about.textContent = t.about;
    folderLabel.hidden = !t.folder;
    textLabel.hidden = t.text === "none";
    textInput.placeholder = t.text === "needed" ? "a prompt, e.g. import os"
      : t.tool === "absorb" ? "optional: calibration text (else held-out text)" : "optional: held-out text when empty";
    fields = t.options.map((o) => [o, optionInput(o, from && from.has(o.name) ? from.get(o.name) : null)]);
    mount(opts, h("legend", {}, `options of ${t.tool}`), fields.map(([o, el]) => optionLabel(o, el)));
    opts.hidden = !fields.length;
  };
  const texts = {[toolSel.value]: textInput.value};  // each tool keeps its own text: a prompt is not a calibration text
  let shownTool = toolSel.value;
  toolSel.addEventListener("change", () => {
    texts[shownTool] = textInput.value;
    shownTool = toolSel.value;
    textInput.value = texts[shownTool] || "";
    sync();
  });
  sync(params);
  const form = h("form", {class: "controls wrap", onsubmit: (e) => { e.preventDefault(); run(); }},
    h("label", {class: "filter"}, h("span", {}, "tool"), toolSel), folderLabel, textLabel, opts, go);
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "Tools on a checkpoint"),
      h("p", {class: "lede"}, "The library's practitioner tools on a checkpoint folder under the server's root ",
        "(config.json, safetensors, the tokenizer's files): the same functions as normatlas lens, outliers, ",
        "prune, embeddings and absorb (in memory: the page never writes a checkpoint), and what normalization ",
        "costs around attention (no checkpoint), run as a job in the inspection queue, one at a time. The server ",
        "checks every option against its bounds before a job starts.")),
    form, about, out);
  const linked = tools.tools.find((x) => x.tool === params.get("tool"));
  if (linked && (folderSel.value || !linked.folder)) run();

  async function run() {
    const tool = toolSel.value, folder = folderSel.value, text = textInput.value;
    const spec = tools.tools.find((x) => x.tool === tool);
    if (spec.folder && !folder) { mount(out, status("choose a checkpoint folder", "error")); return; }
    if (spec.text === "needed" && !text.trim()) { mount(out, status("this tool needs a text (the prompt)", "error")); return; }
    const body = spec.folder ? {tool, folder} : {tool};
    if (spec.text !== "none" && text.trim()) body.text = text;
    for (const [o, el] of fields) {  // only what differs from the default travels (and lands in the link)
      const v = o.kind === "bool" ? el.checked : o.kind === "choice" ? el.value : Number(el.value);
      if (v !== o.default) body[o.name] = o.kind === "int" || o.kind === "float" ? (el.value.trim() === "" ? el.value : v) : v;
    }
    writeHash("tools", body);
    const me = ++runs;
    const live = () => me === runs && out.isConnected;
    go.disabled = true;
    const view = progress(`${tool} on ${folder}`, {verb: "Running", words: WORDS, id: "tools-job"});
    mount(out, view.el);
    try {
      const job = await runJob("/api/tools", body, view, live);
      if (!job) return;
      if (job.state === "failed") mount(out, failure(`${job.error} (after ${fmt(job.elapsed)} s)`, run, "tools-retry"));
      else mount(out, result(job.result, job));
    } catch (e) {
      if (live()) mount(out, failure(e.message, run, "tools-retry"));
    } finally {
      if (me === runs) go.disabled = false;
    }
  }
}

// one input per option, typed from the server's table; the server checks the value again (a 400 names the field)
function optionInput(o, given) {
  const id = `tools-opt-${o.name}`;
  if (o.kind === "bool") {
    const el = h("input", {type: "checkbox", id});
    el.checked = given === null ? o.default : given === "true";
    return el;
  }
  if (o.kind === "choice") {
    const el = h("select", {id}, o.choices.map((c) => h("option", {value: c}, c)));
    el.value = given !== null && o.choices.includes(given) ? given : o.default;
    return el;
  }
  const el = h("input", {type: "number", id, min: o.min, max: o.max, step: o.kind === "int" ? o.step : "any",
    inputmode: o.kind === "int" ? "numeric" : "decimal"});
  el.value = given !== null ? given : String(o.default);
  return el;
}

function optionLabel(o, el) {
  const range = o.kind === "int" || o.kind === "float" ? ` (${o.min}–${o.max})` : "";
  const tip = `${o.about}${range}; default ${o.default}`;
  if (o.kind === "bool") return h("label", {class: "filter tools-check", title: tip}, h("span", {}, o.name.replaceAll("_", " ")), el);
  return h("label", {class: "filter", title: tip}, h("span", {}, o.name.replaceAll("_", " ")), el);
}

const cell = (v) => (v === null || v === undefined ? "–" : typeof v === "number" ? fmt(v)
  : Array.isArray(v) ? (v.length ? v.join(", ") : "none") : String(v));

function table(t) {
  const cols = [...new Set(t.rows.flatMap((r) => Object.keys(r)))];
  const num = new Set(cols.filter((c) => t.rows.every((r) => r[c] === null || r[c] === undefined || typeof r[c] === "number")));
  const body = t.rows.length === 1  // one row (a summary) reads as key / value lines
    ? h("table", {class: "kv"}, h("tbody", {}, cols.map((c) => h("tr", {}, h("th", {scope: "row"}, c.replaceAll("_", " ")), h("td", {}, cell(t.rows[0][c]))))))
    : h("div", {class: "table-wrap", tabindex: 0, role: "region", "aria-label": `${t.name} table (scrolls sideways)`},
      h("table", {class: "grid"},
        h("thead", {}, h("tr", {}, cols.map((c) => h("th", {scope: "col", class: num.has(c) ? "num" : null}, c.replaceAll("_", " "))))),
        h("tbody", {}, t.rows.map((r) => h("tr", {}, cols.map((c) => h("td", {class: num.has(c) ? "num" : null}, cell(r[c]))))))));
  return h("section", {class: "card tool-table", "data-table": t.name},
    h("h2", {}, t.name.replaceAll("_", " ")), h("p", {class: "muted small"}, t.title), body);
}

function result(res, job) {
  const meta = Object.entries(res.meta || {}).map(([k, v]) => h("tr", {}, h("th", {scope: "row"}, k.replaceAll("_", " ")), h("td", {}, cell(v))));
  const c = res.chart;
  const chart = c && c.points.length ? h("figure", {class: "tool-chart"},
    lineChart(c.points, c.series, c.short, null, c.x), h("figcaption", {class: "muted small"}, `${c.title}; the table below holds every value`)) : null;
  return h("div", {class: "report tools-report", "data-tool": res.tool},
    h("section", {class: "card"},
      h("div", {class: "panel-head"}, h("h2", {}, res.model ? `${res.tool}: ${res.model}` : res.tool), h("span", {class: "pill"}, job.target)),
      h("div", {class: "two"}, h("table", {class: "kv"}, h("tbody", {}, meta)), chart),
      h("p", {class: "muted small", id: "tools-timing"}, timing(job))),
    res.tables.map(table));
}
