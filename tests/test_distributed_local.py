"""normatlas.distributed in one process: the plan as data, input validation, the recompute policy and its
measured bytes, the collective counter, and the SyncBatchNorm converter (no process group needed)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

import normatlas
from normatlas.blocks import TransformerLM
from normatlas.blocks.qknorm import QKGain, QKNormConfig, QKScope
from normatlas.distributed import (
    check_replicas,
    full_grads,
    parallelize,
    rebind_param_groups,
    reduce_partial_grads,
    spawn,
    tensor_parallel_plan,
)
from normatlas.distributed.counting import CollectiveCounter, count_collectives
from normatlas.distributed.figures import lm_config, recompute_figures
from normatlas.distributed.fsdp import norm_module_paths, shard_model
from normatlas.distributed.recompute import block_activation_bytes, checkpoint_blocks, norm_recompute_policy
from normatlas.distributed.syncbn import convert_sync_batchnorm
from normatlas.longtail import BatchNorm1d, BatchNorm2d, GhostBatchNorm, SyncBatchNorm


def _lm(placement: str = "pre_ln", norm: str = "rms", **changes: object) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(lm_config(norm, placement, **changes))


@pytest.mark.parametrize("placement", ["pre_ln", "peri_ln", "post_ln"])
def test_plan_marks_every_norm_as_sequence_parallel(placement: str) -> None:
    model = _lm(placement)
    plan = tensor_parallel_plan(model)
    assert set(plan.norms) == set(norm_module_paths(model))  # every norm site with parameters, read from structure
    for path in plan.norms:
        style = plan.styles[path]
        assert isinstance(style, SequenceParallel)
        on_heads = path.endswith(("q_norm", "k_norm"))
        assert style.sequence_sharding[0].dim == (2 if on_heads else 1)  # QK-norm over (B, T, H, Dh): heads
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj"):
            assert isinstance(plan.styles[f"layers.{i}.attn.{p}"], ColwiseParallel)
        for p in ("gate_proj", "up_proj"):
            assert isinstance(plan.styles[f"layers.{i}.mlp.{p}"], ColwiseParallel)
        assert isinstance(plan.styles[f"layers.{i}.attn.o_proj"], RowwiseParallel)
        assert isinstance(plan.styles[f"layers.{i}.mlp.down_proj"], RowwiseParallel)
        assert isinstance(plan.styles[f"layers.{i}.attn"], PrepareModuleInput)
    assert plan.tied == (("embed.weight", "lm_head.weight"),)
    assert sorted(plan.sequence_parallel_params(model)) == sorted(
        f"{p}.{n}" for p in plan.norms for n, _ in model.get_submodule(p).named_parameters()
    )


def test_plan_covers_embed_norm_and_residual_gates() -> None:
    from normatlas.blocks import layerscale

    torch.manual_seed(0)
    model = TransformerLM(lm_config(embed_norm=True).with_(placement=layerscale(1e-2)))
    plan = tensor_parallel_plan(model)
    assert "embed_norm" in plan.norms
    assert isinstance(plan.styles["layers.0.attn_residual.gate"], SequenceParallel)


@pytest.mark.parametrize(
    "qk",
    [QKNormConfig(gain=QKGain.PER_HEAD), QKNormConfig(scope=QKScope.FLAT, gain=QKGain.NONE)],
    ids=["per-head-gains", "flattened"],
)
def test_plan_gives_head_owned_qk_norms_their_heads(qk: QKNormConfig) -> None:
    from normatlas.distributed import HeadShardedNorm

    plan = tensor_parallel_plan(TransformerLM(lm_config().with_(qk_norm=qk)))
    for i in range(2):
        for site in ("q_norm", "k_norm"):
            assert isinstance(plan.styles[f"layers.{i}.attn.{site}"], HeadShardedNorm)
    shared = tensor_parallel_plan(TransformerLM(lm_config()))
    assert isinstance(shared.styles["layers.0.attn.q_norm"], SequenceParallel)


def test_plan_rejects_what_it_cannot_shard() -> None:
    with pytest.raises(ValueError, match="max_positions=16"):
        tensor_parallel_plan(_lm(max_positions=16))
    with pytest.raises(TypeError, match="model=Linear must be"):
        tensor_parallel_plan(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="loss_parallel='yes' must be a bool"):
        tensor_parallel_plan(_lm(), loss_parallel="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="example_inputs is read for transformers models only"):
        tensor_parallel_plan(_lm(), torch.zeros(1, 2, dtype=torch.long))


def test_parallelize_and_helpers_validate_arguments() -> None:
    with pytest.raises(TypeError, match=r"mesh=.* must be a torch\.distributed DeviceMesh"):
        parallelize(_lm(), "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model=3 must be an nn\.Module"):
        reduce_partial_grads(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"atol=-1 must be a float >= 0"):
        check_replicas(_lm(), atol=-1)
    with pytest.raises(TypeError, match=r"model=3 must be an nn\.Module"), full_grads(3):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match=r"groups\[0\] has no 'names' list"):
        rebind_param_groups([{"params": []}], _lm())
    with pytest.raises(ValueError, match="must be a 1-D DeviceMesh"):
        shard_model(_lm(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group_norms=1 must be a bool"):
        shard_model(_lm(), None, group_norms=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass blocks="):
        checkpoint_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="world_size=0 must be an integer in"):
        spawn(print, 0)
    with pytest.raises(ValueError, match="norm='batch' must be one of"):
        lm_config("batch")


def test_reduce_and_check_on_plain_model_do_nothing() -> None:
    model = _lm()
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    assert reduce_partial_grads(model) == []
    assert check_replicas(model) == []  # plain tensors, no group given: nothing to compare, nothing pending
    with full_grads(model) as names:
        assert names == []


def test_recompute_policy_saves_matmuls_and_recomputes_norms() -> None:
    ctx = SelectiveCheckpointContext(is_recompute=False)
    aten = torch.ops.aten
    assert norm_recompute_policy(ctx, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert norm_recompute_policy(ctx, aten.bmm.default) is CheckpointPolicy.MUST_SAVE
    assert norm_recompute_policy(ctx, aten.native_layer_norm.default) is CheckpointPolicy.MUST_RECOMPUTE
    assert norm_recompute_policy(ctx, aten.mul.Tensor) is CheckpointPolicy.PREFER_RECOMPUTE


def test_recompute_bytes_per_block_and_identical_gradients() -> None:
    rows = recompute_figures(d_model=32, seq=16, batch=2, configs=(("pre_ln", "rms"), ("peri_ln", "rms")))
    assert len(rows) == 2
    for r in rows:
        assert r["grad_diff"] == 0.0, r  # the recomputed forward is bit-identical
        assert 0 < r["kept"] < r["stored"] and r["saved"] == r["stored"] - r["kept"], r
    peri = {r["model"]: r["saved"] for r in rows}
    assert peri["peri_ln/rms/qk"] > peri["pre_ln/rms/qk"]  # two more norms per block to recompute


def test_recomputation_reruns_the_norms() -> None:
    model = _lm()
    calls = {"fwd": 0, "asked": 0}
    norm = model.blocks()[0].attn_pre_norm
    norm.register_forward_hook(lambda *a: calls.__setitem__("fwd", calls["fwd"] + 1))

    def policy(ctx: SelectiveCheckpointContext, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        calls["asked"] += 1  # (torch asks in the forward; the recomputation replays its decisions)
        return norm_recompute_policy(ctx, op, *args, **kwargs)

    checkpoint_blocks(model, policy)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    assert calls["fwd"] == 2  # the forward, then the recomputation in the backward
    assert calls["asked"] > 0


def test_block_activation_bytes_counts_saved_tensors() -> None:
    lin = torch.nn.Sequential(torch.nn.Linear(8, 16), normatlas.LayerNorm(16))
    x = torch.randn(4, 8, requires_grad=True)
    b = block_activation_bytes(lin, x)
    assert b.kept_ops == ("addmm",)
    assert b.kept == (4 * 16 + 4 * 8) * 4  # the addmm output and the input
    assert b.stored > b.kept


def test_counter_sees_no_collectives_without_a_group() -> None:
    out, stats = count_collectives(lambda: torch.ones(3).sum())
    assert float(out) == 3.0 and stats.total_count == 0 and stats.rows() == []
    with CollectiveCounter() as c:
        torch.ones(2) * 2
    assert c.stats.total_bytes == 0
    with pytest.raises(TypeError, match="fn=3 must be a callable"):
        count_collectives(3)  # type: ignore[arg-type]


def test_convert_sync_batchnorm_keeps_state_and_function() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(36, 5), BatchNorm1d(5, affine=False), GhostBatchNorm(5, 2))  # fmt: skip
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].running_mean.fill_(0.3)
    ref = copy.deepcopy(model)
    conv = convert_sync_batchnorm(model)
    assert isinstance(conv[1], SyncBatchNorm) and isinstance(conv[4], SyncBatchNorm)
    assert type(conv[5]) is GhostBatchNorm  # other semantics are kept
    assert torch.equal(conv[1].weight, ref[1].weight) and torch.equal(conv[1].running_mean, ref[1].running_mean)
    x = torch.randn(6, 3, 3, 3)
    torch.testing.assert_close(conv(x), ref(x), rtol=1e-5, atol=1e-6)  # world size 1: plain BatchNorm
    torch.testing.assert_close(conv[1].running_var, ref[1].running_var)
    assert isinstance(convert_sync_batchnorm(BatchNorm1d(3)), SyncBatchNorm)
    with pytest.raises(TypeError, match=r"module=3 must be an nn\.Module"):
        convert_sync_batchnorm(3)  # type: ignore[arg-type]


def test_llama_plan_from_the_inspector_and_one_recorded_forward() -> None:
    from tests.tiny_hf import tiny_model

    model = tiny_model("llama").train()
    plan = tensor_parallel_plan(model)
    assert model.training  # the inspector's eval() is undone
    layers = [f"model.layers.{i}" for i in range(2)]
    assert set(plan.norms) == {f"{p}.{n}" for p in layers for n in ("input_layernorm", "post_attention_layernorm")} | {
        "model.norm"
    }
    for p in layers:
        for lin in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert type(plan.styles[f"{p}.{lin}"]) is ColwiseParallel, lin
        for lin in ("self_attn.o_proj", "mlp.down_proj"):
            assert type(plan.styles[f"{p}.{lin}"]) is RowwiseParallel, lin
        attn = plan.styles[f"{p}.self_attn"]
        assert isinstance(attn, PrepareModuleInput) and attn.input_kwarg_layouts.keys() == {"hidden_states"}
        assert isinstance(plan.styles[f"{p}.mlp"], PrepareModuleInput)
    assert type(plan.styles["model.embed_tokens"]) is RowwiseParallel
    assert type(plan.styles["lm_head"]) is ColwiseParallel
    assert (plan.n_heads, plan.n_kv_heads) == (4, 2)
