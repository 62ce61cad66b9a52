"""Placement values, QK-norm, the block's forward against a float64 reference, and configuration-time errors."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normatlas import LayerNorm, RMSNorm
from normatlas.blocks import (
    PRESETS,
    Activation,
    Attention,
    Block,
    DepthScale,
    Gate,
    ModelConfig,
    Placement,
    QKGain,
    QKNorm,
    QKNormConfig,
    QKScope,
    Rope,
    RopeStyle,
    Schedule,
    Sublayer,
    TransformerLM,
    ViTConfig,
    ViTEncoder,
    apply_rope,
    deepnorm,
    mix_ln,
    peri_ln,
    pre_ln,
    rope_tables,
    scaled_residual,
)
from normatlas.vocabulary import Operator, RopeOrder

D = 48


# --------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_draws_its_dataflow(name):
    p = PRESETS[name]()
    assert isinstance(p, Placement) and p.name == name
    doc = PRESETS[name].__doc__ or ""
    assert "(+)" in doc and "x'" in doc, f"{name}: docstring must draw the dataflow"
    assert p.describe().startswith(name)


def _ref_sublayer(x, f, sub, p, norms, pre_scale):
    h = norms["pre"](x) * pre_scale if sub.pre else x
    y = f(h)
    if sub.post:
        y = norms["post"](y)
    x = p.residual_alpha * x + p.branch_scale * y
    return norms["after"](x) if sub.after_add else x


@pytest.mark.parametrize(
    "placement",
    [PRESETS[n]() for n in ("post_ln", "pre_ln", "peri_ln", "res_post_norm", "layernorm_scaling", "hybridnorm")]
    + [deepnorm(6), scaled_residual(0.22)],
    ids=lambda p: p.name,
)
def test_block_forward_matches_a_float64_reference(placement):
    torch.manual_seed(0)
    block = Block(D, placement, RMSNorm, layer=3, n_layers=6, n_heads=4, d_ff=80).double()
    with torch.no_grad():
        for prm in block.parameters():
            prm.add_(0.1 * torch.randn_like(prm))
    x = torch.randn(3, 5, D, dtype=torch.float64)

    def norms(sub):
        return {s: getattr(block, f"{sub}_{s}_norm") for s in ("pre", "post", "after")}

    scale = 1 / math.sqrt(4) if placement.pre_norm_scale is DepthScale.INV_SQRT_LAYER else 1.0
    ref = _ref_sublayer(x, block.attn, placement.attn, placement, norms("attn"), scale)
    ref = _ref_sublayer(ref, block.mlp, placement.ffn, placement, norms("ffn"), scale)
    torch.testing.assert_close(block(x), ref, atol=1e-12, rtol=1e-12)


def test_parallel_block_is_one_add_with_a_shared_norm():
    torch.manual_seed(0)
    block = Block(D, PRESETS["parallel"](), LayerNorm, layer=0, n_layers=1, n_heads=4, d_ff=80).double()
    assert block.ffn_pre_norm is None and block.ffn_residual is None
    x = torch.randn(2, 5, D, dtype=torch.float64)
    h = block.attn_pre_norm(x)
    torch.testing.assert_close(block(x), x + block.attn(h) + block.mlp(h), atol=1e-12, rtol=0)


# --------------------------------------------------------------------------- switching placement in one line
def test_switch_pre_ln_to_peri_ln_in_one_line():
    cfg = ModelConfig(vocab_size=50, d_model=D, n_layers=3, n_heads=4, d_ff=96, norm=RMSNorm, placement=pre_ln())
    peri = TransformerLM(replace(cfg, placement=peri_ln()))
    assert all(b.attn_post_norm is not None and b.ffn_post_norm is not None for b in peri.layers)
    assert all(b.attn_post_norm is None for b in TransformerLM(cfg).layers)


def test_vit_encoder_runs_with_any_placement():
    for placement in (pre_ln(), peri_ln(), PRESETS["layerscale"]()):
        cfg = ViTConfig(d_model=D, n_layers=2, n_heads=4, d_ff=96, norm=LayerNorm, placement=placement,
                        image_size=16, patch_size=4, num_classes=7)  # fmt: skip
        torch.manual_seed(0)
        out = ViTEncoder(cfg)(torch.randn(2, 3, 16, 16))
        assert out.shape == (2, 7) and torch.isfinite(out).all()


# --------------------------------------------------------------------------- QK-norm and RoPE
def _rope(x, style=RopeStyle.HALF, fraction=1.0):
    cos, sin = rope_tables(Rope(style=style, fraction=fraction), x.shape[-1], torch.arange(x.shape[-2]), x.dtype)
    return apply_rope(x, cos, sin, style)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    op=st.sampled_from([Operator.RMSNORM, Operator.L2]),
    style=st.sampled_from(list(RopeStyle)),
    fraction=st.sampled_from([1.0, 0.5]),
)
def test_gain_free_qk_norm_commutes_with_rope(seed, op, style, fraction):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 7, 16, generator=g, dtype=torch.float64)  # (B, H, T, Dh)
    norm = QKNorm(QKNormConfig(op, gain=QKGain.NONE), 3, 16).double()
    torch.testing.assert_close(norm(_rope(x, style, fraction)), _rope(norm(x), style, fraction))


def test_per_dim_gain_qk_norm_does_not_commute_with_rope():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    norm = QKNorm(QKNormConfig(Operator.RMSNORM, gain=QKGain.SHARED), 3, 16).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    assert (norm(_rope(x)) - _rope(norm(x))).abs().max() > 1e-2


def test_attention_qk_norm_before_or_after_rope():
    """Gain-free RMS: the Attention output is the same for either order; with a per-dim gain it differs."""
    outs = {}
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rope = (*rope_tables(Rope(), 12, torch.arange(6), torch.float64), RopeStyle.HALF)
    for gain in (QKGain.NONE, QKGain.SHARED):
        for order in (RopeOrder.BEFORE_ROPE, RopeOrder.AFTER_ROPE):
            torch.manual_seed(0)
            attn = Attention(D, 4, 2, qk_norm=QKNormConfig(gain=gain, order=order)).double()
            if gain is QKGain.SHARED:
                with torch.no_grad():
                    attn.q_norm.weight.copy_(torch.linspace(0.5, 2.0, 12))
                    attn.k_norm.weight.copy_(torch.linspace(2.0, 0.5, 12))
            outs[gain, order] = attn(x, rope)
    torch.testing.assert_close(outs[QKGain.NONE, RopeOrder.BEFORE_ROPE], outs[QKGain.NONE, RopeOrder.AFTER_ROPE])
    diff = outs[QKGain.SHARED, RopeOrder.BEFORE_ROPE] - outs[QKGain.SHARED, RopeOrder.AFTER_ROPE]
    assert diff.abs().max() > 1e-3


def test_qk_norm_variants_shapes_and_zero_centred_gain():
    x = torch.randn(2, 5, 4, 8)
    per_head = QKNorm(QKNormConfig(Operator.LAYERNORM, gain=QKGain.PER_HEAD), 4, 8)
    assert per_head.weight.shape == (4, 8)
    flat = QKNorm(QKNormConfig(scope=QKScope.FLAT, gain=QKGain.PER_HEAD), 4, 8)
    assert flat.weight.shape == (32,)
    zc = QKNorm(QKNormConfig(zero_centred=True), 4, 8)
    assert torch.equal(zc.weight, torch.zeros(8))
    plain = QKNorm(QKNormConfig(gain=QKGain.NONE), 4, 8)
    torch.testing.assert_close(zc(x), plain(x))  # 1 + 0 == identity gain
    ln = per_head(x)
    torch.testing.assert_close(ln.mean(-1), torch.zeros(2, 5, 4), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- configuration-time errors
@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ModelConfig(norm=None, placement=pre_ln()), "has norm slots but norm=None"),
        (
            lambda: ModelConfig(norm=RMSNorm, n_layers=4, placement=mix_ln(3)),
            "has 3 layers but the model has n_layers=4",
        ),
        (lambda: ModelConfig(norm=RMSNorm, n_heads=4, n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
        (lambda: ModelConfig(norm=RMSNorm, d_model=50, n_heads=4), "d_model=50 is not divisible by n_heads=4"),
        (lambda: ModelConfig(norm=None, placement=PRESETS["rezero"]()), "final_norm=True needs a norm operator"),
        (lambda: ModelConfig(norm=RMSNorm, layer_windows=(4,)), "layer_windows has 1 entries but n_layers=2"),
        (lambda: ModelConfig(norm=RMSNorm, placement="pre_ln"), "must be a Placement or a Schedule"),
        (lambda: ModelConfig(norm=RMSNorm, logit_softcap=-1.0), "logit_softcap=-1.0 must be a finite float > 0"),
        (lambda: Placement(parallel=True, attn=Sublayer(after_add=True), ffn=Sublayer()), "must agree"),
        (lambda: Placement(residual_alpha=-1.0), "residual_alpha=-1.0 must be > 0"),
        (lambda: Placement(branch_scale=0.0), "branch_scale=0.0 must be nonzero"),
        (
            lambda: Placement(
                attn=Sublayer(pre=False), ffn=Sublayer(pre=False), pre_norm_scale=DepthScale.INV_SQRT_LAYER
            ),
            "needs a pre-norm slot",
        ),
        (lambda: Placement(gate_init=0.5), "gate_init=0.5 is set but gate=Gate.NONE"),
        (lambda: Placement(gate="scalar"), "gate='scalar' must be one of Gate.NONE"),
        (lambda: QKNormConfig(scope=QKScope.FLAT, gain=QKGain.SHARED), "use QKGain.PER_HEAD or QKGain.NONE"),
        (lambda: QKNormConfig(gain=QKGain.NONE, zero_centred=True), "zero_centred=True needs a gain"),
        (lambda: QKNormConfig(eps=0.0), "eps=0.0 must be a finite float > 0"),
        (lambda: Schedule(()), "Schedule.layers is empty"),
        (lambda: mix_ln(4, post_ln_layers=5), r"post_ln_layers=5 must lie in \[0, n_layers=4\]"),
        (lambda: deepnorm(0), "n_layers=0 must be an integer >= 1"),
        (lambda: Rope(fraction=0.0), "fraction=0.0 must lie in"),
        (lambda: ViTConfig(norm=LayerNorm, image_size=30, patch_size=8), "patch_size=8 must divide image_size=30"),
    ],
)
def test_invalid_combinations_fail_at_configuration_time(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build()


def test_block_without_operator_fails_at_construction():
    with pytest.raises(ValueError, match="placement 'peri_ln' has norm slots but norm=None"):
        Block(D, peri_ln(), None, layer=0, n_layers=1, n_heads=4, d_ff=64)


def test_gate_enum_values_build_gates():
    p = Placement(gate=Gate.VECTOR, gate_init=1e-4)
    block = Block(D, p, RMSNorm, layer=0, n_layers=1, n_heads=4, d_ff=64, activation=Activation.GELU, gated=False)
    torch.testing.assert_close(block.attn_residual.gate.gamma, torch.full((D,), 1e-4))
