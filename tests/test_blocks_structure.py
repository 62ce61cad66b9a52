"""The placement schemes' defining properties, measured on built models at initialisation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from normatlas import LayerNorm, RMSNorm
from normatlas.blocks import (
    Activation,
    DeepNormArch,
    ModelConfig,
    ResidualAdd,
    TransformerLM,
    deepnorm,
    deepnorm_constants,
    depth_scaled_sandwich,
    hybridnorm,
    hybridnorm_star,
    layernorm_scaling,
    layerscale,
    mix_ln,
    peri_ln,
    post_ln,
    pre_ln,
    rezero,
    skipinit,
)

D, L = 64, 12


def _model(placement, n_layers=L, std=0.125, **kw) -> TransformerLM:
    torch.manual_seed(0)
    base = dict(vocab_size=64, d_model=D, n_layers=n_layers, n_heads=4, d_ff=128, norm=RMSNorm,
                placement=placement, init_std=std, tie_embeddings=False)  # fmt: skip
    base.update(kw)
    model = TransformerLM(ModelConfig(**base))
    nn.init.normal_(model.embed.weight, std=1.0)  # a unit-variance stream entering block 0
    return model


def _stream(model: TransformerLM, grad: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inputs of every block plus the last block's output (retaining grads), and the logits."""
    xs: list[torch.Tensor] = []

    def keep(_m, args):
        if grad:
            args[0].retain_grad()
        xs.append(args[0])

    def keep_out(_m, _a, out):
        if grad:
            out.retain_grad()
        xs.append(out)

    hooks = [b.register_forward_pre_hook(keep) for b in model.layers]
    hooks.append(model.layers[-1].register_forward_hook(keep_out))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    try:
        logits = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return xs, logits


def _token_rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1).sqrt()


# --------------------------------------------------------------------------- gradient identity path
def test_pre_ln_gradient_at_embedding_is_not_attenuated_with_depth():
    model = _model(pre_ln())
    xs, logits = _stream(model, grad=True)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.zeros(logits.shape[:2].numel(), dtype=torch.long)
                                      ).backward()  # fmt: skip
    norms = [x.grad.norm().item() for x in xs]
    # dx_L/dx_0 = prod(I + J_l): the identity path carries the top gradient down unattenuated
    assert norms[0] >= norms[-1]
    assert all(a >= b * 0.999 for a, b in itertools.pairwise(norms))


@pytest.mark.parametrize("placement, identity", [(pre_ln(), True), (post_ln(), False)])
def test_identity_path_with_branches_switched_off(placement, identity):
    """With every branch output zeroed, Pre-LN is the identity map (gradient passes exactly); Post-LN is not."""
    model = _model(placement, final_norm=False)
    with torch.no_grad():
        for b in model.layers:
            b.attn.o_proj.weight.zero_()
            b.mlp.down_proj.weight.zero_()
    x = (3.0 * torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2))).requires_grad_()
    g = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3))
    y = model.run_layers(x)
    (y * g).sum().backward()
    assert x.grad is not None
    if identity:
        torch.testing.assert_close(x.grad, g, atol=0, rtol=0)
    else:
        assert (x.grad - g).abs().max() > 0.1


# --------------------------------------------------------------------------- residual-stream variance
def test_pre_ln_stream_variance_grows_with_depth_and_layernorm_scaling_bounds_it():
    with torch.no_grad():
        pre = [x.var().item() for x in _stream(_model(pre_ln()))[0]]
        lns = [x.var().item() for x in _stream(_model(layernorm_scaling()))[0]]
    assert all(b > a for a, b in itertools.pairwise(pre)), pre
    assert pre[-1] > 5 * pre[0]
    # LNS: the same weights, branch inputs scaled by 1/sqrt(l): the growth flattens out
    assert lns[-1] < 0.5 * pre[-1]
    inc = [b - a for a, b in itertools.pairwise(lns)]
    assert inc[-1] < 0.25 * inc[0], inc


def test_peri_ln_bounds_each_update_whatever_the_branch_weights_scale():
    """Peri-LN adds N(F(.)) whose per-token RMS is the gain (1 at init), so RMS(x_L) <= RMS(x_0) + 2L
    for any branch weights; Pre-LN's stream grows with the weights' scale and breaks that bound."""
    out = {}
    for name, placement in (("pre", pre_ln()), ("peri", peri_ln())):
        model = _model(placement)
        with torch.no_grad():
            for b in model.layers:
                b.attn.o_proj.weight.mul_(30.0)
                b.mlp.down_proj.weight.mul_(30.0)
            xs, _ = _stream(model)
        bound = _token_rms(xs[0]) + 2 * L
        out[name] = (_token_rms(xs[-1]) / bound).max().item()
    assert out["peri"] <= 1.0 + 1e-5
    assert out["pre"] > 1.5


# --------------------------------------------------------------------------- DeepNorm / LNS / DSSN constants
@pytest.mark.parametrize("n", [1, 6, 18, 100, 1000])
def test_deepnorm_constants_follow_wang_et_al(n):
    enc = deepnorm_constants(DeepNormArch.ENCODER, n)
    dec = deepnorm_constants(DeepNormArch.DECODER, n)
    assert enc.alpha == pytest.approx((2 * n) ** 0.25, rel=1e-12) and enc.beta == pytest.approx((8 * n) ** -0.25)
    assert (dec.alpha, dec.beta) == (enc.alpha, enc.beta)
    m = n + 3
    ed = deepnorm_constants(DeepNormArch.ENCODER_DECODER, n, m)
    assert ed.alpha == pytest.approx(0.81 * (n**4 * m) ** (1 / 16))
    assert ed.beta == pytest.approx(0.87 * (n**4 * m) ** (-1 / 16))
    assert ed.decoder == pytest.approx(((3 * m) ** 0.25, (12 * m) ** -0.25))


def test_deepnorm_model_uses_alpha_and_beta_init():
    n = 24
    model = _model(deepnorm(n), n_layers=n, final_norm=False)
    alpha, beta = (2 * n) ** 0.25, (8 * n) ** -0.25
    adds = [m for m in model.modules() if isinstance(m, ResidualAdd)]
    assert len(adds) == 2 * n and all(a.alpha == pytest.approx(alpha) for a in adds)

    def xavier_std(w: torch.Tensor, gain: float) -> float:
        return gain * math.sqrt(2.0 / (w.shape[0] + w.shape[1]))

    v = torch.cat([b.attn.v_proj.weight.flatten() / xavier_std(b.attn.v_proj.weight, beta) for b in model.layers])
    q = torch.cat([b.attn.q_proj.weight.flatten() / xavier_std(b.attn.q_proj.weight, 1.0) for b in model.layers])
    assert v.std().item() == pytest.approx(1.0, rel=0.05)
    assert q.std().item() == pytest.approx(1.0, rel=0.05)
    # forward: x_{l+1} = N(alpha * x + F(x)) on the first sublayer
    b = model.layers[0]
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = b.attn_after_norm(alpha * x + b.attn(x))
        got = b.attn_after_norm(b.attn_residual(x, b.attn(x)))
    torch.testing.assert_close(got, ref)


def test_layernorm_scaling_factor_is_inverse_sqrt_layer():
    model = _model(layernorm_scaling(), n_layers=5)
    assert [b.pre_scale for b in model.layers] == pytest.approx([1 / math.sqrt(i + 1) for i in range(5)])


def test_depth_scaled_sandwich_post_gains_start_at_c_over_sqrt_depth():
    model = _model(depth_scaled_sandwich(0.5), n_layers=9)
    for b in model.layers:
        for norm in (b.attn_post_norm, b.ffn_post_norm):
            torch.testing.assert_close(norm.weight, torch.full((D,), 0.5 / 3.0))
        assert torch.equal(b.attn_pre_norm.weight, torch.ones(D))


# --------------------------------------------------------------------------- schedules
def test_hybridnorm_star_treats_block_zero_differently():
    model = _model(hybridnorm_star(4), n_layers=4)
    first, rest = model.layers[0], model.layers[1:]
    assert first.attn_pre_norm is not None and first.ffn_pre_norm is not None
    assert first.attn.v_norm is None and first.ffn_after_norm is None
    for b in rest:
        assert b.attn_pre_norm is None and b.ffn_pre_norm is None
        assert b.attn.q_norm is not None and b.attn.k_norm is not None and b.attn.v_norm is not None
        assert b.ffn_after_norm is not None
    assert {b.placement for b in rest} == {hybridnorm()}


def test_hybridnorm_attention_is_invariant_to_input_scale():
    """QKV-norm normalizes q, k and v over the head dim, so the attention branch ignores the stream's scale."""
    b = _model(hybridnorm(), n_layers=1).layers[0]
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(b.attn(7.0 * x), b.attn(x), atol=1e-5, rtol=1e-5)


def test_mix_ln_first_layers_post_ln_then_pre_ln():
    model = _model(mix_ln(8, post_ln_layers=3), n_layers=8)
    kinds = ["post" if b.attn_after_norm is not None else "pre" for b in model.layers]
    assert kinds == ["post"] * 3 + ["pre"] * 5


def test_schedule_can_change_the_operator_per_layer():
    from normatlas.blocks import LayerPlan, Schedule

    sched = Schedule.of([LayerPlan(pre_ln(), LayerNorm), pre_ln()])
    model = _model(sched, n_layers=2)
    assert isinstance(model.layers[0].attn_pre_norm, LayerNorm)
    assert isinstance(model.layers[1].attn_pre_norm, RMSNorm)


# --------------------------------------------------------------------------- identity at initialisation
@pytest.mark.parametrize("placement", [rezero(), skipinit()])
def test_rezero_and_skipinit_blocks_are_the_identity_at_init(placement):
    model = _model(placement, norm=None, final_norm=False, n_layers=3)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model.run_layers(x), x, atol=0, rtol=0)
    assert not any(isinstance(m, (RMSNorm, LayerNorm)) for m in model.modules())


def test_layerscale_branch_starts_at_init_values():
    b = _model(layerscale(1e-5), n_layers=1).layers[0].double()  # float64: x + 1e-5 * y - x loses bits in fp32
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():
        branch = b.attn(b.attn_pre_norm(x))
        gamma = b.attn_residual.gate.gamma
        torch.testing.assert_close(gamma, torch.full((D,), 1e-5, dtype=torch.float64), atol=0, rtol=1e-7)
        torch.testing.assert_close(b.attn_residual(x, branch) - x, gamma * branch, atol=1e-15, rtol=1e-9)
        assert (b(x) - x).abs().max() < 1e-3


def test_dyt_norm_free_blocks_use_the_pointwise_operator():
    pointwise = pytest.importorskip("normatlas.longtail.pointwise")
    model = _model(peri_ln(), norm=pointwise.DyT, n_layers=2, activation=Activation.GELU)
    kinds = {type(m).__name__ for m in model.modules() if type(m).__name__ in ("DyT", "RMSNorm")}
    assert kinds == {"DyT"}
    x = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.isfinite(model.run_layers(x)).all()
