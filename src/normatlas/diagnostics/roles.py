"""What each module and parameter *does*, found from behaviour and dataflow, never from names.

* :func:`module_kind` classifies a module: known torch / normatlas types first, then the shared
  behavioural probe (:mod:`normatlas.analysis.probe`) on synthetic inputs for anything else. A module is a
  **norm** when its output is invariant to rescaling its input (``f(a x) == f(x)``, the essay's
  re-scaling invariance) and still depends on the input; it is **pointwise** when each
  output feature depends only on the same input feature (DyT, LayerScale, scalings).
  The probe runs on a copy of the parameters set to random values, so zero- or
  one-initialized gains do not fool it, and restores every parameter and buffer.
* :func:`gain_convention` tells ``w * x_hat`` from Gemma's ``(1 + w) * x_hat``: setting
  the gain to 0 (resp. -1) makes the output independent of the input.
* :func:`find_blocks` finds the repeated blocks of a model: the largest container of
  two or more modules of one class (the residual stack).
* :func:`trace_linear_to_norm` records one forward (:mod:`normatlas.analysis`) and finds
  which linear/conv layers feed only norms (through views, reshapes and splits only, no bias
  the norm does not cancel): those weights are scale-invariant, so their effective learning
  rate is ``lr / ||W||^2`` under SGD and ``lr / ||W||`` under Adam (essay, "Scale invariance").
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn

from ..analysis.flow import Dataflow, collapse
from ..analysis.graph import record
from ..analysis.ops import SHAPE_ONLY, SPLITS
from ..analysis.probe import ParamRole, param_roles, randomized, respond
from ..modules import Norm

__all__ = [
    "Kind",
    "find_blocks",
    "gain_convention",
    "iter_kinds",
    "linear_norm_pairs",
    "module_kind",
    "trace_linear_to_norm",
]


class Kind(enum.Enum):
    NORM = "norm"
    POINTWISE = "pointwise"  # elementwise per feature: DyT, LayerScale, learned scalings
    LINEAR = "linear"  # weight matrices: Linear, Conv, Bilinear
    EMBEDDING = "embedding"
    CONTAINER = "container"  # holds no parameters of its own
    OTHER = "other"


_KNOWN_NORMS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    Norm,
)
_KNOWN_LINEAR: tuple[type[nn.Module], ...] = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)
_KNOWN_EMBEDDING: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


def _own_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]


_Probe = randomized  # random own parameters for the probe; restores parameters, buffers, flags


def _behaviour(module: nn.Module, dim: int | None = None) -> tuple[Kind, Tensor | None, int]:
    """The shared probe's response as ``(kind, probe input, feature axis)`` (``dim``: the feature width, for a
    module whose parameters do not show it)."""
    resp = respond(module, dim)
    if resp is None:
        return Kind.OTHER, None, -1
    kind = Kind.NORM if resp.norm else Kind.POINTWISE if resp.pointwise else Kind.OTHER
    return kind, resp.x, resp.feature_axis


def module_kind(module: nn.Module) -> Kind:
    """Classify one module: known types first, else by behaviour on synthetic inputs.

    Only leaf-like modules (no parameterized submodules) are probed; a module holding
    both its own parameters and parameterized children (a block with a ReZero scalar,
    a model with a position table) is ``OTHER`` and its own parameters are judged by shape.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, _KNOWN_NORMS):
        return Kind.NORM
    if isinstance(module, _KNOWN_LINEAR):
        return Kind.LINEAR
    if isinstance(module, _KNOWN_EMBEDDING):
        return Kind.EMBEDDING
    if not _own_params(module):
        return Kind.CONTAINER
    if any(True for c in module.modules() if c is not module and next(c.parameters(recurse=False), None) is not None):
        return Kind.OTHER  # holds parameterized submodules: a block, not a layer; never probed
    with _Probe(module):
        kind, _, _ = _behaviour(module)
    return kind


def iter_kinds(model: nn.Module) -> Iterator[tuple[str, nn.Module, Kind]]:
    """``(name, module, kind)`` for every module that holds parameters of its own."""
    for name, mod in model.named_modules():
        if _own_params(mod):
            yield name, mod, module_kind(mod)


def gain_convention(module: nn.Module) -> dict[str, str]:
    """For a norm (or pointwise) module, the role of each own parameter.

    Returns ``{param_name: "gain" | "gain_one_plus_w" | "bias"}``: a parameter is a gain
    when setting it to 0 makes the output independent of the input, a ``(1 + w)`` gain
    when setting it to -1 does, and a bias otherwise. Scalars (numel 1) such as DyT's
    alpha are reported as ``"scalar"``.
    """
    params = _own_params(module)
    with randomized(module):
        _, x, _ = _behaviour(module)
        if x is None:
            return {n: "scalar" if p.numel() == 1 else "bias" for n, p in params}
        roles = param_roles(module, x)
    return {n: "scalar" if p.numel() == 1 else roles.get(n, ParamRole.BIAS).value for n, p in params}


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the biggest ``ModuleList``/``Sequential`` of >= 2 same-class modules."""
    best: list[nn.Module] = []
    best_params = -1
    for mod in model.modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if isinstance(children[0], _KNOWN_LINEAR + _KNOWN_NORMS + _KNOWN_EMBEDDING):
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n > best_params:
            best, best_params = children, n
    return best


# ops whose output holds the same elements as their first input, re-indexed or cast (views, splits, casts)
_VIEWS = SHAPE_ONLY | SPLITS


def trace_linear_to_norm(model: nn.Module, *args: Any, **kwargs: Any) -> list[tuple[nn.Module, nn.Module]]:
    """Run ``model(*args, **kwargs)`` once and return the ``(linear, norm)`` pairs whose linear weight
    is scale-invariant: the model's output does not change when that weight is multiplied by ``a > 0``.

    Method: the shared dataflow recorder (:mod:`normatlas.analysis`) with linear and norm modules
    as opaque calls. A pair is reported when the norm's input is the linear's output through
    re-indexing ops only (views, reshapes, splits) and, exactly from the recorded dataflow,

    * every use of every output of that linear (in every call) reaches a norm through such ops
      only: no residual add (also not an in-place ``h += x``), no other reader, no model output;
    * the linear has no bias, or every norm it feeds is a torch BatchNorm / InstanceNorm that
      reads its output directly (their per-channel centring cancels the bias); with a bias in
      front of any other norm only ``(W, b)`` together are scale-invariant, never ``W``;
    * no other module shares its weight without qualifying as well.

    Norms are found by :func:`module_kind`, so custom norm classes count. A BatchNorm makes
    each output channel's row scale-invariant, which also holds. One forward runs under
    ``torch.no_grad`` (it advances the RNG and BatchNorm running statistics like any forward).
    """
    return linear_norm_pairs(model, args, kwargs)


def linear_norm_pairs(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    kinds: Mapping[nn.Module, Kind] | None = None,
) -> list[tuple[nn.Module, nn.Module]]:
    """:func:`trace_linear_to_norm` with the model's arguments as a tuple and a dict, and optionally
    the module kinds already computed (so no probe runs)."""
    if kinds is None:
        kinds = {m: module_kind(m) for m in model.modules()}
    flow = collapse(record(model, tuple(args), dict(kwargs or {})), lambda name, m: kinds.get(m) in _OPAQUE)
    pairs: list[tuple[nn.Module, nn.Module]] = []
    for call in flow.calls:
        norm = flow.submodule(call.module) if call.module is not None else None
        if norm is None or kinds.get(norm) is not Kind.NORM or not call.inputs:
            continue
        key, src = call.inputs[0], None
        while (idx := flow.producer.get(key)) is not None:
            src = flow.calls[idx]
            if src.module is not None or src.op not in _VIEWS or not src.inputs:
                break
            key = src.inputs[0]
        lin = flow.submodule(src.module) if src is not None and src.module is not None else None
        if lin is not None and kinds.get(lin) is Kind.LINEAR and (lin, norm) not in pairs:
            pairs.append((lin, norm))
    ok: dict[nn.Module, bool] = {}
    for call in flow.calls:
        lin = flow.submodule(call.module) if call.module is not None else None
        if lin is None or kinds.get(lin) is not Kind.LINEAR:
            continue
        biased = isinstance(getattr(lin, "bias", None), Tensor)
        good = bool(call.outputs) and all(_feeds_norms_only(flow, k, kinds, biased) for k in call.outputs)
        ok[lin] = ok.get(lin, True) and good
    sharers: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, Tensor):
            sharers.setdefault(id(w), []).append(mod)

    def invariant(lin: nn.Module) -> bool:
        w = getattr(lin, "weight", None)
        return isinstance(w, Tensor) and all(ok.get(m, False) for m in sharers.get(id(w), [lin]))

    return [(lin, norm) for lin, norm in pairs if invariant(lin)]


_OPAQUE = (Kind.LINEAR, Kind.NORM)
_CENTRING_PER_CHANNEL: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def _feeds_norms_only(flow: Dataflow, key: int, kinds: Mapping[nn.Module, Kind], biased: bool) -> bool:
    """Every reader of ``key``, past re-indexing ops (:meth:`Dataflow.reach`), is a norm (for a biased linear: a
    BatchNorm or InstanceNorm reading ``key`` itself); ``key`` never reaches the model output."""
    for call, direct in flow.reach(key, lambda c: c.module is None and c.op in _VIEWS):
        if call is None or call.module is None:
            return False
        mod = flow.submodule(call.module)
        if kinds.get(mod) is not Kind.NORM:
            return False
        if biased and not (direct and isinstance(mod, _CENTRING_PER_CHANNEL)):
            return False
    return True


def is_batch_norm(module: nn.Module) -> bool:
    """True for every BatchNorm flavour (:func:`normatlas.longtail.read_batchnorm`, the one detector)."""
    from ..longtail.batchnorm import read_batchnorm

    return read_batchnorm(module) is not None
