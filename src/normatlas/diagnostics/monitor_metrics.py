"""The ten built-in :class:`~normatlas.diagnostics.metric_base.MonitorMetric` s of the Monitor, and their registry.

Each class owns its hooks, its columns and the arithmetic that turns observed tensors into record values (through
the pure functions of :mod:`normatlas.diagnostics.metrics`); :data:`REGISTRY` maps every
:class:`~normatlas.diagnostics.metrics.Metric` to its class and :func:`make_metric` turns what a user passes in
``Monitor(metrics=...)`` (a Metric, its name, a metric object or class) into a checked object.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..functional import compute_dtype
from ..modules import Norm
from ..spec import parse_enum
from . import metrics as M
from .attention import AttentionCapture
from .health import fork_model_rng
from .metric_base import Column, Hook, MonitorMetric, Row, Scope, check_metric, first_tensor, tensors
from .metrics import LR_POWER, Metric
from .roles import is_batch_norm, linear_norm_pairs

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = [
    "REGISTRY",
    "Attention",
    "BatchNormHealth",
    "EffectiveLR",
    "GradNorm",
    "Headroom",
    "Massive",
    "Modality",
    "Ngrams",
    "OutputNorm",
    "Residual",
    "batch_norm_eps",
    "lr_power",
    "make_metric",
]


def batch_norm_eps(module: nn.Module, dtype: torch.dtype) -> float | None:
    """The eps ``module`` computes with on inputs of ``dtype``: torch BatchNorm's ``eps`` (0 stays 0); a normatlas
    ``Norm``'s ``spec.eps``, or the machine eps of its compute dtype when that is None; None when unknown."""
    if isinstance(module, Norm):
        eps = module.spec.eps
        return float(eps) if eps is not None else float(torch.finfo(compute_dtype(dtype, module.spec.cast_order)).eps)
    eps = getattr(module, "eps", None) if isinstance(module, nn.modules.batchnorm._BatchNorm) else None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        return None
    return float(eps)


def _full(t: Tensor) -> Tensor:
    """A plain tensor of ``t``'s full value (a DTensor is reduced / gathered; anything else is itself)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def lr_power(optimizer: object) -> int:
    """``p`` in ``effective_lr = lr / ||W||^p`` for ``optimizer``'s type (:data:`~.metrics.LR_POWER`; else 2)."""
    for cls, p in LR_POWER:
        if isinstance(optimizer, cls):
            return p
    return 2


def _residual_adds(model: nn.Module) -> list[nn.Module]:
    """``normatlas.blocks.residual.ResidualAdd`` modules, when that package is present."""
    try:
        from ..blocks.residual import ResidualAdd
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, ResidualAdd)]


# ------------------------------------------------------------------------------ the built-in metrics

_LAYER = Scope.LAYER


class OutputNorm(MonitorMetric):
    """Mean per-token L2 norm of the last block's output (the model's first floating output without blocks)."""

    key = Metric.OUTPUT_NORM.value
    hooks = frozenset({Hook.STREAM, Hook.MODEL_OUTPUT})
    columns = (
        Column("output_norm", "out-norm", "mean per-token L2 norm of the last block's output", summary="out-norm"),
    )

    def __init__(self) -> None:
        self._done = False

    def on_block(self, layer: int, x: Tensor | None, y: Tensor) -> Row | None:
        if layer != len(self.monitor.blocks) - 1:
            return None
        self._done = True
        return {"output_norm": float(M.token_norms(y).mean())}

    def on_model_output(self, output: Any) -> Row | None:
        done, self._done = self._done, False
        t = None if done else first_tensor(output)
        return {"output_norm": float(M.token_norms(t).mean())} if t is not None and t.dim() >= 2 else None


class GradNorm(MonitorMetric):
    """L2 norm of the gradients: in total and per block (other parameters under their top-level module)."""

    key = Metric.GRAD_NORM.value
    hooks = frozenset({Hook.GRADIENTS})
    columns = (
        Column("grad_norm/total", "grad", "L2 norm of every gradient", summary="grad"),
        Column("grad_norm", "grad_norm", "L2 norm of the block's gradients", scope=_LAYER, table=True),
    )

    def bind(self, monitor: Monitor) -> None:
        super().bind(monitor)
        owner: dict[int, str] = {}
        for i, blk in enumerate(monitor.blocks):
            for p in blk.parameters():
                owner.setdefault(id(p), f"L{i}")
        self._labels = [(owner.get(id(p), name.split(".")[0]), p) for name, p in monitor.model.named_parameters()]

    def on_gradients(self) -> Row | None:
        labels, grads = [], []
        for label, p in self._labels:
            if p.grad is not None:
                labels.append(label)
                grads.append(p.grad.detach())
        if not grads:
            return None
        norms = torch._foreach_norm(grads)
        # a sharded gradient's norm is a DTensor (a Partial sum of squares under sequence parallelism): its full value
        sq = torch.stack([_full(n).float() for n in norms]).pow(2)
        row: dict[str, object] = {"grad_norm/total": float(sq.sum().sqrt())}
        per: dict[str, float] = {}
        for label, v in zip(labels, sq.tolist(), strict=True):
            per[label] = per.get(label, 0.0) + v
        row.update({f"grad_norm/{label}": math.sqrt(v) for label, v in per.items()})
        return row


class Residual(MonitorMetric):
    """Each block as ``y = x + update`` (:func:`~.metrics.residual_stats`), and for models built from
    ``normatlas.blocks`` (whose residual add is a module) the exact split per sublayer."""

    key = Metric.RESIDUAL.value
    hooks = frozenset({Hook.STREAM, Hook.MODULE_OUTPUT})
    per_block = True
    columns = (
        Column("residual/rms", "rms", "RMS of the stream after the block", scope=_LAYER, table=True),
        Column("residual/var", "var", "mean per-token variance of the stream after the block", scope=_LAYER),
        Column("residual/update_ratio", "update/resid", "RMS(y - x) / RMS(x) of the block", scope=_LAYER, table=True),
        Column("residual/identity_cos", "cos(in,out)", "mean per-token cos(x, y)", scope=_LAYER, table=True),
        Column("residual_add/branch_ratio", "branch/stream", "RMS(branch) / RMS(stream)", scope=Scope.MODULE),
        Column("residual_add/update_ratio", "add update", "RMS(out - stream) / RMS(stream)", scope=Scope.MODULE),
    )

    def modules(self) -> Iterable[nn.Module]:
        return _residual_adds(self.monitor.model)

    def on_block(self, layer: int, x: Tensor | None, y: Tensor) -> Row | None:
        if x is None:
            return None
        return {f"residual/{k}/L{layer}": v for k, v in M.residual_stats(x, y).items()}

    def on_module_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Row | None:
        """``ResidualAdd(stream, branch)``: its two positional inputs."""
        if len(args) < 2 or not isinstance(output, Tensor):
            return None
        sample = self.monitor.sample
        x, b = sample(args[0]).detach().float(), sample(args[1]).detach().float()
        rms_x = x.pow(2).mean().sqrt().clamp_min(1e-30)
        name = self.monitor.name_of(module)
        return {
            f"residual_add/branch_ratio/{name}": float(b.pow(2).mean().sqrt() / rms_x),
            f"residual_add/update_ratio/{name}": float(
                (sample(output).detach().float() - x).pow(2).mean().sqrt() / rms_x
            ),
        }


class Attention(MonitorMetric):
    """Attention entropy, maximum logit and sinks of every attention map computed inside a block (eager softmax
    or SDPA, caught by :class:`~.attention.AttentionCapture`), or given through :meth:`Monitor.record_attention`."""

    key = Metric.ATTENTION.value
    hooks = frozenset({Hook.STREAM, Hook.MODEL_OUTPUT})
    columns = (
        Column("attention/entropy", "attn_entropy", "mean attention entropy", "nats", scope=_LAYER, table=True),
        Column("attention/entropy", "head entropy", "attention entropy of one head", "nats", scope=Scope.HEAD),
        Column("attention/entropy_norm", "entropy_norm", "entropy / log(allowed keys), mean over heads", scope=_LAYER),
        Column(
            "attention/entropy_norm_min",
            "ent_norm_min",
            "normalized entropy of the lowest head (1 uniform, 0 one-hot)",
            fmt=".3f",
            scope=_LAYER,
            table=True,
            summary="min attn-entropy",
        ),
        Column("attention/max_logit", "max_logit", "largest finite attention logit", scope=_LAYER, table=True),
        Column(
            "attention/sink_token", "sink_tok", "key position receiving the most attention", scope=_LAYER, table=True
        ),
        Column("attention/sink_share", "sink_share", "mean attention share of that key", scope=_LAYER, table=True),
    )

    def __init__(self) -> None:
        self._capture: AttentionCapture | None = None

    def on_block_start(self, layer: int) -> None:
        self.release()
        mon = self.monitor
        self._capture = AttentionCapture(lambda p, lg: mon.record_attention(layer, p, lg), mon.max_examples)
        self._capture.__enter__()

    def on_block_end(self, layer: int) -> None:
        self.release()

    def on_model_output(self, output: Any) -> Row | None:
        self.release()
        return None

    def release(self) -> None:
        if self._capture is not None:
            cap, self._capture = self._capture, None
            cap.__exit__(None, None, None)

    @staticmethod
    def row(tag: str, probs: Tensor, logits: Tensor | None, allowed: Tensor | None, per_head: bool) -> Row:
        """The values of one attention map ``(B, H, Tq, Tk)`` under layer tag ``tag`` (``L3``, ``L3.1``)."""
        st = M.attention_stats(probs, logits, allowed=allowed)
        row = {
            f"attention/{k}/{tag}": st[k]
            for k in ("entropy", "entropy_norm", "entropy_norm_min", "max_logit")
            if k in st
        }
        if per_head:
            per: list[float] = st["entropy_per_head"]  # type: ignore[assignment]
            row.update({f"attention/entropy/{tag}/h{h}": v for h, v in enumerate(per)})
        sk = M.attention_sinks(probs)
        row[f"attention/sink_token/{tag}"] = sk["sink_token"]
        row[f"attention/sink_share/{tag}"] = sk["sink_share"]
        return row


class Massive(MonitorMetric):
    """The largest activation of each block's output over its median (:func:`~.metrics.massive_activations`)."""

    key = Metric.MASSIVE.value
    hooks = frozenset({Hook.STREAM})
    per_block = True
    columns = (
        Column(
            "massive/max_ratio",
            "massive_x_median",
            "largest |activation| / median",
            "x median",
            scope=_LAYER,
            table=True,
        ),
        Column("massive/value", "massive", "largest |activation|", scope=_LAYER),
        Column("massive/token", "massive_tok", "its token (spatial position for CNNs)", scope=_LAYER, table=True),
        Column("massive/channel", "massive_ch", "its channel", scope=_LAYER, table=True),
        Column("massive/count", "n_massive", "entries above 100 x median", scope=_LAYER),
    )

    def on_block(self, layer: int, x: Tensor | None, y: Tensor) -> Row | None:
        if y.dim() < 2:
            return None
        ma = M.massive_activations(y)
        top = ma["top"][0]  # type: ignore[index]
        row = {f"massive/max_ratio/L{layer}": ma["max_ratio"], f"massive/count/L{layer}": ma["massive"]}
        row.update({f"massive/{k}/L{layer}": top[k] for k in ("value", "token", "channel")})
        return row


# per-block headroom value -> (record key of the worst over blocks, how the worst is chosen)
_HEADROOM_WORST = {
    "bf16_headroom_log2": ("headroom/bf16_log2", min),
    "fp16_headroom_log2": ("headroom/fp16_log2", min),
    "bf16_underflow_share": ("headroom/bf16_underflow_share", max),
    "nonfinite_share": ("headroom/nonfinite_share", max),
}


class Headroom(MonitorMetric):
    """Distance of each block's output from the bf16 / fp16 maximum (:func:`~.metrics.headroom`), worst over blocks:
    ``-inf`` headroom and a positive ``nonfinite_share`` once a block outputs inf or NaN."""

    key = Metric.HEADROOM.value
    hooks = frozenset({Hook.STREAM, Hook.STEP})
    per_block = True
    columns = (
        Column("headroom/bf16_log2", "bf16 headroom", "log2(bf16 max / max|block output|), worst block", "log2"),
        Column("headroom/fp16_log2", "fp16 headroom", "log2(fp16 max / max|block output|), worst block", "log2"),
        Column("headroom/bf16_underflow_share", "bf16 underflow", "share of non-zeros that bf16 rounds to 0", "share"),
        Column("headroom/nonfinite_share", "non-finite", "share of inf / NaN values, worst block", "share"),
        Column("headroom/absmax", "absmax", "max|block output|", scope=_LAYER),
        Column("headroom/nonfinite_share", "non-finite", "share of inf / NaN values", "share", scope=_LAYER),
    )

    def __init__(self) -> None:
        self._worst: dict[str, float] = {}

    def on_block(self, layer: int, x: Tensor | None, y: Tensor) -> Row | None:
        hr = M.headroom(y)
        for k, (key, agg) in _HEADROOM_WORST.items():
            self._worst[key] = agg(self._worst.get(key, hr[k]), hr[k])
        return {f"headroom/absmax/L{layer}": hr["absmax"], f"headroom/nonfinite_share/L{layer}": hr["nonfinite_share"]}

    def on_step(self, record: Mapping[str, object]) -> Row | None:
        worst, self._worst = self._worst, {}
        return worst


class EffectiveLR(MonitorMetric):
    """``effective_lr/<linear> = lr / ||W||^p`` of every scale-invariant linear.

    A linear whose weight ``W`` feeds only norms (found from the dataflow of one extra forward without gradients on
    the first measured step, with the RNG and buffers restored; see :func:`~.roles.trace_linear_to_norm`) is
    scale-invariant, so what its learning rate does depends on ``||W||``: the angular step is ``~ lr / ||W||^2``
    under SGD (the gradient shrinks as ``1 / ||W||``) and ``~ lr / ||W||`` under optimizers that normalize the
    update (Adam, AdamW, RMSprop, ...), and does not depend on ``||W||`` under Adafactor's relative step. ``p`` is
    chosen from the optimizer's type (:func:`lr_power`); without an optimizer (``lr`` = 1) or for an unknown type
    the SGD law ``p = 2`` is assumed.
    """

    key = Metric.EFFECTIVE_LR.value
    hooks = frozenset({Hook.MODEL_INPUT, Hook.STEP})
    columns = (
        Column("effective_lr", "effective lr", "lr / ||W||^p of a scale-invariant linear", scope=Scope.MODULE),
        Column("weight_norm", "||W||", "Frobenius norm of its weight", scope=Scope.MODULE),
        Column("weight_growth", "||W|| / ||W0||", "its norm over the first measured one", scope=Scope.MODULE),
    )

    def __init__(self) -> None:
        self.pairs: list[tuple[str, nn.Parameter]] | None = None
        self._w0: dict[str, float] = {}

    def bind(self, monitor: Monitor) -> None:
        super().bind(monitor)
        monitor.kinds()  # probe every module now, before any hook exists

    def on_model_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Row | None:
        if self.pairs is None:
            self.pairs = self._trace(args, kwargs)
        return None

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, nn.Parameter]]:
        """The scale-invariant linears of one extra forward; the monitor's hooks are off meanwhile and every buffer
        is restored. A model that cannot be recorded gets none."""
        mon = self.monitor
        saved = [
            (m, n, b, b.detach().clone()) for m in mon.model.modules() for n, b in m._buffers.items() if b is not None
        ]
        try:
            with mon.unarmed(), fork_model_rng(mon.model):
                pairs = linear_norm_pairs(mon.model, args, kwargs, mon.kinds())
        except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError):
            pairs = []  # a diagnostic never breaks the forward pass
        finally:
            with torch.no_grad():
                for mod, name, buf, old in saved:
                    if buf.shape != old.shape:
                        mod._buffers[name] = old
                    else:
                        mod._buffers[name] = buf  # undoes a reassignment
                        if not torch.equal(buf, old):
                            buf.copy_(old)
        out = []
        for lin in dict.fromkeys(lin for lin, _ in pairs):
            w = getattr(lin, "weight", None)
            if isinstance(w, nn.Parameter):
                out.append((mon.name_of(lin), w))
        return out

    def on_step(self, record: Mapping[str, object]) -> Row | None:
        mon, row = self.monitor, {}
        power = lr_power(mon.optimizer)
        for name, w in self.pairs or []:
            wn = float(w.detach().float().norm())
            w0 = self._w0.setdefault(name, wn)
            row[f"weight_norm/{name}"] = wn
            row[f"weight_growth/{name}"] = wn / w0 if w0 > 0 else math.inf
            row[f"effective_lr/{name}"] = mon.lr_of(w) / wn**power if wn > 0 else math.inf
        return row


class BatchNormHealth(MonitorMetric):
    """Train / eval gap of every BatchNorm in train mode: batch statistics against the running ones, with the eps
    the module computes with (:func:`batch_norm_eps`; NaN when it is unknown)."""

    key = Metric.BATCHNORM.value
    hooks = frozenset({Hook.MODULE_INPUT})
    columns = (
        Column("batchnorm/mean_gap", "mean gap", "mean |batch mean - running mean| / running std", scope=Scope.MODULE),
        Column("batchnorm/var_logratio", "var logratio", "mean |log(batch var / running var)|", scope=Scope.MODULE),
    )

    def modules(self) -> Iterable[nn.Module]:
        return [m for m in self.monitor.model.modules() if is_batch_norm(m)]

    def on_module_input(self, module: nn.Module, args: tuple[Any, ...]) -> Row | None:
        rm, rv = getattr(module, "running_mean", None), getattr(module, "running_var", None)
        if not module.training or not args or not isinstance(args[0], Tensor):
            return None
        if not isinstance(rm, Tensor) or not isinstance(rv, Tensor):
            return None
        x = args[0].detach()
        eps = batch_norm_eps(module, x.dtype)
        x = x.float()
        cdim = 1 if x.dim() > 1 else 0
        if isinstance(module, Norm) and module.spec.layout.channels_last:
            cdim = x.dim() - 1
        dims = [d for d in range(x.dim()) if d != cdim]
        mean, var = x.mean(dim=dims), x.var(dim=dims, unbiased=False)
        name = self.monitor.name_of(module)
        if eps is None:
            return {f"batchnorm/mean_gap/{name}": math.nan, f"batchnorm/var_logratio/{name}": math.nan}
        gap = ((mean - rm.float()).abs() / (rv.float() + eps).sqrt()).mean()
        ratio = ((var + eps) / (rv.float() + eps)).log().abs().mean()
        return {f"batchnorm/mean_gap/{name}": float(gap), f"batchnorm/var_logratio/{name}": float(ratio)}


class Ngrams(MonitorMetric):
    """Repeated n-grams in the batch's token ids (:func:`~.metrics.repeated_ngrams`; OLMo 2's data filter).

    The token ids are found by structure, never by an argument name: the 2-D integer tensor that enters the
    model's largest embedding table (``nn.Embedding`` / ``nn.EmbeddingBag``), preferring one the model was called
    with; without an embedding, the model's first 2-D integer argument (positional first, then keyword).
    """

    key = Metric.NGRAMS.value
    hooks = frozenset({Hook.MODEL_INPUT, Hook.MODULE_INPUT, Hook.MODEL_OUTPUT})
    columns = (
        Column("ngrams/max_repeats", "max repeats", "most back-to-back repeats of an n-gram (n <= 13) in a sequence"),
        Column("ngrams/flagged", "flagged", "sequences with >= 32 repeats"),
    )

    def __init__(self) -> None:
        self._inputs: list[Tensor] = []
        self._fed: list[tuple[int, Tensor]] = []

    def modules(self) -> Iterable[nn.Module]:
        return [m for m in self.monitor.model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]

    def on_model_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Row | None:
        self._inputs = [t for t in tensors((args, kwargs), floating=False) if t.dim() == 2]
        self._fed = []
        return None

    def on_module_input(self, module: nn.Module, args: tuple[Any, ...]) -> Row | None:
        t = args[0] if args else None
        table = getattr(module, "num_embeddings", 0)
        if isinstance(t, Tensor) and t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool:
            self._fed.append((int(table), t))
        return None

    def on_model_output(self, output: Any) -> Row | None:
        ids = self._token_ids()
        self._inputs, self._fed = [], []
        if ids is None:
            return None
        r = M.repeated_ngrams(ids)
        return {"ngrams/max_repeats": r["max_repeats"], "ngrams/flagged": len(r["flagged"])}  # type: ignore[arg-type]

    def _token_ids(self) -> Tensor | None:
        def given(t: Tensor) -> bool:
            return any(t.data_ptr() == i.data_ptr() and t.shape == i.shape for i in self._inputs)

        fed = [f for f in self._fed if given(f[1])] or self._fed
        if fed:
            return max(fed, key=lambda f: f[0])[1]  # the first of the largest tables on a tie
        return self._inputs[0] if self._inputs else None


class Modality(MonitorMetric):
    """Mean token norm on the two sides of a VLM interface and their ratio (the essay's VLM section): the outputs
    of ``vision`` and ``text`` (default: the Monitor's ``modality=`` mapping)."""

    key = Metric.MODALITY.value
    hooks = frozenset({Hook.MODULE_OUTPUT, Hook.STEP})
    columns = (
        Column("modality/vision_norm", "vision norm", "mean per-token L2 norm of the vision side"),
        Column("modality/text_norm", "text norm", "mean per-token L2 norm of the text side"),
        Column("modality/gap", "gap", "vision norm / text norm", "x"),
    )

    def __init__(self, vision: nn.Module | None = None, text: nn.Module | None = None) -> None:
        self.sides = {"vision": vision, "text": text}

    def bind(self, monitor: Monitor) -> None:
        super().bind(monitor)
        for side, mod in monitor.modality.items():
            self.sides[side] = self.sides[side] or mod

    def modules(self) -> Iterable[nn.Module]:
        return [m for m in self.sides.values() if m is not None]

    def on_module_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Row | None:
        t = first_tensor(output)
        if t is None:
            return None
        norm = float(M.token_norms(t).mean())
        return {f"modality/{side}_norm": norm for side, m in self.sides.items() if m is module}

    def on_step(self, record: Mapping[str, object]) -> Row | None:
        v, t = record.get("modality/vision_norm"), record.get("modality/text_norm")
        if not isinstance(v, float) or not isinstance(t, float):
            return None
        return {"modality/gap": v / t if t > 0 else math.inf}


REGISTRY: dict[Metric, type[MonitorMetric]] = {
    Metric.OUTPUT_NORM: OutputNorm,
    Metric.GRAD_NORM: GradNorm,
    Metric.RESIDUAL: Residual,
    Metric.ATTENTION: Attention,
    Metric.MASSIVE: Massive,
    Metric.HEADROOM: Headroom,
    Metric.EFFECTIVE_LR: EffectiveLR,
    Metric.BATCHNORM: BatchNormHealth,
    Metric.NGRAMS: Ngrams,
    Metric.MODALITY: Modality,
}


def make_metric(spec: object) -> MonitorMetric:
    """A metric object from a :class:`Metric`, its string value, a :class:`MonitorMetric` instance or subclass."""
    if isinstance(spec, MonitorMetric):
        metric = spec
    elif isinstance(spec, type) and issubclass(spec, MonitorMetric):
        metric = spec()
    elif isinstance(spec, (str, Metric)):
        metric = REGISTRY[parse_enum(Metric, spec, name="metrics")]()
    else:
        raise TypeError(
            f"metrics holds {spec!r} ({type(spec).__name__}); each must be a Metric, its name, or a MonitorMetric"
        )
    return check_metric(metric)
