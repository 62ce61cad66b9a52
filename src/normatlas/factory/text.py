"""Turn a TARGET into (model, example inputs): a transformers model type built tiny from its config class (offline,
random weights: :func:`.shrink.tiny_config`), a local checkpoint folder (config.json + safetensors), or
``module.path:factory``.

Models are built as a user's ``from_config`` / ``from_pretrained`` builds them: with transformers' default
attention implementation (``sdpa`` where the model supports it), unless one is chosen
(:func:`.attention.attention_implementation`, the CLI's ``--attn-implementation``)."""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import PICKLE_SUFFIXES
from .attention import attention_implementation, attention_kwargs, choose_attention
from .fit import build_running
from .inputs import example_inputs
from .shrink import TINY, config_parts, is_encoder_decoder, rederived, tiny_config

__all__ = ["build_target", "model_from_config"]


def model_from_config(cfg: Any) -> nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    if is_encoder_decoder(cfg):  # both stacks: a causal-LM class of an encoder-decoder type is its decoder alone
        for auto in (AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, AutoModel):
            with contextlib.suppress(ValueError, KeyError):
                return auto.from_config(cfg, **attention_kwargs()).eval()
    try:
        model = AutoModelForCausalLM.from_config(cfg, **attention_kwargs())
    except (ValueError, KeyError):
        model = AutoModel.from_config(cfg, **attention_kwargs())
    return model.eval()


def _model_for_checkpoint(cfg: Any) -> nn.Module:
    """The class the checkpoint names in ``config.architectures`` (else the base AutoModel)."""
    import transformers
    from transformers import AutoModel

    for arch in getattr(cfg, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls(cfg).eval()
    return AutoModel.from_config(cfg, **attention_kwargs()).eval()


def _matching(model: nn.Module, state: dict[str, torch.Tensor], none: str) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` that fit ``model`` (by name, with or without its base-model prefix, and shape), under
    the model's own names; a ValueError ``none`` when not one does. Works with meta tensors and models."""
    own = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "")
    remapped = {}
    for k, v in state.items():
        key = k if k in own else f"{prefix}.{k}" if f"{prefix}.{k}" in own else k.split(".", 1)[-1]
        if key in own and own[key].shape == v.shape:
            remapped[key] = v
    if not remapped:
        raise ValueError(none)
    return remapped


def build_target(target: str, seed: int = 0, attn_implementation: str | None = None) -> tuple[nn.Module, Any, str]:
    """(model, example inputs, display name) for a CLI TARGET; a transformers model is built with
    ``attn_implementation`` (None: the one chosen by :func:`attention_implementation`, else transformers' default)."""
    if attn_implementation is not None:
        with attention_implementation(attn_implementation):
            return build_target(target, seed)
    torch.manual_seed(seed)
    path = Path(target)
    if path.is_dir():
        from transformers import AutoConfig

        from ..checkpoint import check_build_memory, header_tensors, locate, on_meta, read_tensors

        ckpt = locate(path, weights=False)  # the one load policy: config.json as JSON, safetensors only
        cfg = AutoConfig.from_pretrained(str(path))
        choose_attention(cfg)
        files = ckpt.files
        meta = on_meta(lambda: _model_for_checkpoint(cfg))  # sizes first: no memory, no initialisation
        if meta is not None:
            if files:
                _matching(meta, header_tensors(ckpt), f"{target}: no tensor in the safetensors files matches the "
                          f"{cfg.model_type} model")  # fmt: skip
            check_build_memory(meta, target, weights=sum(f.stat().st_size for f in files))
        model = _model_for_checkpoint(cfg)
        if files:
            state, _ = read_tensors(ckpt)
            remapped = _matching(model, state, f"{target}: no tensor in the safetensors files matches the "
                                 f"{cfg.model_type} model")  # fmt: skip
            model.load_state_dict(remapped, strict=False)
            loaded = f"{len(remapped)}/{len(model.state_dict())} tensors from {len(files)} safetensors file(s)"
        else:
            loaded = "no safetensors: random weights"
        return model.eval(), example_inputs(model, seed=seed), f"{cfg.model_type} ({path.name}; {loaded})"
    if ":" in target and not path.exists():
        mod_name, _, attr = target.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import {target!r}: {exc}") from exc
        built = factory()
        model, inputs = built if isinstance(built, tuple) else (built, None)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{target} returned {type(model).__name__}, expected an nn.Module or (module, inputs)")
        if inputs is None:
            if hasattr(model, "example_inputs"):
                inputs = model.example_inputs()  # type: ignore[operator]
            elif hasattr(model, "config"):
                inputs = example_inputs(model, seed=seed)
            else:
                raise ValueError(f"{target}: return (module, example_inputs) or give the module example_inputs()")
        return model.eval(), inputs, target
    if path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES:
        from ..checkpoint import locate

        locate(path)  # refuses the pickle with the load policy's message
    if path.exists():
        raise FileNotFoundError(f"{target}: not a folder (need a checkpoint folder with config.json)")
    from transformers import AutoConfig

    cfg = tiny_config(target)
    orig = AutoConfig.for_model(target)
    parts = list(zip(config_parts(cfg), (p.to_dict() for p in config_parts(orig)), strict=False))
    model = build_running(cfg, parts, set(TINY), model_from_config, _runs, lambda c: _rederived_shrink(c, orig))
    return model, None, target


def _rederived_shrink(cfg: Any, orig: Any) -> Any:
    """``cfg`` built again from its shrunk fields (:func:`rederived`), keeping what the shrink set: the sizes of
    :data:`TINY` (under the names the config's ``attribute_map`` gives them) and the per-layer lists it cut."""
    aliases = getattr(cfg, "attribute_map", {}) or {}
    was = orig.to_dict()
    cut = {k for k, v in cfg.to_dict().items() if isinstance(v, list) and v != was.get(k)}
    return rederived(cfg, orig, set(TINY) | {aliases[k] for k in TINY if k in aliases} | cut)


def _runs(model: nn.Module) -> bool:
    """Whether ``model`` runs one forward on its example inputs."""
    try:
        with torch.no_grad():
            model(**example_inputs(model))
    except Exception:
        return False
    return True
