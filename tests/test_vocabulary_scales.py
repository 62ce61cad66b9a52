"""The typed scale fields of the inspection reports and their spellings at the JSON edge."""

from __future__ import annotations

import math

import pytest

from normatlas.vocabulary import (
    BranchScale,
    BranchScaling,
    DepthScaling,
    PlacementKind,
    layer_placement_words,
    residual_scale_word,
)


def test_residual_scale_word() -> None:
    assert residual_scale_word(BranchScale()) is None
    assert residual_scale_word(BranchScale.of([2.0])) == "2"
    assert residual_scale_word(BranchScale.of([1 / 3])) == "0.333333"
    both = BranchScale.of([0.5, BranchScaling.LEARNED_SCALAR])
    assert residual_scale_word(both) == "0.5, learned scalar (learned)"


def test_depth_scaling_inverse_sqrt_and_varies() -> None:
    lns = DepthScaling(tuple((k, 1 / math.sqrt(k + 1)) for k in range(4)))
    assert lns.inverse_sqrt and lns.value == "1/sqrt(layer)" and str(lns) == "1/sqrt(layer)"
    off = DepthScaling(((0, 1.0), (1, 0.5), (2, 0.25)))
    assert not off.inverse_sqrt and off.value == "varies: 1, 0.5, 0.25"
    # 1/sqrt(layer + 1) read from layer 1 on (layer 0 missing) is not LayerNorm Scaling's profile
    shifted = DepthScaling(tuple((k, 1 / math.sqrt(k)) for k in range(1, 4)))
    assert not shifted.inverse_sqrt


@pytest.mark.parametrize("bad", [(), ((0, 1.0),), ((0, 1),), (("0", 1.0), (1, 0.5)), [(0, 1.0), (1, 0.5)]])
def test_depth_scaling_refuses_bad_input(bad: object) -> None:
    with pytest.raises(TypeError, match=r"per_layer=.* must be two or more"):
        DepthScaling(bad)  # type: ignore[arg-type]


def test_layer_placement_words() -> None:
    layers = ((PlacementKind.PRE, PlacementKind.PRE), (PlacementKind.POST,))
    assert layer_placement_words(layers) == ["pre/pre", "post"]
    assert layer_placement_words(()) == []
