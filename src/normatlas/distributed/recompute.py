"""Selective activation checkpointing that stores the matmuls' and attention's outputs and recomputes the norms.

Essay rule 9: "under activation checkpointing, norms are the canonical thing to recompute rather than store -
cheap FLOPs, large activation". :func:`norm_recompute_policy` is a policy for
``torch.utils.checkpoint.create_selective_checkpoint_contexts``: outputs of matrix products and attention kernels
are saved (``MUST_SAVE``: expensive to recompute), norms (``native_layer_norm``, ``rms_norm``, our fused ops) are
``MUST_RECOMPUTE``, everything else (pointwise ops, softmax, views) ``PREFER_RECOMPUTE``. Our fused CPU kernels run
as one C++ autograd function inside the checkpointed region, so they are recomputed whole in the backward.

:func:`checkpoint_blocks` wraps each block with it; :func:`block_activation_bytes` measures what a block keeps for
the backward: autograd's saved tensors through ``saved_tensors_hooks`` without checkpointing, and, under the
policy, the outputs it stores plus the block's input, recorded by a dispatch mode applying the same policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

__all__ = ["SAVE_OPS", "ActivationBytes", "block_activation_bytes", "checkpoint_blocks", "norm_recompute_policy"]

_aten = torch.ops.aten
SAVE_OPS = frozenset(
    op for op in (
        _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_efficient_attention,
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    ) if op is not None
)  # fmt: skip
"""Op packets whose outputs the policy stores: the matrix products and fused attention kernels."""

NORM_OPS = frozenset(
    op
    for op in (_aten.native_layer_norm, getattr(_aten, "_fused_rms_norm", None), _aten.native_group_norm)
    if op is not None
)
"""Op packets the policy always recomputes (plus the ``normatlas::`` fused ops)."""


def norm_recompute_policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul / attention outputs, recompute norms (and anything else cheap); see the module docstring."""
    packet = getattr(op, "_overloadpacket", op)
    if packet in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    if packet in NORM_OPS or str(getattr(op, "_schema", "")).startswith("normatlas::"):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(policy: Callable[..., CheckpointPolicy]) -> Any:
    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(
    model: nn.Module,
    policy: Callable[..., CheckpointPolicy] = norm_recompute_policy,
    blocks: Sequence[str] | None = None,
) -> nn.Module:
    """Checkpoint every block of ``model`` in place with ``policy`` (default :func:`norm_recompute_policy`).

    ``blocks``: module paths (default: a TransformerLM's ``layers.{i}``). Uses PyTorch's composable
    ``checkpoint(module, context_fn=...)``: the blocks keep their type, names and parameters (non-reentrant
    checkpointing through module hooks), so it composes with ``fully_shard`` and the TP plan.
    """
    if not callable(policy):
        raise TypeError(f"policy={policy!r} must be a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy")
    from torch.distributed._composable import checkpoint as composable_checkpoint

    from .fsdp import _blocks

    for path in _blocks(model, blocks):
        composable_checkpoint(model.get_submodule(path), context_fn=functools.partial(_context_fn, policy))
    return model


@dataclass(frozen=True)
class ActivationBytes:
    """What one block keeps for its backward, in bytes: ``stored`` without checkpointing, ``kept`` under the
    policy (its saved outputs plus the block input), ``saved = stored - kept``; the op names it keeps."""

    stored: int
    kept: int
    kept_ops: tuple[str, ...]

    @property
    def saved(self) -> int:
        return self.stored - self.kept


def _nbytes(tensors: list[Tensor]) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        try:
            key = (int(t.untyped_storage().data_ptr()), int(t.storage_offset()))
        except (RuntimeError, NotImplementedError):
            key = (id(t), 0)
        seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
    return sum(seen.values())


class _PolicyRecorder(TorchDispatchMode):
    def __init__(self, policy: Callable[..., CheckpointPolicy]) -> None:
        super().__init__()
        self.policy, self.kept, self.names = policy, [], []  # type: ignore[var-annotated]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ctx = SelectiveCheckpointContext(is_recompute=False)
        if self.policy(ctx, func, *args, **kwargs) in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            self.kept += [t for t in tree_leaves(out) if isinstance(t, Tensor)]
            self.names.append(str(getattr(func, "_overloadpacket", func).__name__))
        return out


def block_activation_bytes(
    block: nn.Module, *inputs: Any, policy: Callable[..., CheckpointPolicy] = norm_recompute_policy
) -> ActivationBytes:
    """Measure ``block(*inputs)``'s activation memory without checkpointing and under ``policy`` (see module doc).

    Parameters are not activations: tensors autograd saves that are parameters of ``block`` are not counted.
    """
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(*inputs)
    rec = _PolicyRecorder(policy)
    with torch.no_grad(), rec:
        block(*inputs)
    first = [t for t in tree_leaves(inputs) if isinstance(t, Tensor)][:1]
    return ActivationBytes(_nbytes(saved), _nbytes(rec.kept + first), tuple(rec.names))
