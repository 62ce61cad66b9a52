"""Configuration checks of the block stack: Mix-LN's layer count and the attention head width."""

from __future__ import annotations

import pytest
import torch

from normatlas import RMSNorm
from normatlas.blocks import Attention, Block, mix_ln, pre_ln


def _post_ln_layers(schedule) -> int:
    return sum(p.placement.name == "post_ln" for p in schedule.layers)


# --------------------------------------------------------------------------- Mix-LN: floor(ratio * L) Post-LN layers
@pytest.mark.parametrize(("n_layers", "expected"), [(1, 0), (2, 0), (4, 1), (6, 1), (7, 1), (8, 2), (10, 2), (14, 3),
                                                    (32, 8)])  # fmt: skip
def test_mix_ln_post_ln_layers_are_the_floor_of_ratio_times_depth(n_layers, expected):
    """Li et al. (Mix-LN) put Post-LN on the first floor(alpha * L) layers (their code: ``int(L * ratio)``);
    round() would give 2 for L=6 and 4 for L=14 (banker's rounding of 1.5 and 3.5)."""
    schedule = mix_ln(n_layers)
    assert _post_ln_layers(schedule) == expected
    names = [p.placement.name for p in schedule.layers]
    assert names == ["post_ln"] * expected + ["pre_ln"] * (n_layers - expected)
    assert schedule.name == f"mix_ln(k={expected})"


@pytest.mark.parametrize(("n_layers", "ratio", "expected"), [(5, 0.5, 2), (10, 0.3, 3), (10, 0.7, 7), (3, 1.0, 3),
                                                             (3, 0.0, 0), (10, 1, 10)])  # fmt: skip
def test_mix_ln_ratio_floor(n_layers, ratio, expected):
    assert _post_ln_layers(mix_ln(n_layers, ratio=ratio)) == expected


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"ratio": -1}, ValueError, r"ratio=-1 must lie in \[0, 1\]"),
    ({"ratio": 1.5}, ValueError, r"ratio=1\.5 must lie in \[0, 1\]"),
    ({"ratio": float("nan")}, ValueError, r"ratio=nan must lie in \[0, 1\]"),
    ({"ratio": "0.25"}, TypeError, r"ratio='0\.25' must be a float in \[0, 1\]"),
    ({"ratio": True}, TypeError, r"ratio=True must be a float in \[0, 1\]"),
    ({"post_ln_layers": 2.0}, ValueError, r"post_ln_layers=2\.0 must lie in \[0, n_layers=8\] \(an integer\)"),
    ({"post_ln_layers": -1}, ValueError, r"post_ln_layers=-1 must lie in \[0, n_layers=8\] \(an integer\)"),
    ({"post_ln_layers": True}, ValueError, r"post_ln_layers=True must lie in \[0, n_layers=8\] \(an integer\)"),
])  # fmt: skip
def test_mix_ln_names_the_argument_passed(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        mix_ln(8, **kwargs)
    if "ratio" in kwargs:
        assert "post_ln_layers" not in str(info.value)  # not a value the user never gave


# --------------------------------------------------------------------------- head width
def test_block_rejects_n_heads_that_do_not_divide_d_model():
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by n_heads=4; pass head_dim"):
        Block(30, pre_ln(), RMSNorm, layer=0, n_layers=1, n_heads=4, d_ff=16)
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by n_heads=4; pass head_dim"):
        Attention(30, 4)


def test_block_with_explicit_head_dim_keeps_it():
    block = Block(30, pre_ln(), RMSNorm, layer=0, n_layers=1, n_heads=4, head_dim=8, d_ff=16)
    assert block.attn.head_dim == 8 and block.attn.q_proj.out_features == 32
    x = torch.randn(1, 3, 30, generator=torch.Generator().manual_seed(0))
    assert block(x).shape == (1, 3, 30)
    assert Block(32, pre_ln(), RMSNorm, layer=0, n_layers=1, n_heads=4, d_ff=16).attn.head_dim == 8


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_heads": 0}, r"n_heads=0 must be an integer >= 1"),
    ({"n_heads": 2.0}, r"n_heads=2\.0 must be an integer >= 1"),
    ({"n_heads": 4, "head_dim": 0}, r"head_dim=0 must be an integer >= 1"),
])  # fmt: skip
def test_attention_sizes_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Attention(32, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer": 5, "n_layers": 2}, r"layer=5 must be an integer in \[0, n_layers\) = \[0, 2\)"),
        ({"layer": -1, "n_layers": 2}, r"layer=-1 must be an integer in \[0, n_layers\)"),
        ({"layer": 2, "n_layers": 2}, r"layer=2 must be an integer in \[0, n_layers\)"),
        ({"layer": 0, "n_layers": 0}, r"n_layers=0 must be an integer >= 1"),
        ({"layer": 0, "n_layers": 1, "d_ff": 0}, r"d_ff=0 must be an integer >= 1"),
    ],
)
def test_block_refuses_a_layer_outside_its_depth(kwargs, message):
    """``Block(layer=5, n_layers=2)`` was accepted (and gave depth-scaled schemes a factor for a layer that
    does not exist)."""
    args = {"n_heads": 4, "d_ff": 16} | kwargs
    with pytest.raises(ValueError, match=message):
        Block(32, pre_ln(), RMSNorm, **args)


# --------------------------------------------------------------------------- QK-norm speaks the core's Operator
def test_qk_norm_takes_the_operators_of_the_design_vocabulary():
    """QKNormConfig.operator is a normatlas.Operator: the three a QK-norm computes build their spec; another
    Operator is a ValueError naming the parameter, the value and the allowed ones; a string a TypeError."""
    from normatlas.blocks import QK_OPERATORS, QKNorm, QKNormConfig
    from normatlas.spec import EpsPlacement, Scale
    from normatlas.vocabulary import Operator

    assert QK_OPERATORS == (Operator.RMSNORM, Operator.L2, Operator.LAYERNORM)
    specs = {op: QKNormConfig(operator=op).spec() for op in QK_OPERATORS}
    assert [(s.center, s.scale) for s in specs.values()] == [(False, Scale.RMS), (False, Scale.L2), (True, Scale.RMS)]
    assert specs[Operator.L2].eps_placement is EpsPlacement.CLAMP
    assert QKNormConfig().operator is Operator.RMSNORM
    assert repr(QKNorm(QKNormConfig(Operator.LAYERNORM, bias=True), 2, 4)).startswith("QKNorm(layernorm, scope=head")
    for op in set(Operator) - set(QK_OPERATORS):
        with pytest.raises(ValueError, match=rf"operator={op!r} is not a QK-norm operator; allowed: Operator\.RMSNORM, "
                                             r"Operator\.L2, Operator\.LAYERNORM"):  # fmt: skip
            QKNormConfig(operator=op)
    with pytest.raises(
        TypeError, match=r"operator='rms' must be one of Operator\.RMSNORM, Operator\.L2, Operator\.LAYERNORM"
    ):
        QKNormConfig(operator="rms")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bias=True is a LayerNorm option; operator='rmsnorm'"):
        QKNormConfig(bias=True)


def test_qk_operator_is_a_deprecated_alias_of_operator():
    """``QKOperator`` (still imported by old code) warns and names the same Operator members."""
    import normatlas.blocks as blocks
    from normatlas.blocks import QKNormConfig
    from normatlas.vocabulary import Operator

    assert "QKOperator" not in blocks.__all__
    with pytest.warns(DeprecationWarning, match=r"QKOperator is deprecated: .*QKOperator\.RMS is Operator\.RMSNORM"):
        from normatlas.blocks import QKOperator
    assert (QKOperator.RMS, QKOperator.L2, QKOperator.LAYERNORM) == (Operator.RMSNORM, Operator.L2, Operator.LAYERNORM)
    assert QKNormConfig(operator=QKOperator.LAYERNORM) == QKNormConfig(operator=Operator.LAYERNORM)
    with pytest.raises(AttributeError, match="QKOperators"):
        blocks.QKOperators  # noqa: B018
