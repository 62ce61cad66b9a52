"""Cross-example dependence: "does output i depend on example j?" for any model.

The essay's BatchNorm failure mode 4: in training mode BatchNorm's prediction for
example i depends on examples j != i (the model can cheat by reading batch
statistics). :func:`cross_example_dependence` measures it by perturbation: change
example ``j`` only and report how much every other example's output moves. Per-sample
models (LayerNorm, RMSNorm, GroupNorm, BN in eval mode) give exactly zero up to
floating-point batching noise. Every forward runs with the same random seed (the RNG of
the CPU and of the model's devices is forked, so the caller's RNG is left as it was), so
dropout draws the same masks each time and a model in train mode is judged by its
arithmetic, not by fresh dropout noise. All parameters and buffers (BN running statistics)
are restored afterwards, so the check is safe mid-training. The output compared is found by structure: the
first tensor whose leading dim is the batch (logits, a last hidden state, a plain output), never by a field name.

This module owns that check and :func:`fork_model_rng`, the RNG fork every diagnostic's extra forward runs under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn

from .metric_base import tensors

__all__ = ["Dependence", "cross_example_dependence", "fork_model_rng"]


@dataclass(frozen=True)
class Dependence:
    leak: float  # max |change of output i != j| / max |output|, over probed j
    passed: bool  # leak <= tol
    tol: float
    probed: tuple[int, ...]

    def __str__(self) -> str:
        verdict = "independent" if self.passed else "DEPENDS on other examples"
        return f"cross-example check: {verdict} (relative leak {self.leak:.3g}, tol {self.tol:g})"


@contextlib.contextmanager
def fork_model_rng(model: nn.Module, seed: int | None = None) -> Iterator[None]:
    """Fork the RNG of the CPU and of every accelerator holding ``model``'s parameters or buffers
    (restored on exit); with ``seed``, seed them all inside."""
    devices: dict[str, set[int]] = {}
    for t in chain(model.parameters(), model.buffers()):
        if t.device.type not in ("cpu", "meta"):
            devices.setdefault(t.device.type, set()).add(t.device.index or 0)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator
        for kind, idx in devices.items():
            stack.enter_context(torch.random.fork_rng(devices=sorted(idx), device_type=kind))
        if seed is not None:  # only the forked generators: other devices' RNG is left alone
            torch.default_generator.manual_seed(seed)
            for kind, idx in devices.items():
                mod = torch.get_device_module(kind)
                gens = getattr(mod, "default_generators", None)
                for i in idx:
                    if gens is not None:
                        gens[i].manual_seed(seed)
                    else:
                        mod.manual_seed(seed)
        yield


def _outputs(out: Any, batch: int) -> Tensor:
    """The model's per-example output, read by structure (never by attribute names): the first tensor of ``out``
    (depth first through tuples, lists, mappings and dataclasses) whose leading dim is the batch."""
    found = next((t for t in tensors(out, floating=None) if t.dim() >= 1 and t.shape[0] == batch), None)
    if found is None:
        raise TypeError(
            f"model output of type {type(out).__name__} holds no tensor with the batch of {batch} to compare"
        )
    return found


def _perturb(x: Tensor, j: int, gen: torch.Generator, vocab: int | None) -> Tensor:
    y = x.clone()
    if x.is_floating_point():
        y[j] = y[j] + torch.randn(y[j].shape, generator=gen).to(y) * (float(x.float().std()) + 1.0)
    else:
        hi = vocab if vocab is not None else int(x.max()) + 1
        y[j] = torch.randint(max(hi, 2), y[j].shape, generator=gen).to(y)
    return y


def cross_example_dependence(
    model: nn.Module,
    inputs: Tensor,
    *,
    probes: int = 2,
    tol: float = 1e-5,
    vocab_size: int | None = None,
    seed: int = 0,
) -> Dependence:
    """Perturb example ``j`` of ``inputs`` (batch-first) and measure the change of the others.

    Args:
        model: called as ``model(inputs)``; its mode (train/eval) is used as is.
        inputs: a batch with at least 2 examples: float features or integer token ids.
        probes: how many examples ``j`` to perturb (the first ``probes``).
        tol: the relative change above which the model is declared dependent.
        vocab_size: range for replacement token ids (default ``max(inputs) + 1``).
        seed: seeds the perturbations and, identically before every forward, the RNG (dropout).
    """
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
    if inputs.dim() < 1 or inputs.shape[0] < 2:
        raise ValueError(f"inputs has shape {tuple(inputs.shape)}; the batch dimension must hold >= 2 examples")
    if probes < 1:
        raise ValueError(f"probes={probes!r} must be >= 1")
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    leak = 0.0
    probed = tuple(range(min(probes, inputs.shape[0])))
    try:
        with torch.no_grad():
            with fork_model_rng(model, seed):
                base = _outputs(model(inputs), inputs.shape[0]).float()
            scale = float(base.abs().max()) + 1e-12
            for j in probed:
                model.load_state_dict(saved)
                perturbed = _perturb(inputs, j, gen, vocab_size)
                with fork_model_rng(model, seed):
                    out = _outputs(model(perturbed), inputs.shape[0]).float()
                others = [i for i in range(base.shape[0]) if i != j]
                leak = max(leak, float((out[others] - base[others]).abs().max()) / scale)
    finally:
        model.load_state_dict(saved)
    return Dependence(leak, leak <= tol, tol, probed)
