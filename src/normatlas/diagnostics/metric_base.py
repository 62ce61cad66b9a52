"""What a :class:`~normatlas.diagnostics.Monitor` measures: one object per metric, owning its hooks and columns.

A metric is a :class:`MonitorMetric`: it says which :class:`Hook` s it needs, which :class:`Column` s it writes
(record key, table title, unit, format, description) and implements the ``on_*`` methods of those hooks; each
receives the observed tensors and returns the values it measured as ``{record key: value}`` (or None). The
Monitor drives a list of these objects and knows nothing about any one of them. The ten built-in metrics are
registered in :data:`~normatlas.diagnostics.monitor_metrics.REGISTRY` under the
:class:`~normatlas.diagnostics.metrics.Metric` enum, so ``Monitor(model, metrics=["residual", Metric.ATTENTION])``
keeps working; a user metric is an instance (or a class) passed in ``metrics=`` beside them::

    class NormSaturation(MonitorMetric):
        # the share of each block's norm outputs above 3 in magnitude
        key = "norm_saturation"
        hooks = frozenset({Hook.MODULE_OUTPUT})  # on the model's norms, found by behaviour
        columns = (Column("norm_saturation", "norm>3", "share of norm outputs above 3", scope=Scope.LAYER, table=True),)

        def on_module_output(self, module, args, output):
            layer = self.monitor.layer_of(module)
            if layer is None or not isinstance(output, torch.Tensor):
                return None
            return {self.columns[0].at(layer): float((output.detach().abs() > 3).float().mean())}

    mon = Monitor(model, metrics=[*DEFAULT_METRICS, NormSaturation()])

The pure functions the built-ins compute with live in :mod:`normatlas.diagnostics.metrics`; the structural
rules for reading a model's inputs and outputs (no argument or attribute names) in :func:`tensors`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["HOOK_METHODS", "Column", "Hook", "MonitorMetric", "Row", "Scope", "check_metric", "first_tensor", "tensors"]

Row = Mapping[str, object]


class Hook(enum.Enum):
    """Where a metric observes the model; the Monitor registers only the hooks its metrics need."""

    MODEL_INPUT = "model_input"  # on_model_input(args, kwargs): the model's forward is about to run
    MODEL_OUTPUT = "model_output"  # on_model_output(output): the model's forward returned
    STREAM = "stream"  # on_block_start / on_block_end / on_block(layer, x, y): the residual stream per block
    MODULE_INPUT = "module_input"  # on_module_input(module, args): before each module of modules()
    MODULE_OUTPUT = "module_output"  # on_module_output(module, args, output): after each module of modules()
    GRADIENTS = "gradients"  # on_gradients(): after backward, before the optimizer steps or zeroes them
    STEP = "step"  # on_step(record): a measured step closes (weights, learning rates, values derived per step)


class Scope(enum.Enum):
    """How many values a column holds per record, and the suffix of their keys."""

    STEP = "step"  # one value: ``key``
    LAYER = "layer"  # one per block: ``key/L3`` (``key/L3.1`` for the second call inside block 3)
    MODULE = "module"  # one per module: ``key/<module name>``
    HEAD = "head"  # one per attention head: ``key/L3/h0``


@dataclasses.dataclass(frozen=True)
class Column:
    """One quantity a metric writes: its record key (prefix), how it prints and what it means.

    ``table``: a :attr:`Scope.LAYER` column shown by :meth:`Monitor.layer_table`; ``summary``: its label in
    :meth:`Monitor.summary` (a layer column is summarized by its ``worst`` value over layers, and where).
    """

    key: str
    title: str
    description: str
    unit: str = ""
    fmt: str = ".4g"
    scope: Scope = Scope.STEP
    table: bool = False
    summary: str | None = None
    worst: str = "min"

    def __post_init__(self) -> None:
        for name in ("key", "title", "description"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Column {name}={getattr(self, name)!r} must be a non-empty string")
        if not isinstance(self.scope, Scope):
            raise TypeError(f"Column scope={self.scope!r} must be a Scope ({', '.join(s.name for s in Scope)})")
        if self.worst not in ("min", "max"):
            raise ValueError(f"Column worst={self.worst!r} must be 'min' or 'max'")
        if self.table and self.scope is not Scope.LAYER:
            raise ValueError(f"Column {self.key!r}: table=True needs scope=Scope.LAYER, got {self.scope}")
        format(1.0, self.fmt)  # a bad format spec fails here, not when printing

    def at(self, where: int | str) -> str:
        """The record key of this column at block ``where`` (an int: ``L<where>``) or module / tag ``where``."""
        return f"{self.key}/L{where}" if isinstance(where, int) else f"{self.key}/{where}"

    def format(self, value: object) -> object:
        """``value`` as the table prints it: floats by :attr:`fmt`, anything else as it is."""
        return format(value, self.fmt) if isinstance(value, float) else value


class MonitorMetric:
    """One metric of a :class:`~normatlas.diagnostics.Monitor`; subclass it and set the three class attributes.

    ``key``: the metric's name (a :class:`Metric` value for the built-ins); ``hooks``: the :class:`Hook` s whose
    ``on_*`` methods it implements (others are never called); ``columns``: the :class:`Column` s it writes.
    ``per_block``: measured only through the blocks, so a model without blocks is refused. Every ``on_*`` method
    returns ``{record key: value}`` or None and runs on measured steps only. An object serves one Monitor, which
    :meth:`bind` s it at construction, before any hook exists (:attr:`monitor` is set then).
    """

    key: ClassVar[str]
    hooks: ClassVar[frozenset[Hook]] = frozenset()
    columns: ClassVar[tuple[Column, ...]] = ()
    per_block: ClassVar[bool] = False
    monitor: Monitor

    def bind(self, monitor: Monitor) -> None:
        """Called once by the Monitor; override to prepare (call ``super().bind(monitor)`` first)."""
        bound = getattr(self, "monitor", None)
        if bound is not None and bound is not monitor:
            raise ValueError(f"metric {self.key!r} is already bound to another Monitor; pass a new instance")
        self.monitor = monitor

    def modules(self) -> Iterable[nn.Module]:
        """The modules of :attr:`Hook.MODULE_INPUT` / :attr:`Hook.MODULE_OUTPUT`: by default the model's norms
        (found by behaviour, :meth:`Monitor.norms`)."""
        return self.monitor.norms()

    def on_model_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Row | None:
        return None

    def on_model_output(self, output: Any) -> Row | None:
        return None

    def on_block_start(self, layer: int) -> None:
        """Block ``layer``'s forward is about to run."""

    def on_block_end(self, layer: int) -> None:
        """Block ``layer``'s forward returned; called for every metric before any :meth:`on_block`."""

    def on_block(self, layer: int, x: Tensor | None, y: Tensor) -> Row | None:
        """``y``: block ``layer``'s output stream (sampled: :meth:`Monitor.sample`); ``x``: its input stream, sampled
        alike, or None when no input has the output's shape (see :func:`tensors`)."""
        return None

    def on_module_input(self, module: nn.Module, args: tuple[Any, ...]) -> Row | None:
        return None

    def on_module_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Row | None:
        return None

    def on_gradients(self) -> Row | None:
        return None

    def on_step(self, record: Mapping[str, object]) -> Row | None:
        """A measured step closes; ``record`` holds what was measured so far. Reset per-step state here."""
        return None

    def release(self) -> None:
        """The Monitor detaches: drop anything still active (an attention capture)."""


# the methods each hook calls; a metric overrides at least one of each hook it declares, and none of the others
HOOK_METHODS: dict[Hook, tuple[str, ...]] = {
    Hook.MODEL_INPUT: ("on_model_input",),
    Hook.MODEL_OUTPUT: ("on_model_output",),
    Hook.STREAM: ("on_block_start", "on_block_end", "on_block"),
    Hook.MODULE_INPUT: ("on_module_input",),
    Hook.MODULE_OUTPUT: ("on_module_output",),
    Hook.GRADIENTS: ("on_gradients",),
    Hook.STEP: ("on_step",),
}


def check_metric(metric: MonitorMetric) -> MonitorMetric:
    """``metric`` if its ``key``, ``hooks`` and ``columns`` are well formed and its ``on_*`` methods match its hooks
    (a method of an undeclared hook would never be called); else a TypeError / ValueError that says which."""
    cls = type(metric)
    key, hooks, columns = getattr(metric, "key", None), metric.hooks, metric.columns
    if not isinstance(key, str) or not key:
        raise TypeError(f"{cls.__name__}.key={key!r} must be a non-empty string naming the metric")
    if not isinstance(hooks, frozenset) or not all(isinstance(h, Hook) for h in hooks):
        raise TypeError(f"{cls.__name__}.hooks={hooks!r} must be a frozenset of Hook")
    if not isinstance(columns, tuple) or not all(isinstance(c, Column) for c in columns):
        raise TypeError(f"{cls.__name__}.columns={columns!r} must be a tuple of Column")
    for hook, names in HOOK_METHODS.items():
        own = [n for n in names if getattr(cls, n) is not getattr(MonitorMetric, n)]
        if hook in hooks and not own:
            raise ValueError(f"{cls.__name__}.hooks holds Hook.{hook.name} but it overrides none of {', '.join(names)}")
        if hook not in hooks and own:
            raise ValueError(
                f"{cls.__name__} overrides {own[0]} but its hooks lack Hook.{hook.name}: it would never run"
            )
    return metric


# ------------------------------------------------------------------------------ reading tensors by structure


def tensors(obj: Any, *, floating: bool | None = True) -> Iterator[Tensor]:
    """Every tensor in ``obj`` in order: a tensor, then the items of tuples, lists, mappings (in their order) and
    dataclasses (in field order), depth first. ``floating``: True (float only), False (integer only, no bool),
    None (all). The Monitor reads models by this structure, never by argument or attribute names: a block's input
    stream is its floating input (positional first, then keyword) with the shape of its output stream, its first
    floating output."""
    if isinstance(obj, Tensor):
        if floating is None or (obj.is_floating_point() is floating and obj.dtype != torch.bool):
            yield obj
        return
    if isinstance(obj, Mapping):
        items: Iterable[Any] = obj.values()
    elif isinstance(obj, (tuple, list)):
        items = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = (getattr(obj, f.name, None) for f in dataclasses.fields(obj))
    else:
        return
    for o in items:
        yield from tensors(o, floating=floating)


def first_tensor(obj: Any) -> Tensor | None:
    """The first floating tensor of ``obj`` (:func:`tensors`), or None."""
    return next(tensors(obj), None)
