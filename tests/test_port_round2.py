"""The port's second round of refusals (issue 31), each now a typed field of our Block read by behaviour:

* constant scales held in 0-d (integer) buffers and a constant on the head's input (MiniCPM3's ``scale_emb`` and
  ``hidden / logits_scaling``);
* ALiBi (:class:`~normatlas.blocks.alibi.Alibi`): BLOOM's ``baddbmm`` bias, MPT's added bias, Falcon's ``alibi=True``
  as sdpa's float ``attn_mask`` and its eager path, each read as it runs;
* V-norm (``ModelConfig.v_norm``): Gemma 4's gain-free RMS on the values (its full-attention layers' proportional
  RoPE set to the default, which the port reads separately);
* MoE weights on the experts' input (``MoEConfig.weight_input``): Llama 4 (its layers set NoPE, as its complex-number
  RoPE is refused separately);
* per-layer kv head counts (``ModelConfig.layer_kv_heads``).

Each model is built tiny from its own config (:func:`normatlas.factory.tiny_config`), every parameter
randomised, ported and compared in fp32 with the default attention and eager: logits and every parameter's gradient.
The new math is checked in float64 against naive references written here.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normatlas import Norm, NormSpec  # noqa: E402
from normatlas.blocks import Alibi, ModelConfig, MoEConfig, TransformerLM, geometric_slopes  # noqa: E402
from normatlas.blocks.alibi import alibi_bias  # noqa: E402
from normatlas.blocks.attention import Attention  # noqa: E402
from normatlas.blocks.mlp import Activation  # noqa: E402
from normatlas.blocks.moe import MoE, RouterScore  # noqa: E402
from normatlas.blocks.qknorm import QKGain, QKNormConfig, QKScope  # noqa: E402
from normatlas.factory import tiny_config  # noqa: E402
from normatlas.port import port  # noqa: E402
from normatlas.vocabulary import RopeOrder  # noqa: E402

from .port_helpers import assert_same_gradients, logits_of_both, ported_fixture, token_ids  # noqa: E402
from .tiny_hf import randomise_  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _gemma4(cfg):  # the full-attention layers' proportional RoPE (zero frequencies) is a separate refusal
    cfg.rope_parameters = {
        k: ({"rope_type": "default", "rope_theta": v.get("rope_theta", 1e4)} if isinstance(v, dict) else v)
        for k, v in cfg.rope_parameters.items()
    }


CASES = {
    "minicpm3": {},  # MiniCPM3-4B: 2560 wide, 62 layers; embedding x12 from an int 0-d buffer, hidden / 1 before head
    "bloom": {},  # BLOOM-176B: 14336 / 70L; ALiBi through baddbmm's input
    "mpt": {},  # MPT-7B: 4096 / 32L; ALiBi added to the scores
    # Falcon-RW (1B: 2048 / 24L) with alibi=True: the bias reaches sdpa as a float attn_mask
    "falcon": dict(alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=True, num_kv_heads=4),
    "gemma4_unified_text": _gemma4,  # Gemma 4 text: V-norm (gain-free RMS per head) beside its QK-norm
    "llama4_text": dict(no_rope_layers=[0, 0], attn_temperature_tuning=False),  # Llama 4 Scout: 5120 / 48L, 16 exp
}  # fmt: skip
"""model type -> config attributes set on :func:`tiny_config`'s shrunk defaults (or a function changing it)."""

ATTENTION = {"bloom": ("eager",), "mpt": ("eager",)}  # others: sdpa and eager (BLOOM, MPT have no sdpa)


def _build(name: str, impl: str) -> torch.nn.Module:
    cfg = tiny_config(name)
    change = CASES[name]
    if callable(change):
        change(cfg)
    else:
        for k, v in change.items():
            setattr(cfg, k, v)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval().float()
    return randomise_(hf, 0.05, generator=torch.Generator().manual_seed(1))


PARAMS = [(n, a) for n in sorted(CASES) for a in ATTENTION.get(n, ("sdpa", "eager"))]


ported = ported_fixture(_build, PARAMS, ids=[f"{n}-{a}" for n, a in PARAMS])


def test_config_reads_the_feature(ported):
    name, hf, p, _ = ported
    cfg = p.config
    if name == "minicpm3":
        assert cfg.embed_scale == hf.config.scale_emb and cfg.logit_scale == 1 / hf.config.logits_scaling
    elif name in ("bloom", "mpt", "falcon"):
        assert cfg.alibi is not None and cfg.rope is None
        slopes = geometric_slopes(hf.config.num_attention_heads if name != "mpt" else hf.config.n_heads)
        ratio = {s / g for s, g in zip(cfg.alibi.slopes, slopes, strict=True)}
        assert len(ratio) == 1  # the paper's slopes, times the scale the model applies after the bias
    elif name == "gemma4_unified_text":
        assert cfg.v_norm == QKNormConfig(gain=QKGain.NONE, eps=hf.config.rms_norm_eps)
        assert cfg.qk_norm is not None
    elif name == "llama4_text":
        assert cfg.moe is not None and cfg.moe.weight_input and cfg.moe.score is RouterScore.SIGMOID


def test_same_logits(ported):
    _, hf, _, ours = ported
    ref, got = logits_of_both(hf, ours, token_ids(hf, 1))
    torch.testing.assert_close(got, ref, atol=2e-5 * (1 + float(ref.abs().max())), rtol=0)


def test_same_gradients(ported):
    name, hf, _, ours = ported
    assert_same_gradients(hf, ours, token_ids(hf, 2), upstream=4, name=name, atol=2e-5, reference=(Norm,))


def test_falcon_paths_read_as_they_run():
    """Falcon's sdpa and eager paths are read each as it runs: where the source's two paths give the same logits
    (transformers 5.25), the same slopes; where its eager path adds the bias a second time (earlier 5.x), twice
    the slopes. The port follows the source, never a version check."""
    models = {a: _build("falcon", a) for a in ("sdpa", "eager")}
    slopes = {a: port(m)[0].config.alibi for a, m in models.items()}
    assert slopes["sdpa"] is not None and slopes["eager"] is not None
    ids = token_ids(models["sdpa"], 3)
    with torch.no_grad():
        same = torch.allclose(models["sdpa"](input_ids=ids).logits, models["eager"](input_ids=ids).logits, atol=1e-5)
    factor = 1.0 if same else 2.0
    pairs = zip(slopes["eager"].slopes, slopes["sdpa"].slopes, strict=True)
    assert all(math.isclose(e, factor * s, rel_tol=1e-6) for e, s in pairs), (factor, slopes)


# float64 references for the new math


def _naive_attention(a: Attention, x: torch.Tensor, slopes=None, v_norm_eps=None) -> torch.Tensor:
    b, t, _ = x.shape
    hd, h, kvh = a.head_dim, a.n_heads, a.n_kv_heads
    q = a.q_proj(x).view(b, t, h, hd)
    k = a.k_proj(x).view(b, t, kvh, hd)
    v = a.v_proj(x).view(b, t, kvh, hd)
    if v_norm_eps is not None:
        v = v / torch.sqrt((v * v).mean(-1, keepdim=True) + v_norm_eps)
    out = torch.zeros(b, t, h, hd, dtype=x.dtype)
    for head in range(h):
        kv = head // (h // kvh)
        for i in range(t):
            logits = []
            for j in range(i + 1):
                s = (q[:, i, head] * k[:, j, kv]).sum(-1) * a.scale
                logits.append(s + (slopes[head] * (j - i) if slopes is not None else 0.0))
            w = torch.softmax(torch.stack(logits, -1), -1)
            out[:, i, head] = sum(w[:, j, None] * v[:, j, kv] for j in range(i + 1))
    return a.o_proj(out.reshape(b, t, -1))


def _causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()[None, None]


def test_alibi_matches_naive_float64():
    torch.manual_seed(0)
    slopes = (0.5, 0.25, -0.125, 0.0)
    a = Attention(24, 4, 2, 6, alibi=Alibi(slopes)).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    torch.testing.assert_close(a(x, None, _causal(7)), _naive_attention(a, x, slopes), atol=1e-12, rtol=0)
    bias = alibi_bias(Alibi(slopes), 3, 5, torch.float64)  # 3 queries at the last positions of 5 keys
    assert bias.shape == (4, 3, 5) and float(bias[0, 0, 0]) == -1.0 and float(bias[0, 2, 4]) == 0.0


def test_alibi_gradcheck_float64():
    torch.manual_seed(0)
    a = Attention(8, 2, head_dim=4, alibi=Alibi((0.3, 0.1))).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y: a(y, None, _causal(5)), (x,))


def test_v_norm_matches_naive_float64():
    torch.manual_seed(0)
    cfg = QKNormConfig(gain=QKGain.NONE, eps=1e-6)
    a = Attention(24, 4, 2, 6, v_norm=cfg).double()
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    torch.testing.assert_close(a(x, None, _causal(6)), _naive_attention(a, x, v_norm_eps=1e-6), atol=1e-12, rtol=0)


def test_moe_weight_input_matches_naive_float64():
    torch.manual_seed(0)
    c = MoEConfig(4, 2, 6, score=RouterScore.SIGMOID, weight_input=True)
    m = MoE(8, c, Activation.SILU, True).double()
    for prm in m.parameters():
        prm.data.normal_(0, 0.5)
    x = torch.randn(5, 8, dtype=torch.float64)
    s = torch.sigmoid(m.router(x))
    ref = torch.zeros_like(x)
    for n in range(5):
        for e in s[n].topk(2).indices.tolist():
            xi = x[n] * s[n, e]
            ref[n] += m.down[e] @ (torch.nn.functional.silu(m.gate[e] @ xi) * (m.up[e] @ xi))
    torch.testing.assert_close(m(x), ref, atol=1e-12, rtol=0)


def test_layer_kv_heads():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_ff=32, norm=NormSpec(),
                      layer_kv_heads=(2, 4))  # fmt: skip
    lm = TransformerLM(cfg)
    assert [b.attn.n_kv_heads for b in lm.blocks()] == [2, 4]
    assert lm(torch.randint(0, 32, (1, 5))).shape == (1, 5, 32)


# validation


@pytest.mark.parametrize(
    ("make", "err", "match"),
    [
        (lambda: Alibi(()), TypeError, "slopes"),
        (lambda: Alibi((0.5, float("nan"))), ValueError, "finite"),
        (lambda: Alibi((0.5, True)), ValueError, "slopes holds True"),
        (lambda: geometric_slopes(0), ValueError, "n_heads=0"),
        (lambda: Attention(16, 4, alibi=Alibi((1.0, 0.5))), ValueError, "2 slopes for n_heads=4"),
        (lambda: Attention(16, 4, alibi=(1.0,) * 4), TypeError, "alibi="),
        (lambda: ModelConfig(n_heads=4, alibi=Alibi((1.0,))), ValueError, "1 slopes for n_heads=4"),
        (lambda: Attention(16, 4, v_norm="rms"), TypeError, "v_norm='rms'"),
        (lambda: Attention(16, 4, v_norm=QKNormConfig(order=RopeOrder.AFTER_ROPE)), ValueError, "V is not rotated"),
        (lambda: ModelConfig(v_norm=NormSpec()), TypeError, "v_norm="),
        (lambda: MoEConfig(4, 2, 8, weight_input=1), TypeError, "weight_input=1"),
        (lambda: MoEConfig(4, 2, 8, weight_input=True, routed_scale=2.0), ValueError, "routed_scale=2.0"),
        (lambda: ModelConfig(n_heads=4, layer_kv_heads=(3, 4), norm=NormSpec()), ValueError, "layer_kv_heads holds 3"),
        (lambda: ModelConfig(n_heads=4, layer_kv_heads=(2,), norm=NormSpec()), ValueError, "has 1 entries"),
        (lambda: ModelConfig(n_heads=4, layer_kv_heads=[2, 2], norm=NormSpec()), TypeError, "layer_kv_heads="),
    ],
)
def test_validation(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_v_norm_flat_scope_runs():
    a = Attention(16, 4, 2, v_norm=QKNormConfig(scope=QKScope.FLAT, gain=QKGain.PER_HEAD))
    assert a.v_norm is not None and tuple(a.v_norm.weight.shape) == (8,)
    assert a(torch.randn(1, 3, 16), None, _causal(3)).shape == (1, 3, 16)
