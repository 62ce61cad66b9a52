"""Routed mixture-of-experts MLPs: our :class:`~normatlas.blocks.MoE` against a float64 loop over experts, its config's
validation, and transformers' MoE decoders ported from their dataflow (same logits, same gradients, the state dict
back), with the router variants we do not compute refused by name.

Each model type is built tiny from its own config's defaults (``normatlas.factory.tiny_config``: 2 layers,
width 64, 4 experts of which 2 per token, expert width 32; Mixtral-8x7B is 4096 wide with 8 experts, Qwen1.5-MoE-A2.7B
2048 with 60 and a shared expert, GLM-4.5 5120 with 160 in groups) and every parameter and selection bias
randomised, so that the routing, the renormalisation and the scales matter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normatlas import RMSNorm  # noqa: E402
from normatlas.blocks import ModelConfig, MoE, MoEConfig, RouterScore, TransformerLM  # noqa: E402
from normatlas.blocks.mlp import Activation  # noqa: E402
from normatlas.port import PortError, port  # noqa: E402

from .port_helpers import (  # noqa: E402
    assert_loads_back,
    assert_same_gradients,
    logit_atol,
    logits_of_both,
    ported_fixture,
    token_ids,
)
from .tiny_hf import randomise_  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
SEQ, BATCH = 7, 2

CASES = {
    "mixtral": {},  # softmax, top-2, renormalised
    "qwen2_moe": {},  # softmax, not renormalised, a shared expert behind a sigmoid gate
    "olmoe": {},  # softmax, not renormalised
    "granitemoe": {},  # a softmax over the top-k logits (read as its equal: softmax, then renormalised)
    "glm4_moe": {},  # sigmoid, selection bias, groups (n_group 2, topk_group 1), a dense first layer, shared expert
    "exaone_moe": {},  # as GLM-4.5 with routed_scaling_factor 2.5
    "ernie4_5_moe": {},  # a selection bias that is a parameter
}
"""HF ``model_type`` -> overrides of ``tiny_config`` (the routing each one exercises in the comment)."""


def _build(model_type: str) -> torch.nn.Module:
    from normatlas.factory import tiny_config

    cfg = tiny_config(model_type, **CASES[model_type])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    randomise_(hf, 0.1)
    with torch.no_grad():  # the selection bias starts at zero: move it (a test may name it; the port never does)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.05 * torch.randn(b.shape))
    return hf


def _ids(hf: torch.nn.Module, seed: int) -> torch.Tensor:
    return token_ids(hf, seed, (BATCH, SEQ), low=3)


ported = ported_fixture(_build, sorted(CASES))


def test_reads_a_moe(ported):
    name, _, p, ours = ported
    moe = p.config.moe
    assert moe is not None and moe.n_experts == 4 and moe.top_k == 2, name
    assert any(isinstance(b.mlp, MoE) for b in ours.blocks())
    expected = {
        "mixtral": dict(score=RouterScore.SOFTMAX, renormalize=True, shared_width=0),
        "qwen2_moe": dict(score=RouterScore.SOFTMAX, renormalize=False, shared_width=32, shared_gate=True),
        "granitemoe": dict(score=RouterScore.SOFTMAX, renormalize=True),  # softmax over the top-k logits
        "glm4_moe": dict(score=RouterScore.SIGMOID, selection_bias=True, n_groups=2, topk_groups=1, shared_width=32),
        "exaone_moe": dict(score=RouterScore.SIGMOID, routed_scale=2.5, selection_bias=True),
        "ernie4_5_moe": dict(selection_bias=True),
    }.get(name, {})
    assert {k: getattr(moe, k) for k in expected} == expected
    if name in ("glm4_moe", "exaone_moe"):
        assert p.config.layer_moe == (False, True)  # first_k_dense_replace = 1


def test_same_logits(ported):
    _, hf, p, ours = ported
    ref, got = logits_of_both(hf, ours, _ids(hf, 1))
    torch.testing.assert_close(got, ref, atol=logit_atol(ref), rtol=0)
    assert p.max_abs_diff is not None and p.max_abs_diff <= logit_atol(ref)


def test_same_gradients(ported):
    """Every parameter's gradient (the stacked experts' re-fused by the links) equals transformers'."""
    name, hf, _, ours = ported
    # an expert no token chose in this batch has no gradient in transformers: ours must be zeros
    assert_same_gradients(hf, ours, _ids(hf, 2), upstream=3, name=name, unrouted_zero=True)


def test_state_dict_back(ported):
    name, hf, p, ours = ported
    assert_loads_back(_build(name), hf, p, ours, _ids(hf, 4))


def test_refuses_a_router_we_do_not_compute():
    """PhiMoE's SparseMixer chooses by sorting the scores with a jitter threshold, not by a top-k: refused, named."""
    from normatlas.factory import tiny_config

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config("phimoe")).float().eval()
    with pytest.raises(PortError, match="routed mixture of experts"):
        port(hf)


# ----------------------------------------------------------------------------- our MoE against a float64 loop
def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definitions in blocks/moe.py."""
    c = moe.config
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        logits = moe.router.weight @ x[n]
        s = torch.softmax(logits, 0) if c.score is RouterScore.SOFTMAX else torch.sigmoid(logits)
        sel = (logits if c.score_after_topk else s) + (moe.selection_bias if moe.selection_bias is not None else 0)
        if c.n_groups > 1:
            per = c.n_experts // c.n_groups
            group = [sorted(sel[j * per : (j + 1) * per].tolist())[-2:] for j in range(c.n_groups)]
            best = sorted(range(c.n_groups), key=lambda j: -sum(group[j]))[: c.topk_groups]
            sel = torch.stack([sel[e] if e // per in best else sel.new_tensor(-1e300) for e in range(c.n_experts)])
        chosen = sorted(range(c.n_experts), key=lambda e: -float(sel[e]))[: c.top_k]
        w = torch.stack([torch.softmax(logits[chosen], 0)[i] if c.score_after_topk else s[e] for i, e in
                         enumerate(chosen)])  # fmt: skip
        w = w / w.sum() if c.renormalize else w
        for wi, e in zip(w, chosen, strict=True):
            up = moe.up[e] @ x[n]
            h = moe.activation(moe.gate[e] @ x[n]) * up if moe.gate is not None else moe.activation(up)
            out[n] = out[n] + c.routed_scale * wi * (moe.down[e] @ h)
        if moe.shared is not None:
            sh = moe.shared(x[n])
            out[n] = out[n] + (torch.sigmoid(moe.shared_gate(x[n])) * sh if moe.shared_gate is not None else sh)
    return out


REFERENCE = {
    "softmax": MoEConfig(8, 2, 12),
    "softmax+renorm+shared": MoEConfig(8, 3, 12, renormalize=True, shared_width=10, shared_gate=True),
    "after_topk": MoEConfig(6, 2, 12, score_after_topk=True, selection_bias=True),
    "sigmoid+groups": MoEConfig(8, 2, 12, score=RouterScore.SIGMOID, renormalize=True, routed_scale=2.5,
                                selection_bias=True, n_groups=4, topk_groups=2, shared_width=16),
}  # fmt: skip


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_moe_matches_a_float64_loop(name, gated):
    torch.manual_seed(0)
    moe = MoE(16, REFERENCE[name], Activation.SILU if gated else Activation.GELU, gated).double()
    with torch.no_grad():
        for q in moe.parameters():
            q.normal_(0, 0.5)
        if moe.selection_bias is not None:
            moe.selection_bias.normal_(0, 0.3)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 5, 16, dtype=torch.float64)
    got = moe(x)
    ref = _naive(moe, x.reshape(-1, 16)).reshape(3, 5, 16)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    g_got = torch.autograd.grad((got * up).sum(), [x, *moe.parameters()])
    g_ref = torch.autograd.grad((ref * up).sum(), [x, *moe.parameters()])
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_moe_in_a_model_trains():
    cfg = ModelConfig(norm=RMSNorm, moe=MoEConfig(4, 2, 16, shared_width=8), layer_moe=(False, True))
    lm = TransformerLM(cfg)
    assert not isinstance(lm.blocks()[0].mlp, MoE) and isinstance(lm.blocks()[1].mlp, MoE)
    lm(torch.randint(0, 256, (2, 5))).sum().backward()
    moe = lm.blocks()[1].mlp
    assert isinstance(moe, MoE) and moe.router.weight.grad is not None and moe.up.grad is not None


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(n_experts=0), ValueError, "n_experts=0"),
        (dict(top_k=5), ValueError, "top_k=5 must be <= n_experts=4"),
        (dict(d_expert=True), ValueError, "d_expert=True"),
        (dict(score="softmax"), TypeError, "score='softmax' must be one of RouterScore"),
        (dict(score=RouterScore.SIGMOID, score_after_topk=True), ValueError, "score_after_topk=True needs"),
        (dict(renormalize=1), TypeError, "renormalize=1 must be a bool"),
        (dict(routed_scale=0.0), ValueError, "routed_scale=0.0"),
        (dict(routed_scale=float("inf")), ValueError, "routed_scale=inf"),
        (dict(shared_width=-1), ValueError, "shared_width=-1"),
        (dict(shared_gate=True), ValueError, "shared_gate=True needs shared experts"),
        (dict(n_groups=3), ValueError, "n_groups=3 must divide n_experts=4"),
        (dict(n_groups=2, topk_groups=3), ValueError, "topk_groups=3 must be <= n_groups=2"),
        (dict(topk_groups=2), ValueError, "topk_groups=2 needs n_groups > 1"),
    ],
)
def test_moe_config_validation(kwargs, error, match):
    base = dict(n_experts=4, top_k=2, d_expert=8)
    with pytest.raises(error, match=match):
        MoEConfig(**{**base, **kwargs})


def test_model_config_validation():
    moe = MoEConfig(4, 2, 8)
    with pytest.raises(ValueError, match="layer_moe is set but moe=None"):
        ModelConfig(norm=RMSNorm, layer_moe=(True, False))
    with pytest.raises(ValueError, match="layer_moe has 3 entries but n_layers=2"):
        ModelConfig(norm=RMSNorm, moe=moe, layer_moe=(True, False, True))
    with pytest.raises(TypeError, match=r"layer_moe=.* must be a tuple of bools"):
        ModelConfig(norm=RMSNorm, moe=moe, layer_moe=(1, 0))
    with pytest.raises(TypeError, match="moe='mixtral' must be a MoEConfig"):
        ModelConfig(norm=RMSNorm, moe="mixtral")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mlp_bias=True with moe"):
        ModelConfig(norm=RMSNorm, moe=moe, mlp_bias=True)
    assert dataclasses.replace(ModelConfig(norm=RMSNorm, moe=moe), layer_moe=(False, True)).moe_of(0) is None
