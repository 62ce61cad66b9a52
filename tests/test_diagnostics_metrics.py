"""Pure diagnostics metrics against float64 references and torch's SDPA as the peer."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from normatlas.diagnostics import (
    AttentionCapture,
    EntropyCollapseAlarm,
    SpikeDetector,
    ThresholdAlarm,
    TrendAlarm,
    attention_sinks,
    attention_stats,
    check_image_processor,
    headroom,
    massive_activations,
    modality_norm_gap,
    repeated_ngrams,
    residual_stats,
    sdpa_probs,
)


def test_residual_stats_matches_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 7, 33, generator=g)
    b = a + 0.3 * torch.randn(3, 7, 33, generator=g)
    got = residual_stats(a, b)
    a64, b64 = a.double(), b.double()
    ref_ratio = ((b64 - a64) ** 2).mean().sqrt() / (a64**2).mean().sqrt()
    ref_cos = ((a64 * b64).sum(-1) / (a64.norm(dim=-1) * b64.norm(dim=-1))).mean()
    assert_close(got["update_ratio"], float(ref_ratio), rtol=1e-5, atol=0)
    assert_close(got["identity_cos"], float(ref_cos), rtol=1e-5, atol=0)
    assert_close(got["rms"], float((b64**2).mean().sqrt()), rtol=1e-5, atol=0)
    assert_close(got["var"], float(b64.var(-1, unbiased=False).mean()), rtol=1e-5, atol=0)


@settings(max_examples=25, deadline=None)
@given(scale=st.floats(1e-3, 1e3), seed=st.integers(0, 1000))
def test_residual_ratios_are_scale_invariant(scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    b = a + torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    r1, r2 = residual_stats(a, b), residual_stats(scale * a, scale * b)
    assert_close(r2["update_ratio"], r1["update_ratio"], rtol=1e-5, atol=1e-6)
    assert_close(r2["identity_cos"], r1["identity_cos"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("hq", "hk", "tq", "tk", "causal", "mask"),
    [(4, 4, 5, 5, True, None), (4, 2, 7, 9, False, "bool"), (3, 3, 1, 123, False, "float"), (2, 1, 6, 6, True, None)],
)
def test_sdpa_probs_reproduce_torch_sdpa(hq: int, hk: int, tq: int, tk: int, causal: bool, mask: str | None) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, hq, tq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, hk, tk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, hk, tk, 8, generator=g, dtype=torch.float64)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, tq, tk, generator=g) > 0.3
        m[..., 0] = True
    elif mask == "float":
        m = torch.randn(2, 1, tq, tk, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=hq != hk)
    _, probs = sdpa_probs(q, k, m, causal, None, hq != hk)
    vv = v.repeat_interleave(hq // hk, dim=1)
    assert_close(probs.double() @ vv, ref, rtol=1e-5, atol=1e-5)  # probs are float32


def test_attention_capture_sees_sdpa_and_eager_softmax_alike() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(3))
    got: list[torch.Tensor] = []
    with AttentionCapture(lambda p, lg: got.append(p), max_examples=2):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -math.inf)
        out2 = torch.softmax(scores, dim=-1) @ v
    assert len(got) == 2
    assert_close(got[0], got[1], rtol=1e-5, atol=1e-6)
    assert_close(out, out2, rtol=1e-5, atol=1e-6)  # the intercepted ops still compute the same thing


def test_attention_stats_uniform_and_one_hot() -> None:
    t = 11
    uniform = torch.full((1, 2, t, t), 1.0 / t)
    st_u = attention_stats(uniform)
    assert_close(st_u["entropy"], math.log(t), rtol=1e-5, atol=0)
    assert_close(st_u["entropy_norm"], 1.0, rtol=1e-5, atol=0)
    one_hot = torch.zeros(1, 2, t, t)
    one_hot[..., 0] = 1.0
    st_o = attention_stats(one_hot, logits=torch.randn(1, 2, t, t))
    assert st_o["entropy"] == pytest.approx(0.0, abs=1e-6)
    sinks = attention_sinks(one_hot)
    assert sinks["sink_token"] == 0 and sinks["sink_share"] == pytest.approx(1.0) and sinks["sinks"] == [0]


@settings(max_examples=20, deadline=None)
@given(shift=st.floats(-50, 50), seed=st.integers(0, 1000))
def test_entropy_is_invariant_to_logit_shift(shift: float, seed: int) -> None:
    """Softmax is shift-invariant, so the captured entropy must be (essay: QK-norm section)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    _, p1 = sdpa_probs(q, k)
    _, p2 = sdpa_probs(q, k, torch.full((5, 5), shift))
    assert_close(attention_stats(p2)["entropy"], attention_stats(p1)["entropy"], rtol=1e-4, atol=1e-5)


def test_massive_activation_is_located() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 31, generator=g)
    x[1, 4, 17] = 5000.0
    ma = massive_activations(x)
    top = ma["top"][0]
    assert (top["example"], top["token"], top["channel"]) == (1, 4, 17)
    assert top["value"] == 5000.0
    assert ma["max_ratio"] == pytest.approx(5000.0 / float(x.abs().flatten().median()), rel=1e-6)
    assert ma["massive"] == 1
    with pytest.raises(ValueError, match="factor"):
        massive_activations(x, factor=0.5)


def test_headroom_bf16_fp16() -> None:
    x = torch.tensor([1.0, -1e5, 1e-45, 0.0])
    hr = headroom(x)
    assert hr["fp16_headroom_log2"] < 0  # 1e5 overflows fp16
    assert hr["bf16_headroom_log2"] == pytest.approx(math.log2(float(torch.finfo(torch.bfloat16).max) / 1e5))
    assert hr["bf16_underflow_share"] == pytest.approx(1 / 3)  # 1e-45 (fp32 subnormal) flushes in bf16


def test_repeated_ngrams_finds_planted_repeats() -> None:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1000, (3, 400), generator=g)
    gram = torch.tensor([5, 6, 7, 8, 9])
    ids[1, 50 : 50 + 5 * 40] = gram.repeat(40)
    r = repeated_ngrams(ids)
    assert r["flagged"] == [1]
    assert r["repeats"][1] == pytest.approx(40.0)
    assert r["ngram"][1] == 5
    assert r["repeats"][0] < 3
    pad = torch.zeros(1, 100, dtype=torch.long)
    assert repeated_ngrams(pad, ignore_id=0)["flagged"] == []
    with pytest.raises(TypeError, match="input_ids"):
        repeated_ngrams(torch.randn(2, 5))


def test_modality_gap_and_pixel_constants(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = torch.randn(2, 5, 16)
    assert modality_norm_gap(40 * text, text)["gap"] == pytest.approx(40.0, rel=1e-5)
    clip = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    assert check_image_processor(clip, "clip").ok
    bad = check_image_processor(clip, "siglip")
    assert not bad.ok and bad.matches == "openai_clip" and "inception" in bad.message
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    assert check_image_processor(tmp_path, "SigLIP").ok
    assert check_image_processor(path, "openclip").ok  # OpenCLIP's SigLIP configs use (0.5, 0.5, 0.5)
    assert not check_image_processor(path, "imagenet").ok
    with pytest.raises(ValueError, match="encoder='dino'"):
        check_image_processor(clip, "dino")


def test_alarms_fire_on_their_pattern_only() -> None:
    trend = TrendAlarm("output_norm", window=5, growth=1.5)
    flat = [trend.check(i, {"output_norm": 10 + 0.1 * (-1) ** i}) for i in range(20)]
    assert not any(flat)
    trend2 = TrendAlarm("output_norm", window=5, growth=1.5)
    fired = [i for i in range(20) if trend2.check(i, {"output_norm": 1.2**i})]
    assert fired and fired[0] == 4
    spike = SpikeDetector("grad_norm/*", window=10, z=6, ratio=3)
    g = torch.Generator().manual_seed(5)
    noise = [1.0 + 0.05 * float(torch.randn(1, generator=g)) for _ in range(30)]
    assert not any(spike.check(i, {"grad_norm/total": v}) for i, v in enumerate(noise))
    assert spike.check(30, {"grad_norm/total": 10.0, "loss": 99.0})[0].key == "grad_norm/total"
    ent = EntropyCollapseAlarm(floor=0.1, fraction=0.1)
    assert not ent.check(0, {"attention/entropy_norm/L0": 0.9})
    assert ent.check(1, {"attention/entropy_norm/L0": 0.05})[0].alarm == "entropy-collapse"
    with pytest.raises(ValueError, match="above= or below="):
        ThresholdAlarm("x")


def test_massive_median_estimate_is_close_to_exact() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, 257, generator=g)
    x[0, 0, 5] = 1e4
    exact = massive_activations(x, median_sample=None)
    est = massive_activations(x)
    assert est["top"] == [dict(t, ratio=est["top"][i]["ratio"]) for i, t in enumerate(exact["top"])]
    assert_close(est["median"], exact["median"], rtol=0.05, atol=0)


def test_entropy_norm_counts_allowed_keys_not_surviving_probabilities() -> None:
    """Two keys win among 64 allowed: the losers' probabilities round to exactly 0 in float32, yet they
    were allowed, so the normalized entropy is log(2) / log(64), not 1 (uniform over the survivors)."""
    t = 64
    logits = torch.full((1, 1, t, t), -200.0)
    logits[..., :2] = 0.0
    probs = torch.softmax(logits, -1)
    assert int((probs[0, 0, 0] > 0).sum()) == 2  # the underflow the metric must not trust
    want = math.log(2) / math.log(t)
    assert_close(attention_stats(probs, logits)["entropy_norm"], want, rtol=1e-5, atol=0)
    everywhere = torch.ones(t, t, dtype=torch.bool)
    assert_close(attention_stats(probs, allowed=everywhere)["entropy_norm"], want, rtol=1e-5, atol=0)
    assert_close(attention_stats(probs)["entropy_norm"], want, rtol=1e-5, atol=0)  # default: every key
    far = logits.masked_fill(logits < 0, -2e4)  # losers as far down as a collapsing TinyLM puts them
    assert_close(attention_stats(torch.softmax(far, -1), far)["entropy_norm"], want, rtol=1e-5, atol=0)
    # additive masks of finfo(dtype).min (HF eager) count as masked: 8 allowed keys, uniform over them
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        masked = torch.full((1, 1, 4, t), torch.finfo(dtype).min, dtype=dtype)
        masked[..., :8] = 0.0
        st_m = attention_stats(torch.softmax(masked.float(), -1), masked)
        assert_close(st_m["entropy_norm"], 1.0, rtol=1e-5, atol=0)


def test_entropy_collapse_alarm_fires_when_a_few_keys_survive() -> None:
    t = 64
    logits = torch.full((1, 2, t, t), -200.0)
    logits[..., 0], logits[..., 1] = 0.0, -4.0  # nearly one-hot over 64 allowed keys
    value = attention_stats(torch.softmax(logits, -1), logits)["entropy_norm"]
    assert float(value) < 0.1  # type: ignore[arg-type]
    alarm = EntropyCollapseAlarm()
    assert alarm.check(0, {"attention/entropy_norm/L0": value})[0].alarm == "entropy-collapse"


def test_causal_first_row_is_left_out_of_the_entropy() -> None:
    """Uniform causal attention is uniform over every row's allowed keys: normalized entropy exactly 1.
    Row 0 may attend to one key only; it carries no information and must not count as a 0."""
    t = 9
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    logits = torch.zeros(1, 2, t, t).masked_fill(~causal, -math.inf)
    probs = torch.softmax(logits, -1)
    st_c = attention_stats(probs, logits)
    assert_close(st_c["entropy_norm"], 1.0, rtol=1e-6, atol=0)
    assert_close(st_c["entropy_norm_min"], 1.0, rtol=1e-6, atol=0)
    want = sum(math.log(i + 1) for i in range(1, t)) / (t - 1)
    assert_close(st_c["entropy"], want, rtol=1e-5, atol=0)
    assert_close(attention_stats(probs, allowed=causal)["entropy_norm"], 1.0, rtol=1e-6, atol=0)
    single = attention_stats(torch.ones(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))  # nothing to average over
    assert math.isnan(float(single["entropy_norm"]))  # type: ignore[arg-type]
    assert not EntropyCollapseAlarm().check(0, {"attention/entropy_norm/L0": single["entropy_norm"]})


def test_attention_stats_rejects_a_bad_allowed_mask() -> None:
    probs = torch.full((1, 1, 3, 3), 1 / 3)
    with pytest.raises(TypeError, match="allowed must be a boolean"):
        attention_stats(probs, allowed=torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"allowed has shape \(4, 4\)"):
        attention_stats(probs, allowed=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="logits shape"):
        attention_stats(probs, logits=torch.zeros(1, 1, 3, 4))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_headroom_of_non_finite_activations(bad: float) -> None:
    hr = headroom(torch.tensor([1.0, bad, 2.0, 3.0]))  # before the fix: inf raised "math domain error"
    assert hr["bf16_headroom_log2"] == -math.inf and hr["fp16_headroom_log2"] == -math.inf
    assert hr["nonfinite_share"] == 0.25
    assert hr["bf16_underflow_share"] == 0.0
    assert headroom(torch.tensor([1.0, 2.0]))["nonfinite_share"] == 0.0
    alarm = ThresholdAlarm("headroom/nonfinite_share", above=0.0)
    assert alarm.check(0, {"headroom/nonfinite_share": hr["nonfinite_share"]})
