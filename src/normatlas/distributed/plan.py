"""Tensor + sequence parallel plans as data: ``{module path: ParallelStyle}`` for ``parallelize_module``.

The essay's operational rule 8: a LayerNorm / RMSNorm needs the whole hidden dimension, so every norm is a
sequence-parallel region. The residual stream between the projections is a DTensor sharded on the sequence
(``Shard(1)``); each branch (attention, FFN) all-gathers it at its input (``PrepareModuleInput``), runs its
column-parallel projections (q, k, v, gate, up) and its row-parallel one (o, down) on local heads / columns, and the
row-parallel output is reduce-scattered back onto the sequence. The gathered input stays a ``Replicate`` DTensor
(``use_local_output=False``), so the projections that read it sum their input gradients as ``Partial`` and the
backward reduce-scatters them once per branch; a plain tensor there would make every column-parallel projection
all-reduce its own input gradient (10 all-reduces of the whole activation per step of the 2-block test model).
The norms, the residual adds and any learned residual gates run on the sequence shards with the whole hidden dim
(``SequenceParallel``), so their arithmetic is local and exact; their weights are replicated and their gradients come
back ``Partial`` (see :mod:`normatlas.distributed.grads`). A QK-norm over the head dim runs on the local heads
(``SequenceParallel(sequence_dim=2)``: dim 2 of ``(B, T, H, Dh)`` is the head dim, as in TorchTitan); a QK-norm whose
parameters belong to heads (a gain per head, a norm over the flattened heads) gets :class:`HeadShardedNorm`.

The plan is derived from the model's own structure, never from module names:

* a :class:`~normatlas.blocks.TransformerLM` is read through its typed attributes (blocks, their norm slots,
  attention and MLP projections);
* a transformers Llama-family model (Llama, Mistral, Qwen 2 / 3, Gemma 2 / 3) gets its norm sites from the inspector
  (:func:`normatlas.inspect.inspect_model`) and its projections' roles from one recorded forward: a Linear that
  reads its branch module's own input (the stream, or a pre-norm's output of it) is column-parallel, the branch
  gets the all-gather, and the other Linears inside it write ``hidden_size`` features and are row-parallel.

Everything runs on PyTorch's own engine (``torch.distributed.tensor.parallel``); nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    parallelize_module,
)

from ..blocks import TransformerLM
from .hf_plan import hf_plan
from .styles import (
    HeadShardedNorm,
    TensorParallelPlan,
    embedding_style,
    head_style,
    heads_style,
    qk_style,
    row_to_sequence,
    stream_style,
)

__all__ = ["HeadShardedNorm", "TensorParallelPlan", "parallelize", "rebind_param_groups", "tensor_parallel_plan"]

_SLOTS = ("attn_pre_norm", "attn_post_norm", "attn_after_norm", "ffn_pre_norm", "ffn_post_norm", "ffn_after_norm")


def tensor_parallel_plan(
    model: nn.Module, example_inputs: Any = None, *, loss_parallel: bool = False
) -> TensorParallelPlan:
    """The tensor + sequence parallel plan of ``model`` (a TransformerLM or a transformers Llama-family model).

    ``example_inputs`` (a transformers model only): the inputs of the recorded forward (default: a short
    ``input_ids`` batch). ``loss_parallel=True`` leaves the logits sharded on the vocabulary (``Shard(-1)``
    DTensors, for ``torch.distributed.tensor.parallel.loss_parallel``); otherwise they are gathered whole.
    Raises a ValueError naming what the plan does not cover.
    """
    if not isinstance(loss_parallel, bool):
        raise TypeError(f"loss_parallel={loss_parallel!r} must be a bool")
    if isinstance(model, TransformerLM):
        if example_inputs is not None:
            raise ValueError("example_inputs is read for transformers models only; a TransformerLM's plan is static")
        return _lm_plan(model, loss_parallel)
    if isinstance(model, nn.Module) and hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        return hf_plan(model, example_inputs, loss_parallel)
    raise TypeError(
        f"model={type(model).__name__} must be a normatlas TransformerLM or a transformers PreTrainedModel "
        "(Llama, Mistral, Qwen2/3, Gemma2/3)"
    )


def _check_lm(model: Any) -> None:
    cfg = model.config
    for name in ("max_positions", "type_vocab_size"):
        if getattr(cfg, name):
            raise ValueError(f"{name}={getattr(cfg, name)} (learned positions / token types) is not in the plan; use 0")
    if cfg.head_transform:
        raise ValueError("head_transform=True (the MLM head transform) is not in the plan; use False")


def _lm_plan(model: Any, loss_parallel: bool) -> TensorParallelPlan:
    _check_lm(model)
    path = {id(m): n for n, m in model.named_modules()}
    styles: dict[str, ParallelStyle] = {"embed": embedding_style()}
    norms: list[str] = []

    def region(m: nn.Module | None, style: ParallelStyle, is_norm: bool = True) -> None:
        if m is not None:
            styles[path[id(m)]] = style
            if is_norm:
                norms.append(path[id(m)])

    region(model.embed_norm, stream_style())
    heads = []
    for block in model.blocks():
        for slot in _SLOTS:
            region(getattr(block, slot), stream_style())
        for res in (block.attn_residual, block.ffn_residual):
            region(None if res is None else res.gate, stream_style(), is_norm=False)
        attn, mlp = block.attn, block.mlp
        region(attn, PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
            use_local_output=False), is_norm=False)  # fmt: skip
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            region(lin, ColwiseParallel(), is_norm=False)
        region(attn.o_proj, row_to_sequence(), is_norm=False)
        region(mlp.down_proj, row_to_sequence(), is_norm=False)
        region(mlp, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False),
            is_norm=False)  # fmt: skip
        kind = None if attn.qk_config is None else attn.qk_config.kind
        for qn in (attn.q_norm, attn.k_norm):
            region(qn, qk_style(kind))
        region(attn.v_norm, heads_style())
        heads.append(path[id(attn)])
    region(model.final_norm, stream_style())
    styles["lm_head"] = head_style(loss_parallel)
    tied = (("embed.weight", "lm_head.weight"),) if model.lm_head.weight is model.embed.weight else ()
    cfg = model.config
    kv = cfg.n_heads if cfg.n_kv_heads is None else cfg.n_kv_heads
    return TensorParallelPlan(styles, tuple(norms), tuple(heads), tied, cfg.n_heads, kv)


def _set_param(model: nn.Module, path: str, value: nn.Parameter) -> None:
    owner, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, value)


def _tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh={mesh!r} must be a torch.distributed DeviceMesh (init_device_mesh)")
    if mesh.ndim != 1:
        raise ValueError(f"mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; pass the 1-D tensor-parallel sub-mesh")
    return mesh


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: TensorParallelPlan | None = None) -> nn.Module:
    """Shard ``model`` in place for tensor + sequence parallelism over the 1-D ``mesh`` and return it.

    ``plan`` defaults to :func:`tensor_parallel_plan` ``(model)``. Owns: the divisibility checks (the mesh size
    must divide the query and key/value head counts), ``parallelize_module``, the local head counts of a normatlas
    attention module, and re-tying tied weights (an embedding tied to the LM head stays one ``Shard(0)`` DTensor).
    Every rank must hold the same initial weights (seed them alike): norm weights are replicated from the local
    copy, as ``SequenceParallel`` does.
    """
    mesh = _tp_mesh(mesh)
    plan = tensor_parallel_plan(model) if plan is None else plan
    if not isinstance(plan, TensorParallelPlan):
        raise TypeError(f"plan={plan!r} must be a TensorParallelPlan (from tensor_parallel_plan) or None")
    tp = mesh.size()
    for name, n in (("n_heads", plan.n_heads), ("n_kv_heads", plan.n_kv_heads)):
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by the tensor-parallel size {tp}; allowed: a divisor of {n}")
    parallelize_module(model, mesh, plan.styles)
    for path in plan.heads:
        attn: Any = model.get_submodule(path)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
    for owner, alias in plan.tied:
        _set_param(model, alias, model.get_parameter(owner))
    return model


def rebind_param_groups(groups: Sequence[dict[str, Any]], model: nn.Module) -> list[dict[str, Any]]:
    """Optimizer groups built on the unsharded model (e.g. :func:`normatlas.diagnostics.param_groups`, which reads
    each module's behaviour and so runs before sharding), pointed at ``model``'s sharded parameters by name.

    Each group needs its ``names`` list (``param_groups`` writes one); every other key is kept. ``parallelize`` and
    ``fully_shard`` replace parameters with DTensors under the same names, so compute the groups first::

        groups = param_groups(model); parallelize(model, mesh); opt = AdamW(rebind_param_groups(groups, model))
    """
    out = []
    for i, g in enumerate(groups):
        names = g.get("names") if isinstance(g, dict) else None
        if not isinstance(names, (list, tuple)):
            raise ValueError(f"groups[{i}] has no 'names' list; build the groups with param_groups(model)")
        out.append({**g, "params": [model.get_parameter(n) for n in names]})
    return out
