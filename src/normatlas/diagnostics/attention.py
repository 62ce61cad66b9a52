"""Find attention probabilities in any model without editing its code.

Method: a :class:`torch.overrides.TorchFunctionMode` active only while a monitored
block runs intercepts

* ``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa)``:
  the fused kernel never materializes the probabilities, so we recompute
  ``softmax(q k^T * scale + mask)`` from the captured ``q`` and ``k`` (on at most
  ``max_examples`` examples), exactly as SDPA defines it;
* ``softmax(x, dim=-1)`` on a 4-D tensor (eager attention in HF and most code):
  its input is the logits and its output the probabilities.

* flex attention (the ``flex_attention`` higher-order op, which transformers calls compiled):
  ``softmax(score_mod(q k^T * scale))`` where the block mask's ``mask_mod`` allows, recomputed
  the same way; while the mode is active, compiled code runs its Python eagerly (the same
  computation) so that the call is seen.

This covers HF ``sdpa``, ``flex_attention`` and ``eager`` attention, timm and hand-written models
alike. Models that compute attention otherwise (flash-attn kernels) can report through
:meth:`Monitor.record_attention` from a user hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..analysis.attention_calls import evaluate_mask_mod
from ..analysis.ops import op_name
from .metrics import masked_logits

__all__ = ["AttentionCapture", "flex_probs", "sdpa_probs"]

_SOFTMAX = {torch.softmax, F.softmax, Tensor.softmax, torch.special.softmax}
_SDPA = F.scaled_dot_product_attention


def sdpa_probs(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """Attention logits and probabilities as ``F.scaled_dot_product_attention`` computes them.

    ``query`` is ``(..., H, Tq, E)`` and ``key`` ``(..., Hk, Tk, E)``. Returns
    ``(logits, probs)`` in float32, where ``logits`` include an additive float mask and
    are ``-inf`` at masked positions (also where a float mask masks with a finite value, see
    :func:`~normatlas.diagnostics.metrics.masked_logits`); rows with no allowed key get zero
    probabilities.
    ``is_causal`` masks as SDPA does, top-left aligned (``tril(0)``: query ``i`` attends to keys
    ``0..i`` even when ``Tq != Tk``; a KV-cache decode step must pass an explicit mask instead).
    """
    q, k = query.detach().float(), key.detach().float()
    if q.dim() < 2 or k.dim() != q.dim():
        raise ValueError(f"query {tuple(q.shape)} and key {tuple(k.shape)} must have the same rank >= 2")
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(f"query heads {q.shape[-3]} are not a multiple of key heads {k.shape[-3]}")
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    logits = q @ k.transpose(-1, -2) * s
    tq, tk = logits.shape[-2], logits.shape[-1]
    if is_causal:
        # SDPA's is_causal is top-left aligned: query i sees keys 0..i, also when Tq != Tk
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=logits.device).tril(0)
        logits = logits.masked_fill(~allowed, -math.inf)
    masked = None
    if attn_mask is not None:
        m = attn_mask.detach()
        m = m[: logits.shape[0]] if m.dim() == logits.dim() and m.shape[0] > logits.shape[0] else m
        if m.dtype == torch.bool:
            logits = logits.masked_fill(~m, -math.inf)
        else:
            logits, masked = logits + m.float(), masked_logits(m)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # as SDPA, also for rows masked by finite values
    if masked is not None:
        logits = logits.masked_fill(masked, -math.inf)
    return logits, probs


def flex_probs(
    query: Tensor,
    key: Tensor,
    score_mod: Callable[..., Tensor] | None,
    mask_mod: Callable[..., Tensor] | None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention logits and probabilities as flex attention computes them: ``score_mod`` applied to
    ``q k^T * scale`` at every (batch, head, query, key) index, keys ``mask_mod`` refuses at ``-inf``.
    Shapes and dtypes as :func:`sdpa_probs`."""
    logits, _ = sdpa_probs(query, key, None, False, scale, True)
    b, h, t, s = logits.shape
    if score_mod is not None:
        idx = [torch.arange(n).view(*(1,) * i, n, *(1,) * (3 - i)) for i, n in enumerate((b, h, t, s))]
        logits = torch.as_tensor(score_mod(logits, *idx), dtype=torch.float32).expand(b, h, t, s)
    if mask_mod is not None:
        logits = logits.masked_fill(~evaluate_mask_mod(mask_mod, t, s), -math.inf)
    return logits, torch.softmax(logits, dim=-1).nan_to_num(0.0)


class AttentionCapture(TorchFunctionMode):
    """Calls ``callback(probs, logits)`` for every attention computed while the mode is active.

    ``probs`` and ``logits`` are float32 ``(B', H, Tq, Tk)`` with ``B' <= max_examples``; masked
    logits (:func:`~normatlas.diagnostics.metrics.masked_logits`) are ``-inf``.
    The model's own outputs are untouched: the intercepted call runs unchanged.
    """

    def __init__(self, callback: Callable[[Tensor, Tensor | None], None], max_examples: int = 4) -> None:
        super().__init__()
        if max_examples < 1:
            raise ValueError(f"max_examples={max_examples!r} must be >= 1")
        self.callback = callback
        self.max_examples = max_examples

    def __enter__(self):  # type: ignore[no-untyped-def]
        stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6: compiled flex attention seen eagerly
        self._stance = stance("force_eager") if stance is not None and not torch.compiler.is_compiling() else None
        if self._stance is not None:
            self._stance.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        stance, self._stance = getattr(self, "_stance", None), None
        if stance is not None:
            stance.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            if func is _SDPA:
                self._sdpa(*args, **kwargs)
            elif func in _SOFTMAX:
                self._softmax(out, *args, **kwargs)
            elif op_name(func) == "flex_attention" and len(args) >= 6:
                block = args[4]
                mask_mod = block[-1] if isinstance(block, tuple) and block and callable(block[-1]) else None
                n = self.max_examples
                logits, probs = flex_probs(args[0][:n], args[1][:n], args[3], mask_mod, args[5])
                self.callback(probs, logits)
        except (RuntimeError, ValueError, TypeError, IndexError):
            pass  # a diagnostic never breaks the forward pass
        return out

    def _sdpa(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> None:
        n = self.max_examples
        if query.dim() < 4:
            query, key = query.unsqueeze(0), key.unsqueeze(0)
            attn_mask = attn_mask.unsqueeze(0) if attn_mask is not None and attn_mask.dim() >= 3 else attn_mask
        mask = attn_mask[:n] if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[0] > 1 else attn_mask
        logits, probs = sdpa_probs(query[:n], key[:n], mask, bool(is_causal), scale, enable_gqa)
        self.callback(probs, logits)

    def _softmax(self, out: Tensor, input: Tensor, dim: int | None = None, *args: object, **kwargs: object) -> None:
        if not isinstance(out, Tensor) or out.dim() != 4 or dim not in (-1, 3):
            return
        n = self.max_examples
        logits = input[:n].detach()
        self.callback(out[:n].detach().float(), logits.float().masked_fill(masked_logits(logits), -math.inf))
