"""The attention-side features real decoders use, in our Block and ported from transformers by behaviour.

* Multi-head Latent Attention (:class:`~normatlas.blocks.mla.MLAConfig`): DeepSeek-V2 (complex RoPE), DeepSeek-V3
  (``rope_interleave``: interleaved pairs in, halves out; and plain halves), a full-rank q (``q_lora_rank=None``);
* attention sinks: in the softmax (Flint's dense tiny build; gpt-oss's attention reads the same but its MLP is a
  routed MoE) and as Granite-SWA's ``sigmoid(lse - sink)`` factor after the core;
* a gate on the attention output (:class:`~normatlas.blocks.attn_gate.OutputGate`): AFMoE's sigmoid per element,
  Laguna's softplus per head (their dense tiny builds).

Each model type is built tiny with :func:`normatlas.factory.tiny_config` (MLA's widths made distinct so a
swapped part cannot pass: nope 12, rope 8, value 10, q latent 24, kv latent 20), every parameter randomised, ported,
and compared in fp32: logits and the gradient on every parameter. Our new attention math is checked in float64
against naive references written here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from normatlas import Norm, NormSpec  # noqa: E402
from normatlas.blocks import ModelConfig, TransformerLM  # noqa: E402
from normatlas.blocks.attention import Attention, Rope, RopeStyle, apply_rope, rope_tables  # noqa: E402
from normatlas.blocks.attn_gate import GateActivation, GateScope, OutputGate, softmax_with_sinks  # noqa: E402
from normatlas.blocks.mla import MLAConfig, MLAttention  # noqa: E402
from normatlas.factory import tiny_config  # noqa: E402
from normatlas.port import PortError, port  # noqa: E402

from .port_helpers import assert_loads_back, assert_same_gradients, logits_of_both, ported_fixture, token_ids  # noqa: E402
from .tiny_hf import randomise_  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
VOCAB_SEED = 3

_MLA = dict(q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)

CASES = {
    # DeepSeek-V3 (671B: 7168 wide, 61 layers, q latent 1536, kv latent 512, nope 128, rope 64, v 128)
    "deepseek_v3": dict(_MLA, rope_interleave=True, first_k_dense_replace=2),
    "deepseek_v3+halves": dict(_MLA, rope_interleave=False, first_k_dense_replace=2),
    "deepseek_v3+full_q": dict(_MLA, q_lora_rank=None, first_k_dense_replace=2),
    # DeepSeek-V2 (236B: 5120 wide, 60 layers): RoPE written with complex numbers
    "deepseek_v2": dict(_MLA, first_k_dense_replace=2),
    # Flint: a learned sink logit per head; its tiny build's two layers are dense (mlp_only_layers [0, 1])
    "flint": dict(),
    # Granite-SWA: the same sinks written after the core, attn * sigmoid(logsumexp(scores) - sink)
    "granite_swa": dict(),
    # AFMoE: sigmoid(gate_proj(x)) per element on the attention output (num_dense_layers: the dense MLPs)
    "afmoe": dict(num_dense_layers=2),
    # Laguna: softplus(g_proj(x)) per head
    "laguna": dict(gating="per-head", mlp_layer_types=["dense", "dense"]),
    # MiniCPM 5 MoE: q and a sigmoid gate per element from one q_gate_proj, per head q's rows then the gate's
    "minicpm5_moe": dict(mlp_layer_types=["dense", "sparse"]),
}  # fmt: skip
"""model type (``+variant``) -> config attributes set on :func:`tiny_config`'s shrunk defaults."""


def _build(name: str) -> torch.nn.Module:
    cfg = tiny_config(name.split("+")[0])
    for k, v in CASES[name].items():
        setattr(cfg, k, v)
    if "qk_rope_head_dim" in CASES[name]:
        cfg.head_dim = cfg.qk_rope_head_dim  # the rotary table's width
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval().float()
    return randomise_(hf, 0.1, generator=torch.Generator().manual_seed(1))


ported = ported_fixture(_build, sorted(CASES))


def test_config_reads_the_feature(ported):
    name, _, p, ours = ported
    cfg = p.config
    if name.startswith("deepseek"):
        m = cfg.mla
        assert m is not None and (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
            20,
            12,
            8,
            10,
        )
        assert m.q_lora_rank == (None if name.endswith("full_q") else 24)
        assert m.latent_norm is not None and not m.latent_norm.center  # RMSNorms on the latents, as our Norm
        assert isinstance(ours.layers[0].attn.kv_norm, Norm)
        style = RopeStyle.INTERLEAVED if name == "deepseek_v2" else RopeStyle.HALF
        assert cfg.rope is not None and cfg.rope.style is style and cfg.rope.fraction == 1.0
    elif name in ("flint", "granite_swa"):
        assert cfg.attn_sinks and cfg.attn_gate is None
    elif name == "afmoe":
        assert cfg.attn_gate == OutputGate(GateActivation.SIGMOID, GateScope.ELEMENT)
    elif name == "laguna":
        assert cfg.attn_gate == OutputGate(GateActivation.SOFTPLUS, GateScope.HEAD)
    elif name == "minicpm5_moe":  # one fused projection read as two roles: q's rows and the gate's
        assert cfg.attn_gate == OutputGate(GateActivation.SIGMOID, GateScope.ELEMENT)
        q, gate = ours.layers[0].attn.q_proj.weight, ours.layers[0].attn.gate_proj.weight
        assert q.shape == gate.shape == (cfg.n_heads * cfg.head_dim, cfg.d_model)


def test_same_logits(ported):
    _, hf, p, ours = ported
    ref, got = logits_of_both(hf, ours, token_ids(hf, 1))
    torch.testing.assert_close(got, ref, atol=1e-5 * (1 + float(ref.abs().max())), rtol=0)
    assert p.max_abs_diff is not None and p.max_abs_diff <= 1e-5 * (1 + float(ref.abs().max()))


def test_same_gradients(ported):
    """Every parameter's gradient, mapped back by the port's links (fused and permuted rows re-assembled)."""
    name, hf, _, ours = ported
    assert_same_gradients(hf, ours, token_ids(hf, 2), upstream=4, name=name, reference=(Norm,))


def test_round_trip_state_dict(ported):
    """Our weights under the source's names and layout load back into a fresh source model: the same logits."""
    name, hf, p, ours = ported
    assert_loads_back(_build(name), hf, p, ours, token_ids(hf, 5))


# float64 references for the new math


def _naive_mla(a: MLAttention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """MLA written out head by head and token by token (the rotation as 2x2 matrices over half pairs)."""
    c, (b, t, _) = a.config, x.shape
    q = a.queries(x)  # (B, T, H, nope + rope)
    kv_a = a.kv_a_proj(x)
    latent, k_rot = kv_a[..., : c.kv_lora_rank], kv_a[..., c.kv_lora_rank :]
    kv = a.kv_b_proj(a.kv_norm(latent)).view(b, t, a.n_heads, -1)
    r = c.qk_rope_head_dim

    def rot(vec: torch.Tensor, pos: int) -> torch.Tensor:
        out = vec.clone()
        for i in range(r // 2):
            ang = pos * theta ** (-2 * i / r)
            x1, x2 = vec[..., i], vec[..., i + r // 2]
            out[..., i], out[..., i + r // 2] = (
                x1 * math.cos(ang) - x2 * math.sin(ang),
                x2 * math.cos(ang) + x1 * math.sin(ang),
            )
        return out

    out = torch.zeros(b, t, a.n_heads, c.v_head_dim, dtype=x.dtype)
    for h in range(a.n_heads):
        for i in range(t):
            qi = torch.cat((q[:, i, h, : c.qk_nope_head_dim], rot(q[:, i, h, c.qk_nope_head_dim :], i)), -1)
            logits = []
            for j in range(i + 1):
                kj = torch.cat((kv[:, j, h, : c.qk_nope_head_dim], rot(k_rot[:, j], j)), -1)
                logits.append((qi * kj).sum(-1) / math.sqrt(c.qk_head_dim))
            w = torch.softmax(torch.stack(logits, -1), -1)
            out[:, i, h] = sum(w[:, j, None] * kv[:, j, h, c.qk_nope_head_dim :] for j in range(i + 1))
    return a.o_proj(out.reshape(b, t, -1))


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_matches_naive_float64(q_lora_rank):
    torch.manual_seed(0)
    spec = NormSpec(center=False, eps=1e-6, bias=False)
    cfg = MLAConfig(kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, q_lora_rank=q_lora_rank,
                    latent_norm=spec)  # fmt: skip
    a = MLAttention(48, 3, cfg).double()
    for prm in a.parameters():
        prm.data.add_(0.1 * torch.randn_like(prm))
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    rope = Rope(theta=100.0)
    cos, sin = rope_tables(rope, 8, torch.arange(7), torch.float64)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    got = a(x, (cos, sin, RopeStyle.HALF), mask)
    # the softmax runs in fp32 as HF's eager attention does (in float64 too), so agreement is to fp32 rounding
    torch.testing.assert_close(got, _naive_mla(a, x, 100.0), atol=1e-6, rtol=1e-5)


def test_sinks_match_softmax_over_scores_and_sink_float64():
    g = torch.Generator().manual_seed(0)
    scores, sinks = torch.randn(2, 3, 5, 123, generator=g, dtype=torch.float64), torch.randn(3, generator=g).double()
    ref = []
    for h in range(3):  # softmax over [scores, sink]: the sink joins the denominator, its column dropped
        e, es = scores[:, h].exp(), sinks[h].exp()
        ref.append(e / (e.sum(-1, keepdim=True) + es))
    got = softmax_with_sinks(scores, sinks)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.stack(ref, 1), atol=1e-12, rtol=1e-10)
    lse = torch.logsumexp(scores, -1, keepdim=True)  # the equal form Granite-SWA computes
    torch.testing.assert_close(
        F.softmax(scores, -1) * torch.sigmoid(lse - sinks[None, :, None, None]), torch.stack(ref, 1)
    )
    assert bool((got.sum(-1) < 1).all())


def test_sinks_and_gate_in_attention_float64():
    """Attention with sinks and a per-head softplus gate against the formula written out here."""
    torch.manual_seed(0)
    gate = OutputGate(GateActivation.SOFTPLUS, GateScope.HEAD, bias=True)
    a = Attention(32, 4, 2, 8, sinks=True, out_gate=gate).double()
    for prm in a.parameters():
        prm.data.add_(0.1 * torch.randn_like(prm))
    x = torch.randn(1, 1, 32, dtype=torch.float64)
    got = a(x)
    # one token attends to itself only: softmax([s, sink]) gives w = 1 / (1 + exp(sink - s))
    q, k, v = a.q_proj(x).view(4, 8), a.k_proj(x).view(2, 8), a.v_proj(x).view(2, 8)
    kh, vh = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    s = (q * kh).sum(-1) / math.sqrt(8)
    w = 1 / (1 + torch.exp(a.sinks - s))
    out = (w[:, None] * vh) * F.softplus(a.gate_proj(x).view(4))[:, None]
    torch.testing.assert_close(got, a.o_proj(out.reshape(1, 1, 32)), atol=1e-6, rtol=1e-6)


def test_gradcheck_sinks():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(softmax_with_sinks, (scores, sinks))


def test_rope_interleave_is_a_row_permutation():
    """DeepSeek-V3's rope_interleave (pairs (2i, 2i+1) in, halves out) equals halves on permuted rows: the port's
    reading, checked on its own."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(Rope(), 8, torch.arange(5), torch.float64)
    c, s = cos[..., :4], sin[..., :4]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    theirs = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    perm = [0, 2, 4, 6, 1, 3, 5, 7]
    torch.testing.assert_close(apply_rope(x[..., perm], cos, sin, RopeStyle.HALF), theirs)


# validation


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        (dict(kv_lora_rank=0), ValueError, "kv_lora_rank=0"),
        (dict(qk_rope_head_dim=7), ValueError, "qk_rope_head_dim=7 must be even"),
        (dict(qk_nope_head_dim=-1), ValueError, "qk_nope_head_dim=-1"),
        (dict(q_lora_rank=True), ValueError, "q_lora_rank=True"),
        (dict(latent_norm="rms"), TypeError, "latent_norm='rms' must be a NormSpec"),
    ],
)
def test_mla_config_validation(kwargs, err, match):
    base = dict(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    with pytest.raises(err, match=match):
        MLAConfig(**{**base, **kwargs})


def test_model_config_validation():
    mla = MLAConfig(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    with pytest.raises(ValueError, match="head_dim=16 with mla"):
        ModelConfig(mla=mla, head_dim=16)
    with pytest.raises(ValueError, match="n_kv_heads=2 with mla"):
        ModelConfig(mla=mla, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"rope\.fraction=0\.5 with mla"):
        ModelConfig(mla=mla, rope=Rope(fraction=0.5))
    with pytest.raises(ValueError, match="attn_sinks / attn_gate with mla"):
        ModelConfig(mla=mla, attn_sinks=True)
    with pytest.raises(TypeError, match="mla='deepseek' must be an MLAConfig"):
        ModelConfig(mla="deepseek")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attn_sinks=1 must be a bool"):
        ModelConfig(attn_sinks=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attn_gate='sigmoid' must be an OutputGate"):
        ModelConfig(attn_gate="sigmoid")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="activation='tanh' must be one of GateActivation"):
        OutputGate(activation="tanh")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scope='head' must be one of GateScope"):
        OutputGate(scope="head")  # type: ignore[arg-type]
    model = TransformerLM(ModelConfig(mla=mla, d_model=32, n_heads=2, vocab_size=50, norm=NormSpec(center=False)))
    assert model(torch.randint(0, 50, (1, 5))).shape == (1, 5, 50)


def test_keys_and_values_rounded_before_the_core_are_refused_by_name():
    """Kolibri 1.1's sparse layers attend to NVFP4-rounded keys and values (a straight-through round): our attention
    reads its operands as computed, so the port names the rounding instead of reporting logits that differ."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config("kolibri1_1")).eval().float()
    with pytest.raises(PortError, match=r"k / v rounded to a grid between the projection and the attention core"):
        port(hf)


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        # DeepSeek-V3.2 (DSA): the indexer's top-k over its own key scores masks the keys
        ("deepseek_v32", r"a sparse-attention indexer \(top-k over its own key scores picks the keys\)"),
        # JetMoE (8B: 2048 / 24L, 8 attention experts, top-2): the router's top-k picks the q / output experts
        ("jetmoe", r"a routed mixture of attention experts \(top-k over router scores picks the projections"),
    ],
)
def test_a_top_k_inside_attention_is_named_for_what_it_picks(model_type: str, reason: str) -> None:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).eval().float()
    with pytest.raises(PortError, match=reason):
        port(hf)
