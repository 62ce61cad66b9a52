"""The norm-gradient pitfall under sequence parallelism: find it, and reduce it.

A norm in a sequence-parallel region sees only this rank's tokens, so its weight's gradient on each rank is a
partial sum. DTensor records that honestly: the gradient of a ``Replicate`` weight comes back as a ``Partial``
DTensor, and its ``.to_local()`` is the un-reduced local piece. Code that reads local values (gradient clipping,
fused optimizers, a monitor's gradient norms) then sees the wrong numbers, and any update computed from them
lets the replicas drift apart (the failure users filed against Megatron-LM and TransformerEngine).

* :func:`reduce_partial_grads` redistributes every pending gradient to its parameter's own placements (one
  all-reduce per bucket of same-mesh, same-dtype gradients, run by DTensor), so every ``.grad`` is final before
  anything reads it. Call it after
  ``backward()`` and before clipping / the optimizer / the monitor.
* :func:`full_grads` lends code written for plain tensors (our ``Monitor``'s gradient norms, a hand-written
  clipping loop) the full gradients of a sharded model for the length of a ``with`` block.
* :func:`check_replicas` names every parameter whose gradient is still pending or whose replicas (parameter or
  gradient) differ across the ranks that should hold the same values.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

__all__ = ["Finding", "Problem", "check_replicas", "coalesce_partial", "full_grads", "reduce_partial_grads"]


class Problem(enum.Enum):
    PARTIAL_GRAD = "partial_grad"  # the gradient is a pending (un-reduced) sum over ranks
    PARAM_DIFFERS = "param_differs"  # a replicated parameter holds different values on different ranks
    GRAD_DIFFERS = "grad_differs"  # a replicated, reduced gradient differs across ranks


@dataclass(frozen=True)
class Finding:
    """One parameter with one problem; ``max_diff`` the largest |difference| between ranks (0 for PARTIAL_GRAD)."""

    name: str
    problem: Problem
    placements: str
    max_diff: float

    def __str__(self) -> str:
        tail = "" if self.problem is Problem.PARTIAL_GRAD else f" (max |diff| {self.max_diff:.3g})"
        return f"{self.name}: {self.problem.value} [{self.placements}]{tail}"


def _is_partial(t: Tensor | None) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Partial) for p in t.placements)


def reduce_partial_grads(model: nn.Module) -> list[str]:
    """Reduce every pending (``Partial``) gradient of ``model`` to its parameter's placements, in place.

    Returns the names of the parameters it reduced (the sequence-parallel norm weights and residual gates, under
    :func:`~normatlas.distributed.parallelize`). Gradients already final are left alone (no collective). The
    pending gradients are tiny (a norm weight is one row), so they are reduced in buckets: every gradient with
    the same mesh, placements and dtype is flattened into one buffer that DTensor all-reduces once, and the
    buffer's slices become the gradients (:func:`coalesce_partial`); a gradient that is also sharded on some mesh
    dim is redistributed alone.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={model!r} must be an nn.Module")
    buckets: dict[tuple[Any, ...], list[DTensor]] = {}
    done = []
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor) and _is_partial(g) and isinstance(p, DTensor):
            done.append(name)
            if all(isinstance(pl, (Partial, Replicate)) for pl in (*g.placements, *p.placements)):
                buckets.setdefault((g.device_mesh, g.placements, p.placements, g.dtype), []).append(p)
            else:
                p.grad = g.redistribute(p.device_mesh, p.placements)
    for (_mesh, _pending, placements, _dtype), params in buckets.items():
        coalesce_partial(params, placements)
    return done


def coalesce_partial(params: list[DTensor], placements: tuple[Placement, ...]) -> None:
    """Reduce the ``Partial`` gradients of ``params`` (one mesh, placements and dtype, no Shard) with one
    collective: their local pieces concatenated into one DTensor with the same placements, redistributed to
    ``placements`` by DTensor, and split back (each gradient keeps its shape and becomes ``placements``)."""
    grads = [cast(DTensor, p.grad) for p in params]
    pieces = [g.to_local() for g in grads]
    mesh = grads[0].device_mesh
    whole = DTensor.from_local(torch.cat([t.reshape(-1) for t in pieces]), mesh, grads[0].placements, run_check=False)
    reduced = whole.redistribute(mesh, placements).to_local().split([t.numel() for t in pieces])
    for p, g, local, part in zip(params, grads, pieces, reduced, strict=True):
        p.grad = DTensor.from_local(
            part.view(local.shape), mesh, placements, run_check=False, shape=g.shape, stride=g.stride()
        )


def _spread(local: Tensor, group: dist.ProcessGroup) -> float:
    """The largest |difference| between this rank's ``local`` and any other rank's, over ``group`` (all ranks)."""
    n = dist.get_world_size(group)
    flat = local.detach().reshape(-1).to(torch.float64).contiguous()
    out = torch.empty(n * flat.numel(), dtype=flat.dtype)
    dist.all_gather_single(out, flat, group=group)
    parts = out.reshape(n, -1)
    return float((parts - parts[0]).abs().max()) if flat.numel() else 0.0


def _replica_groups(t: Tensor, default: dist.ProcessGroup | None) -> list[tuple[str, dist.ProcessGroup]]:
    """The process groups over which ``t`` is meant to be identical: its mesh's Replicate dims (a DTensor) or
    ``default`` (a plain tensor, e.g. under DDP)."""
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        return [(f"mesh dim {i}", mesh.get_group(i)) for i, p in enumerate(t.placements) if isinstance(p, Replicate)]
    return [] if default is None else [("group", default)]


def check_replicas(
    model: nn.Module, *, group: dist.ProcessGroup | None = None, atol: float = 0.0, grads: bool = True
) -> list[Finding]:
    """Every parameter of ``model`` whose gradient is pending or whose replicas differ by more than ``atol``.

    A collective call: every rank must call it, with the same model structure. DTensor parameters are compared
    over the mesh dims they are replicated on; plain parameters over ``group`` (None: not compared, since a plain
    tensor under tensor parallelism is a rank-local value; pass the data-parallel group under DDP).
    ``grads=False`` compares the parameters only. Returns findings in ``named_parameters`` order (empty: all well).
    """
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0:
        raise ValueError(f"atol={atol!r} must be a float >= 0")
    findings = []
    for name, p in model.named_parameters():
        where = ",".join(str(x) for x in p.placements) if isinstance(p, DTensor) else "plain"
        if grads and _is_partial(p.grad):
            findings.append(Finding(name, Problem.PARTIAL_GRAD, where, 0.0))
        for _, g in _replica_groups(p, group):
            local = p.to_local() if isinstance(p, DTensor) else p
            d = _spread(local, g)
            if d > atol:
                findings.append(Finding(name, Problem.PARAM_DIFFERS, where, d))
            grad = p.grad
            if grads and grad is not None and not _is_partial(grad):
                gl = grad.to_local() if isinstance(grad, DTensor) else grad
                d = _spread(gl, g)
                if d > atol:
                    findings.append(Finding(name, Problem.GRAD_DIFFERS, where, d))
    return findings


@contextlib.contextmanager
def full_grads(model: nn.Module) -> Iterator[list[str]]:
    """Inside the block every DTensor gradient of ``model`` is its full plain tensor; the DTensors return on exit.

    For code that reads ``.grad`` as plain tensors (``Monitor.step()``, ``param_groups``-driven logging) on a
    TP / FSDP model: ``with full_grads(model): monitor.step()``. A collective call (each sharded or pending
    gradient is gathered or reduced by DTensor); yields the names it replaced. Reduce first
    (:func:`reduce_partial_grads`) if the optimizer is to see the reduced gradients too.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={model!r} must be an nn.Module")
    saved: list[tuple[nn.Parameter, Tensor]] = []
    names = []
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            saved.append((p, g))
            p.grad = g.full_tensor()
            names.append(name)
    try:
        yield names
    finally:
        for p, g in saved:
            p.grad = g
