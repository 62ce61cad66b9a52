"""One object that watches the geometry of normalization during training, through hooks only.

This module owns the :class:`Monitor`: when to measure, which hooks to register for the metric objects it drives
(:mod:`~normatlas.diagnostics.metric_base` defines the protocol, :mod:`~normatlas.diagnostics.monitor_metrics` the
ten built-ins), how a record is assembled, written to the sinks and checked by the alarms, and how it prints.

``Monitor(model)`` finds the model's repeated blocks (:func:`~normatlas.diagnostics.roles.find_blocks`, or
given); every ``every`` steps the next forward is measured and ``monitor.step()`` (call it after ``backward()``,
before ``zero_grad()``) adds the gradient and step metrics, builds one flat record, sends it to the sinks and
runs the alarms. Between measured steps every hook returns at once.

Plain loop::

    mon = Monitor(model, every=10, optimizer=opt)
    for batch in data:
        loss = model(batch).loss
        loss.backward()
        mon.step(loss=loss)
        opt.step(); opt.zero_grad()
    mon.history.series("output_norm")
    print(mon.table())

Record keys are ``metric/statistic/layer`` (``residual/rms/L3``, ``attention/entropy/L3/h0``,
``batchnorm/mean_gap/<module name>``, ``output_norm``, ``loss``); :attr:`Monitor.columns` lists every one with
its unit and meaning (``format_table(mon.describe_columns())`` prints them), and :meth:`Monitor.layer_table`,
:meth:`Monitor.table` and :meth:`Monitor.summary` are derived from them.

The model is read by structure, never by argument or attribute names (:func:`~.metric_base.tensors`): a block's
input stream is its floating input (positional first, then keyword) with the shape of its output, its output
stream its first floating output; token ids are what enters the largest embedding table (see
:class:`~.monitor_metrics.Ngrams`). The loss is the ``loss`` entry of an output mapping or attribute
(transformers' outputs), or what ``step(loss=...)`` is given.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from .alarms import Alarm, AlarmEvent, NonFiniteAlarm, default_alarms
from .metric_base import Column, Hook, MonitorMetric, Row, Scope, first_tensor, tensors
from .metrics import DEFAULT_METRICS, Metric
from .monitor_metrics import Attention, EffectiveLR, Modality, lr_power, make_metric
from .roles import Kind, find_blocks, module_kind
from .sinks import MemorySink, Sink

__all__ = ["DEFAULT_METRICS", "LOSS", "Metric", "Monitor"]

LOSS = Column("loss", "loss", "the training loss: step(loss=...) or the model output's loss", summary="loss")


def _loss_value(loss: float | Tensor) -> float:
    if isinstance(loss, Tensor):
        if loss.numel() != 1:
            raise ValueError(f"loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
        return float(loss.detach())
    if isinstance(loss, (bool, str, bytes)):
        raise TypeError(f"loss must be a number or a one-element tensor, got {type(loss).__name__}")
    try:
        return float(loss)
    except (TypeError, ValueError):
        raise TypeError(f"loss must be a number or a one-element tensor, got {type(loss).__name__}") from None


def _output_loss(out: Any) -> Tensor | None:
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None


def _make_metrics(specs: Iterable[object], modality: bool) -> tuple[MonitorMetric, ...]:
    """Metric objects: the built-ins in :class:`Metric` order, then the user's in the order given; one per key."""
    if isinstance(specs, (str, Metric, MonitorMetric, type)):
        specs = [specs]
    made: dict[str, MonitorMetric] = {}
    for spec in specs:
        metric = make_metric(spec)
        if metric.key in made:
            if isinstance(spec, (str, Metric)):
                continue  # the same built-in named twice
            raise ValueError(f"metrics holds two metrics with key {metric.key!r}; each key may appear once")
        made[metric.key] = metric
    if modality and Metric.MODALITY.value not in made:
        made[Metric.MODALITY.value] = Modality()
    order = {m.value: i for i, m in enumerate(Metric)}
    return tuple(sorted(made.values(), key=lambda m: order.get(m.key, len(order))))


class Monitor:
    """Attach diagnostics to ``model``; see the module docstring for the record keys.

    Args:
        model: any ``nn.Module``.
        every: measure one step in ``every`` (the overhead is paid only then).
        metrics: which metrics to collect: :class:`Metric` s, their string values, and
            :class:`~normatlas.diagnostics.metric_base.MonitorMetric` objects (or classes) of your own.
        blocks: the residual blocks in depth order; found automatically if None (the largest
            ``ModuleList`` / ``Sequential`` of >= 2 same-class modules). A ``ValueError`` when there
            are none and ``metrics`` asks for a per-block one (residual, massive, headroom).
        optimizer: gives the learning rate, and by its type the law, of the effective-LR metric.
        sinks: where records go; a :class:`MemorySink` is always kept as ``history``.
        alarms: defaults to :func:`~normatlas.diagnostics.alarms.default_alarms`.
        modality: ``{"vision": module, "text": module}`` whose outputs are the two sides
            of a VLM interface (e.g. the projector and the token embedding).
        max_examples: examples of the batch used for activation metrics.
        per_head: record the entropy of every head as well.
        print_alarms: print each alarm when it fires.
        print_progress: print :meth:`summary` after every measured step.
        channels_first: block outputs are ``(N, C, *spatial)`` (CNNs); activation metrics
            then treat ``C`` as the feature axis and the spatial positions as tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 10,
        metrics: Iterable[Metric | str | MonitorMetric] = DEFAULT_METRICS,
        blocks: Sequence[nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sinks: Sequence[Sink] = (),
        alarms: Sequence[Alarm] | None = None,
        modality: Mapping[str, nn.Module] | None = None,
        max_examples: int = 4,
        per_head: bool = True,
        print_alarms: bool = True,
        print_progress: bool = False,
        channels_first: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} must be an integer >= 1")
        if max_examples < 1:
            raise ValueError(f"max_examples={max_examples!r} must be >= 1")
        if modality is not None and set(modality) != {"vision", "text"}:
            raise ValueError(f"modality keys {sorted(modality)} must be exactly ['text', 'vision']")
        self.model, self.every, self.optimizer = model, every, optimizer
        self.modality = dict(modality or {})
        self.metrics = _make_metrics(metrics, bool(self.modality))
        self.blocks = list(blocks) if blocks is not None else find_blocks(model)
        self._check_blocks(given=blocks is not None)
        self.history = MemorySink()
        self.sinks: list[Sink] = [self.history, *sinks]
        self.alarms = list(default_alarms() if alarms is None else alarms)
        self.max_examples, self.per_head, self.print_alarms = max_examples, per_head, print_alarms
        self.print_progress, self.channels_first = print_progress, channels_first
        self.events: list[AlarmEvent] = []
        self.step_count = 0
        self._record: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._forward_done, self._grads_read, self._unarmed = False, False, 0
        self._attn_calls: dict[int, int] = {}
        self._stream_in: dict[int, list[Tensor]] = {}
        self._names = {m: n for n, m in model.named_modules()}
        self._kinds: dict[nn.Module, Kind] | None = None
        self._layers: dict[nn.Module, int] | None = None
        self._by_hook = {h: [m for m in self.metrics if h in m.hooks] for h in Hook}
        for metric in self.metrics:
            metric.bind(self)
        self.attach()

    def _check_blocks(self, given: bool) -> None:
        needs_blocks = sorted(m.key for m in self.metrics if m.per_block)
        if not self.blocks and needs_blocks:
            found = "blocks=[] was given" if given else f"found no repeated blocks in {type(self.model).__name__}"
            raise ValueError(
                f"Monitor: {found}; the metrics {', '.join(needs_blocks)} are measured per block. Blocks are found "
                "as the largest nn.ModuleList / nn.Sequential of >= 2 modules of one class that are not linears, "
                "norms or embeddings (e.g. HF's model.layers); pass blocks=[...] (in depth order), or metrics= "
                "without them (e.g. ['grad_norm', 'output_norm', 'batchnorm'])"
            )
        for i, blk in enumerate(self.blocks):
            if not isinstance(blk, nn.Module):
                raise TypeError(f"blocks[{i}] must be an nn.Module, got {type(blk).__name__}")

    # ------------------------------------------------------------------ what metrics may ask
    def metric(self, key: Metric | str) -> MonitorMetric | None:
        """The metric object under ``key`` (a :class:`Metric` or a metric's ``key``), or None."""
        name = key.value if isinstance(key, Metric) else key
        return next((m for m in self.metrics if m.key == name), None)

    def kinds(self) -> Mapping[nn.Module, Kind]:
        """:func:`~normatlas.diagnostics.roles.module_kind` of every module, probed once with the hooks off."""
        if self._kinds is None:
            with self.unarmed():
                self._kinds = {m: module_kind(m) for m in self.model.modules()}
        return self._kinds

    def norms(self) -> list[nn.Module]:
        """The model's norm modules, found by behaviour (:meth:`kinds`), in module order."""
        return [m for m, k in self.kinds().items() if k is Kind.NORM]

    def name_of(self, module: nn.Module) -> str:
        """``module``'s qualified name in the model (its class name when it is not in the model)."""
        return self._names.get(module, type(module).__name__)

    def layer_of(self, module: nn.Module) -> int | None:
        """The index of the block holding ``module`` (None outside every block)."""
        if self._layers is None:
            self._layers = {}
            for i, blk in enumerate(self.blocks):
                for m in blk.modules():
                    self._layers.setdefault(m, i)
        return self._layers.get(module)

    def sample(self, t: Tensor) -> Tensor:
        """The part of an activation the metrics read: ``max_examples`` examples; ``(N, tokens, C)`` for CNNs."""
        if self.channels_first and t.dim() >= 3:
            t = t.movedim(1, -1).flatten(1, -2)
        return t[: self.max_examples] if t.dim() >= 3 else t

    def lr_of(self, p: Tensor) -> float:
        """The learning rate of ``p``'s optimizer group (1 without an optimizer)."""
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                if any(q is p for q in g["params"]):
                    return float(g.get("lr", 1.0))
        return 1.0

    @contextlib.contextmanager
    def unarmed(self) -> Iterator[None]:
        """Every hook returns at once inside (for a metric's own extra forwards)."""
        self._unarmed += 1
        try:
            yield
        finally:
            self._unarmed -= 1

    @property
    def armed(self) -> bool:
        """True while the current step is a measured one and its forward has not run yet."""
        return self.step_count % self.every == 0 and not self._forward_done and not self._unarmed

    # ------------------------------------------------------------------ wiring
    def attach(self) -> Monitor:
        if self._handles:
            return self
        wiring = [(m, list(m.modules())) for m in self.metrics if m.hooks & {Hook.MODULE_INPUT, Hook.MODULE_OUTPUT}]
        h = self._handles
        h.append(self.model.register_forward_pre_hook(self._model_pre, with_kwargs=True))
        h.append(self.model.register_forward_hook(self._model_post, always_call=True))
        if self._by_hook[Hook.STREAM]:
            for i, blk in enumerate(self.blocks):
                h.append(blk.register_forward_pre_hook(self._block_pre(i), with_kwargs=True))
                h.append(blk.register_forward_hook(self._block_post(i), always_call=True))
        for metric, mods in wiring:
            for mod in mods:
                if Hook.MODULE_INPUT in metric.hooks:
                    h.append(mod.register_forward_pre_hook(self._module_pre(metric)))
                if Hook.MODULE_OUTPUT in metric.hooks:
                    h.append(mod.register_forward_hook(self._module_post(metric)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for metric in self.metrics:
            metric.release()

    def close(self) -> None:
        self.detach()
        for s in self.sinks:
            s.close()

    def __enter__(self) -> Monitor:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks
    def add(self, values: Row | None) -> None:
        """Add ``values`` (``{record key: value}``) to the current step's record."""
        if values:
            self._record.update(values)

    def _model_pre(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.armed:
            for metric in self._by_hook[Hook.MODEL_INPUT]:
                self.add(metric.on_model_input(args, kwargs))

    def _model_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if not self.armed:
            return
        loss = _output_loss(out)
        if loss is not None:  # transformers-style outputs carry their loss
            self._record["loss"] = float(loss.detach())
        for metric in self._by_hook[Hook.MODEL_OUTPUT]:
            self.add(metric.on_model_output(out))
        self._forward_done = True

    def _block_pre(self, i: int) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.armed:
                self._stream_in[i] = list(tensors((args, kwargs)))
                for metric in self._by_hook[Hook.STREAM]:
                    metric.on_block_start(i)

        return hook

    def _block_post(self, i: int) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if not self.armed:
                return
            stream = self._by_hook[Hook.STREAM]
            for metric in stream:
                metric.on_block_end(i)
            inputs, y = self._stream_in.pop(i, []), first_tensor(out)
            if y is None:
                return
            x = next((t for t in inputs if t.shape == y.shape), None)  # h_out = h_in + update: same shape
            xs, ys = (self.sample(x) if x is not None else None), self.sample(y)
            for metric in stream:
                self.add(metric.on_block(i, xs, ys))

        return hook

    def _module_pre(self, metric: MonitorMetric) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
            if self.armed:
                self.add(metric.on_module_input(mod, args))

        return hook

    def _module_post(self, metric: MonitorMetric) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if self.armed:
                self.add(metric.on_module_output(mod, args, out))

        return hook

    # ------------------------------------------------------------------ public
    @property
    def scale_invariant(self) -> list[str]:
        """Names of the linear layers whose weight is scale-invariant: unbiased (or biased in front of
        a BatchNorm / InstanceNorm), feeding only norms (empty before the first measured step)."""
        lr = self.metric(Metric.EFFECTIVE_LR)
        return [n for n, _ in lr.pairs or []] if isinstance(lr, EffectiveLR) else []

    @property
    def effective_lr_power(self) -> int:
        """``p`` in ``effective_lr = lr / ||W||^p``: 2 for SGD (and without an optimizer or for an
        unknown type), 1 for update-normalizing optimizers (Adam family, RMSprop, ...), 0 for Adafactor."""
        return lr_power(self.optimizer)

    def record_attention(
        self, layer: int, probs: Tensor, logits: Tensor | None = None, allowed: Tensor | None = None
    ) -> None:
        """Add one attention map ``(B, H, Tq, Tk)`` of ``layer`` (also for user hooks). The keys each
        query may attend to come from ``allowed`` or ``logits``, as in :func:`~.metrics.attention_stats`."""
        n = self._attn_calls.get(layer, 0)
        self._attn_calls[layer] = n + 1
        tag = f"L{layer}" if n == 0 else f"L{layer}.{n}"
        self.add(Attention.row(tag, probs, logits, allowed, self.per_head))

    def read_gradients(self) -> None:
        """Add the gradient metrics of a measured step now (once per step; :meth:`step` calls it too). For
        trainers that zero the gradients before the step closes (see :mod:`~.integrations`)."""
        if self._handles and self.step_count % self.every == 0 and not self._grads_read:
            self._grads_read = True
            for metric in self._by_hook[Hook.GRADIENTS]:
                self.add(metric.on_gradients())

    def step(self, loss: float | Tensor | None = None) -> list[AlarmEvent]:
        """Close the current step: on a measured step add gradient norms and effective LRs,
        write the record to the sinks and run the alarms. Returns the alarms that fired.
        ``loss`` is checked on every step: a NaN or infinite loss fires the
        :class:`~normatlas.diagnostics.alarms.NonFiniteAlarm` (one of the default alarms) also
        between measured steps (a tensor loss costs one device sync per step for that).
        A detached monitor records nothing."""
        if not self._handles:
            return []  # detached: records nothing
        value = None if loss is None else _loss_value(loss)
        events: list[AlarmEvent] = []
        if self.step_count % self.every == 0:
            events = self._close(value)
        elif value is not None and not math.isfinite(value):  # a diverged loss is reported on every step
            rec = {"step": self.step_count, "loss": value}
            events = self._report(
                [e for a in self.alarms if isinstance(a, NonFiniteAlarm) for e in a.check(self.step_count, rec)]
            )
        self._record, self._attn_calls, self._stream_in = {}, {}, {}
        self._forward_done = self._grads_read = False
        self.step_count += 1
        return events

    def _close(self, loss: float | None) -> list[AlarmEvent]:
        """A measured step's record: loss, gradients, step metrics; to the sinks and through the alarms."""
        if loss is not None:
            self._record["loss"] = loss
        self.read_gradients()
        for metric in self._by_hook[Hook.STEP]:
            self.add(metric.on_step(MappingProxyType(self._record)))
        rec = {"step": self.step_count, **self._record}
        for s in self.sinks:
            s.write(rec)
        events = self._report([e for a in self.alarms for e in a.check(self.step_count, rec)])
        if self.print_progress:
            print(self.summary(), flush=True)
        return events

    def _report(self, events: list[AlarmEvent]) -> list[AlarmEvent]:
        if self.print_alarms:
            for e in events:
                print(e, flush=True)
        self.events += events
        return events

    # ------------------------------------------------------------------ reading the records
    @property
    def last(self) -> dict[str, Any]:
        """The latest record (empty before the first measured step)."""
        return self.history.records[-1] if self.history.records else {}

    @property
    def columns(self) -> tuple[Column, ...]:
        """Every column a record may hold: the loss, then each metric's, in metric order."""
        return (LOSS, *(c for m in self.metrics for c in m.columns))

    def describe_columns(self) -> list[dict[str, object]]:
        """One row per column: the metric, its record key (pattern), title, unit and meaning."""
        suffix = {Scope.STEP: "", Scope.LAYER: "/L<i>", Scope.MODULE: "/<module>", Scope.HEAD: "/L<i>/h<j>"}
        owner = {id(c): m.key for m in self.metrics for c in m.columns}
        return [
            {
                "metric": owner.get(id(c), "monitor"),
                "key": c.key + suffix[c.scope],
                "title": c.title,
                "unit": c.unit,
                "description": c.description,
            }
            for c in self.columns
        ]

    def layer_table(self, record: Mapping[str, Any] | None = None) -> list[dict[str, object]]:
        """One row per block of ``record`` (default: the latest): the columns marked ``table``, formatted."""
        rec = self.last if record is None else record
        cols = [c for c in self.columns if c.table]
        rows = []
        for i in range(len(self.blocks)):
            row: dict[str, object] = {"layer": i}
            for col in cols:
                v = rec.get(col.at(i))
                if v is not None:
                    row[col.title] = col.format(v)
            rows.append(row)
        return rows

    def table(self, record: Mapping[str, Any] | None = None, width: int | None = None) -> str:
        """:meth:`layer_table` printed as a width-fitting text table, under :meth:`summary`'s line."""
        from ..cli._format import format_table  # the one table printer (stdlib only); the CLI sits above us

        rec = self.last if record is None else record
        return format_table(self.layer_table(rec), title=self.summary(rec), width=width)

    def summary(self, record: Mapping[str, Any] | None = None) -> str:
        """A one-line progress summary of ``record`` (default: the latest): the columns with a ``summary``
        label; a per-layer one by its worst layer."""
        r = self.last if record is None else record
        parts = [f"step {r.get('step', '-')}"]
        for col in self.columns:
            if col.summary is None:
                continue
            if col.scope is Scope.STEP:
                if col.key in r:
                    parts.append(f"{col.summary} {col.format(float(r[col.key]))}")
                continue
            found = {
                k: v for k, v in r.items() if k.startswith(col.key + "/") and k.count("/") == col.key.count("/") + 1
            }
            if found:
                k = (min if col.worst == "min" else max)(found, key=found.__getitem__)
                parts.append(f"{col.summary} {col.format(float(found[k]))} ({k.rsplit('/', 1)[1]})")
        parts.append(f"alarms {len(self.events)}")
        return " | ".join(parts)
