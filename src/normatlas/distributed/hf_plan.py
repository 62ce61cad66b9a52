"""The tensor + sequence parallel plan of a transformers Llama-family model, from its dataflow.

Norm sites come from the inspector (:func:`normatlas.inspect.inspect_model`: every norm found by its arithmetic,
with its role and the module that ran it). One recorded forward then gives each projection its role by what feeds
it: a Linear whose input *is* a stream norm's output is column-parallel; the branch module that received that
output (attention, MLP) gets the all-gather at its input; a Linear inside the branch that writes ``hidden_size``
features and is not fed by a norm is row-parallel. The embedding and the LM head are the model's own
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
from .plan import TensorParallelPlan, _embedding, _head, _heads, _row_to_sequence, _stream

__all__ = ["hf_plan"]

_QK_ROLES = frozenset({SiteRole.QK, SiteRole.V})  # norms inside attention, on local heads


@dataclass
class _Flow:
    """What one recorded forward saw: norm outputs, and the tensor inputs of every module."""

    norm_out: dict[int, str] = field(default_factory=dict)  # id(output tensor) -> norm path
    inputs: dict[str, list[tuple[int | str, int]]] = field(default_factory=dict)  # path -> [(arg pos / kwarg, id)]
    keep: list[Tensor] = field(default_factory=list)  # every recorded tensor, alive so that no id is reused


def _record(model: nn.Module, inputs: Any, stream_norms: list[str]) -> _Flow:
    flow = _Flow()
    handles = []

    def pre(path: str):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            seen: list[tuple[int | str, int]] = [(i, id(a)) for i, a in enumerate(args) if isinstance(a, Tensor)]
            seen += [(k, id(v)) for k, v in kwargs.items() if isinstance(v, Tensor)]
            flow.inputs.setdefault(path, seen)
            flow.keep += [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]

        return hook

    def post(path: str):
        def hook(_m: nn.Module, _args: tuple, out: Any) -> None:
            if isinstance(out, Tensor):
                flow.norm_out[id(out)] = path
                flow.keep.append(out)

        return hook

    for path, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(pre(path), with_kwargs=True))
        if path in stream_norms:
            handles.append(m.register_forward_hook(post(path)))
    try:
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return flow


def _branch_input(flow: _Flow, model: nn.Module, norm: str, cols: list[str]) -> tuple[str, int | str] | None:
    """The deepest non-Linear module that received ``norm``'s output and holds every Linear it feeds."""
    best: tuple[str, int | str] | None = None
    for path, seen in flow.inputs.items():
        if isinstance(model.get_submodule(path), nn.Linear) or not path:
            continue
        for where, tid in seen:
            fed = flow.norm_out.get(tid) == norm and all(c.startswith(path + ".") for c in cols)
            if fed and (best is None or len(path) > len(best[0])):
                best = (path, where)
    return best


def _prepare(where: int | str) -> PrepareModuleInput:
    if isinstance(where, str):
        return PrepareModuleInput(
            input_kwarg_layouts={where: Shard(1)}, desired_input_kwarg_layouts={where: Replicate()},
            use_local_output=True,
        )  # fmt: skip
    lay = tuple(Shard(1) if i == where else None for i in range(where + 1))
    want = tuple(Replicate() if i == where else None for i in range(where + 1))
    return PrepareModuleInput(input_layouts=lay, desired_input_layouts=want, use_local_output=True)


def _branches(model: nn.Module, flow: _Flow, hidden: int) -> dict[str, ParallelStyle]:
    linears = {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    feeds: dict[str, list[str]] = {}
    for p in linears:
        for _, tid in flow.inputs.get(p, []):
            if tid in flow.norm_out:
                feeds.setdefault(flow.norm_out[tid], []).append(p)
    styles: dict[str, ParallelStyle] = {}
    for norm, cols in feeds.items():
        found = _branch_input(flow, model, norm, cols)
        if found is None:
            raise ValueError(f"the norm at {norm!r} feeds {cols} but no branch module received its output")
        branch, where = found
        styles[branch] = _prepare(where)
        for c in cols:
            styles[c] = ColwiseParallel()
        for p, lin in linears.items():
            if p.startswith(branch + ".") and p not in cols:
                if lin.out_features != hidden:
                    raise ValueError(f"Linear {p!r} in branch {branch!r} is neither fed by a norm nor writes "
                                     f"hidden_size={hidden} features; the plan cannot place it")  # fmt: skip
                styles[p] = _row_to_sequence()
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
        if qk and report.qk_norm is not QKNormKind.PER_HEAD:
            raise ValueError(f"qk_norm={report.qk_norm.value!r}: only a per-head QK-norm runs on local heads")
        hidden = report.hidden_size
        if hidden is None:
            raise ValueError("the inspector found no hidden size; the plan needs it to place row-parallel Linears")
        flow = _record(model, inputs, stream)
    finally:
        model.train(training)
    styles: dict[str, ParallelStyle] = {}
    embed = _path_of(model, model.get_input_embeddings(), "input embedding")
    styles[embed] = _embedding()
    styles.update(_branches(model, flow, hidden))
    for p in stream:
        styles[p] = _stream()
    for p in qk:
        styles[p] = _heads()
    head_mod = model.get_output_embeddings()
    head = _path_of(model, head_mod, "output embedding")
    styles[head] = _head(loss_parallel)
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
