"""Experiments 8-14 in quick mode: each claim's direction where it is robust at quick scale, and otherwise what
the physics requires of the measured numbers (finite, ordered, in range). Full-mode verdicts are in
docs/experiments.md; these tests never assert a full-mode conclusion."""

from __future__ import annotations

import math

import pytest
import torch

from normatlas.experiments.base import RunContext
from normatlas.experiments.e08_output_norm_warning import END_LR, START_LR, RampConfig, spike_step
from normatlas.experiments.e08_output_norm_warning import EXPERIMENT as E08
from normatlas.experiments.e09_dyt_s_curve import ALPHA_7B, fit_tanh, sentences, set_alphas
from normatlas.experiments.e09_dyt_s_curve import EXPERIMENT as E09
from normatlas.experiments.e10_batchnorm_failures import EXPERIMENT as E10
from normatlas.experiments.e10_batchnorm_failures import MILD_SHIFT, mean_variance, shifted
from normatlas.experiments.e11_rmsnorm_vs_layernorm import EXPERIMENT as E11
from normatlas.experiments.e12_geometry import EXPERIMENT as E12
from normatlas.experiments.e13_vlm_norm_gap import EXPERIMENT as E13
from normatlas.experiments.e13_vlm_norm_gap import rotation_by_norm
from normatlas.experiments.e14_bf16_headroom import EXPERIMENT as E14
from normatlas.experiments.e14_bf16_headroom import op_errors

from .experiment_runs import quick_run


def _quick(exp, tmp_path):  # type: ignore[no-untyped-def]
    run = quick_run(exp.name)  # the session's shared quick run at seed 0
    assert (run.folder / "figure.png").stat().st_size > 10_000
    return run.record["measured"], run.record["holds"]


# ---------------------------------------------------------------- helpers, exact and fast
def test_spike_step_finds_the_first_jump_after_the_burn_in() -> None:
    losses = [5.0] * 10 + [3.0] * 50 + [4.5] + [3.0] * 5
    assert spike_step(losses, start=20, nats=1.0) == 60
    assert spike_step(losses[:60], start=20, nats=1.0) is None
    assert spike_step([3.0] * 30 + [math.nan], start=20) == 30


def test_the_ramp_grows_geometrically_from_the_start_rate_to_the_end_rate() -> None:
    cfg = RampConfig(steps=110, lr=START_LR, end_lr=END_LR, warmup=10)
    assert cfg.lr_at(0) == pytest.approx(START_LR / 10) and cfg.lr_at(9) == pytest.approx(START_LR)
    assert cfg.lr_at(109) == pytest.approx(END_LR)
    ratios = [cfg.lr_at(i + 1) / cfg.lr_at(i) for i in range(10, 108)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)  # a constant factor per step: geometric


def test_set_alphas_initialises_each_site_of_the_model() -> None:
    from normatlas.blocks import pre_ln
    from normatlas.experiments.lm import tiny_lm
    from normatlas.longtail import DyT

    lm = set_alphas(tiny_lm(pre_ln(), DyT, n_layers=2, d_model=16, n_heads=2), ALPHA_7B)
    for b in lm.blocks():
        assert float(b.attn_pre_norm.alpha.detach()) == pytest.approx(0.8)
        assert float(b.ffn_pre_norm.alpha.detach()) == pytest.approx(0.2)
    assert float(lm.final_norm.alpha.detach()) == pytest.approx(0.2)
    with pytest.raises(TypeError, match="not DyT or Derf"):
        from normatlas.presets import LayerNorm

        set_alphas(tiny_lm(pre_ln(), LayerNorm, n_layers=1, d_model=16, n_heads=2), ALPHA_7B)


def test_sentences_are_distinct_real_text_drawn_by_seed() -> None:
    a, b = sentences(64, seed=0), sentences(64, seed=1)
    assert len(set(a)) == 64 and a != b and all(len(s.split()) >= 6 for s in a)


def test_the_mild_shift_pulls_toward_mid_grey() -> None:
    x = torch.tensor([0.0, 0.5, 1.0])
    torch.testing.assert_close(shifted(x, MILD_SHIFT), torch.tensor([0.1, 0.5, 0.9]))


def test_fit_tanh_recovers_a_tanh_and_prefers_it_to_a_line() -> None:
    x = torch.linspace(-10, 10, 2001, dtype=torch.float64)
    fit = fit_tanh(x, 2.0 * torch.tanh(0.5 * x))
    assert fit["r2_tanh"] > 0.9999 > fit["r2_line"]
    assert fit["alpha"] == pytest.approx(0.5, rel=0.05) and fit["a"] == pytest.approx(2.0, rel=0.05)


def test_the_batch_mean_variance_falls_as_one_over_n() -> None:
    x = torch.rand(4000, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    var = mean_variance(x, (4, 64), torch.Generator().manual_seed(1), draws=400)
    assert 8 < var[0] / var[1] < 32  # 1/N predicts 16


def test_a_fixed_update_rotates_short_vectors_more() -> None:
    norms = torch.tensor([0.5, 5.0, 50.0], dtype=torch.float64)
    angles = rotation_by_norm(norms, torch.Generator().manual_seed(0))
    assert angles[0] > angles[1] > angles[2]
    assert float(angles[2]) == pytest.approx(math.degrees(math.atan(1 / 50)), rel=0.05)


def test_bf16_statistics_are_less_exact_than_fp32_statistics() -> None:
    errs = op_errors(torch.Generator().manual_seed(0), tokens=4)
    assert errs["bf16_stats"] > 2 * errs["fp32_stats"]


# ---------------------------------------------------------------- the experiments in quick mode
def test_e12_geometry_holds_in_quick_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m, holds = _quick(E12, tmp_path)
    assert holds  # exact identities: they hold at any scale
    assert m["ln_max_cos_y_ones"] < 1e-12 < m["rms_min_over_D_of_max_cos_y_ones"]


def test_e13_vlm_gap_in_quick_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m, _ = _quick(E13, tmp_path)
    # robust at any training length: long vision tokens rotate less, the connector narrows the gap,
    # and the 1/g rescale is exact
    assert m["text_over_vision_rotation_no_connector"] > 5 * m["text_over_vision_rotation_connector"]
    assert m["grad_ratio_not_rescaled_over_rescaled"] == pytest.approx(m["connector_gain"], rel=1e-3)


def test_e08_output_norm_in_quick_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m, _ = _quick(E08, tmp_path)
    # robust: the ramped run's output norm ends far above the flat control's (the verdict needs the default scale:
    # at 150 steps the init transient spans a fifth of the run and trips the alarm in both runs)
    assert m["max_output_norm"] > 2 * m["control_max_output_norm"] > 0


def test_e11_rmsnorm_vs_layernorm_in_quick_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m, _ = _quick(E11, tmp_path)
    # timings under a shared CPU are not robust in quick mode: only that they were measured
    assert all(0 < v < 10 for v in m["op_ratio_rms_over_ln_normatlas"].values())
    assert all(math.isfinite(v) and 0 < v < 6 for v in m["held_out_loss"].values())


def test_e14_bf16_in_quick_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m, _ = _quick(E14, tmp_path)
    errs = m["op_token_scale_max_rel_error"]
    assert errs["bf16_stats"] > 2 * errs["fp32_stats"]  # the op's precision: robust at any scale
    assert m["bf16_headroom_log2"]["Pre-LN"] > 100  # a tiny LM sits far below bf16's max (2^127)


def test_e10_batchnorm_in_quick_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m, _ = _quick(E10, tmp_path)
    assert -1.3 < m["variance_slope_loglog"] < -0.7  # the estimator: robust
    assert all(0 <= v <= 1 for per in m["accuracy"].values() for v in per.values())
    assert m["repeats"] >= 2 and all(v >= 0 for per in m["accuracy_std_over_repeats"].values() for v in per.values())


def test_e10_title_says_level_inside_the_repeats_spread() -> None:
    # the paper run's first title read "BN is above GroupNorm (98.5% vs 98.5%)": a 0.04-point gap, std 0.6-0.8
    from normatlas.experiments.e10_batchnorm_failures import NORMS, _title

    def sweep(bn: list[float], gn: list[float]) -> tuple[dict, dict]:
        acc = {n: {2: gn, 64: [0.97, 0.98]} for n in NORMS} | {"BatchNorm": {2: bn, 64: [0.97, 0.98]}}
        shift = {n: {0.0: [0.97, 0.98], MILD_SHIFT: [0.9, 0.9]} for n in NORMS}
        return acc, shift

    fine = {"Frozen BN": [0.9, 0.92], "live BN": [0.95, 0.96]}
    level = _title(*sweep([0.979, 0.991], [0.978, 0.992]), (2, 64), fine)
    assert level.startswith("At batch 2 BN is level with GroupNorm (98.5% vs 98.5%, std over repeats 0.8 / 1.0)")
    assert "is below GroupNorm" in _title(*sweep([0.90, 0.91], [0.97, 0.98]), (2, 64), fine)
    assert "is above GroupNorm" in _title(*sweep([0.97, 0.98], [0.90, 0.91]), (2, 64), fine)


def test_e09_dyt_in_quick_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m, _ = _quick(E09, tmp_path)
    # the S-curve of the deepest LayerNorm (the model's last) is a property of the trained weights: robust
    last = m["deep_layernorms"][-1]
    assert last["r2_tanh"] > last["r2_line"]
    assert all(math.isfinite(v) for v in m["held_out_loss"].values())
    assert set(m["sweep_held_out"]) == {"DyT", "Derf"} and m["best_alpha_factor"]["DyT"] in (1.0, 4.0)


def test_run_contexts_size_by_mode() -> None:
    assert RunContext(scale="quick", seed=0).size(300, 20) == 20
