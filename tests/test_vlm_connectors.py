"""The VLM connectors (normatlas.longtail.vlm_connectors) and the tiny VLMs built from them (longtail.tiny_vlm).

Each module against an independent float64 computation in plain torch (forward and the backward of a random upstream
gradient), against torch.nn.MultiheadAttention where it is the peer, at odd shapes; Flamingo's gated block is the
identity bit for bit at init; the inspector reads the tiny VLMs' connector and injection back; bad arguments raise
errors that name them.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

from normatlas import RMSNorm
from normatlas.blocks import Activation, Block, ModelConfig, pre_ln, sandwich_ln
from normatlas.longtail import (
    CrossAttention,
    GatedCrossAttentionBlock,
    ModalityBlock,
    ModalitySplitNorm,
    PerceiverResampler,
    TinyVLM,
    TinyVLMConfig,
)
from normatlas.spec import Axis, NormSpec
from normatlas.vocabulary import ConnectorKind, Injection, PlacementKind

F64 = {"atol": 1e-10, "rtol": 1e-9}
RMS_SPEC = NormSpec(center=False, bias=False, eps=1e-6)


# ------------------------------------------------------------------ the float64 reference, plain torch
def ref_ln(x: Tensor, w: Tensor, b: Tensor | None, eps: float = 1e-5) -> Tensor:
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * w
    return y if b is None else y + b


def ref_rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_attention(q_in: Tensor, k_in: Tensor, v_in: Tensor, wq, wk, wv, wo, heads: int, pad=None) -> Tensor:
    b, tq, e = q_in.shape
    d = e // heads

    def split(t: Tensor) -> Tensor:
        return t.view(b, t.shape[1], heads, d).transpose(1, 2)

    q, k, v = split(q_in @ wq.T), split(k_in @ wk.T), split(v_in @ wv.T)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if pad is not None:
        s = s.masked_fill(pad[:, None, None, :], -math.inf)
    o = torch.softmax(s, -1) @ v
    return o.transpose(1, 2).reshape(b, tq, e) @ wo.T


def ref_mlp(x: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (0.5 * (x @ up.T) * (1 + torch.erf((x @ up.T) / math.sqrt(2)))) @ down.T


def _randomise(module: nn.Module) -> None:
    """Every parameter random (gains and biases too), so that a mis-wired norm or gate shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)


def _check_backward(out: Tensor, ref: Tensor, ours: list[Tensor], theirs: list[Tensor]) -> None:
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, ours, g)
    want = torch.autograd.grad(ref, theirs, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **F64)


# ------------------------------------------------------------------ cross-attention
@pytest.mark.parametrize(
    ("b", "tq", "tk", "e", "h", "kdim"), [(3, 5, 7, 12, 3, 10), (1, 1, 1, 6, 1, 6), (2, 9, 4, 8, 4, 5)]
)
def test_cross_attention_matches_reference_and_torch_mha(b, tq, tk, e, h, kdim) -> None:
    attn = CrossAttention(e, h, kdim=kdim, vdim=kdim).double()
    _randomise(attn)
    q = torch.randn(b, tq, e, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(b, tk, kdim, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(b, tk, dtype=torch.bool)
    pad[0, -1] = tk > 1
    out = attn(q, kv, kv, pad)
    ref = ref_attention(q, kv, kv, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                        attn.o_proj.weight, h, pad)  # fmt: skip
    torch.testing.assert_close(out, ref, **F64)
    _check_backward(out, ref, [q, kv, attn.q_proj.weight], [q, kv, attn.q_proj.weight])
    if kdim != e:  # torch's MHA with separate projection weights (kdim != embed_dim), no biases
        mha = nn.MultiheadAttention(e, h, bias=False, kdim=kdim, vdim=kdim, batch_first=True).double()
        with torch.no_grad():
            mha.q_proj_weight.copy_(attn.q_proj.weight)
            mha.k_proj_weight.copy_(attn.k_proj.weight)
            mha.v_proj_weight.copy_(attn.v_proj.weight)
            mha.out_proj.weight.copy_(attn.o_proj.weight)
        torch.testing.assert_close(out, mha(q, kv, kv, key_padding_mask=pad, need_weights=False)[0], **F64)


# ------------------------------------------------------------------ Perceiver resampler
def ref_resampler(r: PerceiverResampler, media: Tensor, pad: Tensor | None, rms: bool) -> Tensor:
    def norm(m: nn.Module, x: Tensor) -> Tensor:
        return ref_rms(x, m.weight, 1e-6) if rms else ref_ln(x, m.weight, m.bias)

    h = r.layers[0].attn.num_heads
    x = r.latents.expand(media.shape[0], -1, -1)
    for layer in r.layers:
        m, q = norm(layer.media_norm, media), norm(layer.latents_norm, x)
        kv, p = m, pad
        if layer.latents_in_kv:
            kv = torch.cat((m, q), 1)
            p = None if pad is None else torch.cat((pad, torch.zeros(pad.shape[0], q.shape[1], dtype=torch.bool)), 1)
        a = layer.attn
        x = x + ref_attention(q, kv, kv, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, h, p)
        x = x + ref_mlp(norm(layer.ffn_norm, x), layer.mlp.up_proj.weight, layer.mlp.down_proj.weight)
    return x if r.final_norm is None else norm(r.final_norm, x)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm-spec"])
@pytest.mark.parametrize("latents_in_kv", [True, False])
@pytest.mark.parametrize(("b", "t", "d", "h", "n", "depth"), [(3, 7, 12, 3, 5, 2), (1, 1, 4, 1, 1, 1)])
def test_resampler_matches_reference(rms, latents_in_kv, b, t, d, h, n, depth) -> None:
    r = PerceiverResampler(d, h, n, depth, ffn_dim=2 * d + 1, norm=RMS_SPEC if rms else None,
                           latents_in_kv=latents_in_kv).double()  # fmt: skip
    _randomise(r)
    media = torch.randn(b, t, d, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(b, t, dtype=torch.bool)
    if t > 1:
        pad[-1, : t // 2] = True
    out = r(media, pad)
    assert out.shape == (b, n, d)
    ref = ref_resampler(r, media, pad, rms)
    torch.testing.assert_close(out, ref, **F64)
    params = [media, r.latents, r.layers[0].media_norm.weight, r.layers[-1].mlp.up_proj.weight]
    _check_backward(out, ref, params, params)


def test_resampler_ignores_padded_media_and_states_its_design() -> None:
    r = PerceiverResampler(8, 2, 3).double()
    media = torch.randn(2, 6, 8, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[:, 4:] = True
    changed = media.clone()
    changed[:, 4:] = 1e6  # what padding holds does not matter
    torch.testing.assert_close(r(media, pad), r(changed, pad), atol=0, rtol=0)
    torch.testing.assert_close(r(media[:, :4]), r(media, pad), **F64)
    assert r.connector_kind is ConnectorKind.RESAMPLER and r.placement_kind is PlacementKind.PRE
    assert sum(isinstance(m, nn.Module) and hasattr(m, "spec") for m in r.modules()) == 4  # 3 per layer + final


# ------------------------------------------------------------------ Flamingo's gated cross-attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("b", "t", "s", "e", "kdim"), [(5, 123, 7, 12, 10), (1, 1, 1, 4, 4)])
def test_gated_block_is_exactly_the_identity_at_init(dtype, b, t, s, e, kdim) -> None:
    blk = GatedCrossAttentionBlock(e, 2 if e % 2 == 0 else 1, kdim=kdim).to(dtype)
    x = torch.randn(b, t, e, dtype=dtype) * 100
    out = blk(x, torch.randn(b, s, kdim, dtype=dtype))
    assert torch.equal(out, x)
    assert blk.gates() == (0.0, 0.0)
    assert blk.injection is Injection.GATED_CROSS_ATTENTION


@given(
    b=st.integers(1, 3),
    t=st.integers(1, 9),
    s=st.integers(1, 5),
    heads=st.sampled_from([1, 2, 4]),
    kdim=st.integers(1, 7),
    scale=st.floats(1e-3, 1e3),
)
def test_property_gated_block_is_the_identity_at_init_and_split_norms_ignore_scale(b, t, s, heads, kdim, scale) -> None:
    torch.manual_seed(b * 100 + t)
    blk = GatedCrossAttentionBlock(8, heads, kdim=kdim).double()
    x = torch.randn(b, t, 8, dtype=torch.float64) * scale
    assert torch.equal(blk(x, torch.randn(b, s, kdim, dtype=torch.float64)), x)
    # Norm(a x) = Norm(x) per modality (LayerNorm and RMS are scale invariant; eps is the only difference)
    norm = ModalitySplitNorm(8, norm=NormSpec(eps=1e-30)).double()
    _randomise(norm)
    mask = torch.rand(b, t) < 0.5
    torch.testing.assert_close(norm(x * scale, mask), norm(x, mask), atol=1e-9, rtol=1e-9)


def test_gated_block_backward_at_init_passes_the_gradient_and_opens_the_gates() -> None:
    blk = GatedCrossAttentionBlock(12, 3, kdim=10).double()
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    media = torch.randn(3, 7, 10, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 12, dtype=torch.float64)
    blk(x, media).backward(g)
    assert torch.equal(x.grad, g)  # d out / d x = I exactly
    assert torch.equal(media.grad, torch.zeros_like(media))
    assert torch.count_nonzero(blk.attn.q_proj.weight.grad) == 0  # behind a closed gate
    # d out / d alpha_attn = <g, branch> (tanh'(0) = 1): the gate is what learns first
    branch = blk.attn(blk.attn_norm(x), media, media).detach()
    torch.testing.assert_close(blk.attn_residual.gate.alpha.grad, (g * branch).sum(), **F64)
    ffn = blk.mlp(blk.ffn_norm(x)).detach()
    torch.testing.assert_close(blk.ffn_residual.gate.alpha.grad, (g * ffn).sum(), **F64)


def test_gated_block_open_matches_reference() -> None:
    blk = GatedCrossAttentionBlock(12, 3, kdim=10, ffn_dim=17, norm=RMS_SPEC).double()
    _randomise(blk)
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    media = torch.randn(3, 7, 10, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, :3] = True
    out = blk(x, media, pad)
    a, ga, gf = blk.attn, blk.attn_residual.gate.alpha, blk.ffn_residual.gate.alpha
    h = ref_rms(x, blk.attn_norm.weight, 1e-6)
    y = x + torch.tanh(ga) * ref_attention(h, media, media, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                                           a.o_proj.weight, 3, pad)  # fmt: skip
    ref = y + torch.tanh(gf) * ref_mlp(ref_rms(y, blk.ffn_norm.weight, 1e-6), blk.mlp.up_proj.weight,
                                       blk.mlp.down_proj.weight)  # fmt: skip
    torch.testing.assert_close(out, ref, **F64)
    _check_backward(out, ref, [x, media, ga, gf], [x, media, ga, gf])


# ------------------------------------------------------------------ norms split by modality
@pytest.mark.parametrize("shape", [(5, 123, 123), (1, 1, 1023), (2, 7, 6)])
def test_split_norm_matches_reference(shape) -> None:
    d = shape[-1]
    norm = ModalitySplitNorm(d).double()
    _randomise(norm)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(shape[:-1]) < 0.4
    mask.view(-1)[0] = True
    out = norm(x, mask)
    ti, tt = norm.image_norm, norm.text_norm
    ref = torch.where(mask[..., None], ref_ln(x, ti.weight, ti.bias), ref_ln(x, tt.weight, tt.bias))
    torch.testing.assert_close(out, ref, **F64)
    params = [x, ti.weight, ti.bias] + ([tt.weight] if bool((~mask).any()) else [])  # (1, 1, D): image only
    _check_backward(out, ref, params, params)


def test_split_norm_on_one_modality_is_that_norm_alone() -> None:
    norm = ModalitySplitNorm(16, norm=RMSNorm).double()
    _randomise(norm)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    none = torch.zeros(3, 5, dtype=torch.bool)
    torch.testing.assert_close(norm(x, none), norm.text_norm(x), atol=0, rtol=0)
    torch.testing.assert_close(norm(x, ~none), norm.image_norm(x), atol=0, rtol=0)
    x.requires_grad_(True)
    norm(x, none).sum().backward()
    assert torch.count_nonzero(norm.image_norm.weight.grad) == 0 and torch.count_nonzero(norm.text_norm.weight.grad)


def test_modality_block_with_equal_norms_is_the_shared_block() -> None:
    torch.manual_seed(0)
    mb = ModalityBlock(12, 3, 20, norm=RMSNorm).double()
    blk = Block(12, pre_ln(), RMSNorm, layer=0, n_layers=1, n_heads=3, d_ff=20).double()
    _randomise(blk)
    sd = {k: v for k, v in blk.state_dict().items() if not k.endswith("norm.weight")}
    mb.load_state_dict({**mb.state_dict(), **sd})
    with torch.no_grad():
        for slot in ("attn", "ffn"):
            w = getattr(blk, f"{slot}_pre_norm").weight
            mb.norms[f"{slot}_pre"].text_norm.weight.copy_(w)
            mb.norms[f"{slot}_pre"].image_norm.weight.copy_(w)
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    mask = torch.rand(2, 9) < 0.5
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(mb(x, mask, None, causal), blk(x, None, causal), **F64)


def test_modality_block_sandwich_matches_reference() -> None:
    mb = ModalityBlock(8, 2, 12, placement=sandwich_ln(), activation=Activation.GELU, gated=False).double()
    assert sorted(mb.norms) == ["attn_post", "attn_pre", "ffn_post", "ffn_pre"]
    assert mb.placement_kind is PlacementKind.PERI
    _randomise(mb)
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True, False]] * 3)

    def n(key: str, t: Tensor) -> Tensor:
        s = mb.norms[key]
        return torch.where(mask[..., None], ref_ln(t, s.image_norm.weight, s.image_norm.bias),
                           ref_ln(t, s.text_norm.weight, s.text_norm.bias))  # fmt: skip

    a = mb.attn
    h = n("attn_pre", x)
    y = x + n(
        "attn_post", ref_attention(h, h, h, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, 2)
    )
    ref = y + n("ffn_post", ref_mlp(n("ffn_pre", y), mb.mlp.up_proj.weight, mb.mlp.down_proj.weight))
    out = mb(x, mask)
    torch.testing.assert_close(out, ref, **F64)
    _check_backward(out, ref, [x, mb.norms["ffn_post"].image_norm.weight], [x, mb.norms["ffn_post"].image_norm.weight])


# ------------------------------------------------------------------ the tiny VLMs
def _batch(cfg: TinyVLMConfig, b: int = 2, text: int = 5) -> tuple[Tensor, Tensor, Tensor | None]:
    n = cfg.image_tokens if cfg.injection is Injection.EMBEDDING_STREAM else 0
    ids = torch.randint(cfg.lm.vocab_size, (b, n + text))
    mask = torch.zeros(b, n + text, dtype=torch.bool)
    mask[:, 2 : 2 + n] = True
    pix = torch.randn(b, cfg.num_patches, cfg.patch_dim)
    return ids, pix, (mask if n else None)


CONFIGS = {
    "resampler": TinyVLMConfig(),
    "mlp": TinyVLMConfig(connector=ConnectorKind.MLP),
    "split-norms": TinyVLMConfig(split_norms=True, vision_norm=RMS_SPEC),
    "flamingo": TinyVLMConfig(injection=Injection.GATED_CROSS_ATTENTION),
    "patch-features": TinyVLMConfig(vision_layers=0, connector=ConnectorKind.LINEAR),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_vlm_runs_forward_and_backward(name) -> None:
    cfg = CONFIGS[name]
    model = TinyVLM(cfg)
    ids, pix, mask = _batch(cfg)
    out = model(ids, pix, mask)
    assert out.shape == (*ids.shape, cfg.lm.vocab_size) and torch.isfinite(out).all()
    out.square().mean().backward()
    if cfg.injection is Injection.EMBEDDING_STREAM:  # the image reaches the loss through the connector
        assert model.tower.patch_embed.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("padded", [False, True])
def test_tiny_vlm_equals_the_decoders_own_layer_loop(padded) -> None:
    # our loop (masks, RoPE tables) against TransformerLM.run_layers on the same stream, float64, odd length 17
    model = TinyVLM(CONFIGS["resampler"]).double()
    ids, pix, mask = _batch(model.config, b=3, text=9)
    pad = torch.ones(ids.shape, dtype=torch.long)
    if padded:
        pad[1, -3:] = 0
    out = model(ids, pix.double(), mask, attention_mask=pad if padded else None)
    x = model.lm.embed_tokens(ids).masked_scatter(mask[..., None], model.image_rows(pix.double()))
    ref = model.lm.lm_head(model.lm.final_norm(model.lm.run_layers(x, pad if padded else None)))
    torch.testing.assert_close(out, ref, **F64)


def test_embedding_stream_is_causal_in_the_image() -> None:
    model = TinyVLM(CONFIGS["resampler"])
    ids, pix, mask = _batch(model.config)
    a, b = model(ids, pix, mask), model(ids, pix + 1.0, mask)
    torch.testing.assert_close(a[:, :2], b[:, :2], atol=0, rtol=0)  # text before the image cannot see it
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-4


def test_flamingo_vlm_at_init_is_the_language_model() -> None:
    model = TinyVLM(CONFIGS["flamingo"])
    ids, pix, _ = _batch(model.config, text=9)
    out = model(ids, pix)
    torch.testing.assert_close(out, model(ids, torch.randn_like(pix) * 50), atol=0, rtol=0)
    torch.testing.assert_close(out, model.lm(ids), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("name", "kind", "injection"),
    [
        ("resampler", ConnectorKind.RESAMPLER, Injection.EMBEDDING_STREAM),
        ("mlp", ConnectorKind.MLP, Injection.EMBEDDING_STREAM),
        ("split-norms", ConnectorKind.RESAMPLER, Injection.EMBEDDING_STREAM),
        ("flamingo", ConnectorKind.RESAMPLER, Injection.GATED_CROSS_ATTENTION),
    ],
)
def test_inspector_reads_the_tiny_vlm_back(name, kind, injection) -> None:
    from normatlas.inspect.vlm import inspect_vlm

    model = TinyVLM(CONFIGS[name])
    ids, pix, mask = _batch(model.config, b=1)
    report = inspect_vlm(model, {"input_ids": ids, "pixel_values": pix, "image_mask": mask}, probe=False)
    assert report.connector.kind is kind
    assert report.injection is injection
    assert report.language.placement is PlacementKind.PRE
    if kind is ConnectorKind.RESAMPLER:
        assert len(report.connector.norms) == 4  # media, latents, FFN, final


# ------------------------------------------------------------------ bad input names the parameter
@pytest.mark.parametrize(
    ("build", "exc", "words"),
    [
        (lambda: CrossAttention(0, 1), ValueError, "embed_dim=0"),
        (lambda: CrossAttention(10, 3), ValueError, "num_heads=3 must divide embed_dim=10"),
        (lambda: CrossAttention(8, 2, kdim=-1), ValueError, "kdim=-1"),
        (lambda: PerceiverResampler(8, 2, 0), ValueError, "num_latents=0"),
        (lambda: PerceiverResampler(8, 2, 3, depth=True), ValueError, "depth=True"),
        (lambda: PerceiverResampler(8, 2, 3, latents_in_kv=1), TypeError, "latents_in_kv=1"),
        (lambda: PerceiverResampler(8, 2, 3, norm=NormSpec(reduce={Axis.SAMPLE})), ValueError, "batch-statistics"),
        (lambda: GatedCrossAttentionBlock(8, 2, gate_init=math.inf), TypeError, "init=inf"),
        (lambda: ModalitySplitNorm(0), ValueError, "normalized_shape=0"),
        (lambda: ModalityBlock(8, 2, 16, placement="pre"), TypeError, "placement='pre'"),
        (lambda: TinyVLMConfig(connector=ConnectorKind.POOLING), ValueError, "connector=<ConnectorKind.POOLING"),
        (lambda: TinyVLMConfig(connector="resampler"), ValueError, "ConnectorKind.RESAMPLER"),
        (lambda: TinyVLMConfig(injection=Injection.TOKENS), ValueError, "Injection.EMBEDDING_STREAM"),
        (lambda: TinyVLMConfig(split_norms=True, injection=Injection.GATED_CROSS_ATTENTION), ValueError,
         "split_norms=True"),
        (lambda: TinyVLMConfig(vision_layers=-1), ValueError, "vision_layers=-1"),
        (lambda: TinyVLMConfig(lm=ModelConfig(norm=RMSNorm, logit_softcap=30.0)), ValueError, "logit_softcap=30.0"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(build, exc, words) -> None:
    with pytest.raises(exc, match=re.escape(words)):
        build()


def test_bad_inputs_are_named() -> None:
    r = PerceiverResampler(8, 2, 3)
    with pytest.raises(ValueError, match="input has last dim 6; built for embed_dim=8"):
        r(torch.randn(2, 4, 6))
    with pytest.raises(TypeError, match="key_padding_mask must be a boolean"):
        r(torch.randn(2, 4, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 5\); expected \(2, 4\)"):
        r(torch.randn(2, 4, 8), torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask masks every key"):
        CrossAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8),
                             torch.ones(2, 4, dtype=torch.bool))  # fmt: skip
    with pytest.raises(TypeError, match="image_mask must be a boolean"):
        ModalitySplitNorm(8)(torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"image_mask has shape \(2, 4\); expected \(2, 3\)"):
        ModalitySplitNorm(8)(torch.randn(2, 3, 8), torch.zeros(2, 4, dtype=torch.bool))
    model = TinyVLM(CONFIGS["resampler"])
    ids, pix, mask = _batch(model.config)
    with pytest.raises(ValueError, match=r"image_mask marks \[7, 8\] tokens per example; the connector writes 8"):
        bad = mask.clone()
        bad[0, 2] = False
        model(ids, pix, bad)
    with pytest.raises(ValueError, match="image_mask=None"):
        model(ids, pix)
    with pytest.raises(ValueError, match=r"pixel_values \(2, 15, 48\) must be"):
        model(ids, pix[:, 1:], mask)
    flamingo = TinyVLM(CONFIGS["flamingo"])
    with pytest.raises(ValueError, match="gated cross-attention injection reads none"):
        flamingo(ids, pix, mask)


def test_gradcheck_split_norm_and_gate() -> None:
    norm = ModalitySplitNorm(5).double()
    _randomise(norm)
    mask = torch.tensor([[True, False, True]])
    x = torch.randn(1, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: norm(t, mask), (x,))
    blk = GatedCrossAttentionBlock(4, 2, gate_init=0.3).double()
    m = torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, u: blk(t, u), (torch.randn(1, 3, 4, dtype=torch.float64,
                                                                         requires_grad=True), m))  # fmt: skip


def test_bf16_resampler_is_close_to_float64() -> None:
    r = PerceiverResampler(16, 4, 4)
    media = torch.randn(2, 9, 16)
    want = r.double()(media.double())
    got = r.to(torch.bfloat16)(media.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.1, rtol=0.05)
    assert F.cosine_similarity(got.double().flatten(), want.flatten(), dim=0) > 0.999
