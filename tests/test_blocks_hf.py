"""Ported HF reference models give the same logits and gradients as ours (fp32, max abs err <= 1e-5).

Each architecture is built tiny (2 layers, width 64) from its config class, offline,
with every parameter randomised (so gain conventions such as Gemma's 1 + w matter),
then ported with ``from_hf``. Each model is built once per module.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normatlas import Norm  # noqa: E402
from normatlas.blocks import QKNorm, from_hf, keymap_for, to_hf_state_dict  # noqa: E402

from .tiny_hf import randomise_, tiny_model  # noqa: E402

SEQ, BATCH, VOCAB = 7, 2, 97
_DEC = dict(width=64, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)  # head_dim 16, ffn 128
_ENC = dict(width=64, vocab_size=VOCAB)  # GPT-2 / BERT: 32 positions, ffn 128

# Original sizes: see tests/tiny_hf.py (Llama-3-8B 4096/32L ... BERT-base 768/12L).
CASES = {
    "llama": ("LlamaForCausalLM", _DEC),
    "qwen3": ("Qwen3ForCausalLM", _DEC),
    "gemma2": ("Gemma2ForCausalLM",
               dict(_DEC, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3ForCausalLM",
                    dict(_DEC, sliding_window=4, query_pre_attn_scalar=24,
                         layer_types=["sliding_attention", "full_attention"])),
    "olmo2": ("Olmo2ForCausalLM", _DEC),
    "cohere": ("CohereForCausalLM", dict(_DEC, logit_scale=0.5)),
    "cohere+qk_norm": ("CohereForCausalLM", dict(_DEC, logit_scale=0.5, use_qk_norm=True)),
    "gpt2": ("GPT2LMHeadModel", _ENC),
    "gpt2+scaled": ("GPT2LMHeadModel", dict(_ENC, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)),
    "bert": ("BertForMaskedLM", _ENC),
    "glm4": ("Glm4ForCausalLM", _DEC),
}  # fmt: skip
"""Keys are HF ``model_type`` names, with ``+variant`` for a second configuration of the same architecture."""


def _type(name: str) -> str:
    return name.split("+")[0]


def _build(name: str):
    model_cls, kw = CASES[name]
    hf = tiny_model(_type(name), model_cls, seed=0, attn_implementation="eager", **kw).float()
    return randomise_(hf, 0.1)  # every gain, bias and weight away from its init


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
    hf = _build(request.param)
    ours = from_hf(hf).eval()
    return request.param, hf, ours


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, 1] = 0  # the pad id of most configs: its embedding row gets no gradient where HF sets padding_idx
    upstream = torch.randn(BATCH, SEQ, VOCAB, generator=g)
    return ids, upstream


def test_model_type_matches_keymap(pair):
    name, hf, _ = pair
    assert hf.config.model_type == _type(name)
    assert type(hf).__name__ == keymap_for(_type(name)).hf_class


def test_same_logits(pair):
    _, hf, ours = pair
    ids, _ = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# the reference path is the ported design's arithmetic; the default (fused) path rounds its row sums differently
GRAD_TOL = {"reference": {"atol": 1e-5, "rtol": 1e-4}, "auto": {"atol": 1e-4, "rtol": 1e-3}}


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_same_gradients(pair, backend):
    name, hf, ours = pair
    norms = [m for m in ours.modules() if isinstance(m, (Norm, QKNorm))]
    assert norms
    for m in norms:
        m.backend = backend
    ids, upstream = _inputs(2)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    (hf(input_ids=ids).logits * upstream).sum().backward()
    (ours(ids) * upstream).sum().backward()
    ours_grads = {n: p.grad for n, p in ours.named_parameters(remove_duplicate=False) if p.grad is not None}
    mapped = to_hf_state_dict(ours, _type(name), ours_grads)
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    assert mapped, "no gradients mapped"
    for key, g in mapped.items():
        ref = hf_params[key].grad
        assert ref is not None, key
        torch.testing.assert_close(g, ref, **GRAD_TOL[backend], msg=lambda m, k=key: f"{name} {k}: {m}")
    for m in norms:
        m.backend = "auto"
    assert len({id(p) for p in hf.parameters()}) == len({id(hf_params[k]) for k in mapped})


def test_round_trip_state_dict_loads_strict(pair):
    name, hf, ours = pair
    sd = to_hf_state_dict(ours, _type(name))
    fresh = _build(name)
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    km = keymap_for(_type(name))
    assert not unexpected
    assert all(any(k.endswith(s) for s in km.ignore) for k in missing), missing
    ids, _ = _inputs(3)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, hf(input_ids=ids).logits, atol=0, rtol=0)


def test_unknown_model_type_is_rejected():
    with pytest.raises(ValueError, match="model_type='mamba' has no key map; supported: bert"):
        keymap_for("mamba")


def test_variants_configure_what_they_claim():
    """The ``+variant`` cases exercise the flags: Cohere's per-head LayerNorm QK-norm, GPT-2's 1/(layer+1) scale."""
    cohere = from_hf(_build("cohere+qk_norm"))
    q_norm = cohere.layers[0].attn.q_norm
    assert q_norm is not None and tuple(q_norm.weight.shape) == (4, 16)
    gpt2 = from_hf(_build("gpt2+scaled"))
    assert [b.attn.scale for b in gpt2.layers] == pytest.approx([16**-0.5, 16**-0.5 / 2])


def test_gpt2_cross_attention_is_rejected():
    hf = tiny_model("gpt2", "GPT2LMHeadModel", **_ENC, n_layer=1, add_cross_attention=True)
    with pytest.raises(ValueError, match="add_cross_attention=True is not supported"):
        from_hf(hf)
