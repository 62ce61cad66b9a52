"""Experiments 15-17 (the guide's new claims) at quick scale, seed 0, and the identities their set-ups rest on.

The files and fields of every experiment, these included, are checked in ``test_experiments.py`` (parametrized
over all of them); here: what each one measures is present and consistent with its own statistics, and the exact
facts each set-up relies on (float64 where an identity is exact). No quick verdict is asserted: at quick scale none
of the three can test its claim (too few steps for spikes, massive activations or a weight-norm equilibrium).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from normatlas.blocks import QKNormConfig, pre_ln, reordered_norm
from normatlas.experiments.base import RunContext, Scale
from normatlas.experiments.data import stdlib_bytes
from normatlas.experiments.e15_olmo2_ablation import CELLS, cell, spikes
from normatlas.experiments.e16_massive_activations import BOS, BosBatches, intervene
from normatlas.experiments.e17_decay_equilibrium import RUNS, ByteMLP, theory_angle
from normatlas.experiments.lm import evaluate_lm, tiny_lm
from normatlas.experiments.verdict import Untested
from normatlas.presets import LayerNorm, RMSNorm

from .experiment_runs import quick_run


def _ok(value: object) -> bool:
    return isinstance(value, dict) or (isinstance(value, float) and math.isfinite(value))


# ---------------------------------------------------------------- 15: OLMo 2's 2x2
def test_e15_quick_run_measures_every_cell() -> None:
    run = quick_run("olmo2-ablation")
    m, stats = run.record["measured"], run.outcome.statistics
    keys = ("pre_ln", "pre_ln_qk_norm", "reordered", "reordered_qk_norm")
    for k in keys:
        assert 0.0 <= m[f"grad_spike_rate_{k}"] <= 1.0
        assert m[f"median_grad_norm_{k}"] > 0 and m[f"max_grad_norm_{k}"] >= m[f"median_grad_norm_{k}"]
    base, both = m["grad_spike_rate_pre_ln"], m["grad_spike_rate_reordered_qk_norm"]
    if base > 0 and m["diverged_at_reordered_qk_norm"] is None:
        assert stats["combo_spikes_removed"] == pytest.approx(1 - both / base)
    assert all(_ok(v) or hasattr(v, "why") for v in stats.values())
    rows = run.outcome.series["training"].rows
    assert {r[0] for r in rows} == set(CELLS)


def test_e15_cells_are_the_placements_they_name() -> None:
    for name in CELLS:
        placement, qk = cell(name)
        assert qk is name.endswith("QK-norm")
        assert placement == (reordered_norm() if name.startswith("reordered") else pre_ln())
    p = reordered_norm()  # x <- x + Norm(F(x)): no norm before the branch, one after it, none after the add
    assert (p.attn.pre, p.attn.post, p.attn.after_add) == (False, True, False)
    assert p.ffn == p.attn
    with pytest.raises(ValueError, match="cell="):
        cell("Post-LN")


def test_e15_hooked_gradient_norm_is_clip_grad_norms_total() -> None:
    """The experiment reads the gradient norm before clipping with post-accumulate hooks; it is exactly the total
    norm ``clip_grad_norm_`` computes (the tied embedding counted once)."""
    lm = tiny_lm(reordered_norm(), RMSNorm, n_layers=2, d_model=32, seed=0, qk_norm=QKNormConfig()).double()
    squares: list[float] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda q: squares.append(float(q.grad.pow(2).sum())))
        for p in lm.parameters()
    ]
    x = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(lm(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    for h in handles:
        h.remove()
    total = float(torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0))
    assert math.sqrt(sum(squares)) == pytest.approx(total, rel=1e-12)


def test_e15_spike_rule() -> None:
    g = [1.0] * 10 + [3.5, 1.0, 2.9, 1.0]
    assert spikes(g, 0, 4, lambda v, m: v > 3 * m) == [10]
    assert spikes(g, 11, 4, lambda v, m: v > 3 * m) == []


# ---------------------------------------------------------------- 16: massive activations
def test_e16_quick_run_measures_the_interventions() -> None:
    run = quick_run("massive-activations")
    m, stats = run.record["measured"], run.outcome.statistics
    assert 0 <= m["peak_block"] < len(m["max_over_median_per_block"])
    assert stats["max_over_median"] == pytest.approx(max(m["max_over_median_per_block"]))
    zero, rand, base = m["loss_top_zeroed"], m["loss_random_zeroed_mean"], m["held_out_loss"]
    if m["bos_max_over_median_per_block"][m["peak_block"]] > 100:
        assert stats["sink_grad_growth"] == pytest.approx(m["grad_norm_bos_top_set_to_mean"] / m["grad_norm_bos"])
        assert stats["loss_zero_top_minus_random"] == pytest.approx((zero - base) - (rand - base))
    else:  # nothing massive on the BOS token: the removal clauses are untested, their numbers still measured
        for key in ("sink_grad_growth", "loss_zero_top_minus_random"):
            value = stats[key]
            assert isinstance(value, Untested) and "no massive activation" in value.why
    assert m["grad_norm_bos_top_set_to_mean"] > 0 and math.isfinite(zero - rand)
    assert len(m["loss_random_zeroed"]) == 8 and len(m["bos_top_channels"]) == 2
    assert all(0.0 <= s <= 1.0 for s in m["sink_share_per_layer"])


def test_e16_bos_batches_put_bos_first_and_shift_targets() -> None:
    data = BosBatches(stdlib_bytes(50_000), seed=3)
    for x, y in (data.train(4, 16), data.held_out(4, 16)):
        assert x.shape == y.shape == (4, 16)
        assert (x[:, 0] == BOS).all() and (x[:, 1:] != BOS).all()
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_e16_bos_residual_is_the_same_in_every_example_and_no_edit_is_the_plain_loss() -> None:
    """Causal attention: position 0 sees only itself, so the BOS token's residual is one vector for every example
    (what lets the experiment pick its channels from one row); an intervention that edits nothing is the model."""
    lm = tiny_lm(pre_ln(), RMSNorm, n_layers=2, d_model=32, seed=1)
    data = BosBatches(stdlib_bytes(50_000), seed=1)
    x, y = data.held_out(5, 12)
    seen: list[torch.Tensor] = []
    handle = lm.blocks()[1].register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    with torch.no_grad():
        lm(x)
    handle.remove()
    torch.testing.assert_close(seen[0][:, 0], seen[0][:1, 0].expand(5, -1), rtol=1e-5, atol=1e-6)
    loss, g_bos, g_other = intervene(lm, 1, x, y, None)
    assert loss == pytest.approx(evaluate_lm(lm, data, batch=5, seq=12), rel=1e-6)
    assert g_bos >= 0 and g_other > 0


def test_rmsnorm_backward_scales_as_one_over_sigma() -> None:
    """The mechanism the claim names: RMSNorm(a x) = RMSNorm(x), so its input gradient at a x is 1/a times that at
    x (float64, eps far below the activations' scale)."""
    norm = RMSNorm(7, eps=None).double()  # eps = the dtype's machine epsilon
    x = torch.randn(5, 123, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    up = torch.randn(5, 123, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for a in (1.0, 1000.0):
        xa = (a * x).requires_grad_()
        (norm(xa) * up).sum().backward()
        assert xa.grad is not None
        grads.append(xa.grad)
    torch.testing.assert_close(grads[1] * 1000.0, grads[0], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- 17: weight decay's equilibrium
def test_e17_quick_run_measures_every_run() -> None:
    run = quick_run("decay-equilibrium")
    m, stats = run.record["measured"], run.outcome.statistics
    assert set(m["w_norm_end"]) == set(RUNS)
    assert stats["angle_over_theory_error"] == pytest.approx(
        max(abs(r - 1) for k in ("A", "B", "D") for r in m["angle_over_theory"][k])
    )
    for k, (eta, _lam) in RUNS.items():
        for w, e in zip(m["w_norm_end"][k], m["eff_lr_end"][k], strict=True):
            assert e == pytest.approx(eta / w**2)
    # without decay SGD only grows a scale-invariant weight (its gradient is orthogonal to it)
    starts, ends = m["w_norm_start"], m["w_norm_end"]["C"]
    assert all(e > s for s, e in zip(starts, ends, strict=True))


def _mlp_grad(net: ByteMLP, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()
    return [w.grad.clone() for w in net.weights() if w.grad is not None]


def test_e17_sgd_step_on_a_normalised_weight_is_exact() -> None:
    """float64: the gradient of every normalised Linear is orthogonal to it, so one SGD step with L2 decay gives
    ||W'||^2 = (1 - eta*lambda)^2 ||W||^2 + eta^2 ||g||^2 exactly (the identity the equilibrium is derived from)."""
    torch.manual_seed(0)
    net = ByteMLP(context=4, emb=8, width=24, depth=2)
    net.norms = torch.nn.ModuleList(LayerNorm(24, eps=None, elementwise_affine=False) for _ in range(2))  # type: ignore[arg-type]
    net = net.double()
    x = torch.randint(1, 256, (6, 4), generator=torch.Generator().manual_seed(2))
    y = torch.randint(1, 256, (6,), generator=torch.Generator().manual_seed(3))
    grads = _mlp_grad(net, x, y)
    eta, lam = 0.7, 0.01
    for w, g in zip(net.weights(), grads, strict=True):
        w = w.detach()
        assert abs(float((w * g).sum())) <= 1e-12 * float(w.norm() * g.norm())
        stepped = (1 - eta * lam) * w - eta * g
        expected = (1 - eta * lam) ** 2 * w.norm() ** 2 + eta**2 * g.norm() ** 2
        assert float(stepped.norm() ** 2) == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize("eta_lam", [(0.1, 0.01), (1.0, 0.001), (1.0, 0.01), (0.3, 0.2)])
def test_e17_theory_angle_is_the_fixed_points_angle(eta_lam: tuple[float, float]) -> None:
    """At the norm's fixed point (eta^2 ||g||^2 = (1 - (1 - eta*lambda)^2) ||W||^2, g orthogonal to W) one step
    turns W by theory_angle(eta, lambda) and keeps its norm; for small eta*lambda that is about sqrt(2 eta*lambda)."""
    eta, lam = eta_lam
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, dtype=torch.float64, generator=gen)
    g = torch.randn(40, dtype=torch.float64, generator=gen)
    g = g - (g @ w) / (w @ w) * w
    g = g * math.sqrt(1 - (1 - eta * lam) ** 2) * float(w.norm()) / (eta * float(g.norm()))
    stepped = (1 - eta * lam) * w - eta * g
    assert float(stepped.norm()) == pytest.approx(float(w.norm()), rel=1e-12)
    cos = float(stepped @ w / (stepped.norm() * w.norm()))
    assert math.acos(cos) == pytest.approx(theory_angle(eta, lam), rel=1e-9)
    if eta * lam <= 0.01:
        assert theory_angle(eta, lam) == pytest.approx(math.sqrt(2 * eta * lam), rel=0.01)


def test_new_claims_are_numbered_15_to_17() -> None:
    from normatlas.experiments import experiments

    numbers = {e.name: e.number for e in experiments()}
    assert numbers["olmo2-ablation"] == 15 and numbers["massive-activations"] == 16
    assert numbers["decay-equilibrium"] == 17
    assert RunContext(scale=Scale.QUICK, seed=0).quick
