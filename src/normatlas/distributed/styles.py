"""The pieces of a tensor + sequence parallel plan: the plan value (:class:`TensorParallelPlan`) and the parallel
styles both plans use, a :class:`~normatlas.blocks.TransformerLM`'s (:mod:`.plan`) and a transformers model's
(:mod:`.hf_plan`): the sequence-sharded stream, a QK-norm on the local heads (:class:`HeadShardedNorm` where its
parameters belong to heads), the row-parallel projection back onto the sequence, the embedding and the LM head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ..vocabulary import QKNormKind

__all__ = [
    "HeadShardedNorm",
    "TensorParallelPlan",
    "embedding_style",
    "head_style",
    "heads_style",
    "qk_style",
    "row_to_sequence",
    "stream_style",
]


@dataclass(frozen=True)
class TensorParallelPlan:
    """A tensor + sequence parallel plan and what applying it needs besides ``parallelize_module``.

    ``styles``: module path -> ParallelStyle (the argument of ``parallelize_module``). ``norms``: the paths of the
    sequence-parallel norm regions (stream norms first per layer, then QK-norms). ``heads``: attention modules whose
    ``n_heads`` / ``n_kv_heads`` attributes become the local head counts (a normatlas model reshapes by them; a
    transformers model reshapes with ``-1`` and needs none). ``tied``: (owner, alias) parameter paths tied in the
    model, re-tied after sharding. ``n_heads`` / ``n_kv_heads``: the head counts the mesh size must divide.
    """

    styles: dict[str, ParallelStyle]
    norms: tuple[str, ...]
    heads: tuple[str, ...]
    tied: tuple[tuple[str, str], ...]
    n_heads: int
    n_kv_heads: int

    def sequence_parallel_params(self, model: nn.Module) -> list[str]:
        """The parameter paths of the norm regions (and residual gates): replicated, gradients ``Partial``."""
        out = []
        for path, style in self.styles.items():
            if isinstance(style, SequenceParallel):
                out += [f"{path}.{n}" for n, _ in model.get_submodule(path).named_parameters()]
        return out


def stream_style() -> SequenceParallel:
    return SequenceParallel()  # input (and output) Shard(1): sequence-sharded, whole hidden dim


def heads_style() -> SequenceParallel:
    return SequenceParallel(sequence_dim=2, use_local_output=True)  # (B, T, H, Dh) sharded over H


class HeadShardedNorm(ParallelStyle):
    """A QK-norm whose parameters belong to heads, on this rank's heads: a gain per head (``(H, Dh)``, Chameleon)
    or a norm over the flattened heads (``(H * Dh,)``, OLMo 2).

    The column-parallel q / k projection leaves each rank its own heads, so the norm's input is local on dim 2 (the
    head dim of ``(B, T, H, Dh)``, or the flattened ``H * Dh`` of ``(B, T, H * Dh)``): it becomes a ``Shard(2)``
    DTensor and the parameters ``Shard(0)`` DTensors (each rank holds its heads' rows). A per-head statistic is then
    local; a statistic over the flattened heads reduces over the sharded dim, and DTensor's sharding propagation
    inserts the all-reduce of the partial sums (PyTorch's engine; nothing here communicates). The output goes back
    to this rank's heads as a plain tensor. The parameters' gradients are ``Shard(0)`` and final (each rank owns
    its heads' rows), so :func:`~normatlas.distributed.reduce_partial_grads` has nothing to do for them.
    """

    @staticmethod
    def _shard_params(_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))

    @staticmethod
    def _input(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if isinstance(x, DTensor):
            raise ValueError(
                f"HeadShardedNorm expects this rank's heads as a plain tensor, got a DTensor {x.placements}"
            )
        return (DTensor.from_local(x, mesh, [Shard(2)], run_check=False), *inputs[1:])

    @staticmethod
    def _output(_mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
        return out.redistribute(mesh, [Shard(2)]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._shard_params, self._input, self._output)  # type: ignore[arg-type]


def row_to_sequence() -> RowwiseParallel:
    return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)  # reduce-scatter onto the sequence


def embedding_style() -> RowwiseParallel:
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)


def head_style(loss_parallel: bool) -> ColwiseParallel:
    out = Shard(-1) if loss_parallel else Replicate()
    return ColwiseParallel(input_layouts=Shard(1), output_layouts=out, use_local_output=not loss_parallel)


def qk_style(kind: QKNormKind | None) -> ParallelStyle:
    """A norm inside attention on this rank's heads: replicated parameters (one gain shared by the heads, or none)
    or parameters that belong to heads (a gain per head, a norm over the flattened heads)."""
    if kind in (QKNormKind.PER_HEAD_GAINS, QKNormKind.FLATTENED):
        return HeadShardedNorm()
    return heads_style()
