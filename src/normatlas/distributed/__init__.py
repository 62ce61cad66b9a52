"""Norms under tensor, sequence and data parallelism, on PyTorch's own ``torch.distributed`` engine."""

from .bnsplit import BNSampleCounts, bn_sample_counts, split_outputs
from .grads import Finding, Problem, check_replicas, coalesce_partial, full_grads, reduce_partial_grads
from .launch import free_port, spawn
from .plan import HeadShardedNorm, TensorParallelPlan, parallelize, rebind_param_groups, tensor_parallel_plan

__all__ = [
    "BNSampleCounts",
    "Finding",
    "HeadShardedNorm",
    "Problem",
    "TensorParallelPlan",
    "bn_sample_counts",
    "check_replicas",
    "coalesce_partial",
    "free_port",
    "full_grads",
    "parallelize",
    "rebind_param_groups",
    "reduce_partial_grads",
    "spawn",
    "split_outputs",
    "tensor_parallel_plan",
]
