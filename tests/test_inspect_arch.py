"""The inspector on transformers' own reference code: each architecture is built tiny
from its config class (litgpt-style shrink: 2 layers, width 64; the real models are
thousands wide and tens of layers deep) and its design read off the dataflow. The
expected designs are what each model's modeling code does (see each comment)."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("transformers")

from normatlas.inspect import InspectionReport, inspect_model
from normatlas.inspect.build import _model_from_config, tiny_config

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
    "chameleon": dict(operator="rmsnorm", placement="res-post", qk_norm="per-head", qk_norm_rope="before-rope"),
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
        model = _model_from_config(tiny_config(mt, **OVERRIDES.get(mt, {})))
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
    assert roles == {"llama": {"pre"}, "olmo2": {"out"}}


def test_chameleon_qk_norm_is_layernorm_with_affine() -> None:
    qk = [n for n in report("chameleon").norms if n.role == "qk"]
    assert qk and all(n.operator.value == "layernorm" and n.gain_convention == "w" and n.bias for n in qk)


def test_every_layer_classified_and_sublayers_paired() -> None:
    rep = report("gemma2")
    assert [s.kind for s in rep.sublayers] == ["attention", "mlp"] * 2
    assert all(len(s.pre) == 1 and len(s.out) == 1 for s in rep.sublayers)
    assert {a.layer for a in rep.attention} == {0, 1}
