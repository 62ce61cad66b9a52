"""The token batch a (tiny) text model reads: ids in its vocabulary, a decoder batch beside them for an
encoder-decoder, and a speech encoder's float features in the first layout that runs."""

from __future__ import annotations

import contextlib
import inspect as pyinspect
from typing import Any

import torch
from torch import nn

__all__ = ["example_inputs"]

# Config fields that state a feature input's channels (an audio encoder's mel bins or filterbank features), tried
# as the channel axis of a float main input; the layout that runs is kept.
_FEATURE_CHANNELS = ("num_mel_bins", "input_feat_per_channel", "feature_size", "num_channels", "input_dim")


def example_inputs(model: nn.Module, seq: int = 8, seed: int = 0) -> dict[str, Any]:
    """A token batch ``{"input_ids": (1, seq)}`` valid for the model's vocabulary; a model whose ``forward`` takes
    ``decoder_input_ids`` (an encoder-decoder) gets a decoder batch beside it, of the same length (both stacks'
    streams then have one shape; a reader of two shapes is :func:`.residual.find_stream`'s)."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", 128)
    gen = torch.Generator().manual_seed(seed)
    high = max(4, min(int(vocab or 128), 1000))
    inputs: dict[str, Any] = {"input_ids": torch.randint(3, high, (1, seq), generator=gen)}
    with contextlib.suppress(TypeError, ValueError):
        params = pyinspect.signature(model.forward).parameters
        if "decoder_input_ids" in params:
            inputs["decoder_input_ids"] = torch.randint(3, high, (1, seq), generator=gen)
        if "use_cache" in params:
            inputs["use_cache"] = False
        main = getattr(model, "main_input_name", "input_ids")
        if main != "input_ids" and main in params and "decoder_input_ids" in params:  # a speech encoder's features
            features = _feature_input(model, main, {k: v for k, v in inputs.items() if k != "input_ids"}, gen)
            if features is not None:
                inputs = {
                    main: features,
                    **{k: v for k, v in inputs.items() if k != "input_ids"},
                }  # hybrid / linear-attention caches need not be built to read the design
    return inputs


def _feature_input(model: nn.Module, name: str, rest: dict[str, Any], gen: torch.Generator) -> torch.Tensor | None:
    """A float main input (``input_features``) in the first layout that runs: ``(1, C, L)`` or ``(1, L, C)``, C a
    channel count its config states (:data:`_FEATURE_CHANNELS`, times ``input_channels`` where it has one), L twice
    or once the encoder's ``max_source_positions`` (Whisper reads exactly that many frames), else 64 frames."""
    cfg = getattr(model, "config", None)
    sub = getattr(cfg, "encoder_config", None) or getattr(cfg, "encoder", None)
    confs = [c for c in (cfg, sub) if c is not None and hasattr(c, "to_dict")]
    chans = [v for c in confs for k in _FEATURE_CHANNELS if type(v := getattr(c, k, None)) is int and v > 0]
    chans += [v * k for c in confs if type(v := getattr(c, "input_feat_per_channel", None)) is int
              if type(k := getattr(c, "input_channels", None)) is int and k > 1]  # fmt: skip
    src = [v for c in confs if type(v := getattr(c, "max_source_positions", None)) is int and 0 < v <= 512]
    lengths = [m * src[0] for m in (2, 1)] if src else []
    for c in dict.fromkeys(chans):
        for n in dict.fromkeys([*lengths, 64]):
            for shape in ((1, c, n), (1, n, c)):
                x = torch.randn(shape, generator=gen)
                try:
                    with torch.no_grad():
                        model(**{name: x}, **rest)
                except Exception:
                    continue
                return x
    return None
