"""Round trip: what ``normatlas.blocks`` writes, ``normatlas.inspect`` reads back (issue 19).

Every blocks placement preset and schedule, built tiny as a ``TransformerLM`` with RMSNorm and with
LayerNorm, with and without a final norm, and with QK-norm before / after RoPE (per head) or over the
flattened heads, is inspected from its recorded dataflow and must read back as its own design, field by
field. The expectations below are written from each preset's own semantics (its docstring drawing and its
``Placement`` fields), in the report's vocabulary; they are never copied from the inspector's output.

Sizes: d_model 32, 2 layers, 2 heads, vocab 64, 6 tokens (a shrunk Llama-style decoder; the schedules vary
between the two layers). ``probe=False``: the design is read from the dataflow alone (the module probe that
cross-checks operators is tested in test_inspect_probe.py), which also keeps the matrix fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import normatlas
from normatlas import blocks
from normatlas.blocks import ModelConfig, QKGain, QKNormConfig, QKScope, TransformerLM
from normatlas.inspect import InspectionReport, inspect
from normatlas.vocabulary import (
    Operator,
    QKNormKind,
    RopeOrder,
    SiteRole,
    SublayerKind,
    branch_scale_word,
    residual_scale_word,
)
from normatlas.vocabulary import PlacementKind as Placement

L, D, H, V, T = 2, 32, 2, 64, 6

PRE, POST, PERI, RES_POST = Placement.PRE, Placement.POST, Placement.PERI, Placement.RES_POST
NONE, PAR = Placement.NONE, Placement.PARALLEL


@dataclass(frozen=True)
class Expect:
    """One preset's design in the report's vocabulary.

    ``layers``: per layer, (attention placement, FFN placement), or ``(PARALLEL,)`` for one shared add.
    ``qkv``: per layer, True when the block itself normalizes q, k and v over the head dim (HybridNorm).
    """

    build: Callable[[int], blocks.Placement | blocks.Schedule]
    layers: tuple[tuple[Placement, ...], ...]
    qkv: tuple[bool, ...] = (False, False)
    residual_scale: str | None = None
    branch_scale: str | None = None
    depth_scaling: str | None = None

    @property
    def has_block_norms(self) -> bool:
        return any(p is not NONE for lay in self.layers for p in lay)


def _alpha(n: int) -> str:  # DeepNet Table 1, decoder-only: alpha = (2M)^(1/4)
    return f"{(2 * n) ** 0.25:.6g}"


# preset -> its design (the preset's docstring drawing, per sublayer; L = 2 layers)
EXPECTED: dict[str, Expect] = {
    "post_ln": Expect(lambda n: blocks.post_ln(), ((POST, POST),) * L),
    "pre_ln": Expect(lambda n: blocks.pre_ln(), ((PRE, PRE),) * L),
    "sandwich_ln": Expect(lambda n: blocks.sandwich_ln(), ((PERI, PERI),) * L),
    "peri_ln": Expect(lambda n: blocks.peri_ln(), ((PERI, PERI),) * L),
    "res_post_norm": Expect(lambda n: blocks.res_post_norm(), ((RES_POST, RES_POST),) * L),
    "reordered_norm": Expect(lambda n: blocks.reordered_norm(), ((RES_POST, RES_POST),) * L),
    "parallel": Expect(lambda n: blocks.parallel(), ((PAR,),) * L),
    "parallel_unshared": Expect(lambda n: blocks.parallel(shared_pre_norm=False), ((PAR,),) * L),
    "layernorm_scaling": Expect(lambda n: blocks.layernorm_scaling(), ((PRE, PRE),) * L, depth_scaling="1/sqrt(layer)"),
    "depth_scaled_sandwich": Expect(lambda n: blocks.depth_scaled_sandwich(), ((PERI, PERI),) * L),
    "deepnorm": Expect(lambda n: blocks.deepnorm(n), ((POST, POST),) * L, residual_scale=_alpha(L)),
    "mix_ln": Expect(lambda n: blocks.mix_ln(n, post_ln_layers=1), ((POST, POST), (PRE, PRE))),
    "hybridnorm": Expect(lambda n: blocks.hybridnorm(), ((NONE, POST),) * L, qkv=(True, True)),
    "hybridnorm_star": Expect(lambda n: blocks.hybridnorm_star(n), ((PRE, PRE), (NONE, POST)), qkv=(False, True)),
    "rezero": Expect(lambda n: blocks.rezero(), ((NONE, NONE),) * L, branch_scale="learned scalar"),
    "skipinit": Expect(lambda n: blocks.skipinit(), ((NONE, NONE),) * L, branch_scale="learned scalar"),
    "layerscale": Expect(lambda n: blocks.layerscale(), ((PRE, PRE),) * L, branch_scale="per-channel"),
    "norm_free": Expect(lambda n: blocks.norm_free(), ((NONE, NONE),) * L),
    "scaled_residual": Expect(lambda n: blocks.scaled_residual(0.5), ((PRE, PRE),) * L, branch_scale="0.5"),
}

# norm name -> (factory, operator it must read as, its eps: RMSNorm's eps=None is float32's machine eps)
NORMS: dict[str, tuple[Callable[[int], torch.nn.Module], Operator, float]] = {
    "rmsnorm": (normatlas.RMSNorm, Operator.RMSNORM, torch.finfo(torch.float32).eps),
    "layernorm": (normatlas.LayerNorm, Operator.LAYERNORM, 1e-5),
}

# QK-norm config -> (config, kind, RoPE order); its eps (1e-6) differs from the block norms' on purpose
QK: dict[str, tuple[QKNormConfig | None, QKNormKind, RopeOrder]] = {
    "none": (None, QKNormKind.NONE, RopeOrder.NOT_APPLICABLE),
    "before-rope": (QKNormConfig(), QKNormKind.PER_HEAD, RopeOrder.BEFORE_ROPE),
    "after-rope": (QKNormConfig(order=RopeOrder.AFTER_ROPE), QKNormKind.PER_HEAD, RopeOrder.AFTER_ROPE),
    "flat": (QKNormConfig(scope=QKScope.FLAT, gain=QKGain.PER_HEAD), QKNormKind.FLATTENED, RopeOrder.BEFORE_ROPE),
}
QK_EPS = 1e-6

# Presets the inspector cannot read back yet: (preset, norm, qk, final) -> the exact misread. Empty: all pass.
_AMBIGUOUS = (
    "reads ['pre/pre', 'none/none'] + a final norm: with no final norm, the last FFN's Post-Norm is the only norm on "
    "the last stream value and the one earlier FFN (Pre-Norm) has none to compare, so the dataflow is identical to "
    "an unnormed last FFN followed by a final norm (needs 3+ layers, or a final norm, to tell)"
)
MISREADS: dict[tuple[str, str, str, bool], str] = {
    ("hybridnorm_star", "rmsnorm", "none", False): _AMBIGUOUS,
    ("hybridnorm_star", "layernorm", "none", False): _AMBIGUOUS,
}


def _model(preset: str, norm: str, qk: str, final: bool) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_ff=2 * D, norm=NORMS[norm][0],
        placement=EXPECTED[preset].build(L), qk_norm=QK[qk][0], final_norm=final,
    )  # fmt: skip
    return TransformerLM(cfg)


def _check(preset: str, norm: str, qk: str, final: bool) -> None:
    exp = EXPECTED[preset]
    _, op, eps = NORMS[norm]
    qk_cfg, qk_kind, qk_rope = QK[qk]
    torch.manual_seed(0)
    r: InspectionReport = inspect(_model(preset, norm, qk, final), torch.randint(0, V, (1, T)), probe=False)

    # placement, per sublayer and per layer, then the summary fields
    assert r.layers == L
    assert r.placement_by_layer == tuple(tuple(lay) for lay in exp.layers)
    kinds = [
        (SublayerKind.PARALLEL,) if len(lay) == 1 else (SublayerKind.ATTENTION, SublayerKind.MLP) for lay in exp.layers
    ]
    want_subs = [
        (i, k, p)
        for i, (ks, lay) in enumerate(zip(kinds, exp.layers, strict=True))
        for k, p in zip(ks, lay, strict=True)
    ]
    assert [(s.layer, s.kind, s.placement) for s in r.sublayers] == want_subs
    flat = {p for lay in exp.layers for p in lay}
    assert r.placement == (flat.pop() if len(flat) == 1 else Placement.MIX)
    # operator and eps over the block norms and the final norm (QK / V norms are reported apart)
    has_main = exp.has_block_norms or final
    assert r.operator == (op if has_main else Operator.NONE)
    assert r.eps == (pytest.approx(eps) if has_main else None)
    assert r.final_norm == (op if final else Operator.NONE)
    assert r.embedding_norm == Operator.NONE
    # scalings
    assert residual_scale_word(r.residual_scale) == exp.residual_scale
    assert branch_scale_word(r.branch_scale) == exp.branch_scale
    assert (r.depth_scaling.value if r.depth_scaling else None) == exp.depth_scaling
    # QK-norm per layer: the config wins over HybridNorm's own q/k norms; V is normed only by HybridNorm
    per_layer = [qk_kind if qk_cfg is not None else QKNormKind.PER_HEAD if qkv else QKNormKind.NONE for qkv in exp.qkv]
    assert [a.qk_norm for a in r.attention] == per_layer
    normed = [k for k in per_layer if k is not QKNormKind.NONE]
    assert r.qk_norm == (per_layer[0] if len(set(per_layer)) == 1 else QKNormKind.MIXED)  # MIXED: differs by layer
    rope = qk_rope if qk_cfg is not None else RopeOrder.BEFORE_ROPE  # HybridNorm: A(N(xWq), N(xWk), N(xWv))
    assert r.qk_norm_rope == (rope if normed else RopeOrder.NOT_APPLICABLE)
    assert [a.v_norm for a in r.attention] == list(exp.qkv)
    assert r.v_norm == any(exp.qkv)
    # the QK / V norms themselves: operator and eps of what wrote them
    qk_sites = [(n.layer, n.operator, n.eps) for n in r.norms if n.role is SiteRole.QK]
    qk_op = qk_cfg.operator if qk_cfg is not None else op  # QK-norm speaks the one Operator vocabulary
    want_qk = [
        (i, qk_op, QK_EPS if qk_cfg is not None else eps) for i, k in enumerate(per_layer) if k is not QKNormKind.NONE
    ]
    assert [(lay, o) for lay, o, _ in qk_sites] == [(lay, o) for lay, o, _ in want_qk for _ in (0, 1)]
    assert [e for _, _, e in qk_sites] == pytest.approx([e for _, _, e in want_qk for _ in (0, 1)])
    v_sites = [(n.layer, n.operator) for n in r.norms if n.role is SiteRole.V]
    assert v_sites == [(i, op) for i, qkv in enumerate(exp.qkv) if qkv]
    assert {n.role for n in r.norms} <= {
        SiteRole.PRE,
        SiteRole.OUT,
        SiteRole.POST,
        SiteRole.FINAL,
        SiteRole.QK,
        SiteRole.V,
    }


def _case(preset: str, norm: str, qk: str, final: bool) -> object:
    reason = MISREADS.get((preset, norm, qk, final))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(
        preset, norm, qk, final, marks=marks, id=f"{preset}-{norm}-qk_{qk}-{'final' if final else 'nofinal'}"
    )


# every preset x operator x final norm on/off (no QK-norm) ...
CASES = [_case(p, n, "none", f) for p in EXPECTED for n in NORMS for f in (True, False)]
# ... every preset with a per-head QK-norm before and after RoPE (both operators covered, final norm on) ...
CASES += [
    _case(p, n, qk, True) for p in EXPECTED for n, qk in (("rmsnorm", "before-rope"), ("layernorm", "after-rope"))
]
# ... and the flattened (OLMo 2) QK-norm on the schemes that ship or name it
CASES += [_case(p, "rmsnorm", "flat", True) for p in ("pre_ln", "reordered_norm", "hybridnorm", "post_ln")]


@pytest.mark.parametrize(("preset", "norm", "qk", "final"), CASES)
def test_round_trip(preset: str, norm: str, qk: str, final: bool) -> None:
    _check(preset, norm, qk, final)


def test_table_covers_every_preset() -> None:
    """A preset added to blocks without a row here fails (the table, not the inspector, is the spec)."""
    named = set(blocks.PRESETS) | {"deepnorm", "scaled_residual", "mix_ln", "hybridnorm_star"}
    assert named <= set(EXPECTED)


def _plans(design: blocks.Placement | blocks.Schedule) -> list[blocks.Placement]:
    return [lp.placement for lp in design.layers] if isinstance(design, blocks.Schedule) else [design] * L


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_table_is_the_presets_own_vocabulary(preset: str) -> None:
    """The writer speaks the reader's words: each preset's ``Placement.kinds`` is the row above, so what the
    inspector reads back is compared with the design the blocks declare, not with a copy of it."""
    exp = EXPECTED[preset]
    plans = _plans(exp.build(L))
    assert tuple(p.kinds for p in plans) == exp.layers
    assert tuple(p.qkv_norm for p in plans) == exp.qkv
    kinds = {k for p in plans for k in p.kinds}
    assert {p.kind for p in plans} <= kinds | {Placement.MIX}


@pytest.mark.parametrize("qk", sorted(k for k in QK if k != "none"))
def test_qk_configs_declare_the_kind_read_back(qk: str) -> None:
    cfg, kind, rope = QK[qk]
    assert cfg is not None and cfg.kind is kind and cfg.order is rope


def test_qk_gain_per_head_reads_back_as_per_head_gains() -> None:
    """One gain per head (Chameleon's ``LayerNorm((heads, head_dim))``) is told from one shared gain (Qwen 3)."""
    cfg = QKNormConfig(gain=QKGain.PER_HEAD)
    assert cfg.kind is QKNormKind.PER_HEAD_GAINS
    torch.manual_seed(0)
    model = TransformerLM(
        ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, d_ff=2 * D, norm=normatlas.RMSNorm, qk_norm=cfg)
    )
    r = inspect(model, torch.randint(0, V, (1, T)), probe=False)
    assert r.qk_norm is QKNormKind.PER_HEAD_GAINS and [a.qk_norm for a in r.attention] == [cfg.kind] * L


VIT_PRESETS = ("pre_ln", "post_ln", "peri_ln", "res_post_norm", "layerscale", "layernorm_scaling", "deepnorm")


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("preset", VIT_PRESETS)
def test_vit_encoder_round_trip(preset: str, norm: str) -> None:
    """``ViTEncoder`` (patch conv, class token, positions, blocks, final norm, head) read by ``inspect_vision``."""
    from normatlas.inspect import inspect_vision

    exp = EXPECTED[preset]
    factory, op, eps = NORMS[norm]
    torch.manual_seed(0)
    cfg = blocks.ViTConfig(
        vocab_size=1, d_model=D, n_layers=L, n_heads=H, d_ff=2 * D, norm=factory, placement=exp.build(L),
        image_size=16, patch_size=8,
    )  # fmt: skip
    r = inspect_vision(blocks.ViTEncoder(cfg).eval(), torch.randn(1, 3, 16, 16), probe=False)
    assert r.placement_by_layer == tuple(tuple(lay) for lay in exp.layers)
    assert r.operator is op and r.eps == pytest.approx(eps)
    assert r.final_norm is op and r.tokens == 1 + cfg.n_patches
    depth = r.depth_scaling.value if r.depth_scaling else None
    assert (residual_scale_word(r.residual_scale), branch_scale_word(r.branch_scale), depth) == (
        exp.residual_scale, exp.branch_scale, exp.depth_scaling,
    )  # fmt: skip
