"""The inspector on transformers' own reference code: each architecture is built tiny
from its config class (litgpt-style shrink: 2 layers, width 64; the real models are
thousands wide and tens of layers deep) and its design read off the dataflow. The
expected designs are what each model's modeling code does (see each comment)."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("transformers")

from normatlas.factory import model_from_config, tiny_config
from normatlas.inspect import InspectionReport, inspect_model
from normatlas.vocabulary import GainConvention, SiteRole, SublayerKind

OVERRIDES: dict[str, dict[str, Any]] = {
    "granite": {"residual_multiplier": 0.25, "embedding_multiplier": 12.0},
    "chameleon": {"swin_norm": True},  # the 34B recipe; the default (7B) config is pre-norm
}

EXPECTED: dict[str, dict[str, Any]] = {
    # pre-LN RMSNorm, weight * x.to(dtype): cast before gain
    "llama": dict(
        operator="rmsnorm",
        placement="pre",
        gain_convention="w",
        cast_order="before_gain",
        qk_norm="none",
        final_norm="rmsnorm",
        eps=1e-6,
    ),
    "mistral": dict(operator="rmsnorm", placement="pre", qk_norm="none", final_norm="rmsnorm"),
    # per-head q_norm / k_norm on head_dim, applied before apply_rotary_pos_emb
    "qwen3": dict(operator="rmsnorm", placement="pre", qk_norm="per-head", qk_norm_rope="before-rope"),
    # (1 + w) gain, computed in fp32 then cast: after gain; embeddings * sqrt(hidden)
    "gemma": dict(placement="pre", gain_convention="1+w", cast_order="after_gain", embedding_scale=math.sqrt(64)),
    # four norms per block (peri), tanh soft-capping of attention scores and final logits
    "gemma2": dict(
        placement="peri",
        gain_convention="1+w",
        attn_softcap=50.0,
        final_logit_softcap=30.0,
        qk_norm="none",
        embedding_scale=math.sqrt(64),
    ),
    "gemma3_text": dict(placement="peri", qk_norm="per-head", qk_norm_rope="before-rope", attn_softcap=None),
    # OLMo 1: LayerNorm without affine parameters
    "olmo": dict(operator="layernorm-nonparam", placement="pre", gain_convention="none", bias=False),
    # OLMo 2: norms on branch outputs (reordered / res-post), q_norm over all heads before the head split
    "olmo2": dict(
        operator="rmsnorm", placement="res-post", qk_norm="flattened", qk_norm_rope="before-rope", final_norm="rmsnorm"
    ),
    # one LayerNorm (no bias) feeding attention and MLP in parallel
    "cohere": dict(operator="layernorm", placement="parallel", bias=False),
    "gpt2": dict(operator="layernorm", placement="pre", bias=True, final_norm="layernorm", eps=1e-5),
    "bert": dict(operator="layernorm", placement="post", eps=1e-12, embedding_norm="layernorm", final_norm="none"),
    # residual_multiplier on each branch, embedding_multiplier on the embeddings
    "granite": dict(operator="rmsnorm", placement="pre", branch_scale="0.25", embedding_scale=12.0),
    "phi": dict(operator="layernorm", placement="parallel", bias=True),
    # attn_output + feed_forward + residual: one branch that is a sum of two
    "gptj": dict(operator="layernorm", placement="parallel"),
    "falcon": dict(operator="layernorm", placement="parallel", qk_norm="none"),
    # use_parallel_residual: two LayerNorms, x + attn(ln1(x)) + mlp(ln2(x))
    "gpt_neox": dict(operator="layernorm", placement="parallel"),
    "bloom": dict(operator="layernorm", placement="pre", embedding_norm="layernorm"),
    # flattens tokens to (B*T, D) for the MLP residual
    "opt": dict(operator="layernorm", placement="pre", final_norm="layernorm"),
    # LayerNorm1P: layer_norm with weight + 1
    "nemotron": dict(operator="layernorm", placement="pre", gain_convention="1+w"),
    "stablelm": dict(operator="layernorm", placement="pre"),
    # swin_norm: norms on branch outputs; per-head LayerNorm (with per-head affine) on q and k before RoPE
    "chameleon": dict(operator="rmsnorm", placement="res-post", qk_norm="per-head-gains", qk_norm_rope="before-rope"),
    # a learned per-channel multiplier on the residual itself
    "doge": dict(placement="pre", residual_scale="per-channel (learned)", qk_norm="per-head"),
    # MoE with a shared expert: one MLP sublayer, not a parallel block
    "qwen2_moe": dict(placement="pre", placement_mlp="pre", placement_attention="pre"),
    # zero-centred (1+w) RMSNorm, per-head QK-norm in the full-attention layers
    "qwen3_next": dict(gain_convention="1+w", qk_norm="per-head"),
}

_REPORTS: dict[str, InspectionReport] = {}


def report(mt: str) -> InspectionReport:
    if mt not in _REPORTS:
        model = model_from_config(tiny_config(mt, **OVERRIDES.get(mt, {})))
        _REPORTS[mt] = inspect_model(model, name=mt)
    return _REPORTS[mt]


@pytest.mark.parametrize("mt", sorted(EXPECTED))
def test_design_matches_reference_code(mt: str) -> None:
    got = report(mt).summary_row()
    for key, want in EXPECTED[mt].items():
        if isinstance(want, float):
            assert got[key] == pytest.approx(want, rel=1e-6), (mt, key)
        else:
            assert got[key] == want, (mt, key, got[key])
    assert got["layers"] == 2 and got["tracer"] == "torch_function"


@pytest.mark.parametrize("mt", ["llama", "gemma2", "olmo2", "bert", "nemotron"])
def test_probe_agrees_with_the_graph(mt: str) -> None:
    """Every module-wrapped norm, perturbed by the name-free probe, gives the graph's reading."""
    rep = report(mt)
    probed = [n for n in rep.norms if n.probe]
    assert probed, mt
    assert all(n.probe["agrees"] for n in probed), [(n.module, n.probe) for n in probed if not n.probe["agrees"]]


def test_post_attention_layernorm_means_different_things() -> None:
    """HF's ``post_attention_layernorm`` is a pre-FFN norm in Llama and a branch-output norm in OLMo 2."""
    roles = {
        mt: {n.role for n in report(mt).norms if n.module.endswith("post_attention_layernorm")}
        for mt in ("llama", "olmo2")
    }
    assert roles == {"llama": {SiteRole.PRE}, "olmo2": {SiteRole.OUT}}


def test_chameleon_qk_norm_is_layernorm_with_affine() -> None:
    qk = [n for n in report("chameleon").norms if n.role is SiteRole.QK]
    assert qk and all(n.operator.value == "layernorm" and n.gain_convention is GainConvention.W and n.bias for n in qk)


def test_every_layer_classified_and_sublayers_paired() -> None:
    rep = report("gemma2")
    assert [s.kind for s in rep.sublayers] == [SublayerKind.ATTENTION, SublayerKind.MLP] * 2
    assert all(len(s.pre) == 1 and len(s.out) == 1 for s in rep.sublayers)
    assert {a.layer for a in rep.attention} == {0, 1}


def test_gemma3n_tiny_config_keeps_kv_sharing_valid() -> None:
    """Gemma 3n (35 layers, the last 15 reusing K/V): the shrink keeps one producer and one consumer of each
    attention kind, and cuts every per-layer list (FFN widths, activation sparsity) to the tiny depth."""
    cfg = tiny_config("gemma3n_text")
    kinds = {"sliding_attention", "full_attention"}
    n = cfg.num_hidden_layers
    assert (n, cfg.num_kv_shared_layers) == (4, 2) and set(cfg.layer_types[: n - 2]) == set(cfg.layer_types) == kinds
    modes = cfg.kv_sharing_modes  # raised "The set of layer types producing a cache is different ..." before
    assert modes[2:] == ["reuse", "reuse"] and modes[:2] == ["store", "store"]
    assert cfg.intermediate_size == [128] * n and len(cfg.activation_sparsity_pattern) == n


def test_gemma3n_is_peri_ln_with_side_path_norms() -> None:
    """Gemma3nTextDecoderLayer: input_layernorm / post_attention_layernorm around attention and pre_ / post_feedforward
    around the MLP (peri); the LAuReL low-rank path beside attention (linear_left -> linear_right -> post_laurel_norm,
    added to the normed input) is a side path, not a parallel sublayer; Gemma3nRMSNorm multiplies by w."""
    rep = report("gemma3n_text")
    got = rep.summary_row()
    want = dict(
        operator="rmsnorm", placement="peri", qk_norm="per-head", qk_norm_rope="before-rope", v_norm=True, layers=4
    )
    assert {k: got[k] for k in want} == want and got["gain_convention"] == "w"
    assert [s.kind for s in rep.sublayers] == [SublayerKind.ATTENTION, SublayerKind.MLP] * 4
    side = [n for n in rep.norms if n.module.endswith("post_laurel_norm")]
    assert len(side) == 4 and {n.role for n in side} == {SiteRole.OTHER}


@pytest.mark.parametrize(
    ("mt", "placement"), [("glm4v_text", "peri"), ("glm4v_moe_text", "pre"), ("qwen2_vl_text", "pre")]
)
def test_mrope_sections_fit_the_tiny_head(mt: str, placement: str) -> None:
    """M-RoPE splits the rotary half-width into (t, h, w) sections (GLM-4V's [8, 12, 12] in its modeling code):
    the shrink re-splits the tiny one; GLM-4.1V's decoder is GLM-4-0414's sandwich, GLM-4.5V's is Pre-LN."""
    cfg = tiny_config(mt)
    rope = cfg.rope_parameters
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # GLM-4V: no head_dim
    half = int(head * rope.get("partial_rotary_factor", 1.0)) // 2
    assert len(rope["mrope_section"]) == 3 and sum(rope["mrope_section"]) == half
    got = report(mt).summary_row()
    assert (got["operator"], got["placement"], got["qk_norm"], got["gain_convention"]) == (
        "rmsnorm",
        placement,
        "none",
        "w",
    )
