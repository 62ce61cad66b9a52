"""Surgery on tiny random-initialised transformers models: exact where it applies, refused with reasons
where not. Configs are the real families' defaults shrunk to 2 layers, width 32 (litgpt style)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normatlas.analysis import record_flow as record  # noqa: E402
from normatlas.modules import Norm  # noqa: E402
from normatlas.spec import EpsPlacement, GainConvention  # noqa: E402
from normatlas.surgery import (  # noqa: E402
    Tolerance,
    cancel_pre_attention_norms,
    change_eps,
    convert_gain_convention,
    deferred_runtime,
    find_norms,
    fold_gains,
    gain_offset_warnings,
    ln_to_rms,
    model_output,
    probe_inputs,
    run_checks,
    save_surgery,
)

from .tiny_hf import randomise_, tiny_model  # noqa: E402

# 2 layers, width 32, vocab 64 (tests/tiny_hf.py), shrunk from: Llama-2-7B (4096 wide, 32 layers); Qwen3-0.6B
# (1024/28L, QK-norm per head); Gemma-3-1B text (1152/26L, (1 + w) gains, sandwich norms, QK-norm); OLMo-2-1B
# (2048/16L, post-branch norms, QK-norm over the full projection); GPT-2 small and OPT-125m (768/12L, Pre-LN
# LayerNorm, tied head). GPT-2 and OPT need in-vocabulary token ids.
TOKENS = {"gpt2": dict(bos_token_id=0, eos_token_id=0), "opt": dict(pad_token_id=1, bos_token_id=0, eos_token_id=0)}
MODEL_TYPE = {"gemma3": "gemma3_text"}  # family name in the test ids -> HF model_type


def tiny(family: str) -> torch.nn.Module:
    """A fresh copy of :func:`_tiny` (built once per family per session)."""
    return copy.deepcopy(_tiny(family))


@functools.cache
def _tiny(family: str) -> torch.nn.Module:
    """A seeded tiny model of ``family`` with every 1-D parameter (gains, biases) randomised, so that
    folding a gain is not a no-op and a mistake shows in the logits."""
    model = tiny_model(MODEL_TYPE.get(family, family), seed=0, **TOKENS.get(family, {}))
    return randomise_(model, 0.3, vectors_only=True, generator=torch.Generator().manual_seed(1))


FAMILIES = ["llama", "qwen3", "gemma3", "olmo2", "gpt2", "opt"]
TOL64 = 1e-6  # HF norms compute in float32 even in a float64 model: errors sit near 1e-7


def logits(model: torch.nn.Module, inputs: dict, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return model_output(copy.deepcopy(model).to(dtype), inputs)[0]


def assert_same_logits(before, after, inputs) -> None:
    ref = logits(before, inputs)
    torch.testing.assert_close(logits(after, inputs), ref, rtol=0, atol=TOL64 * float(ref.abs().max()))
    ref32 = logits(before, inputs, torch.float32)
    torch.testing.assert_close(
        logits(after, inputs, torch.float32), ref32, rtol=0, atol=2e-5 * float(ref32.abs().max())
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_fold_gains_is_exact_and_refuses_with_reasons(family: str) -> None:
    model = tiny(family)
    x = probe_inputs(model)
    s = fold_gains(model, x)
    run_checks(model, s, x, tolerance=Tolerance(TOL64, 1e-5))
    assert s.passed, s.check_rows()
    assert s.changes, "something must fold in every family (at least the final norm into the head)"
    runtime = s.runtime()
    assert_same_logits(model, runtime, x)
    assert_same_logits(model, s.stock, x)
    folded = {c.target for c in s.changes}
    for name in folded:  # the runtime norms are weightless
        assert isinstance(runtime.get_submodule(name), Norm)
    refused = {r.target: r.reason for r in s.refusals}
    if family in ("gemma3", "olmo2"):  # post-branch norms feed the residual add
        post = [n for n, r in refused.items() if "add" in r]
        assert post, refused
    if family in ("qwen3", "gemma3", "olmo2"):
        assert any("q_norm" in n for n in refused)
    if family in ("gpt2", "opt", "gemma3"):  # tied LM head had to be untied
        assert any("untied" in n for n in s.notes)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_deferred_normalisation_is_exact(family: str) -> None:
    model = tiny(family)
    x = probe_inputs(model)
    s = fold_gains(model, x, defer=True)
    assert s.deferred
    assert_same_logits(model, deferred_runtime(s), x)


def test_a_wrong_fold_is_caught_and_not_written(tmp_path) -> None:
    model = tiny("llama")
    x = probe_inputs(model)
    s = fold_gains(model, x)
    with torch.no_grad():  # break the proof: undo one consumer's fold
        s.stock.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    run_checks(model, s, x)
    assert not s.passed
    with pytest.raises(ValueError, match="verification failed"):
        save_surgery(s, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_ln_to_rms_exact_on_pre_ln(family: str) -> None:
    model = tiny(family)
    x = probe_inputs(model)
    s = ln_to_rms(model, x)
    run_checks(model, s, x, tolerance=Tolerance(TOL64, 1e-5))
    assert s.passed and not s.refusals, (s.check_rows(), s.refusals)
    runtime = s.runtime()
    norms = find_norms(record(model, x))
    assert all(f.measured.center for f in norms.values())
    for name in norms:
        swapped = runtime.get_submodule(name)
        assert isinstance(swapped, Norm) and not swapped.spec.center
    assert_same_logits(model, runtime, x)
    assert_same_logits(model, s.stock, x)  # stock LayerNorm on the centred stream == RMSNorm


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "olmo2"])
def test_ln_to_rms_has_nothing_to_do_on_rms_models(family: str) -> None:
    model = tiny(family)
    s = ln_to_rms(model, probe_inputs(model))
    assert not s.changes and not s.swaps


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_cancel_refused_when_only_q_and_k_are_normalised(family: str) -> None:
    model = tiny(family)
    s = cancel_pre_attention_norms(model, probe_inputs(model))
    assert not s.changes
    reasons = [r.reason for r in s.refusals if r.target.endswith("input_layernorm")]
    assert len(reasons) == 2
    assert all("v_proj" in r and "value path" in r for r in reasons)


def test_cancel_refused_without_qk_norm() -> None:
    model = tiny("llama")
    s = cancel_pre_attention_norms(model, probe_inputs(model))
    assert not s.changes and not s.refusals
    assert "nothing to cancel" in s.notes[0] and "(no QK-norm)" in s.notes[0]


def test_cancel_on_olmo2_names_the_missing_pre_attention_norm() -> None:
    """OLMo 2 has a QK-norm (over the flattened heads) but no norm before q / k / v (res-post): the note says so,
    not "no QK-norm" (issue 20)."""
    model = tiny("olmo2")
    s = cancel_pre_attention_norms(model, probe_inputs(model))
    assert not s.changes and not s.refusals
    note = s.notes[0]
    assert "(QK-norm)" in note and "no pre-attention norm" in note and "q_proj" in note and "no QK-norm" not in note


class QKVNormAttention(torch.nn.Module):
    """A pre-norm attention block whose Q, K and V are all normalised per head after projection."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
        self.qn, self.kn, self.vn = (torch.nn.RMSNorm(d // heads, eps=1e-6) for _ in range(3))
        self.o = torch.nn.Linear(d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, t, d = h.shape
        q, k, v = (
            n(p(h).view(b, t, self.heads, -1)).transpose(1, 2)
            for p, n in ((self.q, self.qn), (self.k, self.kn), (self.v, self.vn))
        )
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, d))


def test_cancel_deletes_the_norm_when_q_k_and_v_are_normalised() -> None:
    torch.manual_seed(0)
    model = QKVNormAttention().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.3)
    x = torch.randn(2, 7, 32) * 3
    s = cancel_pre_attention_norms(model, (x,))
    assert [c.target for c in s.changes] == ["norm"], s.refusals
    run_checks(model, s, (x,), tolerance=Tolerance(1e-5, 1e-4))
    assert s.passed, s.check_rows()
    runtime = s.runtime()
    assert isinstance(runtime.norm, torch.nn.Identity)
    with torch.no_grad():
        ref = model.double()(x.double())
        torch.testing.assert_close(runtime.double()(x.double()), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,code", [("gemma3", GainConvention.ONE_PLUS_W), ("llama", GainConvention.W)])
def test_gain_convention_measured_and_converted_both_ways(family: str, code: GainConvention) -> None:
    model = tiny(family)
    x = probe_inputs(model)
    norms = find_norms(record(model, x))
    assert {f.measured.gain_convention for f in norms.values()} == {code}
    other = GainConvention.W if code is GainConvention.ONE_PLUS_W else GainConvention.ONE_PLUS_W
    s = convert_gain_convention(model, x, other)
    run_checks(model, s, x, tolerance=Tolerance(TOL64, 1e-5))
    assert s.passed and len(s.changes) == len(norms) and not s.stock_equivalent
    assert_same_logits(model, s.runtime(), x)
    back = convert_gain_convention(s.runtime(), x, code)
    for name in norms:
        w0 = model.get_submodule(name).weight
        torch.testing.assert_close(back.runtime().get_submodule(name).weight, w0, rtol=0, atol=1e-6)


def test_double_offset_is_warned() -> None:
    model = tiny("gemma3")
    x = probe_inputs(model)
    assert gain_offset_warnings(model, find_norms(record(model, x))) == []
    with torch.no_grad():  # what a bad conversion does: bake the +1 into weights the code offsets again
        model.model.norm.weight.add_(1.0)
    warnings = gain_offset_warnings(model, find_norms(record(model, x)))
    assert len(warnings) == 1 and "model.norm" in warnings[0] and "double offset" in warnings[0]


def test_eps_changes_report_measured_deviation() -> None:
    model = tiny("llama")
    x = probe_inputs(model)
    same = change_eps(model, x, eps=1e-6)
    run_checks(model, same, x, tolerance=Tolerance(TOL64, 1e-5))
    assert same.passed
    moved = change_eps(model, x, eps_placement=EpsPlacement.OUTSIDE_SQRT)
    devs = [float(c.detail.rsplit(" ", 1)[1]) for c in moved.changes]
    assert all(d > 0 for d in devs)
    big = change_eps(model, x, eps=1.0)
    run_checks(model, big, x)
    assert not big.passed and big.checks[0].max_rel > 1e-3
    with pytest.raises(ValueError, match="eps=-1"):
        change_eps(model, x, eps=-1.0)


def test_ln_to_rms_refuses_post_ln_opt_with_the_reason() -> None:
    # OPT-350m's layout: do_layer_norm_before=False (Post-LN), 24 layers, width 1024
    model = tiny_model("opt", seed=0, do_layer_norm_before=False, **TOKENS["opt"])
    x = probe_inputs(model)
    s = ln_to_rms(model, x)
    assert not s.changes and len(s.refusals) == 4
    assert all("Post-LN" in r.reason and "P*diag(g)" in r.reason for r in s.refusals[1:])
    first = s.refusals[0]  # reads embeddings only, but its stream is also read by the attention projections
    assert "q_proj" in first.reason and "would see the centred values" in first.reason
    folded = fold_gains(model, x)
    assert all("add" in r.reason or "model output" in r.reason for r in folded.refusals)
    assert [c.target for c in folded.changes] == ["model.decoder.layers.1.final_layer_norm"]  # feeds only lm_head
    run_checks(model, folded, x, tolerance=Tolerance(TOL64, 1e-5))
    assert folded.passed, folded.check_rows()
