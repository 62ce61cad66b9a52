"""The proof: the model before and after, on the same probe inputs, in float64 and the working dtype.

Reports the maximum absolute error, the maximum error relative to the largest reference
output (``max|a - b| / max|b|``), top-1 agreement over the last axis when the output is
LM logits, and the minimum row cosine when an embedding head is given. A check passes
when ``max_rel`` is within the tolerance set for its dtype.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .report import Check, Surgery

__all__ = [
    "DEFAULT_TOLERANCE",
    "Tolerance",
    "analysis_copy",
    "compare",
    "model_dtype",
    "model_inputs",
    "model_output",
    "probe_inputs",
    "run_checks",
]

Head = Callable[[Tensor, dict[str, Any]], Tensor]


# Default largest ``max_rel`` by dtype: (float64 check, by the *stored* dtype; working-dtype check, by the working
# dtype). A transformation of a 16-bit checkpoint rounds every rewritten tensor to that dtype, so even the float64
# check measures that rounding (a few ulps of the stored dtype; tiny 16-bit models measure up to ~2.6e-3 in
# bfloat16, ~5e-4 in float16, on the float64 check, and ~1.2e-2 / ~1.3e-3 in the working dtype).
DEFAULT_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-5, 1e-5),
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (2.5e-3, 5e-3),
}


@dataclass(frozen=True)
class Tolerance:
    """Largest allowed ``max_rel`` per dtype (float64 and the working dtype)."""

    float64: float = 1e-5
    working: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("float64", "working"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
                raise ValueError(f"tolerance {name}={v!r} must be a positive finite number")

    @classmethod
    def default(
        cls,
        stored: torch.dtype,
        working: torch.dtype,
        *,
        float64: float | None = None,
        working_tol: float | None = None,
    ) -> Tolerance:
        """The defaults of :data:`DEFAULT_TOLERANCE` for a checkpoint stored in ``stored`` and checked in
        ``working`` (the working one never tighter than the float64 one), each overridden where given."""
        t64 = DEFAULT_TOLERANCE.get(stored, DEFAULT_TOLERANCE[torch.float32])[0]
        # a check in a wider working dtype still sees the stored rounding: never tighter than the float64 one
        tw = max(DEFAULT_TOLERANCE.get(working, DEFAULT_TOLERANCE[torch.float32])[1], t64)
        return cls(t64 if float64 is None else float64, tw if working_tol is None else working_tol)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype holding most of ``model``'s parameters and buffers (float32 when none is floating)."""
    from ..checkpoint import storage_dtype

    tensors = [*model.parameters(), *model.buffers()]
    return storage_dtype(tensors) or torch.float32


def analysis_copy(model: nn.Module) -> tuple[nn.Module, dict[str, torch.dtype]]:
    """(the model to analyse and transform, every tensor's stored dtype). A model holding 16-bit tensors is
    analysed in a float32 copy (measuring a norm's behaviour in bfloat16 misreads it); pass the transformed
    :class:`Surgery` to :meth:`Surgery.restore_dtypes` with the dtypes before verifying and writing, so every
    tensor is written in its own dtype and the proof measures the rounding."""
    state = model.state_dict()
    dtypes = {k: v.dtype for k, v in state.items()}
    if any(v.dtype in (torch.bfloat16, torch.float16) for v in state.values()):
        return copy.deepcopy(model).float().eval(), dtypes
    return model, dtypes


def probe_inputs(model: nn.Module, *, batch: int = 2, length: int = 12, seed: int = 0) -> dict[str, Any]:
    """Seeded probe inputs for a transformers model (token ids or pixels), from its config."""
    config = getattr(model, "config", None)
    gen = torch.Generator().manual_seed(seed)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, channels, 32, 32, generator=gen)}
    vocab = getattr(config, "vocab_size", None) if config is not None else None
    if vocab is None:
        raise ValueError("probe inputs need a transformers config with vocab_size; pass example inputs instead")
    return model_inputs(model, torch.randint(0, vocab, (batch, length), generator=gen))


def model_inputs(model: nn.Module, ids: Tensor) -> dict[str, Any]:
    """``input_ids`` (with an all-ones attention mask and ``use_cache=False`` where the forward takes them)."""
    inputs: dict[str, Any] = {"input_ids": ids}
    params = inspect.signature(model.forward).parameters
    if "attention_mask" in params:
        inputs["attention_mask"] = torch.ones_like(ids)
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def model_output(model: nn.Module, inputs: Any) -> tuple[Tensor, bool]:
    """Run ``model`` and return (the output tensor, whether it is LM logits)."""
    with torch.no_grad():
        out = (
            model(**inputs)
            if isinstance(inputs, dict)
            else model(*inputs)
            if isinstance(inputs, tuple)
            else model(inputs)
        )
    if isinstance(out, Tensor):
        return out, False
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits, True
    for key in ("last_hidden_state", "pooler_output"):
        value = getattr(out, key, None)
        if isinstance(value, Tensor):
            return value, False
    first = out[0] if isinstance(out, (tuple, list)) else out.to_tuple()[0]
    return first, False


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, dict):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(_cast_inputs(v, dtype) for v in inputs)
    if isinstance(inputs, Tensor) and inputs.is_floating_point():
        return inputs.to(dtype)
    return inputs


def _as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` in ``dtype``: itself when already there, else a cast copy (the original is untouched)."""
    if all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return model.eval()
    return copy.deepcopy(model).to(dtype).eval()


def _reference(before: nn.Module, inputs: Any, dtype: torch.dtype, head: Head | None) -> tuple[Tensor, bool]:
    x = _cast_inputs(inputs, dtype)
    ref, is_lm = model_output(_as(before, dtype), x)
    return (head(ref, x) if head is not None else ref), is_lm


def compare(
    before: nn.Module,
    after: nn.Module,
    inputs: Any,
    dtype: torch.dtype,
    *,
    label: str = "runtime",
    tol: float = 1e-4,
    head: Head | None = None,
    reference: tuple[Tensor, bool] | None = None,
) -> Check:
    """One check: both models in ``dtype`` (cast copies where needed), same inputs."""
    ref, is_lm = reference if reference is not None else _reference(before, inputs, dtype, head)
    x = _cast_inputs(inputs, dtype)
    out, _ = model_output(_as(after, dtype), x)
    if head is not None:
        out = head(out, x)
    ref64, out64 = ref.double(), out.double()
    max_abs = float((out64 - ref64).abs().max())
    max_rel = max_abs / max(float(ref64.abs().max()), torch.finfo(torch.float64).tiny)
    top1 = float((out64.argmax(-1) == ref64.argmax(-1)).double().mean()) if is_lm else None
    min_cos = None
    if head is not None:
        r2, o2 = ref64.reshape(-1, ref64.shape[-1]), out64.reshape(-1, out64.shape[-1])
        min_cos = float(torch.nn.functional.cosine_similarity(r2, o2, dim=-1).min())
    ok = bool(torch.isfinite(out64).all()) and max_rel <= tol
    return Check(label, str(dtype).replace("torch.", ""), max_abs, max_rel, top1, min_cos, ok, tol)


def run_checks(
    before: nn.Module,
    surgery: Surgery,
    inputs: Any,
    *,
    tolerance: Tolerance | None = None,
    working_dtype: torch.dtype | None = None,
    head: Head | None = None,
    runtime: nn.Module | None = None,
) -> Surgery:
    """Attach the proof to ``surgery``: runtime (swapped) model, the saved structure when it is
    meant to be stock-equivalent, and the deferred-normalisation runtime when :func:`.fold.fold_gains`
    deferred any norm, each in float64 and the working dtype (all must pass for ``surgery.passed``).

    The working dtype defaults to ``before``'s own (:func:`model_dtype`: the checkpoint's), the tolerance to
    :meth:`Tolerance.default` for those dtypes. For a 16-bit checkpoint transformed in an :func:`analysis_copy`,
    call :meth:`Surgery.restore_dtypes` first, so the proof measures the tensors as they will be written."""
    wdtype = working_dtype or model_dtype(before)
    tol = tolerance or Tolerance.default(model_dtype(before), wdtype)
    targets = [("runtime", runtime if runtime is not None else surgery.runtime())]
    if surgery.stock_equivalent and surgery.swaps:
        targets.append(("stock", surgery.stock))
    if surgery.deferred:
        from .fold import deferred_runtime

        targets.append(("deferred", deferred_runtime(surgery)))
    surgery.checks = []
    for dtype, t in ((torch.float64, tol.float64), (wdtype, tol.working)):
        ref = _reference(before, inputs, dtype, head)
        for label, model in targets:
            surgery.checks.append(compare(before, model, inputs, dtype, label=label, tol=t, head=head, reference=ref))
    order = {label: i for i, (label, _) in enumerate(targets)}
    surgery.checks.sort(key=lambda c: order[c.model])
    return surgery
