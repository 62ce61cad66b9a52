"""The tensor + sequence parallel plan of a transformers Llama-family model, from its dataflow.

Norm sites come from the inspector (:func:`normatlas.inspect.inspect_model`: every norm found by its arithmetic,
with its role and the module that ran it). One recorded forward then gives each projection its role by what it
reads: a Linear whose input *is* the input of the branch module above it (attention, MLP: the residual stream, or
a pre-norm's output of it) is column-parallel, and that branch gets the all-gather at its input; every other Linear
inside the branch must write ``hidden_size`` features and is row-parallel. So a pre-norm model (Llama) and a
model whose branches read the raw stream and normalise their outputs (OLMo 2) get the same rule.
The embedding and the LM head are the model's own
``get_input_embeddings()`` / ``get_output_embeddings()``. No module name is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput

from ..vocabulary import QKNormKind, SiteRole
from .styles import TensorParallelPlan, embedding_style, head_style, qk_style, row_to_sequence, stream_style

__all__ = ["hf_plan"]

_QK_ROLES = frozenset({SiteRole.QK, SiteRole.V})  # norms inside attention, on local heads


@dataclass
class _Flow:
    """What one recorded forward saw: the tensor inputs of every module."""

    inputs: dict[str, list[tuple[int | str, int]]] = field(default_factory=dict)  # path -> [(arg pos / kwarg, id)]
    keep: list[Tensor] = field(default_factory=list)  # every recorded tensor, alive so that no id is reused


def _record(model: nn.Module, inputs: Any) -> _Flow:
    flow = _Flow()
    handles = []

    def pre(path: str):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            seen: list[tuple[int | str, int]] = [(i, id(a)) for i, a in enumerate(args) if isinstance(a, Tensor)]
            seen += [(k, id(v)) for k, v in kwargs.items() if isinstance(v, Tensor)]
            flow.inputs.setdefault(path, seen)
            flow.keep += [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]

        return hook

    for path, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(pre(path), with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return flow


def _prepare(where: int | str) -> PrepareModuleInput:
    if isinstance(where, str):
        return PrepareModuleInput(
            input_kwarg_layouts={where: Shard(1)}, desired_input_kwarg_layouts={where: Replicate()},
            use_local_output=False,
        )  # fmt: skip
    lay = tuple(Shard(1) if i == where else None for i in range(where + 1))
    want = tuple(Replicate() if i == where else None for i in range(where + 1))
    return PrepareModuleInput(input_layouts=lay, desired_input_layouts=want, use_local_output=False)


def _first_input(flow: _Flow, path: str) -> int | None:
    seen = flow.inputs.get(path, [])
    return seen[0][1] if seen else None


def _branch_of(flow: _Flow, model: nn.Module, linear: str, skip: set[str]) -> tuple[str, int | str] | None:
    """The deepest non-Linear module above ``linear`` that received ``linear``'s own input, and where (argument
    position or keyword): the branch (attention, MLP) whose input the projection reads, or None."""
    tid = _first_input(flow, linear)
    parts = linear.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:depth])
        if path in skip or isinstance(model.get_submodule(path), nn.Linear):
            continue
        for where, seen in flow.inputs.get(path, []):
            if seen == tid:
                return path, where
    return None


def _branches(model: nn.Module, flow: _Flow, hidden: int, skip: set[str]) -> dict[str, ParallelStyle]:
    """Column-parallel: every Linear that reads its branch's own input (the residual stream, or a pre-norm's output
    of it); the branch gets the all-gather of that input. Row-parallel: every other Linear of a branch, which must
    write ``hidden_size`` features (the stream). Linears outside every branch (the head) are placed elsewhere."""
    linears = [p for p, m in model.named_modules() if isinstance(m, nn.Linear) and p not in skip]
    styles: dict[str, ParallelStyle] = {}
    branches: dict[str, int | str] = {}
    for p in linears:
        found = _branch_of(flow, model, p, skip)
        if found is not None:
            branches[found[0]] = found[1]
            styles[p] = ColwiseParallel()
    for branch, where in branches.items():
        styles[branch] = _prepare(where)
        for p in linears:
            if p.startswith(branch + ".") and p not in styles:
                lin = model.get_submodule(p)
                if lin.out_features != hidden:
                    raise ValueError(f"Linear {p!r} in branch {branch!r} neither reads the branch's input nor "
                                     f"writes hidden_size={hidden} features; the plan cannot place it")  # fmt: skip
                styles[p] = row_to_sequence()
    return styles


def _path_of(model: nn.Module, module: nn.Module | None, what: str) -> str:
    for p, m in model.named_modules():
        if m is module:
            return p
    raise ValueError(f"the model's {what} is not one of its submodules")


def hf_plan(model: Any, example_inputs: Any, loss_parallel: bool) -> TensorParallelPlan:
    """The plan of a transformers decoder (see the module docstring); restores the model's train / eval mode."""
    from ..inspect import inspect_model

    training = model.training
    try:
        inputs = example_inputs if example_inputs is not None else _default_inputs(model)
        report = inspect_model(model, inputs, probe=False)
        stream: list[str] = []
        qk: list[str] = []
        for n in report.norms:
            if not n.module or n.fused:
                where = f"norm #{n.index} ({n.role.value}, layer {n.layer})"
                raise ValueError(f"{where} is not run by a module; no style fits")
            (qk if n.role in _QK_ROLES else stream).append(n.module)
        if qk and report.qk_norm is QKNormKind.MIXED:
            raise ValueError("qk_norm='mixed' (its kind differs across layers): one style per model is planned")
        hidden = report.hidden_size
        if hidden is None:
            raise ValueError("the inspector found no hidden size; the plan needs it to place row-parallel Linears")
        flow = _record(model, inputs)
    finally:
        model.train(training)
    styles: dict[str, ParallelStyle] = {}
    embed = _path_of(model, model.get_input_embeddings(), "input embedding")
    styles[embed] = embedding_style()
    head_mod = model.get_output_embeddings()
    head = _path_of(model, head_mod, "output embedding")
    styles.update(_branches(model, flow, hidden, {head, ""}))
    for p in stream:
        styles[p] = stream_style()
    for p in qk:
        styles[p] = qk_style(report.qk_norm)
    styles[head] = head_style(loss_parallel)
    tied: tuple[tuple[str, str], ...] = ()
    if head_mod is not None and head_mod.weight is model.get_input_embeddings().weight:
        tied = ((f"{embed}.weight", f"{head}.weight"),)
    cfg = model.config
    n_heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    return TensorParallelPlan(styles, tuple(stream + qk), (), tied, n_heads, kv)


def _default_inputs(model: Any) -> dict[str, Tensor]:
    """Eight seeded token ids (the same on every rank)."""
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab, (1, 8), generator=gen)}
