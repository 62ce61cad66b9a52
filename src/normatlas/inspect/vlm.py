"""Inspect an image-text model whole: its vision tower, its connector and its language model, from one run.

Method: one eager forward of the whole model on a synthetic image + text batch (:mod:`normatlas.factory.vlm_inputs`) is
recorded with the shared recorder. The graph is then split by dataflow (:mod:`.vlm_graph`):

* the **image part** is every value computed from the pixel input and not from the text embedding (the
  ``embedding`` lookup fed by ``input_ids``); its **entries** are the image values the rest of the run reads;
* the **tower** is the image part inside the tower's module calls (the outermost calls that take the image itself
  and compute nothing from the text; the whole image part where no call qualifies), read as a vision encoder
  (:func:`.vision.vision_report`): operator, placement, LayerScale, the final norm, the batch-statistics norms.
  A norm the tower's calls do not run is the connector's, even on every token of the tower's last stream value
  (Mistral 3's projector RMSNorm; Pixtral itself has no final norm);
* the **tap** is the last stream value of the tower (a residual add, or the final / post norm on one) that feeds
  an entry: LLaVA reads its tower's second-to-last layer, so the tap is that layer's output; the **taps** count
  every tower stream value the connector reads directly (VipLLaVA and Mllama concatenate several layers);
* the **connector** is what lies between the tap and the entries, with the learned values it computes from
  parameters alone (a resampler's queries and their norms). Its kind is read off its ops: the image passing
  through integer values only (a VQ tokenizer's code ids: ``vq-tokens``), an attention inside it (learned queries
  attending to the image: a Perceiver resampler or Q-Former), a pooling op, rows regrouped into wider rows (a
  patch merger or pixel shuffle: the row width grows, the element count does not), two projections with an
  activation between (an MLP), one projection (linear); its norms are the norms found inside it;
* the **language model** is the graph restricted to the text embedding's descendants and what feeds them, image
  part cut (:func:`.analyze.analyze`); how the image reaches it (**injection**) is read off the entries' readers:
  into the embedding stream (its first stream value descends from an entry), as keys / values of cross-attention
  layers (gated when a ``tanh`` of a parameter scales the branch), or as discrete tokens. A cross-attention whose
  keys are computed from the image alone may normalise them in the image part, after the connector's output
  (Mllama's ``k_norm``): that norm is the report's ``image_key_norm``, noted per layer; the language model's
  ``qk_norm`` for the layer is then its queries' norm;
* other inputs: a second floating-point image (DeepSeek-VL hybrid's ``high_res_pixel_values``) feeds an encoder of
  its own, left out of the connector and noted; integer side inputs (InstructBLIP's ``qformer_input_ids``) count
  with the parameters, so what the connector computes from them is the connector's.

Guaranteed property: every field is a fact of the executed computation (module calls are read for their extent,
never their names); module paths are labels only.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..analysis.graph import record
from ..factory import build_vlm, vlm_inputs
from ..vocabulary import Operator, QKNormKind, branch_scale_word
from . import vlm_graph as vg
from .report import InspectionReport, UntraceableModel, _plain, gain_word
from .vision import VisionReport, vision_report
from .vlm_graph import ConnectorInfo, ConnectorKind, Injection

__all__ = [
    "ConnectorInfo",
    "ConnectorKind",
    "Injection",
    "VLMReport",
    "inspect_vlm",
    "inspect_vlm_target",
]


def _runs(ops: list[Operator]) -> str:
    """``layernorm, rmsnorm x10``: the operators in order, a run of one repeated written once with its count."""
    out: list[str] = []
    for op, group in itertools.groupby(o.value for o in ops):
        n = len(list(group))
        out.append(f"{op} x{n}" if n > 1 else op)
    return ", ".join(out) or "none"


@dataclass
class VLMReport:
    """The three parts of an image-text model, each from the one recorded run."""

    model: str
    vision: VisionReport
    connector: ConnectorInfo
    language: InspectionReport
    injection: Injection
    image_tokens: int  # rows of image features the language model reads
    tower_layers_run: int = 0  # tower layers the language model's input depends on (LLaVA: all but the last)
    batch_stat_norms: int = 0  # batch-statistics norms in the tower (BatchNorm / InstanceNorm calls)
    # the norm on keys computed from the image alone, in the language model's cross-attention (Mllama's k_norm):
    # it runs in the image part, after the connector's output, so the language model's qk_norm does not see it
    image_key_norm: QKNormKind = QKNormKind.NONE
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def part_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Three field / value tables: the vision tower, the connector, the language model."""
        v, c, lm = self.vision, self.connector, self.language
        tower = {
            "operator": v.operator.value,
            "placement": v.placement.value,
            "layers (run / built)": f"{self.tower_layers_run} / {v.layers}",
            "layer scale": branch_scale_word(v.branch_scale),
            "batch-statistics norms": self.batch_stat_norms,
            "embedding norm": v.embedding_norm.value,
            "final norm": v.final_norm.value,
            "pooled norm": v.pooled_norm.value,
            "tokens": v.tokens,
        }
        conn = {
            "kind": c.kind.value,
            "norms": ", ".join(o.value for o in c.norms) or "none",
            "norm widths": ", ".join(str(w) for w in c.norm_widths) or None,
            "projections": c.projections,
            "activation": c.activation,
            "tokens in -> out": f"{c.tokens_in} -> {c.tokens_out}",
            "tower taps": c.taps,
            "rows merged": c.row_merge,
            "output scale": c.scale,
            "injection": self.injection.value,
            "modules (labels)": ", ".join(c.modules[:4]) + (" ..." if len(c.modules) > 4 else ""),
        }
        lang = {
            "operator": lm.operator.value,
            "placement": lm.placement.value,
            "layers": lm.layers,
            "qk_norm": lm.qk_norm.value,
            "final norm": lm.final_norm.value,
            "embedding scale": lm.embedding_scale,
            "gain convention": gain_word(lm.gain_convention),
            "image-side key norm": self.image_key_norm.value,
        }
        return {
            key: [{"field": k, "value": val} for k, val in part.items()]
            for key, part in (("vision tower", tower), ("connector", conn), ("language model", lang))
        }

    def summary_row(self) -> dict[str, Any]:
        """One flat row of the three parts (for comparing several models)."""
        v, c, lm = self.vision, self.connector, self.language
        return {
            "model": self.model,
            "tower": f"{v.operator.value} {v.placement.value}",
            "tower final": v.final_norm.value,
            "layer scale": branch_scale_word(v.branch_scale),
            "batch-stat": self.batch_stat_norms,
            "connector": c.kind.value,
            "connector norm": _runs(c.norms),
            "injection": self.injection.value,
            "lm": f"{lm.operator.value} {lm.placement.value}",
            "lm qk_norm": lm.qk_norm.value,
            "image tokens": self.image_tokens,
        }

    def check_row(self) -> dict[str, Any]:
        """The language model's summary row plus the atlas's part fields (``matrix --check`` compares them):
        the tower's operator, the connector's kind (a gated cross-attention injection names the connector)
        and its first norm."""
        gated = self.injection is Injection.GATED_CROSS_ATTENTION
        return {
            **self.language.summary_row(),
            "model": self.model,
            "vision_tower_norm": self.vision.operator.value,
            "connector": "gated-cross-attention" if gated else self.connector.kind.value,
            "connector_norm": self.connector.norm.value,
        }

    def to_dict(self, detail: bool = False) -> dict[str, Any]:
        """JSON-ready: the three parts (the tower and language model as their report dicts)."""
        return {
            "model": self.model,
            "vision": self.vision.to_dict(detail=detail),
            "connector": _plain({**self.connector.__dict__, "norm": self.connector.norm}),
            "language": self.language.to_dict(detail=detail),
            "injection": self.injection.value,
            "image_tokens": self.image_tokens,
            "tower_layers_run": self.tower_layers_run,
            "batch_stat_norms": self.batch_stat_norms,
            "image_key_norm": self.image_key_norm.value,
            "notes": list(self.notes),
            "seconds": self.seconds,
        }


# ----------------------------------------------------------------------------- entry points
def inspect_vlm(
    model: nn.Module, inputs: dict[str, Any] | None = None, *, name: str | None = None, probe: bool = True
) -> VLMReport:
    """Report an image-text model's tower, connector and language model from one recorded forward.

    ``inputs`` are keyword inputs of ``model.forward`` holding ``input_ids`` and ``pixel_values`` (default: the
    synthetic batch of :func:`normatlas.factory.vlm_inputs.vlm_inputs`). Raises
    :class:`~normatlas.inspect.UntraceableModel` when the model does not run on them, ``ValueError`` when the run has
    no image part or no text embedding.
    """
    from .analyze import analyze
    from .probe import check_sites
    from .residual import scale_after

    t0 = time.perf_counter()
    inputs = vlm_inputs(model) if inputs is None else inputs
    for key in ("input_ids", "pixel_values"):
        if not isinstance(inputs.get(key) if isinstance(inputs, dict) else None, torch.Tensor):
            raise ValueError(f"inputs must be a dict holding a tensor {key!r}, got keys {sorted(inputs or {})}")
    label = name or type(model).__name__
    try:
        g = record(model.eval(), inputs)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UntraceableModel(f"cannot run {label} on an image + text: {type(exc).__name__}: {first}") from exc
    text = vg.text_embedding(g, vg.input_node(g, inputs["input_ids"]))
    pixel = vg.input_node(g, inputs["pixel_values"])
    text_bits = vg.desc(g, text)
    image = vg.desc(g, pixel) & ~text_bits
    entries = vg.entries_of(g, image)
    if not entries:
        raise ValueError(f"{label}: nothing computed from pixel_values reaches the language model")
    tokens = vg.discrete(g, pixel, entries)
    injection_entries, entries = entries, [vg.joined(g, image, entries)]
    region = vg.tower_region(g, pixel, text_bits)
    gi = vg.restricted(g, vg.closure(g, image))
    gv = gi if region is None else vg.restricted(g, vg.closure(g, image & region))
    vision = vision_report(model, gv, f"{label} / vision tower", probe=probe)
    tap, layers_run, feeding = vg.tap(g, gv, vision, entries)
    cut = vg.restricted(g, ~image)
    gl = vg.restricted(cut, vg.closure(cut, vg.desc(cut, text)))
    language = analyze(gl, f"{label} / language model")
    if language.embedding_scale is None:  # the walk back from the first stream value stops at the merge
        language.embedding_scale = scale_after(g, text)
    if probe:
        check_sites(model, gl, language)
    before_tap = vg.closure(g, 1 << tap) if tap is not None else 0
    second = vg.second_images(g, inputs, pixel, text_bits)
    learned = vg.learned(g, vg.side_inputs(g, inputs))
    conn_bits = vg.closure(g, vg.bits_of(entries)) & (image | learned) & ~before_tap & ~second
    conn_bits &= ~vg.neck(g, gi, region, conn_bits)
    connector = vg.connector_info(g, gi, conn_bits, tap, entries, tokens)
    connector.taps = vg.taps(g, feeding, tap, conn_bits)
    report = VLMReport(
        label,
        vision,
        connector,
        language,
        vg.injection_of(g, gl, text, injection_entries, tokens),
        connector.tokens_out or 0,
        tower_layers_run=layers_run,
        batch_stat_norms=vg.batch_stat_norms(gv, image),
    )
    if region is None:
        report.notes.append("no module call takes the image alone: the whole image part is read as the tower")
    if tap is None:
        report.notes.append("no tower stream value feeds the language model: the connector is the whole image part")
    _note_image_key_norms(report, g, text_bits, image, (1 << pixel) | (1 << text))
    if second:
        report.notes.append(
            "a second image input feeds an encoder of its own (what is computed from it alone and its parameters is "
            "left out of the connector and not read; the tower is the pixel_values one)"
        )
    report.seconds = time.perf_counter() - t0
    return report


def _note_image_key_norms(report: VLMReport, g: Any, text_bits: int, image: int, stream_bit: int) -> None:
    """The norms on keys computed from the image alone (:func:`.vlm_graph.image_key_norms`): their kind in the
    report's ``image_key_norm`` and, per cross-attention layer, a note saying where its q and k norms run."""
    from .attention import qk_kind

    found = vg.image_key_norms(g, text_bits, image, stream_bit)
    kinds = {qk_kind(keys, head_dim) for _, head_dim, keys in found}
    if kinds:
        report.image_key_norm = kinds.pop() if len(kinds) == 1 else QKNormKind.MIXED
    attention = report.language.attention
    for i, head_dim, keys in found:
        layer, queries = (attention[i].layer, attention[i].qk_norm.value) if i < len(attention) else (i, "unknown")
        report.notes.append(
            f"language-model layer {layer}'s cross-attention takes keys computed from the image alone: their norm "
            f"({_runs([s.operator for s in keys])}, {qk_kind(keys, head_dim).value}) runs in the image part, after "
            f"the connector's output; the language model's qk_norm for the layer ({queries}) is its queries' norm"
        )


def inspect_vlm_target(model_type: str, *, seed: int = 0, probe: bool = True) -> VLMReport:
    """Build a tiny image-text model of a transformers ``model_type`` and inspect it whole."""

    model = build_vlm(model_type, seed=seed)
    return inspect_vlm(model, vlm_inputs(model, seed=seed), name=model_type, probe=probe)
