"""``normatlas port``: a transformers decoder ported into our Block from its dataflow, and (``--check``) proven."""

from __future__ import annotations

import argparse
from typing import Any

from . import CliError, add_attention_option
from . import _progress as progress
from ._format import Section, add_format_option, emit


def configure_port(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target",
        help="transformers model type (built tiny, offline) or a checkpoint folder (config.json + safetensors)",
    )
    p.add_argument(
        "--check", action="store_true", help="compare the fp32 logits and every parameter's gradient with transformers"
    )
    add_attention_option(p)
    add_format_option(p)


def _build(target: str) -> Any:
    from ..factory import build_target

    try:
        with progress.phase(f"building {target}"):
            model, _, label = build_target(target)
    except (ValueError, TypeError, FileNotFoundError, OSError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    except Exception as exc:  # building a model can fail in many ways; one line, never a traceback
        raise CliError(
            f"cannot build {target}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        ) from exc
    return model.float().eval(), label


def _design_rows(cfg: Any) -> list[dict[str, object]]:
    """The derived design, one field per row, grouped as the docs describe it."""
    placement = [" / ".join(k.value for k in cfg.plan(i)[0].kinds) for i in range(cfg.n_layers)]
    p0 = cfg.plan(0)[0]
    spec = cfg.plan(0)[1](cfg.d_model).spec if cfg.plan(0)[1] is not None else None
    rope = cfg.rope
    qk = cfg.qk_norm
    per_layer = placement[0] if len(set(placement)) == 1 else " | ".join(placement)
    gate = " + LayerScale" if p0.gate.value != "none" else ""
    rope_text = None if rope is None else f"theta={rope.theta:g}, {rope.style.value}, fraction={rope.fraction:g}"
    positions = cfg.max_positions or ("rope" if rope else "none")
    rows: list[tuple[str, str, object]] = [
        ("placement", "per layer", per_layer),
        ("placement", "residual x / branch x", f"{p0.residual_alpha:g} / {p0.branch_scale:g}{gate}"),
        ("norm", "operator", "none" if spec is None else ("layernorm" if spec.center else "rmsnorm")),
        ("norm", "eps", None if spec is None else spec.eps),
        ("norm", "gain / bias", None if spec is None else f"{spec.gain_convention.value} / {spec.bias}"),
        ("norm", "cast order", None if spec is None else spec.cast_order.value),
        ("norm", "final / embedding", f"{cfg.final_norm} / {cfg.embed_norm}"),
        ("attention", "heads / kv heads / head dim", f"{cfg.n_heads} / {cfg.n_kv_heads} / {cfg.head_dim}"),
        ("attention", "qkv / out bias", f"{cfg.qkv_bias} / {cfg.out_bias}"),
        ("attention", "scale", cfg.layer_attn_scale or cfg.attn_scale or "head_dim**-0.5"),
        ("attention", "softcap", cfg.attn_softcap),
        ("attention", "causal / windows", f"{cfg.causal} / {cfg.layer_windows}"),
        ("attention", "rope", rope_text),
        ("attention", "rope per layer", cfg.layer_rope),
        ("attention", "qk-norm", None if qk is None else f"{qk.kind.value}, {qk.operator.value}, {qk.order.value}"),
        ("mlp", "gated / activation / d_ff", f"{cfg.gated} / {cfg.activation.value} / {cfg.d_ff}"),
        ("mlp", "bias", cfg.mlp_bias),
        ("embedding/head", "vocab / positions", f"{cfg.vocab_size} / {positions}"),
        ("embedding/head", "embed scale / tied", f"{cfg.embed_scale:g} / {cfg.tie_embeddings}"),
        ("embedding/head", "logit scale / softcap", f"{cfg.logit_scale:g} / {cfg.logit_softcap}"),
    ]  # fmt: skip
    moe = getattr(cfg, "moe", None)
    if moe is not None:  # a routed mixture of experts in the MLP slot (of the layers layer_moe marks)
        route = f"{moe.score.value}{' after top-k' if moe.score_after_topk else ''}" + (
            ", renormalised" if moe.renormalize else ""
        )
        groups = f", {moe.topk_groups} of {moe.n_groups} groups" if moe.n_groups > 1 else ""
        rows[rows.index(("mlp", "bias", cfg.mlp_bias)) + 1 : 0] = [
            ("mlp", "experts / top-k / width", f"{moe.n_experts} / {moe.top_k} / {moe.d_expert}"),
            ("mlp", "routing / scale", f"{route}{groups} / {moe.routed_scale:g}"),
            ("mlp", "selection bias / shared", f"{moe.selection_bias} / {moe.shared_width or None}"
             + (" (sigmoid gate)" if moe.shared_gate else "")),
            ("mlp", "MoE layers", "all" if cfg.layer_moe is None else cfg.layer_moe),
        ]  # fmt: skip
    if hasattr(cfg, "pool"):  # a ViT-style classifier: its ends instead of a token vocabulary
        rows = [r for r in rows if r[0] != "embedding/head"]
        pool = cfg.pool.value
        rows.append(("embedding/head", "image / patch / pool / classes",
                     f"{cfg.image_size} / {cfg.patch_size} / {pool} / {cfg.num_classes}"))  # fmt: skip
    return [{"part": a, "field": b, "value": c} for a, b, c in rows]


def _link_rows(p: Any) -> list[dict[str, object]]:
    links = p.links
    return [
        {"what": "our parameters linked", "count": len(links)},
        {"what": "rows of a fused projection", "count": sum(lk.rows is not None for lk in links)},
        {"what": "transposed (Conv1D)", "count": sum(lk.transpose for lk in links)},
        {"what": "tied (one source tensor under two names)", "count": sum(len(lk.theirs) > 1 for lk in links)},
        {"what": "source buffers with no parameter of ours", "count": len(p.buffers)},
        {"what": "source parameters the forward never reads (not ported)", "count": len(p.unused)},
    ]  # fmt: skip


def check_rows(hf: Any, ours: Any, seed: int = 5) -> list[dict[str, object]]:
    """fp32 max abs differences of the logits and of every linked parameter's gradient, on a seeded batch, and the
    same relative to each reference tensor's largest |value| (the backward seeds every logit, so gradients are
    large and their fp32 rounding is judged against their own size)."""
    import torch

    from ..port import example_batch, to_hf_state_dict

    g = torch.Generator().manual_seed(seed)
    batch = example_batch(hf, 2, seed)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    ref, got = hf(**batch).logits, ours(next(iter(batch.values())))
    up = torch.randn(ref.shape, generator=g)
    (ref * up).sum().backward()
    (got * up).sum().backward()
    grads = {n: q.grad for n, q in ours.named_parameters(remove_duplicate=False) if q.grad is not None}
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    mapped = to_hf_state_dict(ours, None, grads)
    pairs = [(v, hf_params[k].grad) for k, v in mapped.items()]
    worst = max((float((v - r).abs().max()) for v, r in pairs), default=0.0)
    rel = max((float((v - r).abs().max() / r.abs().max().clamp_min(1e-30)) for v, r in pairs), default=0.0)
    logit_diff = float((ref - got).abs().max())
    return [
        {"compared": "logits", "tensors": 1, "max_abs_diff": logit_diff,
         "max_rel_diff": logit_diff / max(float(ref.abs().max()), 1e-30)},
        {"compared": "gradients", "tensors": len(mapped), "max_abs_diff": worst, "max_rel_diff": rel},
    ]  # fmt: skip


def port_cmd(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    with progress.phase("loading the port"):
        from ..port import PortError, port
    hf, label = _build(args.target)
    try:
        with progress.phase(f"recording and porting {args.target}"):
            p, ours = port(hf)
    except PortError as exc:
        rows = [{"missing": m} for m in exc.missing]
        emit([Section("refused", rows, f"{label}: cannot port into our Block")], args.format)
        return 1
    sections = [
        Section("design", _design_rows(p.config), f"{label}: derived design (logits within {p.max_abs_diff:.2g})",
                group="part"),
        Section("links", _link_rows(p), "parameter mapping"),
    ]  # fmt: skip
    if args.check:
        with progress.phase("comparing logits and gradients"):
            sections.append(Section("check", check_rows(hf, ours), "fp32 check against transformers"))
    emit(sections, args.format)
    return 0
