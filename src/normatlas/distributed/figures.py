"""The measured checks and figures of this package, as functions a test, a benchmark or a user can run.

Each ``*_check(rank, world_size)`` runs inside one process of :func:`~normatlas.distributed.spawn` (a gloo group
is initialised) and returns plain data: the largest differences from a single-process reference built on the same
rank from the same seed, the collectives counted, the replica findings. :func:`recompute_figures` runs in one
process. Sizes are the tests' (tiny, fp32); ``benchmarks/distributed_norms.py`` prints them.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from .counting import count_collectives
from .fsdp import shard_model
from .grads import Problem, check_replicas, reduce_partial_grads
from .plan import parallelize

__all__ = [
    "collectives_check", "fsdp_tp_check", "lm_config", "loss_parallel_check", "recompute_figures", "reduce_check",
    "syncbn_ddp_check", "tp_check",
]  # fmt: skip

VOCAB = 64


def lm_config(norm: str = "rms", placement: str = "pre_ln", *, qk_norm: bool = True, **changes: Any) -> Any:
    """A tiny TransformerLM config (2 layers, d_model 32, 4 heads / 2 kv heads, d_ff 64) for the checks."""
    from normatlas import blocks
    from normatlas.blocks.qknorm import QKNormConfig
    from normatlas.presets import LayerNorm, RMSNorm

    norms = {"rms": RMSNorm, "layernorm": LayerNorm}
    if norm not in norms:
        raise ValueError(f"norm={norm!r} must be one of {sorted(norms)}")
    if placement not in ("pre_ln", "peri_ln", "post_ln"):
        raise ValueError(f"placement={placement!r} must be one of 'pre_ln', 'peri_ln', 'post_ln'")
    kw = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm=norms[norm],
              placement=getattr(blocks, placement)(), qk_norm=QKNormConfig() if qk_norm else None)  # fmt: skip
    return blocks.ModelConfig(**{**kw, **changes})


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _logits(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(input_ids=ids, use_cache=False) if hasattr(model, "get_input_embeddings") else model(ids)
    return out.logits if hasattr(out, "logits") else out


def _max_diff(pairs: list[tuple[Any, Any]]) -> float:
    """The largest |a - b| over pairs of tensors (DTensors gathered whole); both of a pair must be tensors."""
    return max(float((_full(a).detach() - b.detach()).abs().max()) for a, b in pairs)


def _ids(seed: int, batch: int = 2, seq: int = 8) -> Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _compare_training(
    ref: nn.Module, par: nn.Module, ids: Tensor, rows: slice, steps: int
) -> dict[str, Any]:  # fmt: skip
    """One step compared in full (logits, loss, every gradient), then ``steps`` AdamW steps; the final weights.

    ``ref`` trains on the global batch ``ids``; ``par`` on this rank's ``ids[rows]`` (equal shares, so the mean of
    the ranks' mean losses is the global mean)."""
    local_ids = ids[rows]
    out: dict[str, Any] = {}
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        lr_, lp = _logits(ref, ids), _logits(par, local_ids)
        loss_r, loss_p = _loss(lr_, ids), _loss(lp, local_ids)
        loss_r.backward()
        loss_p.backward()
        if step == 0:
            out["pending"] = [f.name for f in check_replicas(par) if f.problem is Problem.PARTIAL_GRAD]
        reduced = reduce_partial_grads(par)
        if step == 0:
            out["reduced"] = reduced
            out["logits"] = float((_full(lp.detach()) - lr_[rows].detach()).abs().max())
            out["loss"] = abs(float(_full(loss_p)) - float(_loss(lr_[rows], local_ids)))
            pairs = [(p.grad, r.grad) for p, r in zip(par.parameters(), ref.parameters(), strict=False)]
            out["grads"] = _max_diff(pairs)
            out["findings_after_reduce"] = [str(f) for f in check_replicas(par)]
        opt_r.step()
        opt_p.step()
        opt_r.zero_grad()
        opt_p.zero_grad()
    out["weights"] = _max_diff(list(zip(par.parameters(), ref.parameters(), strict=False)))
    out["findings_after_steps"] = [str(f) for f in check_replicas(par, grads=False)]
    return out


def tp_check(rank: int, world_size: int, steps: int = 5, hf: str | None = None) -> list[dict[str, Any]]:
    """TP + SP over all ranks vs one process: pre / peri / post-LN x RMSNorm / LayerNorm with QK-norm, or the
    tiny transformers model ``hf`` (e.g. ``"llama"``). One dict per model (see :func:`_compare_training`)."""
    mesh = init_device_mesh("cpu", (world_size,))
    rows = []
    for name, ref in _tp_models(hf):
        par = parallelize(copy.deepcopy(ref), mesh)
        ids = _ids(1)
        row = _compare_training(ref, par, ids, slice(None), steps)
        row["model"] = name
        rows.append(row)
    return rows


def _tp_models(hf: str | None) -> list[tuple[str, nn.Module]]:
    from normatlas.blocks import TransformerLM

    if hf is not None:
        return [(hf, _hf_model(hf))]
    out: list[tuple[str, nn.Module]] = []
    for placement in ("pre_ln", "peri_ln", "post_ln"):
        for norm in ("rms", "layernorm"):
            torch.manual_seed(0)
            out.append((f"{placement}/{norm}/qk", TransformerLM(lm_config(norm, placement))))
    for name, cfg in _qk_variants().items():
        torch.manual_seed(0)
        out.append((name, _perturb_norms(TransformerLM(cfg))))
    return out


def _qk_variants() -> dict[str, Any]:
    """The QK-norms whose parameters belong to heads (a gain per head; one norm over the flattened heads, OLMo
    2's), and the fused CPU kernels on the sequence shards (``backend="fused"`` raises where they cannot run)."""
    from normatlas.blocks.qknorm import QKGain, QKNormConfig, QKScope
    from normatlas.presets import RMSNorm

    return {
        "pre_ln/rms/qk-per-head-gains": lm_config(qk_norm=False).with_(qk_norm=QKNormConfig(gain=QKGain.PER_HEAD)),
        "pre_ln/rms/qk-flattened": lm_config(qk_norm=False).with_(
            qk_norm=QKNormConfig(scope=QKScope.FLAT, gain=QKGain.PER_HEAD)
        ),
        "pre_ln/rms-fused/qk": lm_config().with_(norm=functools.partial(RMSNorm, backend="fused")),
    }


def _perturb_norms(model: nn.Module) -> nn.Module:
    """Every QK-norm gain moved off its init, so a gain row on the wrong rank shows in the logits."""
    from normatlas.blocks.qknorm import QKNorm

    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QKNorm) and m.weight is not None:
                m.weight.add_(0.2 * torch.randn(m.weight.shape, generator=gen))
    return model


def _hf_model(model_type: str) -> nn.Module:
    """A tiny transformers model: 2 layers, 32 wide, 4 heads (2 kv), gains and biases off their init."""
    import transformers

    classes = {
        "llama": "LlamaConfig", "qwen3": "Qwen3Config", "mistral": "MistralConfig", "gemma2": "Gemma2Config",
        "olmo2": "Olmo2Config", "qwen2": "Qwen2Config", "gemma3_text": "Gemma3TextConfig",
    }  # fmt: skip
    if model_type not in classes:
        raise ValueError(f"model_type={model_type!r} must be one of {sorted(classes)}")
    cfg = getattr(transformers, classes[model_type])(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.train()


def _step(model: nn.Module, ids: Tensor, opt: torch.optim.Optimizer) -> None:
    _loss(_logits(model, ids), ids).backward()
    reduce_partial_grads(model)
    opt.step()
    opt.zero_grad()


def fsdp_tp_check(rank: int, world_size: int, steps: int = 3) -> dict[str, Any]:
    """FSDP x TP on a ``(world_size // 2) x 2`` (dp x tp) mesh vs one process, over ``steps`` AdamW steps, in
    float64 (so that Adam's division by sqrt(v) does not magnify fp32 rounding in near-zero gradients)."""
    from normatlas.blocks import TransformerLM

    if world_size % 2:
        raise ValueError(f"world_size={world_size} must be even (a dp x 2 mesh)")
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = TransformerLM(lm_config("rms", "peri_ln")).double()
    par = shard_model(parallelize(copy.deepcopy(ref), mesh["tp"]), mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    ids = _ids(1, batch=2 * (world_size // 2))
    return _compare_training(ref, par, ids, slice(2 * dp, 2 * dp + 2), steps)


def collectives_check(rank: int, world_size: int) -> dict[str, Any]:
    """The collectives of one training step (forward, backward, gradient reduction, AdamW): FSDP2 over all ranks
    with the norms grouped into their blocks' units and with a unit per norm, and TP + SP over all ranks; rows of
    :class:`CollectiveStats` per layout, and under ``"comm_debug_mode"`` the total count that torch's own
    ``CommDebugMode`` gives for another such step (a cross-check of the counter)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from normatlas.blocks import TransformerLM

    flat = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {"comm_debug_mode": {}}
    for name in ("fsdp_grouped", "fsdp_per_norm", "tp_sp"):
        torch.manual_seed(0)
        model: nn.Module = TransformerLM(lm_config("rms", "pre_ln"))
        if name == "tp_sp":
            model = parallelize(model, flat)
        else:
            model = shard_model(model, flat, group_norms=name == "fsdp_grouped")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, _ids(2), opt)  # warm-up: lazy init and optimizer state
        _, stats = count_collectives(functools.partial(_step, model, _ids(2), opt))
        out[name] = stats.rows()
        with CommDebugMode() as cdm:
            _step(model, _ids(2), opt)
        out["comm_debug_mode"][name] = cdm.get_total_counts()
    return out


def loss_parallel_check(rank: int, world_size: int) -> dict[str, Any]:
    """The LM head column-parallel with the logits left sharded on the vocabulary (``loss_parallel=True``) and the
    cross-entropy computed under torch's ``loss_parallel()`` (no rank ever holds the whole logits), vs one
    process: the loss, every gradient, and the logits' placements."""
    from torch.distributed.tensor.parallel import loss_parallel

    from normatlas.blocks import TransformerLM

    from .plan import tensor_parallel_plan

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ref = TransformerLM(lm_config("rms", "peri_ln"))
    par = copy.deepcopy(ref)
    parallelize(par, mesh, tensor_parallel_plan(par, loss_parallel=True))
    ids = _ids(1)
    logits = par(ids)
    with loss_parallel():
        loss = _loss(logits, ids)
        loss.backward()
    reduce_partial_grads(par)
    loss_r = _loss(ref(ids), ids)
    loss_r.backward()
    pairs = [(p.grad, r.grad) for p, r in zip(par.parameters(), ref.parameters(), strict=False)]
    return {
        "placements": [str(p) for p in logits.placements] if isinstance(logits, DTensor) else ["plain"],
        "local_vocab": int(logits.to_local().shape[-1]) if isinstance(logits, DTensor) else int(logits.shape[-1]),
        "loss": abs(float(_full(loss)) - float(loss_r)),
        "grads": _max_diff(pairs),
    }


def reduce_check(rank: int, world_size: int) -> dict[str, Any]:
    """The collectives :func:`reduce_partial_grads` issues for the pending norm gradients of a TP + SP model
    (RMSNorm: weights; LayerNorm: weights and biases), and the reduced gradients against one process."""
    from normatlas.blocks import TransformerLM

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for norm in ("rms", "layernorm"):
        torch.manual_seed(0)
        ref = TransformerLM(lm_config(norm, "peri_ln"))
        par = parallelize(copy.deepcopy(ref), mesh)
        ids = _ids(1)
        _loss(par(ids), ids).backward()
        _loss(ref(ids), ids).backward()
        names, stats = count_collectives(functools.partial(reduce_partial_grads, par))
        pairs = [(p.grad, r.grad) for p, r in zip(par.parameters(), ref.parameters(), strict=False)]
        out[norm] = {"pending": len(names), "collectives": stats.rows(), "grads": _max_diff(pairs)}
    return out


def syncbn_ddp_check(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """Converted SyncBatchNorm in a real DDP step, uneven batches (rank r holds 3 + 2 r samples), vs one process
    on the concatenated batch: outputs, input and parameter gradients, running statistics, weights after SGD."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from normatlas.longtail import BatchNorm1d, BatchNorm2d

    from .syncbn import convert_sync_batchnorm

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNorm2d(4), nn.Tanh(), nn.Flatten(), nn.Linear(36, 5), BatchNorm1d(5))
    ddp = DistributedDataParallel(convert_sync_batchnorm(copy.deepcopy(ref)))
    sizes = [3 + 2 * r for r in range(world_size)]
    start, n = sum(sizes[:rank]), sum(sizes)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out: dict[str, Any] = {"sizes": sizes}
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 + step)
        x = torch.randn(n, 3, 3, 3, generator=gen, dtype=torch.float32)
        c = torch.randn(n, 5, generator=gen)
        xr, xd = x.clone().requires_grad_(), x[start : start + sizes[rank]].clone().requires_grad_()
        yr, yd = ref(xr), ddp(xd)
        ((yr * c).sum() / n).backward()
        (world_size * (yd * c[start : start + sizes[rank]]).sum() / n).backward()
        assert xd.grad is not None and xr.grad is not None
        if step == 0:
            out["output"] = float((yd - yr[start : start + sizes[rank]]).abs().max())
            out["input_grad"] = float((xd.grad / world_size - xr.grad[start : start + sizes[rank]]).abs().max())
            pairs = [(a.grad, b.grad) for a, b in zip(ddp.module.parameters(), ref.parameters(), strict=False)]
            out["param_grads"] = _max_diff(pairs)
        opt_r.step()
        opt_d.step()
        opt_r.zero_grad()
        opt_d.zero_grad()
    out["weights"] = _max_diff(list(zip(ddp.module.parameters(), ref.parameters(), strict=False)))
    bufs = [(a, b) for a, b in zip(ddp.module.buffers(), ref.buffers(), strict=False) if a.is_floating_point()]
    out["running_stats"] = _max_diff(bufs)
    out["replicas"] = [str(f) for f in check_replicas(ddp.module, group=dist.group.WORLD)]
    return out


_ALL = tuple((p, n) for p in ("pre_ln", "peri_ln", "post_ln") for n in ("rms", "layernorm"))


def recompute_figures(
    d_model: int = 64, seq: int = 64, batch: int = 4, configs: tuple[tuple[str, str], ...] = _ALL
) -> list[dict[str, Any]]:
    """Activation bytes per block without checkpointing and under :func:`norm_recompute_policy`, and the largest
    gradient difference between the two, for each (placement, norm) of ``configs`` (default: pre / peri / post-LN
    x RMSNorm / LayerNorm, all with QK-norm)."""
    from normatlas.blocks import TransformerLM
    from normatlas.blocks.attention import rope_tables

    from .recompute import block_activation_bytes, checkpoint_blocks

    rows = []
    for placement, norm in configs:
        torch.manual_seed(0)
        cfg = lm_config(norm, placement, d_model=d_model, d_ff=4 * d_model, n_kv_heads=None)
        model = TransformerLM(cfg)
        ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
        block = model.blocks()[0]
        x = model.embed(ids).detach().requires_grad_()
        cos, sin = rope_tables(cfg.rope, block.attn.head_dim, torch.arange(seq))
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
        b = block_activation_bytes(block, x, (cos, sin, cfg.rope.style), mask)
        ck = checkpoint_blocks(copy.deepcopy(model))
        _loss(model(ids), ids).backward()
        _loss(ck(ids), ids).backward()
        diff = _max_diff([(p.grad, q.grad) for p, q in zip(ck.parameters(), model.parameters(), strict=False)])
        rows.append({"model": f"{placement}/{norm}/qk", "stored": b.stored, "kept": b.kept, "saved": b.saved,
                     "saved_fraction": b.saved / b.stored, "grad_diff": diff})  # fmt: skip
    return rows
