"""Norms under tensor, sequence and data parallelism, on PyTorch's own ``torch.distributed`` engine."""

from .grads import Finding, Problem, check_replicas, coalesce_partial, full_grads, reduce_partial_grads
from .launch import free_port, spawn
from .plan import HeadShardedNorm, TensorParallelPlan, parallelize, rebind_param_groups, tensor_parallel_plan

__all__ = [
    "Finding",
    "HeadShardedNorm",
    "Problem",
    "TensorParallelPlan",
    "check_replicas",
    "coalesce_partial",
    "free_port",
    "full_grads",
    "parallelize",
    "rebind_param_groups",
    "reduce_partial_grads",
    "spawn",
    "tensor_parallel_plan",
]
