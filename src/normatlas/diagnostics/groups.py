"""Optimizer parameter groups by role, found from the module tree and behaviour.

The essay's practical rule ("Exclude norm parameters (and embeddings) from weight
decay"): decay shrinks a norm gain, which is a learning-rate change disguised as
regularization; OLMo 2 also excludes embeddings. Name filters (``"norm" in name``)
miss custom norm classes and (1+w) gains; here each parameter's role comes from
:func:`~normatlas.diagnostics.roles.module_kind` (behaviour) and
:func:`~normatlas.diagnostics.roles.gain_convention`:

==================  ======================================  ==========
role                what                                    decay
==================  ======================================  ==========
weight              matrices of Linear/Conv and others      yes
embedding           Embedding tables (and tied heads)       option
norm_gain           w of ``w * x_hat``                      no
norm_gain_1pw       w of ``(1 + w) * x_hat`` (Gemma)        option
norm_bias           norm biases                             no
bias                biases of linear/conv layers            no
scalar              numel-1 parameters: DyT alpha, ReZero   no
pointwise           LayerScale gammas, DyT weight/bias      no
vector              other 1-D parameters                    no
==================  ======================================  ==========

Decaying a ``(1 + w)`` gain pulls the layer toward identity scale rather than to
zero (essay, "Gemma's (1 + w) convention"), so ``decay_one_plus_w=True`` is a
meaningful choice; the default keeps every norm parameter undecayed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from torch import nn

from .roles import Kind, gain_convention, module_kind

__all__ = ["ParamInfo", "Role", "format_report", "param_groups", "param_roles", "summarize_roles"]


class Role(enum.Enum):
    WEIGHT = "weight"
    EMBEDDING = "embedding"
    NORM_GAIN = "norm_gain"
    NORM_GAIN_ONE_PLUS_W = "norm_gain_1pw"
    NORM_BIAS = "norm_bias"
    BIAS = "bias"
    SCALAR = "scalar"
    POINTWISE = "pointwise"
    VECTOR = "vector"


@dataclass(frozen=True)
class ParamInfo:
    name: str  # first name in named_parameters order
    aliases: tuple[str, ...]  # other names of the same tensor (tied weights)
    shape: tuple[int, ...]
    module: str  # class of the owning module(s)
    role: Role
    decay: bool


def _role_in(kind: Kind, mod: nn.Module, pname: str, p: nn.Parameter, conv: dict[str, str] | None) -> Role:
    if p.numel() == 1:
        return Role.SCALAR
    if kind is Kind.EMBEDDING:
        return Role.EMBEDDING
    if kind is Kind.NORM:
        label = (conv or {}).get(pname, "gain")
        return {"gain": Role.NORM_GAIN, "gain_one_plus_w": Role.NORM_GAIN_ONE_PLUS_W}.get(label, Role.NORM_BIAS)
    if kind is Kind.POINTWISE:
        return Role.POINTWISE
    if kind is Kind.LINEAR:
        return Role.WEIGHT if p.dim() >= 2 else Role.BIAS
    return Role.WEIGHT if p.dim() >= 2 else Role.VECTOR


_PRIORITY = [Role.EMBEDDING, Role.NORM_GAIN_ONE_PLUS_W, Role.NORM_GAIN, Role.NORM_BIAS, Role.SCALAR, Role.POINTWISE]


def param_roles(model: nn.Module, *, decay_embeddings: bool = False, decay_one_plus_w: bool = False) -> list[ParamInfo]:
    """The role and decay decision of every trainable parameter of ``model`` (tied ones once)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    seen: dict[int, dict[str, object]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if p is not None]
        if not own:
            continue
        kind = module_kind(mod)
        conv = gain_convention(mod) if kind in (Kind.NORM, Kind.POINTWISE) else None
        for pname, p in own:
            entry = seen.setdefault(id(p), {"p": p, "names": [], "roles": [], "modules": []})
            full = f"{mname}.{pname}" if mname else pname
            if full not in entry["names"]:  # type: ignore[operator]
                entry["names"].append(full)  # type: ignore[attr-defined]
                entry["roles"].append(_role_in(kind, mod, pname, p, conv))  # type: ignore[attr-defined]
                entry["modules"].append(type(mod).__name__)  # type: ignore[attr-defined]
    out = []
    for entry in seen.values():
        p = entry["p"]
        assert isinstance(p, nn.Parameter)
        if not p.requires_grad:
            continue
        roles: list[Role] = entry["roles"]  # type: ignore[assignment]
        role = next((r for r in _PRIORITY if r in roles), roles[0])
        decay = role is Role.WEIGHT or (role is Role.EMBEDDING and decay_embeddings)
        decay = decay or (role is Role.NORM_GAIN_ONE_PLUS_W and decay_one_plus_w)
        names: list[str] = entry["names"]  # type: ignore[assignment]
        mods: list[str] = entry["modules"]  # type: ignore[assignment]
        out.append(ParamInfo(names[0], tuple(names[1:]), tuple(p.shape), "+".join(dict.fromkeys(mods)), role, decay))
    return out


def param_groups(
    model: nn.Module,
    weight_decay: float = 0.1,
    *,
    decay_embeddings: bool = False,
    decay_one_plus_w: bool = False,
    report: bool = False,
) -> list[dict[str, object]] | tuple[list[dict[str, object]], list[ParamInfo]]:
    """Two optimizer groups, ``decay`` (``weight_decay``) and ``no_decay`` (0.0), by role.

    Pass the result straight to ``torch.optim.AdamW(groups, lr=...)``. With
    ``report=True`` returns ``(groups, infos)`` where ``infos`` lists every parameter's
    role and decision (see :func:`format_report`). Each group also carries its
    parameter ``names``, which torch optimizers keep and ignore.
    """
    if (
        isinstance(weight_decay, bool)
        or not isinstance(weight_decay, (int, float))
        or not math.isfinite(weight_decay)
        or weight_decay < 0
    ):
        raise ValueError(f"weight_decay={weight_decay!r} must be a finite number >= 0")
    infos = param_roles(model, decay_embeddings=decay_embeddings, decay_one_plus_w=decay_one_plus_w)
    if not infos:
        frozen = sum(1 for p in model.parameters() if not p.requires_grad)
        why = f"all {frozen} of its parameters are frozen (requires_grad=False)" if frozen else "it has no parameters"
        raise ValueError(
            f"model={type(model).__name__} has nothing to optimize: {why}; param_groups needs a module with at "
            "least one trainable parameter"
        )
    params = dict(model.named_parameters())
    decay = [i for i in infos if i.decay]
    no_decay = [i for i in infos if not i.decay]
    groups: list[dict[str, object]] = [
        {
            "params": [params[i.name] for i in decay],
            "weight_decay": float(weight_decay),
            "names": [i.name for i in decay],
        },
        {"params": [params[i.name] for i in no_decay], "weight_decay": 0.0, "names": [i.name for i in no_decay]},
    ]
    return (groups, infos) if report else groups


def format_report(infos: list[ParamInfo]) -> list[dict[str, object]]:
    """Rows for :func:`normatlas.cli._format.format_rows`: one per parameter."""
    return [
        {
            "parameter": i.name + (f" (= {', '.join(i.aliases)})" if i.aliases else ""),
            "shape": "x".join(map(str, i.shape)) or "scalar",
            "module": i.module,
            "role": i.role.value,
            "group": "decay" if i.decay else "no_decay",
        }
        for i in infos
    ]


def summarize_roles(infos: list[ParamInfo]) -> list[dict[str, object]]:
    """One row per (role, group): how many tensors, how many values, and an example name."""
    rows: dict[tuple[str, str], dict[str, object]] = {}
    for i in infos:
        key = (i.role.value, "decay" if i.decay else "no_decay")
        row = rows.setdefault(key, {"role": key[0], "group": key[1], "tensors": 0, "values": 0, "example": i.name})
        n = 1
        for d in i.shape:
            n *= d
        row["tensors"] = int(row["tensors"]) + 1  # type: ignore[call-overload]
        row["values"] = int(row["values"]) + n  # type: ignore[call-overload]
    return sorted(rows.values(), key=lambda r: (str(r["group"]), str(r["role"])))
