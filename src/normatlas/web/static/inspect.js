// Inspect: an architecture (a transformers model type, built tiny offline) or a checkpoint folder under
// the server's --root, read off its dataflow by POST /api/inspect; its placement drawn by drawPlacement.
import {drawPlacement} from "./placements.js";
import {api, fmt, h, mount, once, status, writeHash} from "./util.js";

const SUMMARY = ["operator", "eps", "gain_convention", "bias", "cast_order", "placement", "placement_attention",
  "placement_mlp", "residual_scale", "branch_scale", "qk_norm", "qk_norm_rope", "v_norm", "attn_softcap",
  "final_norm", "final_logit_softcap", "embedding_scale", "embedding_norm", "layers", "hidden_size"];

export async function render(root, params) {
  const [models, where] = await Promise.all([once("/api/models"), once("/api/inspect")]);
  const types = [...new Set(models.models.flatMap((m) => m.hf_model_types))].sort();
  const typeInput = h("input", {id: "inspect-type", list: "inspect-types", placeholder: "llama, gpt2, qwen3…",
    "aria-label": "transformers model type", value: params.get("model_type") || ""});
  const folderSel = h("select", {id: "inspect-folder", "aria-label": "checkpoint folder under the root"},
    h("option", {value: ""}, where.folders.length ? "a folder under the root…" : "no checkpoint folder under the root"),
    where.folders.map((f) => h("option", {value: f}, f)));
  folderSel.value = params.get("folder") || "";
  const out = h("div", {id: "inspect-out", "aria-live": "polite"});
  const go = h("button", {type: "button", class: "primary", id: "inspect-go", onclick: run}, "Inspect");
  const form = h("form", {class: "controls wrap", onsubmit: (e) => { e.preventDefault(); run(); }},
    h("label", {class: "filter"}, h("span", {}, "model type"), typeInput,
      h("datalist", {id: "inspect-types"}, types.map((t) => h("option", {value: t})))),
    h("span", {class: "muted"}, "or"),
    h("label", {class: "filter"}, h("span", {}, `folder in ${where.root}`), folderSel), go);
  mount(root,
    h("header", {class: "view-head"}, h("h1", {}, "Inspect a model"),
      h("p", {class: "lede"}, "The model is built (tiny, random weights, offline) or loaded, traced, and its normalization ",
        "design read off the dataflow, never off parameter names. The first inspection of a type takes a few seconds.")),
    form, out);
  if (typeInput.value || folderSel.value) run();

  async function run() {
    const folder = folderSel.value, type = typeInput.value.trim();
    if (!folder && !type) { mount(out, status("choose a model type or a folder", "error")); return; }
    const body = folder ? {folder} : {model_type: type};
    writeHash("inspect", body);
    go.disabled = true;
    mount(out, status(`building and tracing ${folder || type}…`));
    try {
      const rep = await api("/api/inspect", body);
      mount(out, report(rep));
    } catch (e) {
      mount(out, status(e.message, "error"));
    } finally {
      go.disabled = false;
    }
  }
}

function report(rep) {
  const rows = SUMMARY.filter((k) => k in rep).map((k) => h("tr", {}, h("th", {scope: "row"}, k.replaceAll("_", " ")),
    h("td", {}, typeof rep[k] === "number" ? fmt(rep[k]) : String(rep[k] ?? "–"))));
  const subs = (rep.sublayers || []).map((sl) => h("tr", {}, [sl.layer, sl.kind, sl.placement, sl.pre.length, sl.out.length,
    sl.post.length, sl.skip_scale ?? "–", sl.branch_scale ?? "–"].map((v) => h("td", {}, String(v)))));
  return h("div", {class: "report"},
    h("section", {class: "card"},
      h("div", {class: "panel-head"}, h("h2", {}, rep.model), h("span", {class: "pill"}, rep.placement)),
      rep.drawing ? drawPlacement(rep.drawing, {label: `${rep.model}: the placement of its first layer`}) : status("no residual add found"),
      h("p", {class: "muted small"}, `first layer as traced; ${fmt(rep.seconds)} s${rep.cached ? " (cached)" : ""}`)),
    h("div", {class: "two"},
      h("section", {class: "card"}, h("h2", {}, "design"), h("table", {class: "kv"}, h("tbody", {}, rows))),
      h("section", {class: "card"}, h("h2", {}, "sublayers"), h("div", {class: "table-wrap"}, h("table", {class: "grid"},
        h("thead", {}, h("tr", {}, ["layer", "sublayer", "placement", "pre", "out", "post", "residual ×", "branch ×"].map((c) => h("th", {}, c)))),
        h("tbody", {}, subs))))),
    rep.notes && rep.notes.length ? h("section", {class: "card"}, h("h2", {}, "notes"), h("ul", {}, rep.notes.map((n) => h("li", {}, n)))) : null);
}
