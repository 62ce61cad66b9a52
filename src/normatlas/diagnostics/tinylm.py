"""A tiny seeded Pre-LN causal LM with a QK-norm switch, for provoking attention entropy collapse.

Shape follows nanoGPT (Karpathy, ``model.py``) shrunk to seconds on a CPU: token +
position embeddings, ``n_layer`` Pre-LN blocks (RMSNorm -> causal self-attention via
``F.scaled_dot_product_attention``, RMSNorm -> GELU MLP), a final RMSNorm and a head
tied to the embedding. ``qk_norm=True`` puts a per-head RMSNorm on q and k after the
projections (Dehghani et al. 2023, ViT-22B; OLMo 2, Gemma 3), which bounds the
attention logits by ``sqrt(head_dim) * |g_q| * |g_k|`` and prevents entropy collapse.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..presets import RMSNorm

__all__ = ["TinyLM", "bag_batches", "collapse_experiment"]


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, qk_norm: bool) -> None:
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.q_norm = RMSNorm(self.d_head) if qk_norm else None
        self.k_norm = RMSNorm(self.d_head) if qk_norm else None

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.n_head, self.d_head)
        k = self.k(x).view(b, t, self.n_head, self.d_head)
        v = self.v(x).view(b, t, self.n_head, self.d_head)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, qk_norm: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = _Attention(d_model, n_head, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """``TinyLM(vocab_size, d_model, n_layer, n_head, block_size, qk_norm)``; ``forward(ids) -> logits``."""

    def __init__(
        self,
        vocab_size: int = 64,
        d_model: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        block_size: int = 32,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(block_size, d_model))
        self.blocks = nn.ModuleList(_Block(d_model, n_head, qk_norm) for _ in range(n_layer))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def bag_batches(
    steps: int, batch: int = 16, seq: int = 32, vocab: int = 64, k: int = 4, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """Seeded ``(input, target)`` batches: each sequence draws uniformly from its own ``k`` tokens.

    The best next-token prediction is the empirical distribution of the prefix, i.e.
    *uniform* attention over it, so a low attention entropy here is pathological: a
    clean test bed for entropy collapse (optimal loss tends to ``log k``).
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sets = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(batch)])
        ids = sets.gather(1, torch.randint(k, (batch, seq + 1), generator=g))
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def lm_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, monitor: Any = None) -> Tensor:
    """One next-token training step: cross-entropy of ``model(x)`` against ``y``, backward, ``monitor.step``
    (when given, between backward and the optimizer step, where it reads gradients), optimizer step, zero grad."""
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    if monitor is not None:
        monitor.step(loss=loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def collapse_experiment(
    qk_norm: bool,
    *,
    steps: int = 160,
    peak_lr: float = 0.1,
    warmup: int = 100,
    batch: int = 32,
    every: int = 2,
    spike_margin: float = 0.2,
    seed: int = 0,
) -> dict[str, Any]:
    """Train :class:`TinyLM` on :func:`bag_batches` at a high learning rate under a :class:`Monitor`.

    AdamW (betas 0.9/0.95, no decay), linear warmup to ``peak_lr``. The loss spike is
    the first step where the EMA(0.1) of the loss exceeds its running minimum by
    ``spike_margin`` nats. Returns the first entropy-collapse alarm step (None if none),
    the spike step (None if none), the losses and the monitor.
    """
    from .monitor import Monitor

    torch.manual_seed(seed)
    model = TinyLM(qk_norm=qk_norm)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warmup))
    mon = Monitor(
        model, every=every, optimizer=opt, metrics=["attention", "output_norm", "grad_norm"], print_alarms=False
    )
    losses: list[float] = []
    ema, best, spike = None, float("inf"), None
    for i, (x, y) in enumerate(bag_batches(steps, batch=batch, seed=seed)):
        loss = lm_step(model, opt, x, y, mon)
        sched.step()
        losses.append(float(loss.detach()))
        ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
        if spike is None and ema > best + spike_margin:
            spike = i
        best = min(best, ema)
    mon.detach()
    collapse = [e.step for e in mon.events if e.alarm == "entropy-collapse"]
    return {"alarm_step": min(collapse) if collapse else None, "spike_step": spike, "losses": losses, "monitor": mon}
