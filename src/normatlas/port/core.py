"""Port a transformers decoder into our :class:`~normatlas.blocks.TransformerLM`, derived from the model itself.

``port(hf_model)`` records one forward pass, reads the design off the dataflow (:mod:`.design`), builds our model,
copies every tensor by its link, and checks the logits; ``from_hf`` returns the built model (its ``hf_port`` is the
:class:`Port`); ``to_hf_state_dict`` maps our tensors back to the source's names and layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..analysis.graph import Graph, record
from ..analysis.ops import SHAPE_ONLY
from ..analysis.walk import strip
from ..blocks.alibi import Alibi
from ..blocks.model import ModelConfig, TransformerLM, ViTConfig, ViTEncoder
from ..inspect.analyze import analyze
from ..inspect.attention import find_cores, trig_bits
from ..inspect.norms import Site, find_sites
from ..inspect.report import InspectionReport
from ..inspect.residual import embedding, final_norm, find_stream, place_norms
from .design import LayerReading, Source, make_config, norm_spec, qk_config, read_layers, v_config
from .ends import EmbedProjection, embed_projection, table_index
from .errors import PortError
from .measure import logit_ends
from .read import Proj, projections

__all__ = ["Link", "Port", "example_batch", "from_hf", "port", "to_hf_state_dict"]

CHECK_TOL = 1e-4  # the port's own check: max abs logit difference relative to (1 + max |logit|), fp32


@dataclass(frozen=True)
class Link:
    """Our parameter ``ours`` <- the model's parameter registered under ``theirs`` (every name of one tensor: a tied
    weight has two), transposed first when ``transpose`` (Conv1D), then ``rows`` of it (a fused projection)."""

    ours: str
    theirs: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    rows: tuple[int, ...] | None = None
    axis: int = 0  # the dim ``rows`` index (after the transpose): 1 for a fused gate-and-up stack of experts


@dataclass
class Port:
    """A derived port: our config, the links of every parameter, the inspector's report, the check's result."""

    model_type: str
    config: ModelConfig
    links: tuple[Link, ...]
    report: InspectionReport
    buffers: tuple[str, ...] = ()  # the source's state-dict entries that are buffers (no parameter of ours)
    unused: tuple[str, ...] = ()  # parameters the recorded forward never reads (DINOv2's mask token): not ported
    max_abs_diff: float | None = None
    notes: list[str] = field(default_factory=list)


def _seq_len(cfg: Any) -> int:
    """A sequence long enough to show the shortest sliding window in the recorded mask (capped at 512 tokens)."""
    limit = next(
        (v for k in ("max_position_embeddings", "n_positions") if isinstance(v := getattr(cfg, k, None), int)), 512
    )
    w = getattr(cfg, "sliding_window", None)
    t = w + 4 if isinstance(w, int) and 0 < w <= 508 else 8
    return max(2, min(t, limit))


def _known_thetas(cfg: Any) -> tuple[float, ...]:
    """Every RoPE base the config states (exact values for the measured ones to snap to)."""
    found: list[float] = []

    def walk(d: Any) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and "theta" in str(k):
                    found.append(float(v))
                walk(v)

    walk(cfg.to_dict() if hasattr(cfg, "to_dict") else {})
    return tuple(found)


def _inputs(hf: nn.Module, seq: int, batch: int, seed: int) -> dict[str, Any]:
    from ..factory import example_inputs
    from .vision import is_vision, pixel_inputs

    if is_vision(hf.config):
        return pixel_inputs(hf.config, batch, seed)
    ins = example_inputs(hf, seq=seq, seed=seed)
    if batch > 1:
        more = [example_inputs(hf, seq=seq, seed=seed + k)["input_ids"] for k in range(1, batch)]
        ins["input_ids"] = torch.cat([ins["input_ids"], *more])
    return ins


def example_batch(hf_model: nn.Module, batch: int = 2, seed: int = 5) -> dict[str, Any]:
    """A seeded batch the model takes: ``input_ids`` for a language model, ``pixel_values`` for an image classifier."""
    return _inputs(hf_model, _seq_len(hf_model.config), batch, seed)


@dataclass
class _Read:
    g: Graph
    sites: list[Site]
    layers: list[LayerReading]
    final: Site | None
    emb_scale: float | None
    emb_norm: Site | None
    projs: list[Proj]
    stream_shape: tuple[int, ...]
    last: int  # the last stream value the head reads: the final norm's output, or the last sublayer's
    head_norm: Site | None = None
    first: int = 0  # the first stream value (the embedding's output, before any embedding norm)
    embed_proj: EmbedProjection | None = None  # a projection from the embedding width onto the stream (ELECTRA)


def _read(hf: nn.Module, inputs: dict[str, Any]) -> _Read:
    g = record(hf, inputs)
    sites = find_sites(g)
    stream = find_stream(g, sites)
    subs = stream.sublayers
    if not subs:
        raise PortError(["no residual stream with sublayers was found"])
    start_bit = 1 << subs[0].source
    stream_inputs = {strip(g, s.source, SHAPE_ONLY) for s in subs} | {strip(g, s.adds[-1], SHAPE_ONLY) for s in subs}
    cores = find_cores(g, sites, start_bit, stream_inputs, trig_bits(g))
    place_norms(g, stream, sum(1 << c.node for c in cores), {})
    final = final_norm(g, stream)
    emb_scale, emb_norm = embedding(g, stream)
    if emb_norm is None:  # a norm whose last op returns its input object (type_as to its own dtype): NanoChat
        first = strip(g, subs[0].source, SHAPE_ONLY)
        emb_norm = next((s for s in sites if s.node == first), None)
    projs = projections(g)
    ep = embed_projection(g, projs, subs[0].source, stream.by_output) if emb_norm is None and not emb_scale else None
    if ep is not None:
        emb_scale, emb_norm = ep.scale, ep.norm
    layers = read_layers(g, subs, cores, projs, _known_thetas(hf.config), sites)  # type: ignore[union-attr]
    end = subs[-1]
    last = final.output if final else (end.post[-1].output if end.post else end.adds[-1])
    first = emb_norm.input if emb_norm is not None else strip(g, subs[0].source, SHAPE_ONLY)
    return _Read(g, sites, layers, final, emb_scale, emb_norm, projs, tuple(stream.shape), last, first=first,
                 embed_proj=ep)  # fmt: skip


def _agree(values: list[Any], what: str) -> Any:
    uniq = list(dict.fromkeys(values))
    if len(uniq) != 1:
        raise PortError([f"{what} that differ between layers ({', '.join(map(str, uniq[:4]))})"])
    return uniq[0]


def _rope_fields(layers: list[LayerReading]) -> dict[str, Any]:
    readings = [r.rope for r in layers]
    live = [r for r in readings if r is not None]
    if not live:
        return {"rope": None}
    _agree([r.style for r in live], "RoPE layouts")
    _agree([r.rotary_dim for r in live], "rotated widths")
    _agree([(r.inv_freq, r.attention_factor, r.long_inv_freq, r.long_after, r.clockwise) for r in live],
           "RoPE frequency profiles (scaled inverse frequencies, attention factor)")  # fmt: skip
    hd = layers[0].rope_head or layers[0].heads[2]
    thetas = [r.theta for r in live]
    out: dict[str, Any] = {"rope": live[0].rope(hd)}
    if len(set(thetas)) > 1:
        out["layer_rope_theta"] = tuple(r.theta if r is not None else thetas[0] for r in readings)
    if len(live) < len(readings):
        out["layer_rope"] = tuple(r is not None for r in readings)
    return out


def _attention_fields(layers: list[LayerReading]) -> dict[str, Any]:
    scores = [r.scores for r in layers]
    assert all(s is not None for s in scores)
    n_heads, hd = _agree([(r.heads[0], r.heads[2]) for r in layers], "attention shapes (heads, head dim)")
    kv = tuple(r.heads[1] for r in layers)
    scales = [s.scale for s in scores]  # type: ignore[union-attr]
    out: dict[str, Any] = dict(n_heads=n_heads, n_kv_heads=kv[0], head_dim=hd)
    if len(set(kv)) > 1:  # kv head counts per layer (MiMo-V2-Flash)
        out["layer_kv_heads"] = kv
    out["mla"] = _agree([r.mla for r in layers], "attention kinds (MLA and not, or MLA shapes)")
    out["attn_sinks"] = _agree([r.sinks for r in layers], "attention sinks (in some layers only)")
    out["attn_gate"] = _agree([r.gate for r in layers], "attention output gates")
    slopes = _agree([s.alibi for s in scores], "ALiBi slopes (or ALiBi in some layers only)")  # type: ignore[union-attr]
    out["alibi"] = None if slopes is None else Alibi(slopes)
    out["causal"] = _agree([s.causal for s in scores], "causal masks")  # type: ignore[union-attr]
    out["attn_softcap"] = _agree([s.softcap for s in scores], "attention soft-caps")  # type: ignore[union-attr]
    windows = tuple(s.window for s in scores)  # type: ignore[union-attr]
    out["layer_windows"] = windows if any(w is not None for w in windows) else None
    if all(math.isclose(s, scales[0], rel_tol=1e-9) for s in scales):
        out["attn_scale"] = None if math.isclose(scales[0], hd**-0.5, rel_tol=1e-7) else scales[0]
    else:
        out["layer_attn_scale"] = tuple(scales)
    return out


def _bias_fields(layers: list[LayerReading]) -> dict[str, Any]:
    flags: dict[str, list[bool]] = {"qkv": [], "out": [], "mlp": []}
    for r in layers:
        for key, has in r.biases.items():
            group = "mlp" if key.startswith("mlp") else "out" if key.endswith("o_proj") else "qkv"
            flags[group].append(has)
    problems = [f"{g} projections with and without bias" for g, v in flags.items() if len(set(v)) > 1]
    if problems:
        raise PortError(problems)
    return {f"{g}_bias": bool(v and v[0]) for g, v in flags.items()}


def _mlp_fields(layers: list[LayerReading]) -> dict[str, Any]:
    """The dense MLP's activation, gating and width, and the MoE of the layers that route (one for all of them;
    experts and dense layers share the activation and gating)."""
    kinds = [(m.activation, m.gated) for r in layers for m in (r.mlp, r.moe) if m is not None]
    act = _agree([a for a, _ in kinds], "MLP activations (dense and experts)")
    gated = _agree([gd for _, gd in kinds], "gated and plain MLPs (dense and experts)")
    moes = [r.moe for r in layers if r.moe is not None]
    dense = [r.d_ff for r in layers if r.moe is None]
    out: dict[str, Any] = {"activation": act, "gated": gated}
    out["d_ff"] = _agree(dense, "MLP widths") if dense else moes[0].config.d_expert
    if moes:
        out["moe"] = _agree([m.config for m in moes], "MoE configs")
        if dense:
            out["layer_moe"] = tuple(r.moe is not None for r in layers)
    return out


def _table(module: nn.Module) -> nn.Parameter:
    w = module.weight  # nn.Embedding's typed API
    assert isinstance(w, nn.Parameter)
    return w


def _embeddings(r: _Read, seq: int) -> tuple[nn.Module, dict[str, Any], dict[str, Source]]:
    """The token embedding (the table reading the input ids) and learned absolute positions (a table read at
    ``offset + 0..T-1`` and added to it, its rows counted by the rule a padded batch shows: :mod:`.positions`); any
    other table is refused."""
    from .positions import position_rule, table_rows

    g = r.g
    tables = [s for s in g.spans if isinstance(s.module, nn.Embedding) and s.inputs]
    tok = [s for s in tables if g.nodes[strip(g, table_index(g, s), SHAPE_ONLY)].op == "input"]
    if len(tok) != 1:
        raise PortError([f"{len(tok)} embedding tables read the input ids"])
    fields: dict[str, Any] = {"vocab_size": tok[0].module.num_embeddings, "pad_token_id": tok[0].module.padding_idx}
    sources = {"embed.weight": Source(_table(tok[0].module))}
    if r.emb_scale is None and len(tables) > 1:  # positions added: the walk back from the stream stops at the add
        from ..inspect.residual import scale_after

        reads = [n.idx for n in g.nodes if n.op == "embedding" and any(g.tensors.get(i) is _table(tok[0].module)
                                                                          for i in n.inputs)]  # fmt: skip
        r.emb_scale = scale_after(g, reads[0]) if reads else None
    for s in tables:
        if s is tok[0]:
            continue
        idx = table_rows(g, _table(s.module))
        idx = g.tensors[table_index(g, s)] if idx is None else idx
        if not bool(idx.any()) and "type_embed.weight" not in sources:  # one type id for every token (BERT)
            fields["type_vocab_size"] = s.module.num_embeddings
            sources["type_embed.weight"] = Source(_table(s.module))
            continue
        if not bool(idx.any()):
            raise PortError([f"a second embedding table ({s.name}) read at all-zeros: an id input besides the tokens "
                             "and the token types (RoC-BERT's shape / pronunciation ids)"])  # fmt: skip
        row = idx.reshape(-1, idx.shape[-1])[0]
        offset = int(row[0])
        if not torch.equal(row, torch.arange(offset, offset + row.shape[-1], device=row.device)):
            raise PortError([f"an embedding table ({s.name}) read at something other than the positions 0..T-1 "
                             f"from an offset (rows {row.tolist()[:8]})"])  # fmt: skip
        if "pos_embed.weight" in sources:
            raise PortError(["two position tables"])
        ids = g.tensors[tok[0].inputs[0]]
        rule = position_rule(g.model, _table(s.module), ids, offset, tok[0].module.padding_idx, s.name)  # type: ignore[arg-type]
        fields.update(max_positions=s.module.num_embeddings, position_offset=offset, position_ids=rule)
        sources["pos_embed.weight"] = Source(_table(s.module))
    _fixed_positions(r, tok[0].module)
    return tok[0].module, fields, sources


def _fixed_positions(r: _Read, tok: nn.Module) -> None:
    """Refuse a position table that is a buffer (CTRL's sinusoids, computed at init) added to the token embeddings
    before the first layer: our positions are a learned table (or RoPE)."""
    from .rope import _buffer_table

    g = r.g
    reads = [n.idx for n in g.nodes if n.op == "embedding" and any(g.tensors.get(i) is _table(tok) for i in n.inputs)]
    first = r.first
    for n in g.nodes[reads[0] if reads else 0 : first + 1]:
        if n.op != "add" or not (n.idx == first or g.feeds(n.idx, first)) or not reads:
            continue
        if not any(g.feeds(reads[0], i) or i == reads[0] for i in n.inputs):
            continue
        if any(_buffer_table(g, i) and not (g.feeds(reads[0], i) or i == reads[0]) for i in n.inputs):
            raise PortError(["fixed absolute positions (a buffer, e.g. sinusoids computed at init) added to the "
                             "token embeddings; our absolute positions are a learned table"])  # fmt: skip


def _head(r: _Read, embed: nn.Module) -> tuple[dict[str, Any], dict[str, Source]]:
    g = r.g
    out = g.outputs[0] if g.outputs else None
    heads = [p for p in r.projs if out is not None and (p.output == out or g.feeds(p.output, out))]
    heads = [p for p in heads if not any(q is not p and g.feeds(p.output, q.input) for q in heads)]
    if len(heads) != 1 or heads[-1].kind != "linear":
        raise PortError(["the logits are not one linear head projection"])
    head = heads[-1]
    transform = _head_transform(r, head)
    scale, cap = logit_ends(g, head, r.last)
    tied = head.weight() is embed.weight
    fields = {"tie_embeddings": tied, "logit_scale": scale, "logit_softcap": cap, "head_bias": head.bias() is not None}
    if head.weight().shape[0] != embed.num_embeddings:  # an untied head over another vocabulary (Mllama, Moshi)
        fields["head_vocab_size"] = int(head.weight().shape[0])
    sources = {"lm_head.weight": Source(head.weight())}
    if head.bias() is not None:
        sources["lm_head.bias"] = Source(head.bias())  # type: ignore[arg-type]
    if transform is not None:
        from .design import _norm_sources

        dense, site = transform
        fields["head_transform"] = True
        fields["head_transform_bias"] = dense.bias() is not None
        if (width := int(dense.weight().shape[0])) != r.stream_shape[-1]:
            fields["head_width"] = width
        sources["head_dense.weight"] = Source(dense.weight())
        if dense.bias() is not None:
            sources["head_dense.bias"] = Source(dense.bias())  # type: ignore[arg-type]
        sources.update(_norm_sources(g, "head_norm", site))
        r.head_norm = site
    return fields, sources


def _head_transform(r: _Read, head: Proj) -> tuple[Proj, Site] | None:
    """A masked-LM head's transform (BERT): a norm right before the head whose input is ``act(dense(x))``."""
    from ..blocks.mlp import Activation

    g = r.g
    used = {s.node for layer in r.layers for s in layer.norms.values()} | {s.node for s in (r.final, r.emb_norm) if s}
    site = next((s for s in r.sites if s.output == strip(g, head.input, SHAPE_ONLY) and s.node not in used), None)
    if site is None:
        return None
    y = strip(g, site.input, SHAPE_ONLY)
    dense = [p for p in r.projs if p is not head and g.feeds(p.output, y)]
    acts = r.layers[0].mlp.activation if r.layers and r.layers[0].mlp else None
    if not dense or acts is None:
        raise PortError(["a norm before the head that is not a dense-activation-norm transform"])
    d = dense[-1]
    if not torch.allclose(Activation(acts)(g.tensors[d.output]), g.tensors[y], atol=1e-5):
        raise PortError(["a head transform whose activation is not the MLP's"])
    return d, site


def _spec(r: _Read) -> Any:
    """One norm operator for every slot (block norms, final, embedding)."""
    sites = [s for layer in r.layers for s in layer.norms.values()]
    sites += [s for s in (r.final, r.emb_norm, r.head_norm) if s is not None]
    specs = list(dict.fromkeys(norm_spec(s) for s in sites))
    if len(specs) > 1:
        brief = sorted({f"{'LN' if s.center else 'RMS'} eps={s.eps:g} bias={s.bias} gain={s.gain_convention.value}"
                        for s in specs})  # fmt: skip
        raise PortError([f"norms of {len(specs)} kinds in one model ({'; '.join(brief)}); our slots take one"])
    return specs[0] if specs else None


def _sources(r: _Read, glob: dict[str, Source]) -> dict[str, Source]:
    from .design import _norm_sources

    out = dict(glob)
    for layer in r.layers:
        prefix = f"layers.{layer.index}."
        out.update({prefix + k: v for k, v in layer.sources.items()})
        for slot, site in layer.norms.items():
            out.update({prefix + k: v for k, v in _norm_sources(r.g, slot, site).items()})
    for slot, maybe in (("final_norm", r.final), ("embed_norm", r.emb_norm)):
        if maybe is not None:
            out.update(_norm_sources(r.g, slot, maybe))
    return out


def _vision_config(hf: nn.Module, r: _Read) -> tuple[ModelConfig, dict[str, Source]]:
    from .vision import vision_ends

    fields, glob = vision_ends(r.g, r.projs, r.last, hf.config)
    attention = _attention_fields(r.layers)
    if attention.pop("causal") or attention.get("layer_windows"):
        raise PortError(["a vision encoder with a causal or windowed mask"])
    if any(layer.rope is not None for layer in r.layers) or qk_config(r.layers) or v_config(r.layers):
        raise PortError(["a vision encoder with RoPE or QK-norm (our ViTEncoder has learned positions only)"])
    base = dict(
        d_model=r.stream_shape[-1], n_layers=len(r.layers), final_norm=r.final is not None, **fields,
        **attention, **_mlp_fields(r.layers), **_bias_fields(r.layers),
    )  # fmt: skip
    return make_config(base, r.layers, _spec(r), ViTConfig), _sources(r, glob)


def _config(hf: nn.Module, r: _Read, seq: int) -> tuple[ModelConfig, dict[str, Source]]:
    from .vision import is_vision

    if is_vision(hf.config):  # type: ignore[union-attr]
        return _vision_config(hf, r)
    embed, fields, glob = _embeddings(r, seq)
    head_fields, head_src = _head(r, embed)
    glob.update(head_src)
    if head_fields.pop("head_bias"):
        fields["head_bias"] = True
    if r.embed_proj is not None:
        p = r.embed_proj.proj
        fields.update(embed_dim=int(p.weight().shape[1]), embed_proj_bias=p.bias() is not None)
        glob["embed_proj.weight"] = Source(p.weight())
        if p.bias() is not None:
            glob["embed_proj.bias"] = Source(p.bias())  # type: ignore[arg-type]
    spec = _spec(r)
    base = dict(
        d_model=r.stream_shape[-1], n_layers=len(r.layers), qk_norm=qk_config(r.layers), v_norm=v_config(r.layers),
        final_norm=r.final is not None, embed_norm=r.emb_norm is not None, embed_scale=r.emb_scale or 1.0,
        **fields, **head_fields, **_attention_fields(r.layers), **_mlp_fields(r.layers), **_bias_fields(r.layers),
        **_rope_fields(r.layers),
    )  # fmt: skip
    if spec is None:
        base.update(final_norm=False, embed_norm=False)
    cfg = (
        make_config(base, r.layers, spec) if spec is not None else ModelConfig(placement=r.layers[0].placement, **base)
    )
    return cfg, _sources(r, glob)


def _names(hf: nn.Module, buffers: bool = False) -> dict[int, tuple[str, ...]]:
    names: dict[int, list[str]] = {}
    named = hf.named_buffers(remove_duplicate=False) if buffers else hf.named_parameters(remove_duplicate=False)
    for n, p in named:
        names.setdefault(id(p), []).append(n)
    return {k: tuple(v) for k, v in names.items()}


def _pull(src: Source) -> Tensor:
    t = src.param.detach()
    t = t.transpose(-2, -1) if src.transpose else t
    return t.index_select(src.axis, torch.tensor(src.rows, device=t.device)) if src.rows is not None else t


def _links(
    hf: nn.Module, ours: nn.Module, sources: dict[str, Source], read: set[int]
) -> tuple[tuple[Link, ...], tuple[str, ...]]:
    """Every parameter of ours linked to its source; a source parameter the forward reads but nothing of ours
    takes is refused, one it never reads is returned as unused."""
    names = _names(hf)
    buffer_names = _names(hf, buffers=True)  # a source may be a buffer (a MoE's selection bias); never "unused"
    sd = ours.state_dict()
    missing = [k for k in sd if k not in sources]
    linked = {id(s.param) for s in sources.values()}
    unused = sorted({n[0] for i, n in names.items() if i not in linked and i in read})
    never = tuple(sorted({n[0] for i, n in names.items() if i not in linked and i not in read}))
    problems = [f"parameters with no place in our Block: {', '.join(unused[:8])}"] if unused else []
    if missing:
        problems.append(f"our parameters not found in the model: {', '.join(missing[:8])}")
    if problems:
        raise PortError(problems)
    links = []
    for key, t in sd.items():
        src = sources[key]
        got = _pull(src)
        theirs = names.get(id(src.param)) or buffer_names[id(src.param)]
        if got.numel() != t.numel():
            raise PortError([f"{theirs[0]} has {tuple(got.shape)} elements for our {key} {tuple(t.shape)}"])
        links.append(Link(key, theirs, tuple(src.param.shape), src.transpose, src.rows, src.axis))
    return tuple(links), never


def _logit_params(g: Graph) -> set[int]:
    """The parameters the logits depend on (a pooler the forward computes beside them, BigBird's, is not one)."""
    out = g.outputs[0] if g.outputs else None
    return {id(g.tensors[n.idx]) for n in g.nodes if n.op == "param" and (out is None or g.feeds(n.idx, out))}


def _load(hf: nn.Module, ours: nn.Module, links: tuple[Link, ...], sources: dict[str, Source]) -> None:
    sd = ours.state_dict()
    filled = {k: _pull(sources[k]).reshape(sd[k].shape).clone() for k in sd}
    ours.load_state_dict(filled, strict=True)


def _check(hf: nn.Module, ours: nn.Module, seq: int) -> float:
    ins = _inputs(hf, seq, batch=2, seed=11)
    with torch.no_grad():
        ref = hf(**ins).logits.float()
        got = ours(next(iter(ins.values()))).float()
    if ref.shape != got.shape:
        raise PortError([f"logits of shape {tuple(got.shape)} for the model's {tuple(ref.shape)}"])
    return float((ref - got).abs().max())


def port(hf_model: nn.Module, *, check: bool = True) -> tuple[Port, Any]:
    """Derive the port of ``hf_model`` (a transformers decoder) and build our model with its weights.

    Raises :class:`PortError` naming every feature our Block does not express, and (with ``check``) when the
    derived model's fp32 logits differ from the source's by more than ``CHECK_TOL`` relative to the logits' size."""
    config = getattr(hf_model, "config", None)
    if config is None or not isinstance(hf_model, nn.Module):
        raise TypeError(
            f"hf_model={type(hf_model).__name__} must be a transformers PreTrainedModel (it has no .config)"
        )
    name = str(getattr(config, "model_type", type(hf_model).__name__))
    dtype = next(hf_model.parameters()).dtype
    hf_model = hf_model.eval()
    seq = _seq_len(config)
    try:
        r = _read(hf_model, _inputs(hf_model, seq, batch=1, seed=0))
        cfg, sources = _config(hf_model, r, seq)
        ours = (ViTEncoder(cfg) if isinstance(cfg, ViTConfig) else TransformerLM(cfg)).to(dtype=dtype).eval()
        links, unused = _links(hf_model, ours, sources, _logit_params(r.g))
        _load(hf_model, ours, links, sources)
        report = analyze(r.g, name)
    except PortError as e:
        raise e.named(name) from None
    linked = {n for link in links for n in link.theirs}
    buffers = tuple(k for k in hf_model.state_dict() if k not in linked and k not in unused)
    result = Port(name, cfg, links, report, buffers, unused=unused)
    if check:
        diff = _check(hf_model, ours, seq)
        result.max_abs_diff = diff
        with torch.no_grad():
            size = float(ours(next(iter(_inputs(hf_model, seq, 1, 11).values()))).abs().max())
        if not diff <= CHECK_TOL * (1 + size):
            raise PortError([f"the derived design's logits differ from the model's by {diff:.3g}"], name)
    ours.hf_port = result  # type: ignore[assignment]
    return result, ours


def from_hf(hf_model: nn.Module) -> TransformerLM:
    """Our model equal to ``hf_model`` (same logits; its weights copied), derived from its dataflow; the
    :class:`Port` is ``model.hf_port`` (for :func:`to_hf_state_dict`)."""
    return port(hf_model)[1]


def to_hf_state_dict(
    model: TransformerLM, port: Port | None = None, tensors: Mapping[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """Our state dict (or any dict with our names, e.g. gradients) under the source model's names and layout
    (fused projections re-fused, Conv1D weights transposed back; a tied tensor under each of its names).

    ``port`` defaults to ``model.hf_port``. A model changed with our blocks saves back while its parameters still
    fit the source layout (same names and shapes: a placement's scaling changed, say); a parameter the source has
    no place for (a new norm slot) or a missing one raises :class:`PortError`."""
    if isinstance(port, str):
        raise TypeError(f"port={port!r}: pass the Port (model.hf_port) or nothing, not a model type (no key maps)")
    port = port if port is not None else getattr(model, "hf_port", None)
    if not isinstance(port, Port):
        raise TypeError("to_hf_state_dict needs the Port of a ported model: pass port= or use a model from from_hf")
    src = dict(model.state_dict()) if tensors is None else dict(tensors)
    by_ours = {link.ours: link for link in port.links}
    extra = [k for k in src if k not in by_ours]
    missing = [k for k in by_ours if k not in src] if tensors is None else []
    if extra or missing:
        raise PortError(
            ([f"no place in the {port.model_type} layout for {', '.join(extra[:6])}"] if extra else [])
            + ([f"missing {', '.join(missing[:6])}"] if missing else []),
            port.model_type,
        )
    groups: dict[tuple[str, ...], list[Link]] = {}
    for key in src:
        groups.setdefault(by_ours[key].theirs, []).append(by_ours[key])
    out: dict[str, Tensor] = {}
    for theirs, links in groups.items():
        t = _assemble(links, src)
        for name in theirs:
            out[name] = t
    return out


def _assemble(links: list[Link], src: Mapping[str, Tensor]) -> Tensor:
    first = links[0]
    shape = (*first.shape[:-2], first.shape[-1], first.shape[-2]) if first.transpose else first.shape
    if first.rows is None:
        t = src[first.ours].reshape(shape)
    else:
        t = src[first.ours].new_zeros(shape)
        covered, ax = 0, first.axis
        for link in links:
            part = src[link.ours]
            if link.rows is None or link.axis != ax or part.dim() <= ax or part.shape[ax] != len(link.rows):
                raise PortError([f"{link.ours}: shape {tuple(part.shape)} does not fit its rows of {link.theirs[0]}"])
            t.index_copy_(ax, torch.tensor(link.rows, device=t.device), part.to(t.dtype))
            covered += len(link.rows)
        if covered != shape[ax]:
            raise PortError(
                [f"{first.theirs[0]} is fused from {len(links)} of ours, covering {covered}/{shape[ax]} rows"]
            )
    return t.transpose(-2, -1).contiguous() if first.transpose else t
