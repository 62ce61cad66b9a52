"""normatlas.distributed on 2 gloo processes, against a single-process reference built from the same seed.

One spawn for the whole module (process start-up dominates on a small machine): the worker runs every check and
returns plain data, and each test below asserts on its part. Checks: TP + SP for pre / peri / post-LN x RMSNorm /
LayerNorm with QK-norm and a tiny transformers Llama (logits, loss, every gradient within 1e-5 in fp32; after 5
AdamW steps every replica identical), the norm-gradient pitfall named and reduced, Monitor and param_groups on the
sharded model, the collective counts with and without the norm grouping, SyncBatchNorm under DDP with uneven
batches, the fused kernels on sequence shards, QK-norms whose gains belong to heads (per-head gains, OLMo 2's
flattened norm, on our model and on transformers' OLMo 2), the logits kept vocabulary-sharded under loss_parallel,
and the pending norm gradients reduced in one collective.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from normatlas.distributed import figures, spawn

TOL = 1e-5  # fp32, the bound for logits, loss and gradients
PLACEMENTS = ("pre_ln", "peri_ln", "post_ln")
NORMS = ("rms", "layernorm")


def _monitor_and_groups(rank: int, world: int) -> dict[str, Any]:
    """Monitor's gradient norms and param_groups' decisions on a TP model (after the reduction) vs one process."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from normatlas.blocks import TransformerLM
    from normatlas.diagnostics import Monitor, param_groups
    from normatlas.distributed import full_grads, parallelize, rebind_param_groups, reduce_partial_grads

    torch.manual_seed(0)
    ref = TransformerLM(figures.lm_config("rms", "peri_ln"))
    par = copy.deepcopy(ref)
    groups = param_groups(par)  # roles read from behaviour: before sharding
    parallelize(par, init_device_mesh("cpu", (world,)))
    rebound = rebind_param_groups(groups, par)
    out: dict[str, Any] = {
        "groups": [[g["names"] for g in param_groups(ref)], [g["names"] for g in rebound]],
        "rebound_to_sharded": all(
            p is par.get_parameter(n) for g in rebound for p, n in zip(g["params"], g["names"], strict=True)
        ),
    }
    recs = []
    for model in (ref, par):
        mon = Monitor(model, every=1, metrics=["grad_norm"], print_alarms=False)
        ids = figures._ids(1)
        figures._loss(figures._logits(model, ids), ids).backward()
        reduce_partial_grads(model)
        with full_grads(model):
            mon.step()
        recs.append(mon.last)
    out["grad_norm_keys"] = sorted(recs[0])
    out["grad_norm_diff"] = max(abs(float(recs[0][k]) - float(recs[1][k])) for k in recs[0] if "grad_norm" in k)
    return out


def _fused_on_dtensor(rank: int, world: int) -> dict[str, Any]:
    """backend='fused' on DTensors: sequence-sharded (the kernels run on the local shard) against the whole tensor
    on one rank, forward and the weight's gradient; sharded on the normalized dim (refused)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    import normatlas

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    whole = torch.randn(2, 6, 8)
    ref = normatlas.RMSNorm(8)
    with torch.no_grad():
        ref.weight.add_(torch.randn(8))
    norm = parallelize_module(normatlas.RMSNorm(8, backend="fused"), mesh, SequenceParallel(use_local_output=False))
    with torch.no_grad():
        norm.weight.to_local().copy_(ref.weight)
    x = distribute_tensor(whole, mesh, [Shard(1)])
    y = norm(x)
    (y.full_tensor() * torch.arange(8.0)).sum().backward()
    (ref(whole) * torch.arange(8.0)).sum().backward()
    out: dict[str, Any] = {
        "forward": float((y.full_tensor() - ref(whole)).abs().max()),
        "weight_grad": float((norm.weight.grad.full_tensor() - ref.weight.grad).abs().max()),
        "grad_placements": str(norm.weight.grad.placements),
    }
    try:
        normatlas.RMSNorm(8, backend="fused")(distribute_tensor(whole, mesh, [Shard(2)]))
        out["feature_sharded"] = "no error"
    except ValueError as e:
        out["feature_sharded"] = str(e)
    return out


def _indivisible_heads(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from normatlas.blocks import TransformerLM
    from normatlas.distributed import parallelize

    try:
        parallelize(TransformerLM(figures.lm_config(n_kv_heads=1)), init_device_mesh("cpu", (world,)))
    except ValueError as e:
        return str(e)
    return "no error"


def two_rank_checks(rank: int, world: int) -> dict[str, Any]:
    """Everything this module asserts, computed on one rank of the 2-process group."""
    import time

    warnings.simplefilter("ignore")  # DTensor / FSDP deprecation chatter in the workers
    out: dict[str, Any] = {"seconds": {}}
    for key, fn in (
        ("tp", lambda: figures.tp_check(rank, world, steps=5)),
        ("llama", lambda: figures.tp_check(rank, world, steps=5, hf="llama")[0]),
        ("syncbn", lambda: figures.syncbn_ddp_check(rank, world)),
        ("collectives", lambda: figures.collectives_check(rank, world)),
        ("monitor", lambda: _monitor_and_groups(rank, world)),
        ("fused", lambda: _fused_on_dtensor(rank, world)),
        ("olmo2", lambda: figures.tp_check(rank, world, steps=5, hf="olmo2")[0]),
        ("loss_parallel", lambda: figures.loss_parallel_check(rank, world)),
        ("reduce", lambda: figures.reduce_check(rank, world)),
        ("heads", lambda: _indivisible_heads(rank, world)),
    ):
        t0 = time.process_time()
        out[key] = fn()
        out["seconds"][key] = round(time.process_time() - t0, 2)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn(two_rank_checks, 2, timeout=600)


def _tp_row(ranks: list[dict[str, Any]], rank: int, placement: str, norm: str) -> dict[str, Any]:
    (row,) = [r for r in ranks[rank]["tp"] if r["model"] == f"{placement}/{norm}/qk"]
    return row


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_tp_sp_matches_one_process(ranks: list[dict[str, Any]], placement: str, norm: str) -> None:
    for rank in (0, 1):
        row = _tp_row(ranks, rank, placement, norm)
        assert row["logits"] <= TOL and row["loss"] <= TOL and row["grads"] <= TOL, row


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_tp_sp_replicas_identical_after_adamw(ranks: list[dict[str, Any]], placement: str, norm: str) -> None:
    for rank in (0, 1):
        row = _tp_row(ranks, rank, placement, norm)
        assert row["findings_after_steps"] == []  # atol 0: every replicated weight bit-identical across ranks
        assert row["weights"] <= 1e-4  # and still the single-process weights (Adam magnifies fp32 rounding)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_pitfall_partial_norm_grads_named_then_reduced(ranks: list[dict[str, Any]], placement: str) -> None:
    row = _tp_row(ranks, 0, placement, "layernorm")
    assert row["pending"], "sequence-parallel norm weights must come back Partial"
    assert all(n.endswith((".weight", ".bias")) and "norm" in n for n in row["pending"])
    assert row["reduced"] == row["pending"]
    assert row["findings_after_reduce"] == []
    n_layers = 2
    slots = {"pre_ln": 2, "peri_ln": 4, "post_ln": 2}[placement]
    assert len(row["pending"]) == 2 * (n_layers * (slots + 0) + 1) + 2 * n_layers  # LN: weight + bias; QK: weight


def test_llama_tp_sp_matches_one_process(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        row = ranks[rank]["llama"]
        assert row["logits"] <= TOL and row["loss"] <= TOL and row["grads"] <= TOL, row
        assert row["findings_after_steps"] == [] and row["weights"] <= 1e-4, row
        # the inspector's five RMSNorm sites (2 per layer + final), pending before the reduction
        assert len(row["pending"]) == 5 and row["reduced"] == row["pending"]


def test_monitor_and_param_groups_on_sharded_model(ranks: list[dict[str, Any]]) -> None:
    mon = ranks[0]["monitor"]
    assert "grad_norm/total" in mon["grad_norm_keys"]
    assert mon["grad_norm_diff"] <= 1e-5
    assert mon["groups"][0] == mon["groups"][1] and mon["rebound_to_sharded"]


def _count(rows: list[dict[str, Any]], kind: str) -> tuple[int, int]:
    hits = [r for r in rows if kind in r["collective"]]
    return sum(r["count"] for r in hits), sum(r["bytes"] for r in hits)


def test_fsdp_norm_grouping_cuts_collectives(ranks: list[dict[str, Any]]) -> None:
    c = ranks[0]["collectives"]
    g_ag, g_ag_b = _count(c["fsdp_grouped"], "allgather")
    u_ag, u_ag_b = _count(c["fsdp_per_norm"], "allgather")
    g_rs, _ = _count(c["fsdp_grouped"], "reduce_scatter")
    u_rs, _ = _count(c["fsdp_per_norm"], "reduce_scatter")
    # 2 blocks + root: forward 3 all-gathers, backward 2 (the root stays unsharded), 3 reduce-scatters
    assert (g_ag, g_rs) == (5, 3)
    # 9 norms as units of their own: each adds an all-gather in forward and backward and a reduce-scatter
    assert u_ag > 3 * g_ag and u_rs > 3 * g_rs
    assert math.isclose(u_ag_b, g_ag_b, rel_tol=0.01)  # the same bytes, in many more messages
    for layout in ("fsdp_grouped", "fsdp_per_norm", "tp_sp"):  # the counter agrees with torch's CommDebugMode
        assert sum(r["count"] for r in c[layout]) == c["comm_debug_mode"][layout], (layout, c)


def test_tp_sp_branch_input_gradients_reduce_scatter_once(ranks: list[dict[str, Any]]) -> None:
    # each branch's gathered input stays a Replicate DTensor: its projections' input gradients sum as Partial and
    # leave in one reduce-scatter per branch; the only all-reduce is the bucket of pending norm gradients
    tp = ranks[0]["collectives"]["tp_sp"]
    assert _count(tp, "all_reduce")[0] == 1, tp
    blocks = 2  # lm_config's n_layers
    # forward: embedding + o / down per block; backward: attention / FFN input per block + the LM head's input
    assert _count(tp, "reduce_scatter")[0] == 1 + 2 * blocks + 2 * blocks + 1, tp


def test_syncbn_ddp_uneven_batches(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        s = ranks[rank]["syncbn"]
        assert s["sizes"] == [3, 5]
        for key in ("output", "input_grad", "param_grads", "weights", "running_stats"):
            assert s[key] <= 1e-5, (key, s)
        assert s["replicas"] == []


def test_every_check_is_timed_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    # each rank ran every check of two_rank_checks and timed it: a finite, non-negative CPU time per check, the
    # same checks on both ranks, and real work in all (building and stepping the models costs CPU time)
    checks = set(ranks[0]) - {"seconds"}
    assert len(checks) == 10, sorted(checks)
    for rank in (0, 1):
        seconds = ranks[rank]["seconds"]
        assert set(ranks[rank]) - {"seconds"} == checks and set(seconds) == checks, (rank, sorted(seconds))
        assert all(isinstance(s, float) and math.isfinite(s) and s >= 0 for s in seconds.values()), seconds
        assert sum(seconds.values()) > 0, seconds
    print("worker CPU seconds:", ranks[0]["seconds"])  # shown with -s


def test_fused_kernels_run_on_sequence_shards(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        f = ranks[rank]["fused"]
        assert f["forward"] <= 1e-6 and f["weight_grad"] <= 1e-5, f
        assert "Partial" in f["grad_placements"]  # each rank's rows: pending until reduce_partial_grads
        assert "backend='fused' cannot run on this DTensor" in f["feature_sharded"]


QK_VARIANTS = ("pre_ln/rms/qk-per-head-gains", "pre_ln/rms/qk-flattened", "pre_ln/rms-fused/qk")


@pytest.mark.parametrize("model", QK_VARIANTS)
def test_tp_sp_head_owned_qk_norms_and_fused_kernels(ranks: list[dict[str, Any]], model: str) -> None:
    for rank in (0, 1):
        (row,) = [r for r in ranks[rank]["tp"] if r["model"] == model]
        assert row["logits"] <= TOL and row["loss"] <= TOL and row["grads"] <= TOL, row
        assert row["findings_after_steps"] == [] and row["weights"] <= 1e-4, row
        qk_pending = [n for n in row["pending"] if ".attn.q_norm." in n or ".attn.k_norm." in n]
        # a gain per head / over the flattened heads is Shard(0): final on its rank; a shared gain is Partial
        assert bool(qk_pending) is (model == "pre_ln/rms-fused/qk"), row["pending"]


def test_olmo2_flattened_qk_norm_tp_sp_matches_one_process(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        row = ranks[rank]["olmo2"]
        assert row["logits"] <= TOL and row["loss"] <= TOL and row["grads"] <= TOL, row
        assert row["findings_after_steps"] == [] and row["weights"] <= 1e-4, row
        # OLMo 2: post-branch norms (2 per layer) + final pending; its q / k norms own their heads' rows
        assert len(row["pending"]) == 5 and not any("norm" in n and "attn" in n for n in row["pending"]), row


def test_loss_parallel_keeps_logits_sharded_on_the_vocabulary(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        lp = ranks[rank]["loss_parallel"]
        assert lp["placements"] == ["S(2)"] and lp["local_vocab"] == figures.VOCAB // 2, lp
        assert lp["loss"] <= TOL and lp["grads"] <= TOL, lp


@pytest.mark.parametrize("norm", NORMS)
def test_pending_norm_grads_reduced_in_one_collective(ranks: list[dict[str, Any]], norm: str) -> None:
    r = ranks[0]["reduce"][norm]
    assert r["pending"] == {"rms": 13, "layernorm": 22}[norm]  # peri-LN, 2 layers, QK-norm
    assert sum(row["count"] for row in r["collectives"]) == 1, r["collectives"]
    assert r["grads"] <= TOL


def test_parallelize_refuses_head_counts_the_mesh_does_not_divide(ranks: list[dict[str, Any]]) -> None:
    assert "n_kv_heads=1 is not divisible by the tensor-parallel size 2" in ranks[0]["heads"]
