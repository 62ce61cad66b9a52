"""Positions the port reads by behaviour: learned tables read from an offset or counted over the mask / the non-pad
ids (OPT, BioGPT, RoBERTa), scaled RoPE as measured inverse frequencies and attention factor (linear, YaRN, Llama 3,
LongRoPE, CWM, Ministral 3), RoPE from a precomputed sinusoid buffer (GPT-J, CodeGen), NanoChat's reversed rotation;
and the refusals that name their feature (dynamic NTK, CTRL's fixed sinusoids).

Each model type is built tiny from its own config's defaults (``normatlas.factory``: 2 layers, width 64), its
weights randomised, and ported: the same fp32 logits as transformers (<= 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normatlas.blocks import ModelConfig, Rope, RopeStyle, rope_tables  # noqa: E402
from normatlas.blocks.positions import PositionIds, position_rows  # noqa: E402
from normatlas.port import PortError, port  # noqa: E402
from normatlas.spec import NormSpec  # noqa: E402

from .tiny_hf import randomise_, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
TOL = 1e-5


def _build(model_type: str) -> torch.nn.Module:
    from normatlas.factory import build_target

    torch.manual_seed(0)
    model, _, _ = build_target(model_type)
    return randomise_(model.float().eval(), 0.05, generator=torch.Generator().manual_seed(1))


# model type -> what the port must read (position offset, counting rule; or the RoPE fields that matter)
TYPES = {
    "opt": dict(position_offset=2, position_ids=PositionIds.FROM_MASK),
    "biogpt": dict(position_offset=2, position_ids=PositionIds.ARANGE),
    "roberta": dict(position_offset=2, position_ids=PositionIds.FROM_PADDING),
    "xlm-roberta": dict(position_offset=2, position_ids=PositionIds.FROM_PADDING),
    "roberta-prelayernorm": dict(position_offset=2, position_ids=PositionIds.FROM_PADDING),
    "cwm": dict(scaled=True),
    "ministral3": dict(scaled=True),
    "gptj": dict(style=RopeStyle.INTERLEAVED),
    "codegen": dict(style=RopeStyle.INTERLEAVED),
    "nanochat": dict(clockwise=True),
}


@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_model_type_ports_with_the_same_logits(model_type):
    torch.set_num_threads(1)
    hf = _build(model_type)
    p, _ = port(hf)
    assert p.max_abs_diff is not None and p.max_abs_diff <= TOL
    want, cfg = TYPES[model_type], p.config
    for key in ("position_offset", "position_ids"):
        if key in want:
            assert getattr(cfg, key) == want[key]
    if "scaled" in want:
        assert cfg.rope is not None and cfg.rope.inv_freq is not None
    if "style" in want:
        assert cfg.rope is not None and cfg.rope.style is want["style"]
    if "clockwise" in want:
        assert cfg.rope is not None and cfg.rope.clockwise


def _llama(**rope: object) -> torch.nn.Module:
    hf = tiny_model("llama", seed=0, width=64, vocab_size=97, max_position_embeddings=64, pad_token_id=0,
                    attn_implementation="eager", rope_parameters=dict(rope, rope_theta=10000.0))  # fmt: skip
    return randomise_(hf.float(), 0.1, generator=torch.Generator().manual_seed(2))


SCALED = {  # Llama with each static rope_type (head_dim 16: 8 rotated pairs)
    "linear": dict(rope_type="linear", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "longrope": dict(rope_type="longrope", factor=4.0, original_max_position_embeddings=16,
                     short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.3 * i for i in range(8)]),
}  # fmt: skip


@pytest.mark.parametrize("rope_type", sorted(SCALED))
def test_llama_scaled_rope_ports_exactly(rope_type):
    torch.set_num_threads(1)
    hf = _llama(**SCALED[rope_type])
    p, ours = port(hf)
    assert p.max_abs_diff is not None and p.max_abs_diff <= TOL
    rope = p.config.rope
    assert rope is not None and rope.inv_freq is not None
    if rope_type in ("yarn", "longrope"):  # cos and sin scaled by the attention factor
        assert rope.attention_factor > 1.0
    if rope_type == "longrope":
        assert rope.long_after == 16 and rope.long_inv_freq is not None
        ids = torch.randint(3, 97, (1, 24), generator=torch.Generator().manual_seed(3))  # past 16: the long profile
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, rtol=0, atol=TOL)


def test_dynamic_ntk_is_refused_by_name():
    with pytest.raises(PortError, match="dynamic NTK"):
        port(_llama(rope_type="dynamic", factor=2.0))


def test_ctrl_fixed_sinusoids_are_refused_by_name():
    torch.set_num_threads(1)
    with pytest.raises(PortError, match="fixed absolute positions"):
        port(_build("ctrl"))


@pytest.mark.parametrize("model_type", ["roberta", "opt"])
def test_padded_batch_gives_the_same_logits(model_type):
    """Pad ids (RoBERTa counts only the others) and a mask dropping the first tokens (OPT counts the mask's)."""
    torch.set_num_threads(1)
    hf = _build(model_type)
    p, ours = port(hf)
    pad = p.config.pad_token_id
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :3] = pad
    mask[0, :3] = 0
    mask[1, :2] = 0
    keep = mask.bool()
    with torch.no_grad():
        ref, got = hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask)
    torch.testing.assert_close(got[keep], ref[keep], rtol=0, atol=TOL)  # rows of masked queries are arbitrary


def test_position_rows_follow_each_rule():
    ids = torch.tensor([[1, 1, 5, 6], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    assert position_rows(PositionIds.ARANGE, 2, ids).tolist() == [[2, 3, 4, 5]]
    assert position_rows(PositionIds.FROM_PADDING, 2, ids, pad_token_id=1).tolist() == [[1, 1, 2, 3], [2, 3, 4, 5]]
    assert position_rows(PositionIds.FROM_MASK, 2, ids, mask).tolist() == [[2, 3, 4, 5], [1, 2, 3, 4]]


def _reference(rope: Rope, head_dim: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin in float64 from the definition, pair by pair (independent of rope_tables)."""
    d = int(head_dim * rope.fraction)
    long = rope.long_inv_freq is not None and rope.long_after is not None and t > rope.long_after
    f = rope.long_inv_freq if long else rope.inv_freq or tuple(rope.theta ** (-2 * i / d) for i in range(d // 2))
    sign = -1.0 if rope.clockwise else 1.0
    cos, sin = torch.zeros(t, d, dtype=torch.float64), torch.zeros(t, d, dtype=torch.float64)
    for p in range(t):
        for i, fi in enumerate(f):
            cols = (i, i + d // 2) if rope.style is RopeStyle.HALF else (2 * i, 2 * i + 1)
            for c in cols:
                cos[p, c] = rope.attention_factor * math.cos(p * fi)
                sin[p, c] = sign * rope.attention_factor * math.sin(p * fi)
    return cos, sin


@pytest.mark.parametrize(
    "rope",
    [
        Rope(inv_freq=(1.0, 0.3, 0.07, 0.002), attention_factor=1.2),
        Rope(style=RopeStyle.INTERLEAVED, fraction=0.5, inv_freq=(0.5, 0.01), clockwise=True),
        Rope(inv_freq=(1.0, 0.3, 0.07, 0.002), long_inv_freq=(0.5, 0.1, 0.02, 0.0005), long_after=5),
        Rope(theta=500.0, attention_factor=0.9),
        Rope(inv_freq=(1.0, 0.18, 0.0, 0.0)),  # zero frequencies: pairs that never turn (Gemma 4's proportional RoPE)
    ],
)
@pytest.mark.parametrize("t", [4, 11])
def test_scaled_rope_tables_match_a_float64_reference(rope, t):
    head_dim = 8
    cos, sin = rope_tables(rope, head_dim, torch.arange(t), torch.float64)
    ref_cos, ref_sin = _reference(rope, head_dim, t)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-12, atol=1e-12)


def _cfg(**fields: object) -> ModelConfig:
    return ModelConfig(norm=NormSpec(), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Rope(inv_freq=(1.0, -0.5)), ValueError, r"inv_freq holds -0.5"),
        (lambda: Rope(inv_freq=[1.0, 0.5]), TypeError, r"inv_freq=\[1.0, 0.5\] must be a non-empty tuple"),
        (lambda: Rope(attention_factor=0.0), ValueError, r"attention_factor=0.0 must be a finite float > 0"),
        (lambda: Rope(long_inv_freq=(1.0,)), ValueError, r"long_inv_freq and long_after=None go together"),
        (lambda: Rope(inv_freq=(1.0,), long_inv_freq=(1.0, 2.0), long_after=4), ValueError, r"one per rotated pair"),
        (lambda: Rope(long_inv_freq=(1.0,), long_after=0), ValueError, r"long_after=0 must be an integer >= 1"),
        (lambda: Rope(clockwise="yes"), TypeError, r"clockwise='yes' must be a bool"),
        (lambda: _cfg(head_dim=16, rope=Rope(inv_freq=(1.0, 0.5, 0.25))), ValueError, r"rotates 8 pairs"),
        (lambda: _cfg(position_offset=-1, max_positions=8), ValueError, r"position_offset=-1 must be"),
        (lambda: _cfg(position_offset=2), ValueError, r"position_offset=2 needs a learned position table"),
        (lambda: _cfg(position_ids="arange", max_positions=8), TypeError, r"position_ids='arange' must be"),
        (lambda: _cfg(position_ids=PositionIds.FROM_MASK, max_positions=8), ValueError,
         r"position_offset=0 must be >= 1"),
        (lambda: _cfg(position_ids=PositionIds.FROM_PADDING, max_positions=8, position_offset=2), ValueError,
         r"FROM_PADDING counts the tokens that are not pad_token_id"),
    ],
)  # fmt: skip
def test_validation_names_the_parameter(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_zero_frequency_pair_is_left_as_it_is():
    """A pair whose frequency is 0 is the identity at every position: its cos is 1, its sin 0."""
    cos, sin = rope_tables(Rope(inv_freq=(1.0, 0.0)), 4, torch.arange(7), torch.float64)
    torch.testing.assert_close(cos[:, [1, 3]], torch.ones(7, 2, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(sin[:, [1, 3]], torch.zeros(7, 2, dtype=torch.float64), rtol=0, atol=0)
