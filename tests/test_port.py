"""The derived port (issue 24): transformers decoders ported into our one Block from their dataflow, no key map.

Each family is built tiny (2 layers, width 64; original sizes in tests/tiny_hf.py) from its config class, offline,
with every parameter randomised (so gain conventions such as Gemma's 1 + w matter), then ported with ``from_hf``:
the same fp32 logits as transformers (max abs diff <= 1e-5) and the same gradient on every parameter. The old
key maps' results (tests/data/port_keymaps.json, written from blocks/keymaps.py before its language-model tables
were deleted) are what the derived port must reproduce: the same config fields and the same parameter mapping.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normatlas import Norm  # noqa: E402
from normatlas.blocks import QKNorm, TransformerLM, layernorm_scaling, peri_ln  # noqa: E402
from normatlas.port import PortError, from_hf, port, to_hf_state_dict  # noqa: E402
from normatlas.vocabulary import Operator  # noqa: E402

from .port_helpers import (  # noqa: E402
    assert_loads_back,
    assert_same_gradients,
    backward_both,
    logit_atol,
    logits_of_both,
    ported_fixture,
    reference_backend,
)
from .renamer import old_names, renamed  # noqa: E402
from .tiny_hf import randomise_, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
SEQ, BATCH, VOCAB = 7, 2, 97
_DEC = dict(width=64, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)  # head_dim 16, ffn 128
_ENC = dict(width=64, vocab_size=VOCAB)  # GPT-2: 32 positions, ffn 128
_WINDOWED = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])

CASES = {
    # the families of the old key maps
    "llama": _DEC,
    "qwen3": _DEC,
    "gemma2": dict(_DEC, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(_DEC, query_pre_attn_scalar=24, **_WINDOWED),
    "olmo2": _DEC,
    "cohere": dict(_DEC, logit_scale=0.5),
    "cohere+qk_norm": dict(_DEC, logit_scale=0.5, use_qk_norm=True),
    "gpt2": _ENC,
    "gpt2+scaled": dict(_ENC, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
    "bert": _ENC,  # an encoder: bidirectional, Post-LN, token types, the masked-LM head transform
    "glm4": _DEC,
    # the five the key maps refused
    "mistral": dict(_DEC, sliding_window=4),
    "qwen2": dict(_DEC, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "granite": dict(_DEC, embedding_multiplier=3.0, residual_multiplier=0.3, attention_multiplier=0.2,
                    logits_scaling=4.0),
    "olmo3": dict(_DEC, **_WINDOWED),
    "exaone4": dict(_DEC, **_WINDOWED),
    # Block features added for the sweep: ReLU squared, a 1 + w gain inside a fused LayerNorm, half the dims rotated
    "nemotron": _DEC,
}  # fmt: skip
"""HF ``model_type`` (``+variant`` for a second configuration) -> config overrides of the tiny model."""

MODEL_CLASS = {"bert": "BertForMaskedLM"}
OLD = json.loads((Path(__file__).parent / "data" / "port_keymaps.json").read_text())
# the record spells QK-norm's operator in the words of its old enum (QKOperator); QKNormConfig takes Operator now
RECORDED_QK_OPERATOR = {"rms": Operator.RMSNORM, "l2": Operator.L2, "layernorm": Operator.LAYERNORM}


def _type(name: str) -> str:
    return name.split("+")[0]


ATTENTION = ("default", "eager")
"""How each case is built: as ``from_config`` builds it (transformers' default attention: sdpa where the model
supports it, eager for Gemma 2's soft-capped scores), and with eager attention."""


def _build(name: str, attn: str = "default") -> torch.nn.Module:
    cls = MODEL_CLASS.get(_type(name))
    chosen = {} if attn == "default" else {"attn_implementation": attn}
    hf = tiny_model(_type(name), cls, seed=0, **chosen, **CASES[name]).float()
    return randomise_(hf, 0.1)  # every gain, bias and weight away from its init


ported = ported_fixture(_build, [(n, a) for n in sorted(CASES) for a in ATTENTION], ids="-".join)


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, 1] = 0  # the pad id: its embedding row gets no gradient where HF sets padding_idx
    return ids, torch.randn(BATCH, SEQ, VOCAB, generator=g)


def test_same_logits(ported):
    _, hf, p, ours = ported
    ref, got = logits_of_both(hf, ours, _inputs()[0])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=logit_atol(ref), rtol=0)
    assert p.max_abs_diff is not None and p.max_abs_diff <= logit_atol(ref)


def test_same_gradients(ported):
    """Every parameter's gradient, mapped back by the port's links, equals transformers' (reference backend)."""
    name, hf, _, ours = ported
    ids, upstream = _inputs(2)
    # the tolerance grows with the gradient: fp32 rounding of Nemotron's ~200
    mapped, hf_params = assert_same_gradients(hf, ours, ids, upstream, name, reference=(Norm, QKNorm))
    assert {id(q) for q in hf.parameters()} == {id(hf_params[k]) for k in mapped}  # every parameter checked


def test_round_trip_state_dict_loads(ported):
    name, hf, p, ours = ported
    assert_loads_back(_build(name, hf.config._attn_implementation), hf, p, ours, _inputs(3)[0])


def test_float64_gradients_agree_to_rounding():
    """Nemotron's ReLU-squared MLP gives gradients of ~200, whose fp32 rounding passes 1e-5 absolute; in float64 the
    port's gradients equal transformers' to 1e-10, so the design is exact and the fp32 gap is rounding."""
    hf = _build("nemotron")
    _, ours = port(hf)
    hf, ours = hf.double(), ours.double()
    ids, upstream = _inputs(2)
    with reference_backend(ours, (Norm, QKNorm)):
        mapped, hf_params = backward_both(hf, ours, ids, upstream.double())
    for key, g in mapped.items():
        torch.testing.assert_close(g, hf_params[key].grad, atol=1e-10, rtol=1e-10)


def _effective(cfg) -> dict:
    """The config fields the old key maps set, with equivalent spellings made equal (an explicit default attention
    scale, per-layer scales that are all one value)."""
    hd = cfg.head_dim or cfg.d_model // cfg.n_heads
    scales = cfg.layer_attn_scale or (cfg.attn_scale or hd**-0.5,) * cfg.n_layers
    return {"scales": [round(s, 9) for s in scales], "head_dim": hd, "n_kv_heads": cfg.n_kv_heads or cfg.n_heads}


@pytest.mark.parametrize("name", sorted(set(OLD) - {"vit", "dinov2"}))  # the two classifiers: test_blocks_vit.py
def test_matches_the_old_key_map(name):
    """The derived port reproduces what the key map of its family wrote: config fields and parameter mapping."""
    if name not in CASES:
        pytest.skip(f"{name} is not a decoder the derived port reads (see docs/port.md)")
    p, _ = port(_build(name))
    old = OLD[name]
    cfg = p.config
    exp = old["config"]
    skip = {
        "attn_scale",
        "layer_attn_scale",
        "head_dim",
        "n_kv_heads",
        "placement_kinds",
        "qk_norm",
        "rope",
        "norm_spec",
    }
    got = {k: getattr(cfg, k) for k in exp if k not in skip}
    got = {k: (v.value if hasattr(v, "value") else list(v) if isinstance(v, tuple) else v) for k, v in got.items()}
    assert got == {k: v for k, v in exp.items() if k not in skip}
    hd = exp["head_dim"] or exp["d_model"] // exp["n_heads"]
    scales = exp["layer_attn_scale"] or [exp["attn_scale"] or hd**-0.5] * exp["n_layers"]
    assert _effective(cfg) == {"scales": [round(s, 9) for s in scales], "head_dim": hd,
                               "n_kv_heads": exp["n_kv_heads"] or exp["n_heads"]}  # fmt: skip
    assert [[k.value for k in cfg.plan(i)[0].kinds] for i in range(cfg.n_layers)] == exp["placement_kinds"]
    assert cfg.plan(0)[1](8).spec.to_dict() == exp["norm_spec"]
    qk = None if cfg.qk_norm is None else {k: getattr(cfg.qk_norm, k) for k in exp["qk_norm"] or {}}
    want_qk = exp["qk_norm"] and {**exp["qk_norm"], "operator": RECORDED_QK_OPERATOR[exp["qk_norm"]["operator"]].value}
    assert (qk and {k: getattr(v, "value", v) for k, v in qk.items()}) == want_qk
    rope = cfg.rope and {"theta": cfg.rope.theta, "style": cfg.rope.style.value, "fraction": cfg.rope.fraction}
    assert rope == exp["rope"]
    links = {link.ours: link for link in p.links}
    assert set(links) == set(old["mapping"])
    for key, (theirs, transpose, chunks, index) in old["mapping"].items():
        link = links[key]
        assert theirs in link.theirs, key
        assert link.transpose == (transpose and len(link.shape) == 2), key
        if chunks > 1:
            n = link.shape[1 if link.transpose else 0] // chunks
            assert link.rows == tuple(range(index * n, (index + 1) * n)), key
        else:
            assert link.rows is None, key


@pytest.mark.parametrize("name", ["llama", "gpt2", "olmo3"])
def test_a_renamed_model_ports_the_same(name):
    """Every module and parameter renamed (meaningless names): the same config and the same links, by identity."""
    hf = _build(name)
    twin = renamed(hf)
    p1, _ = port(hf)
    p2, _ = port(twin)
    assert p2.config == p1.config
    back = old_names(hf, twin)
    assert [(lk.ours, tuple(back[t] for t in lk.theirs), lk.transpose, lk.rows) for lk in p2.links] == [
        (lk.ours, lk.theirs, lk.transpose, lk.rows) for lk in p1.links
    ]


def test_a_changed_model_saves_back_where_the_layout_fits():
    """LayerNorm Scaling keeps every parameter: it saves in the source layout and loads strictly (the source class
    still computes its own design); Peri-LN adds norm slots the source has no place for, so it is refused."""
    hf = _build("llama")
    p, ours = port(hf)
    lns = TransformerLM(p.config.with_(placement=layernorm_scaling()))
    lns.load_state_dict(ours.state_dict())
    sd = to_hf_state_dict(lns, p)
    fresh = _build("llama")
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= set(p.buffers)
    ids, _ = _inputs(4)
    with torch.no_grad():
        assert not torch.allclose(lns(ids), ours(ids))  # the design did change
    peri = TransformerLM(p.config.with_(placement=peri_ln()))
    with pytest.raises(PortError, match=r"no place in the llama layout for layers\.0\.attn_post_norm"):
        to_hf_state_dict(peri, p)


def test_refusals_name_what_is_missing():
    from normatlas.factory import build_target

    moe, _, _ = build_target("phimoe")  # SparseMixer: experts chosen by a sort, not a top-k (Mixtral ports now)
    with pytest.raises(PortError, match="routed mixture of experts") as err:
        port(moe.float())
    assert err.value.model == "phimoe" and err.value.missing
    ssm, _, _ = build_target("mamba")
    with pytest.raises(PortError, match="a layer with no attention"):
        port(ssm.float())


def test_bad_arguments_are_typed_errors():
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel"):
        port(torch.nn.Linear(2, 2))
    hf = _build("llama")
    _, ours = port(hf)
    with pytest.raises(TypeError, match="not a model type"):
        to_hf_state_dict(ours, "llama")
    with pytest.raises(TypeError, match="needs the Port"):
        to_hf_state_dict(TransformerLM(ours.config))


def test_variants_configure_what_they_claim():
    """Cohere's per-head LayerNorm QK-norm; Granite's four multipliers; EXAONE 4's NoPE global layer."""
    cohere = from_hf(_build("cohere+qk_norm"))
    q_norm = cohere.layers[0].attn.q_norm
    assert q_norm is not None and tuple(q_norm.weight.shape) == (4, 16)
    g = port(_build("granite"))[0].config
    assert (g.embed_scale, g.logit_scale, g.attn_scale) == (3.0, 0.25, 0.2)
    assert math.isclose(g.placement.branch_scale, 0.3)  # type: ignore[union-attr]
    e = port(_build("exaone4"))[0].config
    assert e.layer_rope == (True, False) and e.layer_windows == (4, None)


def test_layer_rope_is_validated_and_switches_rope_off():
    """The one Block feature the port added: a per-layer RoPE switch (a NoPE layer computes no rotation)."""
    from normatlas import RMSNorm
    from normatlas.blocks import ModelConfig

    with pytest.raises(ValueError, match="layer_rope has 1 entries but n_layers=2"):
        ModelConfig(norm=RMSNorm, layer_rope=(True,))
    with pytest.raises(ValueError, match="layer_rope is set but rope=None"):
        ModelConfig(norm=RMSNorm, layer_rope=(True, False), rope=None)
    with pytest.raises(TypeError, match="must be a tuple of bools"):
        ModelConfig(norm=RMSNorm, layer_rope=(1, 0))  # type: ignore[arg-type]
    torch.manual_seed(0)
    base = TransformerLM(ModelConfig(norm=RMSNorm, n_layers=1)).eval()
    nope = TransformerLM(ModelConfig(norm=RMSNorm, n_layers=1, layer_rope=(False,))).eval()
    free = TransformerLM(ModelConfig(norm=RMSNorm, n_layers=1, rope=None)).eval()
    nope.load_state_dict(base.state_dict())
    free.load_state_dict(base.state_dict())
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(nope(ids), free(ids), atol=0, rtol=0)
        assert not torch.allclose(nope(ids), base(ids))
