"""Experiments 1-7 in quick mode: what each must show even at that scale.

Quick mode trains for seconds, so not every full-mode conclusion is reachable; each test asserts what is robust
there and says which: exact identities (scale invariance), what the architecture forces (a Post-LN stream is
re-normalised after every block; GPT-2's scaled init lowers the variance at init), and directions that are large
at any scale (attention logits without QK-norm at a high learning rate). The full-mode verdicts are in
docs/experiments.md.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from .experiment_runs import quick_run


def measured(name: str) -> dict[str, Any]:
    return quick_run(name).record["measured"]


def test_scale_invariance_quick() -> None:
    """Exact in float64 (at machine eps); norm growth and decay move eta/||W||^2 from the first steps on."""
    m = measured("scale-invariance")
    assert m["output_gap"] < 1e-9 and m["grad_gap"] < 1e-6 and m["grad_cos_w"] < 1e-6
    assert m["output_gap_eps_1e-5"] > m["output_gap"]  # eps = 1e-5 bends it: the check can fail
    assert m["w_norm_end_no_decay"] > m["w_norm_start"] and m["eff_lr_end_no_decay"] < m["eff_lr_start"]
    assert m["eff_lr_end_decay"] > m["eff_lr_end_no_decay"]
    assert abs(m["angle_over_predicted_median"] - 1) < 0.05
    assert quick_run("scale-invariance").record["holds"] is True


def test_covariate_shift_quick() -> None:
    """Robust at quick scale: all three nets learn more than the most common next byte (the accuracy of a net that
    ignores its context) and BN's gradient changes less along the step than the net without BN (1.9x to 3.2x over
    seeds 0-2 at quick scale); the noisy-BN accuracy comparison needs the full run."""
    from normatlas.experiments import RunContext
    from normatlas.experiments import e02_covariate_shift as e02
    from normatlas.experiments._shared import byte_data

    _, targets = e02.windows(byte_data(RunContext(scale="quick", seed=0)), e02.TEST, held_out=True)
    majority = float(torch.bincount(targets, minlength=256).max()) / e02.TEST
    assert 0.05 < majority < 0.3  # the space byte, most likely
    m = measured("covariate-shift")
    for v in ("no_BN", "BN", "noisy_BN"):
        assert m[f"test_accuracy_{v}"] > majority + 0.03
    assert m["mean_grad_change_BN"] < m["mean_grad_change_no_BN"]


def test_covariate_shift_task_is_next_byte_from_one_hot_context() -> None:
    """The inputs are the CONTEXT bytes before the target, one-hot, scaled to mean square 1 per coordinate; the
    held-out windows are the same on every call and never drawn from the training text."""
    from normatlas.experiments import RunContext
    from normatlas.experiments import e02_covariate_shift as e02
    from normatlas.experiments._shared import byte_data

    data = byte_data(RunContext(scale="quick", seed=0))
    x, y = e02.windows(data, 5)
    assert x.shape == (5, e02.CONTEXT * 256) and y.shape == (5,)
    assert float(x.pow(2).mean()) == pytest.approx(1.0)
    assert (x.view(5, e02.CONTEXT, 256) > 0).sum(-1).eq(1).all()  # one byte per position
    a, b = e02.windows(data, 7, held_out=True), e02.windows(data, 7, held_out=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    model = e02.mlp("noisy BN", torch.Generator().manual_seed(0))
    assert model(x).shape == (5, 256)


def test_covariate_shift_averages_the_training_phase_only() -> None:
    """The smoothness statistics leave out step 0's probe (the untrained net), whatever its size, and are NaN
    (not a silent 0) with no probe after it; the quick run's means equal the landscape series' mean after step 0."""
    from normatlas.experiments.e02_covariate_shift import _training_mean

    probes = [{"step": 0, "loss_range": 1e6}, {"step": 20, "loss_range": 2.0}, {"step": 40, "loss_range": 4.0}]
    assert _training_mean(probes, "loss_range") == 3.0
    assert math.isnan(_training_mean(probes[:1], "loss_range"))
    run = quick_run("covariate-shift")
    landscape = run.outcome.series["landscape"]
    rows = [dict(zip(landscape.columns, r, strict=True)) for r in landscape.rows]
    assert any(r["step"] == 0 for r in rows)  # step 0 is probed and drawn, but not averaged
    after = [r["loss_range"] for r in rows if r["variant"] == "BN" and r["step"] > 0]
    assert run.record["measured"]["mean_loss_range_BN"] == pytest.approx(sum(after) / len(after), rel=1e-12)


def test_variance_depth_quick() -> None:
    """The architecture forces Post-LN and DeepNorm streams to stay at the norm's scale (growth ~ 1) and Pre-LN's
    stream to accumulate; LNS's 1/sqrt(l) makes its growth at init smaller than Pre-LN's."""
    m = measured("variance-depth")
    for key in ("post_ln", "deepnorm"):
        assert 0.8 < m[f"growth_init_{key}"] < 1.25 and 0.5 < m[f"growth_trained_{key}"] < 2
    assert m["growth_trained_pre_ln"] > 2 * m["growth_trained_post_ln"]
    assert m["growth_init_lns"] < m["growth_init_pre_ln"]


def test_gradient_depth_quick() -> None:
    """Post-LN's gradient shrinks toward the input at init; Pre-LN's last-layer gradient falls with depth."""
    m = measured("gradient-depth")
    assert m["first_over_last_post_ln"] < 1 and m["backward_slope_post_ln"] < 0
    assert m["last_layer_grad_slope_vs_depth_pre_ln"] < 0
    assert m["last_layer_grad_slope_vs_depth_pre_ln"] < m["last_layer_grad_slope_vs_depth_post_ln"]


def test_gradient_depth_fit_recovers_a_power_law() -> None:
    from normatlas.experiments.e04_gradient_depth import fit

    xs = [1, 2, 4, 8, 16]
    k, c, r2 = fit(xs, [3.0 * x**-0.5 for x in xs])
    assert abs(k + 0.5) < 1e-12 and abs(math.exp(c) - 3.0) < 1e-9 and abs(r2 - 1) < 1e-12


def test_curse_of_depth_quick() -> None:
    """Robust at quick scale: every model's layers matter in sum (removing them raises the held-out loss) and
    the per-layer increases are finite; the early/late comparison needs the full run."""
    m = measured("curse-of-depth")
    for key in ("pre_ln", "lns", "peri_ln"):
        deltas = m[f"loss_increase_per_layer_{key}"]
        assert all(math.isfinite(d) for d in deltas) and sum(deltas) > 0
        assert 0 < m[f"held_out_loss_{key}"] < math.log(256)


def test_curse_of_depth_rule_reads_layers_two_on() -> None:
    """The late / early ratio skips layer 1 by default (it dominates every model); first=1 reads all layers."""
    from normatlas.experiments.e05_curse_of_depth import late_over_early

    deltas = [5.0, 1.0, 1.0, 0.5, 0.5]  # layer 1 dominates; layers 2..5: early mean 1.0, late 0.5
    assert late_over_early(deltas) == 0.5
    assert late_over_early(deltas, first=1) == (1.0 + 0.5 + 0.5) / 3 / ((5.0 + 1.0) / 2)
    assert math.isnan(late_over_early([1.0, -0.1, 0.2]))  # shallower half not positive: no ratio
    with pytest.raises(ValueError, match="first=3"):
        late_over_early([1.0, 2.0, 3.0], first=3)


def test_scaled_init_quick() -> None:
    """GPT-2's scaled init lowers the depth growth at init (deterministic); training grows it back at once."""
    m = measured("scaled-init")
    assert m["growth_init_pre_ln_scaled_init"] < m["growth_init_pre_ln"]
    assert m["growth_end_pre_ln_scaled_init"] > m["growth_init_pre_ln_scaled_init"]


def test_qk_norm_quick() -> None:
    """At the high learning rate the logits without QK-norm outgrow the normalised ones many times over, and the
    lowest head entropy is lower; the LR-sensitivity comparison needs the full sweep."""
    m = measured("qk-norm")
    assert m["max_attention_logit_top_lr_no_qk_norm"] > 5 * m["max_attention_logit_top_lr_qk_norm"]
    assert m["min_norm_entropy_top_lr_no_qk_norm"] < m["min_norm_entropy_top_lr_qk_norm"]
