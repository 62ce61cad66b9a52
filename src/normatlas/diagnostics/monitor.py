"""One object that watches the geometry of normalization during training, through hooks only.

``Monitor(model)`` registers forward hooks on the model's repeated blocks (found by
:func:`~normatlas.diagnostics.roles.find_blocks`, or given), on BatchNorm layers and on
optional VLM interface modules; every ``every`` steps the next forward is measured and
``monitor.step()`` (call it after ``backward()``, before ``zero_grad()``) adds the
gradient norms and effective learning rates, builds one flat record, sends it to the
sinks and runs the alarms. Between measured steps every hook returns at once.

Plain loop::

    mon = Monitor(model, every=10, optimizer=opt)
    for batch in data:
        loss = model(batch).loss
        loss.backward()
        mon.step(loss=loss)
        opt.step(); opt.zero_grad()
    mon.history.series("output_norm")

Record keys (``metric/statistic/layer``): ``output_norm``, ``grad_norm/total``,
``grad_norm/L3``, ``residual/{rms,var,update_ratio,identity_cos}/L3``,
``attention/{entropy,entropy_norm,entropy_norm_min,max_logit,sink_token,sink_share}/L3``,
``attention/entropy/L3/h0``, ``massive/{max_ratio,value,token,channel,count}/L3``,
``headroom/{bf16_log2,fp16_log2,bf16_underflow_share,nonfinite_share}`` (worst over blocks;
``-inf`` headroom and a positive ``nonfinite_share`` once a block outputs inf or NaN),
``headroom/{absmax,nonfinite_share}/L3``, ``effective_lr/<linear>``,
``weight_norm/<linear>``, ``weight_growth/<linear>``, ``batchnorm/{mean_gap,var_logratio}/<bn>``,
``ngrams/{max_repeats,flagged}``, ``modality/{vision_norm,text_norm,gap}``, and, for models
built from ``normatlas.blocks`` (whose residual add is a module), the exact per-sublayer
``residual_add/{branch_ratio,update_ratio}/<module>`` = RMS(branch) / RMS(stream).

Effective learning rate: a linear whose weight ``W`` feeds only norms (found from the dataflow
of one extra forward without gradients on the first measured step, with the RNG and buffers
restored; see :func:`~normatlas.diagnostics.roles.trace_linear_to_norm`) is scale-invariant, so
what its learning rate does depends on ``||W||``: the angular step is ``~ lr / ||W||^2`` under
SGD (the gradient shrinks as ``1 / ||W||``) and ``~ lr / ||W||`` under optimizers that normalize
the update (Adam, AdamW, RMSprop, ...), and does not depend on ``||W||`` under Adafactor's
relative step. ``effective_lr/<linear> = lr / ||W||^p`` with ``p`` = :attr:`Monitor.effective_lr_power`
chosen from the optimizer's type; without an optimizer (``lr`` = 1) or for an unknown type the
SGD law ``p = 2`` is assumed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..spec import parse_enum
from . import metrics as M
from .alarms import Alarm, AlarmEvent, NonFiniteAlarm, default_alarms
from .attention import AttentionCapture
from .health import fork_model_rng
from .metrics import DEFAULT_METRICS, LR_POWER, PER_BLOCK, Metric
from .roles import Kind, find_blocks, is_batch_norm, linear_norm_pairs, module_kind
from .sinks import MemorySink, Sink

__all__ = ["DEFAULT_METRICS", "Metric", "Monitor"]


def _first_tensor(obj: Any, float_only: bool = True) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj if (obj.is_floating_point() or not float_only) else None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    elif hasattr(obj, "last_hidden_state") and isinstance(obj.last_hidden_state, Tensor):
        return obj.last_hidden_state
    if isinstance(obj, (tuple, list)):
        for o in obj:
            t = _first_tensor(o, float_only)
            if t is not None:
                return t
    return None


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


def _residual_adds(model: nn.Module) -> list[nn.Module]:
    """``normatlas.blocks.residual.ResidualAdd`` modules, when that package is present."""
    try:
        from ..blocks.residual import ResidualAdd
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, ResidualAdd)]


class Monitor:
    """Attach diagnostics to ``model``; see the module docstring for the record keys.

    Args:
        model: any ``nn.Module``.
        every: measure one step in ``every`` (the overhead is paid only then).
        metrics: which :class:`Metric` s (or their string values) to collect.
        blocks: the residual blocks in depth order; found automatically if None (the largest
            ``ModuleList`` / ``Sequential`` of >= 2 same-class modules). A ``ValueError`` when there
            are none and ``metrics`` asks for a per-block one (residual, massive, headroom).
        optimizer: gives the learning rate, and by its type the law, of the effective-LR metric
            (see the module docstring).
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
        metrics: Iterable[Metric | str] = DEFAULT_METRICS,
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
        self.model, self.every, self.optimizer = model, every, optimizer
        if isinstance(metrics, (str, Metric)):
            metrics = [metrics]
        self.metrics = frozenset(parse_enum(Metric, m, name="metrics") for m in metrics)
        self.blocks = list(blocks) if blocks is not None else find_blocks(model)
        if modality is not None and set(modality) != {"vision", "text"}:
            raise ValueError(f"modality keys {sorted(modality)} must be exactly ['text', 'vision']")
        needs_blocks = sorted(m.value for m in self.metrics & PER_BLOCK)
        if not self.blocks and needs_blocks:
            found = (
                "blocks=[] was given" if blocks is not None else f"found no repeated blocks in {type(model).__name__}"
            )
            raise ValueError(
                f"Monitor: {found}; the metrics {', '.join(needs_blocks)} are measured per block. Blocks are found "
                "as the largest nn.ModuleList / nn.Sequential of >= 2 modules of one class that are not linears, "
                "norms or embeddings (e.g. HF's model.layers); pass blocks=[...] (in depth order), or metrics= "
                "without them (e.g. ['grad_norm', 'output_norm', 'batchnorm'])"
            )
        for i, blk in enumerate(self.blocks):
            if not isinstance(blk, nn.Module):
                raise TypeError(f"blocks[{i}] must be an nn.Module, got {type(blk).__name__}")
        self.modality = dict(modality or {})
        if self.modality:
            self.metrics |= {Metric.MODALITY}
        self.history = MemorySink()
        self.sinks: list[Sink] = [self.history, *sinks]
        self.alarms = list(default_alarms() if alarms is None else alarms)
        self.max_examples, self.per_head, self.print_alarms = max_examples, per_head, print_alarms
        self.print_progress, self.channels_first = print_progress, channels_first
        self.events: list[AlarmEvent] = []
        self.step_count = 0
        self._record: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._forward_done = False
        self._capture: AttentionCapture | None = None
        self._attn_calls: dict[int, int] = {}
        self._inputs: dict[int, Tensor | None] = {}
        self._pairs: list[tuple[str, nn.Parameter]] | None = None
        self._tracing = False
        self._w0: dict[str, float] = {}
        names = {m: n for n, m in model.named_modules()}
        self._names = names
        self._layer_of = self._param_layers()
        self._kinds: dict[nn.Module, Kind] = {}
        if Metric.EFFECTIVE_LR in self.metrics:  # probe before any hook exists
            self._kinds = {m: module_kind(m) for m in model.modules()}
        self.attach()

    # ------------------------------------------------------------------ wiring
    def _param_layers(self) -> list[tuple[str, nn.Parameter]]:
        owner: dict[int, str] = {}
        for i, blk in enumerate(self.blocks):
            for p in blk.parameters():
                owner.setdefault(id(p), f"L{i}")
        out = []
        for name, p in self.model.named_parameters():
            out.append((owner.get(id(p), name.split(".")[0]), p))
        return out

    @property
    def armed(self) -> bool:
        """True while the current step is a measured one and its forward has not run yet."""
        return self.step_count % self.every == 0 and not self._forward_done and not self._tracing

    def attach(self) -> Monitor:
        if self._handles:
            return self
        h = self._handles
        h.append(self.model.register_forward_pre_hook(self._model_pre, with_kwargs=True))
        h.append(self.model.register_forward_hook(self._model_post, always_call=True))
        for i, blk in enumerate(self.blocks):
            h.append(blk.register_forward_pre_hook(self._block_pre(i), with_kwargs=True))
            h.append(blk.register_forward_hook(self._block_post(i), always_call=True))
        if Metric.BATCHNORM in self.metrics:
            for mod in self.model.modules():
                if is_batch_norm(mod):
                    h.append(mod.register_forward_pre_hook(self._bn_pre))
        for side, mod in self.modality.items():
            h.append(mod.register_forward_hook(self._modality_post(side)))
        if Metric.RESIDUAL in self.metrics:
            for mod in _residual_adds(self.model):
                h.append(mod.register_forward_hook(self._residual_add_post))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stop_capture()

    def close(self) -> None:
        self.detach()
        for s in self.sinks:
            s.close()

    def __enter__(self) -> Monitor:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks
    def _model_pre(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.armed:
            return
        if Metric.NGRAMS in self.metrics:
            ids = kwargs.get("input_ids")
            if ids is None:
                ids = next((a for a in args if isinstance(a, Tensor) and not a.is_floating_point()), None)
            if isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point() and ids.dtype != torch.bool:
                r = M.repeated_ngrams(ids)
                self._record["ngrams/max_repeats"] = r["max_repeats"]
                self._record["ngrams/flagged"] = len(r["flagged"])  # type: ignore[arg-type]
        if Metric.EFFECTIVE_LR in self.metrics and self._pairs is None:
            self._trace(args, kwargs)

    def _model_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if not self.armed:
            return
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if isinstance(loss, Tensor) and loss.numel() == 1:  # HF-style outputs carry their loss
            self._record["loss"] = float(loss.detach())
        if Metric.OUTPUT_NORM in self.metrics and "output_norm" not in self._record:
            t = _first_tensor(out)
            if t is not None and t.dim() >= 2:
                self._record["output_norm"] = float(M.token_norms(t).mean())
        self._stop_capture()
        self._forward_done = True

    def _sub(self, t: Tensor) -> Tensor:
        if self.channels_first and t.dim() >= 3:
            t = t.movedim(1, -1).flatten(1, -2)
        return t[: self.max_examples] if t.dim() >= 3 else t

    def _block_pre(self, i: int) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.armed:
                return
            if self.metrics & {Metric.RESIDUAL}:
                t = _first_tensor(args) if args else None
                t = t if t is not None else _first_tensor(kwargs.get("hidden_states", kwargs))
                self._inputs[i] = t
            if Metric.ATTENTION in self.metrics:
                self._stop_capture()
                self._capture = AttentionCapture(lambda p, lg: self.record_attention(i, p, lg), self.max_examples)
                self._capture.__enter__()

        return hook

    def _block_post(self, i: int) -> Any:
        last = len(self.blocks) - 1

        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if not self.armed:
                return
            self._stop_capture()
            t = _first_tensor(out)
            if t is None:
                return
            y = self._sub(t)
            rec, tag = self._record, f"L{i}"
            x = self._inputs.pop(i, None)
            if Metric.RESIDUAL in self.metrics and x is not None and x.shape == t.shape:
                for k, v in M.residual_stats(self._sub(x), y).items():
                    rec[f"residual/{k}/{tag}"] = v
            if Metric.MASSIVE in self.metrics and y.dim() >= 2:
                ma = M.massive_activations(y)
                top = ma["top"][0]  # type: ignore[index]
                rec[f"massive/max_ratio/{tag}"] = ma["max_ratio"]
                rec[f"massive/count/{tag}"] = ma["massive"]
                for k in ("value", "token", "channel"):
                    rec[f"massive/{k}/{tag}"] = top[k]
            if Metric.HEADROOM in self.metrics:
                hr = M.headroom(y)
                rec[f"headroom/absmax/{tag}"] = hr["absmax"]
                rec[f"headroom/nonfinite_share/{tag}"] = hr["nonfinite_share"]
                for k, agg in (
                    ("bf16_headroom_log2", min),
                    ("fp16_headroom_log2", min),
                    ("bf16_underflow_share", max),
                    ("nonfinite_share", max),
                ):
                    key = "headroom/" + k.replace("_headroom", "")
                    rec[key] = agg(rec.get(key, hr[k]), hr[k])
            if Metric.OUTPUT_NORM in self.metrics and i == last:
                rec["output_norm"] = float(M.token_norms(y).mean())

        return hook

    def _bn_pre(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.armed or not mod.training or not args or not isinstance(args[0], Tensor):
            return
        rm, rv = getattr(mod, "running_mean", None), getattr(mod, "running_var", None)
        if not isinstance(rm, Tensor) or not isinstance(rv, Tensor):
            return
        x = args[0].detach().float()
        cdim = 1 if x.dim() > 1 else 0
        spec = getattr(mod, "spec", None)
        if spec is not None and spec.layout.channels_last:
            cdim = x.dim() - 1
        dims = [d for d in range(x.dim()) if d != cdim]
        mean, var = x.mean(dim=dims), x.var(dim=dims, unbiased=False)
        eps = float(getattr(mod, "eps", 1e-5) or 1e-5)
        name = self._names.get(mod, type(mod).__name__)
        self._record[f"batchnorm/mean_gap/{name}"] = float(
            ((mean - rm.float()).abs() / (rv.float() + eps).sqrt()).mean()
        )
        ratio = ((var + eps) / (rv.float() + eps)).log().abs()
        self._record[f"batchnorm/var_logratio/{name}"] = float(ratio.mean())

    def _residual_add_post(self, mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        """Exact per-sublayer split from a ``normatlas.blocks`` ``ResidualAdd(residual, branch)``."""
        if not self.armed or len(args) < 2 or not isinstance(out, Tensor):
            return
        x, b = self._sub(args[0]).detach().float(), self._sub(args[1]).detach().float()
        rms_x = x.pow(2).mean().sqrt().clamp_min(1e-30)
        name = self._names.get(mod, "residual_add")
        self._record[f"residual_add/branch_ratio/{name}"] = float(b.pow(2).mean().sqrt() / rms_x)
        self._record[f"residual_add/update_ratio/{name}"] = float(
            (self._sub(out).detach().float() - x).pow(2).mean().sqrt() / rms_x
        )

    def _modality_post(self, side: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            t = _first_tensor(out)
            if self.armed and t is not None:
                self._record[f"modality/{side}_norm"] = float(M.token_norms(t).mean())

        return hook

    def _stop_capture(self) -> None:
        if self._capture is not None:
            cap, self._capture = self._capture, None
            cap.__exit__(None, None, None)

    # ------------------------------------------------------------- effective LR
    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Find the scale-invariant linears from the dataflow of one extra forward (no gradients).

        The RNG is forked and every buffer restored, so training is not changed; the monitor's
        own hooks are off meanwhile. A model that cannot be recorded gets no pairs.
        """
        saved = [
            (mod, name, buf, buf.detach().clone())
            for mod in self.model.modules()
            for name, buf in mod._buffers.items()
            if buf is not None
        ]
        self._tracing = True
        try:
            with fork_model_rng(self.model):
                pairs = linear_norm_pairs(self.model, args, kwargs, self._kinds)
        except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError):
            pairs = []  # a diagnostic never breaks the forward pass
        finally:
            self._tracing = False
            with torch.no_grad():
                for mod, name, buf, old in saved:
                    if buf.shape != old.shape:
                        mod._buffers[name] = old
                    else:
                        mod._buffers[name] = buf  # undoes a reassignment
                        if not torch.equal(buf, old):
                            buf.copy_(old)
        self._pairs = []
        for lin in dict.fromkeys(lin for lin, _ in pairs):
            w = getattr(lin, "weight", None)
            if isinstance(w, nn.Parameter):
                self._pairs.append((self._names.get(lin, "?"), w))

    @property
    def scale_invariant(self) -> list[str]:
        """Names of the linear layers whose weight is scale-invariant: unbiased (or biased in front of
        a BatchNorm / InstanceNorm), feeding only norms (empty before the first measured step)."""
        return [n for n, _ in self._pairs or []]

    @property
    def effective_lr_power(self) -> int:
        """``p`` in ``effective_lr = lr / ||W||^p``: 2 for SGD (and without an optimizer or for an
        unknown type), 1 for update-normalizing optimizers (Adam family, RMSprop, ...), 0 for Adafactor."""
        for cls, p in LR_POWER:
            if isinstance(self.optimizer, cls):
                return p
        return 2

    def _lr_of(self, p: Tensor) -> float:
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                if any(q is p for q in g["params"]):
                    return float(g.get("lr", 1.0))
        return 1.0

    # ------------------------------------------------------------------ public
    def record_attention(
        self, layer: int, probs: Tensor, logits: Tensor | None = None, allowed: Tensor | None = None
    ) -> None:
        """Add one attention map ``(B, H, Tq, Tk)`` of ``layer`` (also for user hooks). The keys each
        query may attend to come from ``allowed`` or ``logits``, as in :func:`~.metrics.attention_stats`."""
        n = self._attn_calls.get(layer, 0)
        self._attn_calls[layer] = n + 1
        tag = f"L{layer}" if n == 0 else f"L{layer}.{n}"
        st = M.attention_stats(probs, logits, allowed=allowed)
        rec = self._record
        for k in ("entropy", "entropy_norm", "entropy_norm_min", "max_logit"):
            if k in st:
                rec[f"attention/{k}/{tag}"] = st[k]
        if self.per_head:
            per_head: list[float] = st["entropy_per_head"]  # type: ignore[assignment]
            for h, v in enumerate(per_head):
                rec[f"attention/entropy/{tag}/h{h}"] = v
        sk = M.attention_sinks(probs)
        rec[f"attention/sink_token/{tag}"] = sk["sink_token"]
        rec[f"attention/sink_share/{tag}"] = sk["sink_share"]

    def step(self, loss: float | Tensor | None = None) -> list[AlarmEvent]:
        """Close the current step: on a measured step add gradient norms and effective LRs,
        write the record to the sinks and run the alarms. Returns the alarms that fired.
        ``loss`` is checked on every step: a NaN or infinite loss fires the
        :class:`~normatlas.diagnostics.alarms.NonFiniteAlarm` (one of the default alarms) also
        between measured steps (a tensor loss costs one device sync per step for that).
        A detached monitor records nothing."""
        events: list[AlarmEvent] = []
        if not self._handles:
            return events  # detached: records nothing
        value = None if loss is None else _loss_value(loss)
        if self.step_count % self.every == 0:
            rec = self._record
            if value is not None:
                rec["loss"] = value
            if Metric.GRAD_NORM in self.metrics:
                self._grad_norms(rec)
            if Metric.EFFECTIVE_LR in self.metrics and self._pairs:
                power = self.effective_lr_power
                for name, w in self._pairs:
                    wn = float(w.detach().float().norm())
                    w0 = self._w0.setdefault(name, wn)
                    rec[f"weight_norm/{name}"] = wn
                    rec[f"weight_growth/{name}"] = wn / w0 if w0 > 0 else math.inf
                    rec[f"effective_lr/{name}"] = self._lr_of(w) / wn**power if wn > 0 else math.inf
            if "modality/vision_norm" in rec and "modality/text_norm" in rec:
                t = rec["modality/text_norm"]
                rec["modality/gap"] = rec["modality/vision_norm"] / t if t > 0 else math.inf
            rec = {"step": self.step_count, **rec}
            for s in self.sinks:
                s.write(rec)
            for a in self.alarms:
                events += a.check(self.step_count, rec)
            for e in events:
                if self.print_alarms:
                    print(e, flush=True)
            self.events += events
            if self.print_progress:
                print(self.summary(), flush=True)
        elif value is not None and not math.isfinite(value):  # a diverged loss is reported on every step
            for a in self.alarms:
                if isinstance(a, NonFiniteAlarm):
                    events += a.check(self.step_count, {"step": self.step_count, "loss": value})
            for e in events:
                if self.print_alarms:
                    print(e, flush=True)
            self.events += events
        self._record = {}
        self._attn_calls = {}
        self._forward_done = False
        self.step_count += 1
        return events

    def _grad_norms(self, rec: dict[str, Any]) -> None:
        labels, grads = [], []
        for label, p in self._layer_of:
            if p.grad is not None:
                labels.append(label)
                grads.append(p.grad.detach())
        if not grads:
            return
        norms = torch._foreach_norm(grads)
        sq = torch.stack([n.float() for n in norms]).pow(2)
        rec["grad_norm/total"] = float(sq.sum().sqrt())
        per: dict[str, float] = {}
        for label, v in zip(labels, sq.tolist(), strict=False):
            per[label] = per.get(label, 0.0) + v
        for label, v in per.items():
            rec[f"grad_norm/{label}"] = math.sqrt(v)

    @property
    def last(self) -> dict[str, Any]:
        """The latest record (empty before the first measured step)."""
        return self.history.records[-1] if self.history.records else {}

    def layer_table(self, record: Mapping[str, Any] | None = None) -> list[dict[str, object]]:
        """One row per block of ``record`` (default: the latest) for printing."""
        rec = self.last if record is None else record
        rows = []
        cols = [
            ("rms", "residual/rms"),
            ("update/resid", "residual/update_ratio"),
            ("cos(in,out)", "residual/identity_cos"),
            ("attn_entropy", "attention/entropy"),
            ("ent_norm_min", "attention/entropy_norm_min"),
            ("max_logit", "attention/max_logit"),
            ("sink_tok", "attention/sink_token"),
            ("sink_share", "attention/sink_share"),
            ("massive_x_median", "massive/max_ratio"),
            ("massive_tok", "massive/token"),
            ("massive_ch", "massive/channel"),
            ("grad_norm", "grad_norm"),
        ]
        for i in range(len(self.blocks)):
            row: dict[str, object] = {"layer": i}
            for title, key in cols:
                v = rec.get(f"{key}/L{i}")
                if v is not None:
                    row[title] = f"{v:.4g}" if isinstance(v, float) else v
            rows.append(row)
        return rows

    def summary(self) -> str:
        """A one-line progress summary of the latest record."""
        r = self.last
        parts = [f"step {r.get('step', '-')}"]
        for key, label in (("loss", "loss"), ("output_norm", "out-norm"), ("grad_norm/total", "grad")):
            if key in r:
                parts.append(f"{label} {r[key]:.4g}")
        ents = {k: v for k, v in r.items() if k.startswith("attention/entropy_norm_min/")}
        if ents:
            k = min(ents, key=ents.__getitem__)
            parts.append(f"min attn-entropy {ents[k]:.3f} ({k.rsplit('/', 1)[1]})")
        parts.append(f"alarms {len(self.events)}")
        return " | ".join(parts)
