"""``inspect --vision`` on towers read alone: towers that need more than pixel values, staged and channels-first
towers, a patch-sequence tower, and a norm right before the first pre-norm (Pixtral's ``ln_pre``).

Each transformers tower is built tiny offline and checked against its modeling file (transformers 5.24,
models/<name>/modeling_<name>.py); the toy towers' designs are known by construction.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from normatlas.vocabulary import Operator, PlacementKind
from tests.test_inspect_vlm import Block, D, P  # the toy VLMs' width, patch size and Pre-norm block


class CastRMSNorm(nn.Module):
    """Pixtral's RMSNorm (modeling_pixtral.py PixtralRMSNorm): ``x.to(float32)``, scaled by rsqrt(mean(x^2) + eps),
    ``weight * x.to(input dtype)``. In a float32 run both casts return their input tensor itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.weight * x.to(dtype)


class PreNormedTower(nn.Module):
    """A patch embedding, optionally a norm on it right before the first of 2 Pre-norm blocks (Pixtral's ln_pre)."""

    def __init__(self, ln_pre: bool) -> None:
        super().__init__()
        self.patch, self.ln_pre = nn.Linear(P, D), CastRMSNorm() if ln_pre else nn.Identity()
        self.blocks = nn.ModuleList([Block(CastRMSNorm()) for _ in range(2)])

    def forward(self, pixel_values: Tensor) -> Tensor:
        x = self.ln_pre(self.patch(pixel_values))
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("ln_pre", [True, False])
def test_a_norm_right_before_the_first_pre_norm_is_the_embedding_norm(ln_pre: bool) -> None:
    """The first pre-norm's ``x.to(float32)`` is a no-op that returns ``x`` itself: it used to be read as the
    previous norm's cast after its gain, so that norm's output became the next norm's input cast and it was
    neither on the embeddings nor anywhere (embedding norm ``none``). Read by dataflow, the affine walk stops
    before another norm's input cast: ln_pre is the embedding norm, with the same cast order as the block norms."""
    from normatlas.inspect import inspect_vision

    torch.manual_seed(0)
    rep = inspect_vision(PreNormedTower(ln_pre).eval(), torch.randn(1, 16, P))
    assert rep.embedding_norm is (Operator.RMSNORM if ln_pre else Operator.NONE)
    assert (rep.operator, rep.placement, rep.layers) == (Operator.RMSNORM, PlacementKind.PRE, 2)
    assert {n.cast_order.value for n in rep.norms if n.cast_order} == {"before_gain"}
    assert len(rep.norms) == 2 + ln_pre and not [n for n in rep.norms if n.role.value == "other"]


def test_pixtral_tower_reads_its_ln_pre() -> None:
    from normatlas.inspect import inspect_vision_target

    rep = inspect_vision_target("pixtral", probe=False)
    assert (rep.operator, rep.placement, rep.embedding_norm, rep.final_norm) == (
        Operator.RMSNORM, PlacementKind.PRE, Operator.RMSNORM, Operator.NONE,
    )  # fmt: skip


def test_vision_of_a_tower_that_needs_more_than_pixel_values() -> None:
    """Qwen2.5-VL's tower reads flattened patches and their grid: run whole, its tower part reported."""
    from normatlas.inspect import inspect_vision_target

    rep = inspect_vision_target("qwen2_5_vl", probe=False)
    assert (rep.operator, rep.placement, rep.merger_norm) == (Operator.RMSNORM, PlacementKind.PRE, Operator.RMSNORM)
    assert rep.model == "qwen2_5_vl"


@pytest.mark.parametrize(
    ("model_type", "placement"),
    [("swinv2", PlacementKind.RES_POST), ("swin", PlacementKind.PRE)],  # modeling_swinv2.py: x + LN(attn(x))
)
def test_vision_of_a_staged_tower(model_type: str, placement: PlacementKind) -> None:
    """Swin's per-stage depths / heads lists are kept whole (shrinking the stage count broke them: IndexError)."""
    from normatlas.inspect import inspect_vision_target

    rep = inspect_vision_target(model_type, probe=False)
    assert (rep.operator, rep.placement, rep.embedding_norm) == (Operator.LAYERNORM, placement, Operator.LAYERNORM)


def test_vision_of_convnext_reads_its_channels_first_stream() -> None:
    """ConvNeXt adds on (B, C, H, W) and normalises NHWC views after a depthwise conv (modeling_convnext.py):
    it used to fail to run (a stage list cut); now its stream is found and the norm inside the branch, after
    the depthwise conv, reads as neither pre nor post (placement ``none``), with the stem's LayerNorm."""
    from normatlas.inspect import inspect_vision_target

    rep = inspect_vision_target("convnext", probe=False)
    assert rep.embedding_norm is Operator.LAYERNORM and rep.placement is PlacementKind.NONE
    assert rep.sublayers and {n.operator for n in rep.norms} == {Operator.LAYERNORM}


def test_vision_of_a_patch_sequence_tower() -> None:
    """SigLIP 2 reads flattened patches, a mask and each image's grid (modeling_siglip2.py): it runs and reads as
    Pre-LN with a final LayerNorm and the pooling head's."""
    from normatlas.inspect import inspect_vision_target

    rep = inspect_vision_target("siglip2_vision_model", probe=False)
    assert (rep.operator, rep.placement, rep.final_norm, rep.head_norm) == (
        Operator.LAYERNORM, PlacementKind.PRE, Operator.LAYERNORM, Operator.LAYERNORM,
    )  # fmt: skip
    assert rep.tokens == 16
