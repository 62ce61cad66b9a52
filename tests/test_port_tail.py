"""The port's long tail (issue 31): the Block features added so that more model types port exactly, each read by
behaviour, and the validation of each new field.

Each transformers model type is built tiny from its own config's defaults (``normatlas.factory.tiny_config``:
2 layers, width 64; ELECTRA-base is 768 wide over 128-wide embeddings, RemBERT 1152 over 256 with a 1664-wide head,
Mllama-11B's text model 4096 with 8 image-token rows more than its head, Apertus-8B 4096 with xIELU) and every
parameter randomised. Two features no ported model type shows alone are checked on a Llama whose decoder layer is
rewritten: Beam's depth-scaled adds (a different residual alpha and branch scale on every add) and Doge's learned
per-channel multiplier on the stream itself.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normatlas import RMSNorm  # noqa: E402
from normatlas.blocks import ModelConfig, TransformerLM  # noqa: E402
from normatlas.blocks.mlp import XIELU, Activation  # noqa: E402
from normatlas.blocks.moe import MoEConfig  # noqa: E402
from normatlas.blocks.placement import Gate, Placement, Schedule, parallel, pre_ln  # noqa: E402
from normatlas.port import PortError, port  # noqa: E402

from .port_helpers import assert_same_gradients, logit_atol, logits_of_both, ported_fixture, token_ids  # noqa: E402
from .tiny_hf import randomise_, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
SEQ, BATCH = 7, 2

CASES: dict[str, tuple[dict, dict]] = {
    # model type: (config overrides, what the port must read)
    "electra": ({}, dict(embed_dim=128, head_width=128, tie_embeddings=True)),  # projection in, head back to 128
    "rembert": ({}, dict(embed_dim=256, head_width=1664, tie_embeddings=False)),
    "mllama": ({}, dict(head_vocab_size=128, tie_embeddings=False)),  # a table of 136 rows
    "moshi": ({}, dict(head_vocab_size=128, tie_embeddings=False)),  # a table of 129 rows
    "modernbert-decoder": ({}, dict(head_transform=True, head_transform_bias=False)),
    "openai-gpt": ({}, dict(causal=True)),  # scores * b + -1e4 * (1 - b)
    "big_bird": ({}, dict(head_transform=True)),  # gelu_new written out in the head; a pooler beside the logits
    "apertus": (  # its Llama 3 RoPE scaling set to the default: xIELU is what is read here
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        dict(activation=Activation.XIELU),
    ),
}


def _build(model_type: str) -> torch.nn.Module:
    from normatlas.factory import tiny_config

    cfg = tiny_config(model_type)
    for k, v in CASES[model_type][0].items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    return randomise_(hf, 0.1)


def _ids(hf: torch.nn.Module, seed: int) -> torch.Tensor:
    return token_ids(hf, seed, (BATCH, SEQ), low=3)


def _same_logits_and_gradients(hf: torch.nn.Module, ours: TransformerLM, name: str) -> None:
    """The same logits (fp32, :func:`logit_atol`), and every parameter the logits read: its gradient, mapped back by
    the port's links, equals transformers'."""
    ref, got = logits_of_both(hf, ours, _ids(hf, 1))
    torch.testing.assert_close(got, ref, atol=logit_atol(ref), rtol=0)
    assert_same_gradients(hf, ours, _ids(hf, 2), upstream=9, name=name)


ported = ported_fixture(_build, sorted(CASES))


def test_reads_the_feature(ported):
    name, _, p, _ = ported
    for field, value in CASES[name][1].items():
        assert getattr(p.config, field) == value, (name, field)


def test_same_logits_and_gradients(ported):
    name, hf, p, ours = ported
    ref, _ = logits_of_both(hf, ours, _ids(hf, 1))
    assert p.max_abs_diff is not None and p.max_abs_diff <= logit_atol(ref)
    _same_logits_and_gradients(hf, ours, name)


def test_a_pooler_beside_the_logits_is_unused():
    hf = _build("big_bird")
    p, _ = port(hf)
    assert any("pooler" in n for n in p.unused), p.unused  # computed by the forward, never read by the logits


# --------------------------------------------------------------------------- rewritten Llama layers
class _DepthScaledAdds(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """Beam's adds: the k-th residual add of the model is ``sqrt((k-1)/k) x + F / sqrt(k)``, k = 2 (l + 1) and one
    more for the MLP."""

    def forward(self, hidden_states, **kwargs):
        k = 2 * (self.self_attn.layer_idx + 1)
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        x = hidden_states * math.sqrt((k - 1) / k) + h / math.sqrt(k)
        h = self.mlp(self.post_attention_layernorm(x))
        return x * math.sqrt(k / (k + 1)) + h / math.sqrt(k + 1)


class _LearnedSkip(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """Doge's adds: ``input_residual * x + F`` with one learned value per channel, per sublayer."""

    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        x = self.skip_attn * hidden_states + h
        return self.skip_mlp * x + self.mlp(self.post_attention_layernorm(x))


def _rewritten(layer_class: type) -> torch.nn.Module:
    hf = tiny_model("llama", seed=0, vocab_size=64).float()
    for layer in hf.model.layers:
        layer.__class__ = layer_class
        if layer_class is _LearnedSkip:
            layer.skip_attn = torch.nn.Parameter(torch.ones(32))
            layer.skip_mlp = torch.nn.Parameter(torch.ones(32))
    return randomise_(hf, 0.1)


def test_per_sublayer_scalings_port():
    torch.set_num_threads(1)
    hf = _rewritten(_DepthScaledAdds)
    p, ours = port(hf)
    assert isinstance(p.config.placement, Schedule)
    for i, lp in enumerate(p.config.placement.layers):
        k = 2 * (i + 1)
        pl = lp.placement
        assert pl.residual_alpha == pytest.approx(math.sqrt((k - 1) / k), rel=1e-9)
        assert pl.branch_scale == pytest.approx(1 / math.sqrt(k), rel=1e-9)
        assert pl.scalings("ffn") == pytest.approx((math.sqrt(k / (k + 1)), 1 / math.sqrt(k + 1)), rel=1e-9)
    _same_logits_and_gradients(hf, ours, "depth-scaled")


def test_learned_skip_multiplier_ports():
    torch.set_num_threads(1)
    hf = _rewritten(_LearnedSkip)
    p, ours = port(hf)
    assert p.config.placement.skip_gate is Gate.VECTOR  # type: ignore[union-attr]
    assert ours.layers[0].ffn_residual.skip_gate.gamma.shape == (32,)
    _same_logits_and_gradients(hf, ours, "learned skip")


# --------------------------------------------------------------------------- xIELU
def test_xielu_matches_a_float64_reference_and_transformers():
    from transformers.activations import XIELUActivation

    torch.manual_seed(0)
    ref = XIELUActivation(alpha_p_init=0.7, alpha_n_init=0.9, dtype=torch.float64)
    ours = XIELU(0.7, 0.9).double()
    assert float(torch.nn.functional.softplus(ours.alpha_p)) == pytest.approx(0.7, rel=1e-6)  # init, fp32-stored
    with torch.no_grad():  # the same float64 values (ours were initialised in float32)
        ours.alpha_p.copy_(ref.alpha_p)
        ours.alpha_n.copy_(ref.alpha_n)
    x = torch.randn(5, 123, dtype=torch.float64, requires_grad=True) * 3
    torch.testing.assert_close(ours(x), ref(x), atol=1e-12, rtol=0)
    a_p, a_n = (float(f(t)) for f, t in ((torch.nn.functional.softplus, ours.alpha_p),
                                          (lambda t: 0.5 + torch.nn.functional.softplus(t), ours.alpha_n)))  # fmt: skip
    direct = torch.where(x > 0, a_p * x * x + 0.5 * x, (torch.expm1(torch.clamp(x, max=-1e-6)) - x) * a_n + 0.5 * x)
    torch.testing.assert_close(ours(x), direct, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda t: ours(t), (x.detach()[:2, :7].requires_grad_(),))


def test_xielu_is_the_mlp_module():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=24, norm=RMSNorm, activation=Activation.XIELU,
                      gated=False)  # fmt: skip
    model = TransformerLM(cfg)
    assert isinstance(model.layers[0].mlp.act, XIELU)
    assert {"layers.0.mlp.act.alpha_p", "layers.0.mlp.act.alpha_n"} <= set(model.state_dict())
    with pytest.raises(TypeError, match="learned parameters"):
        Activation.XIELU(torch.zeros(2))


# --------------------------------------------------------------------------- refusals and validation
def test_refusals_name_the_feature():
    from normatlas.factory import build_target

    torch.set_num_threads(1)
    model, _, _ = build_target("zaya")
    with pytest.raises(PortError, match="a learned bias on the residual stream itself"):
        port(model.float())
    model, _, _ = build_target("trocr")  # the position table is found by its lookup's index: arange + 2, not the ids
    p, _ = port(model.float())  # ... and read from row 2 (ModelConfig.position_offset)
    assert p.config.position_offset == 2 and p.max_abs_diff is not None and p.max_abs_diff < 1e-5
    model, _, _ = build_target("xglm")  # XGLM's floor on the scores passes; its sinusoids held in a buffer do not
    with pytest.raises(PortError, match="fixed absolute positions"):
        port(model.float())


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(ffn_residual_alpha=0.0), ValueError, "ffn_residual_alpha=0.0 must be > 0"),
        (dict(ffn_residual_alpha="1"), TypeError, "ffn_residual_alpha='1' must be a finite float"),
        (dict(ffn_branch_scale=0.0), ValueError, "ffn_branch_scale=0.0 must be nonzero"),
        (dict(ffn_branch_scale=math.inf), TypeError, "ffn_branch_scale=inf must be a finite float"),
        (dict(skip_gate="vector"), TypeError, "skip_gate='vector' must be one of Gate.NONE"),
    ],
)
def test_placement_fields_are_validated(changes, error, match):
    with pytest.raises(error, match=match):
        pre_ln().with_(**changes)


def test_parallel_has_one_add():
    with pytest.raises(ValueError, match=r"parallel=True has one residual add, so ffn_residual_alpha=0\.5"):
        parallel().with_(ffn_residual_alpha=0.5)
    with pytest.raises(ValueError, match="sublayer='mlp' must be 'attn' or 'ffn'"):
        pre_ln().scalings("mlp")
    assert pre_ln().with_(residual_alpha=2.0, ffn_branch_scale=0.5).scalings("ffn") == (2.0, 0.5)
    assert "s*x" in Placement(skip_gate=Gate.SCALAR).describe()


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(head_width=8), ValueError, "head_width=8 needs head_transform=True"),
        (dict(head_width=0, head_transform=True), ValueError, "head_width=0 must be an integer >= 1"),
        (dict(head_transform_bias=False), ValueError, "head_transform_bias=False needs head_transform=True"),
        (dict(head_transform_bias=0), TypeError, "head_transform_bias=0 must be a bool"),
        (dict(head_vocab_size=40), ValueError, "head_vocab_size=40 with tie_embeddings=True"),
        (dict(embed_dim=8), ValueError, r"tie_embeddings=True needs the head's input width \(16"),
        (dict(embed_dim=8, tie_embeddings=False, embed_proj_bias=None), TypeError, "embed_proj_bias=None"),
        (dict(activation=Activation.XIELU, moe=MoEConfig(n_experts=4, top_k=2, d_expert=8)), ValueError,
         "activation='xielu' has learned parameters"),
    ],
)  # fmt: skip
def test_model_fields_are_validated(changes, error, match):
    with pytest.raises(error, match=match):
        ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=24, norm=RMSNorm, **changes)


def test_ends_build_the_widths_they_claim():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=24, norm=RMSNorm, embed_dim=8, embed_norm=True,
                      head_transform=True, head_width=8, head_transform_bias=False)  # fmt: skip
    m = TransformerLM(cfg)
    assert m.embed.weight.shape == (32, 8) and m.embed_proj.weight.shape == (16, 8)
    assert m.head_dense.bias is None and m.lm_head.weight is m.embed.weight
    assert m(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 32)
    untied = TransformerLM(cfg.with_(tie_embeddings=False, head_vocab_size=24))
    assert untied(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 24)
    with pytest.raises(ValueError, match=r"eps=0\.1 must be <= 0"):
        XIELU(eps=0.1)
    with pytest.raises(ValueError, match=r"alpha_n_init=0\.4 > beta=0\.5"):
        XIELU(alpha_n_init=0.4)
