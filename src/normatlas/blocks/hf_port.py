"""Port weights between HF transformers reference models and :class:`TransformerLM` / :class:`ViTEncoder`.

``from_hf(model)`` is the public entry. A language model is ported from its own dataflow by
:mod:`normatlas.port` (imported lazily: ``port`` sits above ``blocks`` in the layers), with no per-family table;
its ``to_hf_state_dict(model)`` reads the links on ``model.hf_port``. The two image classifiers (vit, dinov2)
still go through the declarative key maps of :mod:`normatlas.blocks.keymaps`: ``to_hf_state_dict(model,
"vit")`` applies their rules backwards. Either way every HF parameter must be consumed and every one of ours
filled, and the result loads into the HF class; it also maps any dict with our names (e.g. gradients).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .keymaps import KEYMAPS, KeyMap, Rule
from .model import TransformerLM, ViTConfig, ViTEncoder

__all__ = ["from_hf", "keymap_for", "to_hf_state_dict"]


def keymap_for(model_type: str) -> KeyMap:
    """The key map registered for HF's ``config.model_type`` (the vision classifiers; language models need none)."""
    if model_type not in KEYMAPS:
        raise ValueError(
            f"model_type={model_type!r} has no key map (only the vision classifiers {', '.join(sorted(KEYMAPS))} "
            "have one; a language model is ported from its dataflow by from_hf)"
        )
    return KEYMAPS[model_type]


def _expand(km: KeyMap, n_layers: int) -> list[Rule]:
    rules = list(km.globals)
    for i in range(n_layers):
        rules += [Rule(r.ours.format(i=i), r.theirs.format(i=i), r.transpose, r.chunks, r.index, r.optional)
                  for r in km.layer]  # fmt: skip
    return rules


def _pull(t: Tensor, r: Rule) -> Tensor:
    if r.transpose:
        t = t.t()
    if r.chunks > 1:
        t = t.chunk(r.chunks, dim=0)[r.index]
    return t


def _ignored(km: KeyMap, key: str) -> bool:
    return any(key.endswith(s) for s in km.ignore)


def from_hf(hf_model: nn.Module, *, keymap: KeyMap | None = None) -> TransformerLM | ViTEncoder:
    """Build a :class:`TransformerLM` (derived from the model's dataflow by :func:`normatlas.port.from_hf`) or a
    :class:`ViTEncoder` (a vision classifier's key map) equal to ``hf_model`` (same logits) with its weights."""
    config = getattr(hf_model, "config", None)
    if config is None:
        raise TypeError(f"{type(hf_model).__name__} has no .config; pass an HF PreTrainedModel")
    if keymap is None and config.model_type not in KEYMAPS:
        from ..port import from_hf as derived

        return derived(hf_model)
    km = keymap or keymap_for(config.model_type)
    ours_cfg = km.config(config)
    getter = getattr(hf_model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    pad = getattr(embedding, "padding_idx", None)
    if pad is not None:  # read from the module, which is what decides the gradient
        ours_cfg = ours_cfg.with_(pad_token_id=pad)
    model = ViTEncoder(ours_cfg) if isinstance(ours_cfg, ViTConfig) else TransformerLM(ours_cfg)
    theirs = hf_model.state_dict()
    ours = model.state_dict()
    filled: dict[str, Tensor] = {}
    used: set[str] = set()
    for r in _expand(km, ours_cfg.n_layers):
        if r.ours not in ours:
            if r.optional:
                if r.theirs in theirs and not _ignored(km, r.theirs):
                    raise ValueError(f"HF has {r.theirs!r} but our model has no {r.ours!r} (config mismatch)")
                continue
            raise ValueError(f"key map rule {r.ours!r} <- {r.theirs!r}: our model has no {r.ours!r}")
        if r.theirs not in theirs:
            raise ValueError(f"key map rule {r.ours!r} <- {r.theirs!r}: HF state dict has no {r.theirs!r}")
        t = _pull(theirs[r.theirs], r)
        if t.shape != ours[r.ours].shape:
            raise ValueError(f"{r.theirs!r} -> {r.ours!r}: shape {tuple(t.shape)} != {tuple(ours[r.ours].shape)}")
        filled[r.ours] = t
        used.add(r.theirs)
    left = [k for k in theirs if k not in used and not _ignored(km, k)]
    if left:
        raise ValueError(f"HF keys not consumed by the {km.model_type!r} key map: {left[:6]}")
    missing = [k for k in ours if k not in filled]
    if missing:
        raise ValueError(f"our keys not filled by the {km.model_type!r} key map: {missing[:6]}")
    model.load_state_dict(filled, strict=True)
    return model.to(dtype=next(hf_model.parameters()).dtype)


def to_hf_state_dict(
    model: TransformerLM | ViTEncoder, model_type: Any = None, tensors: Mapping[str, Tensor] | None = None
) -> dict[str, Any]:
    """Our state dict (or any dict with our names, e.g. gradients) under the HF names: a ported language model's
    (``model_type`` None or its :class:`normatlas.port.Port`), or a vision classifier's key map (``"vit"``)."""
    if not isinstance(model_type, str) or model_type not in KEYMAPS:
        from ..port import to_hf_state_dict as derived

        return derived(model, model_type, tensors)  # type: ignore[arg-type]
    km = keymap_for(model_type)
    src = dict(model.state_dict()) if tensors is None else dict(tensors)
    groups: dict[str, list[tuple[Rule, Tensor]]] = {}
    for r in _expand(km, model.config.n_layers):
        if r.ours not in src:
            if r.optional:
                continue
            raise ValueError(f"no tensor for {r.ours!r} (needed for {r.theirs!r})")
        groups.setdefault(r.theirs, []).append((r, src[r.ours]))
    out: dict[str, Any] = {}
    for key, parts in groups.items():
        r0 = parts[0][0]
        if r0.chunks > 1:
            if len(parts) != r0.chunks:
                raise ValueError(f"{key!r} is fused from {r0.chunks} tensors but {len(parts)} were given")
            t = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0].index)], dim=0)
        else:
            t = parts[0][1]
        out[key] = t.t().contiguous() if r0.transpose else t
    return out
