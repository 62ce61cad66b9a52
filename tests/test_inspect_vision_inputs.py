"""inspect_vision on towers that read more than one (B, C, H, W) image: the layout :func:`tower_inputs` builds from
the config and the forward signature, and the design read on it, each checked against transformers' modeling file
(models/<name>/modeling_<name>.py) and built tiny offline.

Patch-grid towers (``grid_thw``): HunYuan-VL's blocks are ``layer_norm1`` / ``layer_norm2`` nn.LayerNorm before
attention and MLP, its merger starts with ``before_rms`` (an RMSNorm); VideoLLaMA 3 reads ``merge_sizes`` beside the
grid and ends in ``post_layernorm``; PaddleOCR-VL's embedding reads ``(B, N, C, p, p)`` patches and the tower ends in
``post_layernorm``. MiniCPM-V's tower needs ``target_sizes`` (the patch grid) beside the image. Video towers:
VideoMAE (``(B, T, C, H, W)``; ``use_mean_pooling`` makes its final ``layernorm`` an nn.Identity), TimeSformer and
ViViT (final nn.LayerNorm), X-CLIP's vision tower (frames as the batch, CLS rows ``post_layernorm``-ed). SegGPT reads a
prompt image and mask beside the image, each half the config's height. Inkling's tower folds a channels-last clip
into depth through Linear + RMSNorm layers with no residual add anywhere.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from normatlas.factory import build_vision, tower_inputs  # noqa: E402
from normatlas.inspect import UntraceableModel, inspect_vision_target  # noqa: E402
from normatlas.inspect.vision import inspect_vision  # noqa: E402
from normatlas.vocabulary import Operator  # noqa: E402
from normatlas.vocabulary import PlacementKind as Placement  # noqa: E402

LN, RMS, NONE = Operator.LAYERNORM, Operator.RMSNORM, Operator.NONE


def _shapes(inputs: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in inputs.items()}


# model type, the layout it runs on, (operator, placement, final norm), the norm after the blocks and its field
CASES = [
    (
        "hunyuan_vl_vision",
        {"pixel_values": (16, 192), "grid_thw": (1, 3)},
        (LN, Placement.PRE, NONE),
        ("head_norm", RMS),
    ),
    (
        "video_llama_3_vision",
        {"pixel_values": (16, 192), "grid_thw": (1, 3), "merge_sizes": (1,)},
        (LN, Placement.PRE, LN),
        None,
    ),
    ("paddleocr_vl_vision", {"pixel_values": (1, 16, 3, 8, 8), "grid_thw": (1, 3)}, (LN, Placement.PRE, LN), None),
    ("minicpm_ocr_vision", {"pixel_values": (1, 3, 32, 32), "target_sizes": (1, 2)}, (LN, Placement.PRE, LN), None),
    ("videomae", {"pixel_values": (1, 16, 3, 32, 32)}, (LN, Placement.PRE, NONE), None),
    ("timesformer", {"pixel_values": (1, 8, 3, 32, 32)}, (LN, Placement.PRE, LN), None),
    ("vivit", {"pixel_values": (1, 32, 3, 32, 32)}, (LN, Placement.PRE, LN), None),
    ("xclip_vision_model", {"pixel_values": (8, 3, 32, 32)}, (LN, Placement.PRE, NONE), ("pooled_norm", LN)),
    (
        "seggpt",
        {"pixel_values": (1, 3, 16, 32), "prompt_pixel_values": (1, 3, 16, 32), "prompt_masks": (1, 3, 16, 32)},
        (LN, Placement.PRE, NONE),
        None,
    ),
]


@pytest.mark.parametrize(("model_type", "layout", "design", "after"), CASES, ids=[c[0] for c in CASES])
def test_tower_reads_its_layout_and_its_design(
    model_type: str,
    layout: dict[str, tuple[int, ...]],
    design: tuple[Operator, Placement, Operator],
    after: tuple[str, Operator] | None,
) -> None:
    assert _shapes(tower_inputs(build_vision(model_type))) == layout
    rep = inspect_vision_target(model_type, probe=False)
    assert (rep.operator, rep.placement, rep.final_norm) == design
    if after is not None:
        assert getattr(rep, after[0]) is after[1]


def test_tiled_and_refitted_towers() -> None:
    """Mllama's tower reads aspect-ratio tiles with their ratio ids and mask; its ``intermediate_layers_indices``
    (5 taps of 32 layers) are refitted to the shrunk depth and ``vision_output_dim`` to the taps' concatenated
    width, as for the whole image-text model. Its 2 local Pre-LN layers and 8 gated global ones read pre, and no
    norm follows the global stack (``layernorm_post`` sits between the two stacks)."""
    model = build_vision("mllama_vision_model")
    assert model.config.intermediate_layers_indices == [0] and model.config.vision_output_dim == 2 * 64
    assert _shapes(tower_inputs(model)) == {
        "pixel_values": (1, 1, 4, 3, 32, 32), "aspect_ratio_ids": (1, 1), "aspect_ratio_mask": (1, 1, 4),
    }  # fmt: skip
    rep = inspect_vision_target("mllama_vision_model", probe=False)
    assert (rep.operator, rep.placement, rep.final_norm, rep.layers) == (LN, Placement.PRE, NONE, 10)


def test_a_clip_of_unstated_length() -> None:
    """VidEoMT's forward reads ``pixel_values_videos`` (5-d) and its config states no frame count: two frames."""
    assert _shapes(tower_inputs(build_vision("videomt"))) == {"pixel_values": (1, 2, 3, 32, 32)}
    rep = inspect_vision_target("videomt", probe=False)
    assert (rep.operator, rep.placement, rep.final_norm) == (LN, Placement.PRE, LN)


def test_a_width_stated_by_the_tower_config_is_refitted() -> None:
    """Dots3's merger reads ``adapter_in_dim`` (the original tower width, 1536): refitted to the shrunk width the
    tower runs (pre-RMSNorm blocks with QK-norm, a final ``norm``, the merger's ``ln_q`` LayerNorm)."""
    model = build_vision("dots3_note_vision_encoder")
    assert model.config.adapter_in_dim == model.config.hidden_size == 64
    rep = inspect_vision_target("dots3_note_vision_encoder", probe=False)
    assert rep.operator is RMS and rep.merger_norm is LN


@pytest.mark.xfail(
    strict=True,
    reason="reader: a norm on the last stream value followed by another norm is read as the last sublayer's "
    "post-norm and the next as the final one (residual.final_norm's chained rule), so Dots3's final RMSNorm reads "
    "as post and the merger's ln_q as final, then merger",
)
def test_dots3_final_norm_then_merger_norm() -> None:
    rep = inspect_vision_target("dots3_note_vision_encoder", probe=False)
    assert (rep.placement, rep.final_norm) == (Placement.PRE, RMS)


def test_a_side_stream_inside_each_block_is_no_stage() -> None:
    """X-CLIP's vision layer runs a message attention on the frames' CLS tokens ``(B, T, D)`` before its attention
    and MLP on ``(B T, N, D)`` (XCLIPVisionEncoderLayer: message_ln, message_attn, layer_norm1, self_attn,
    layer_norm2, mlp): the shapes alternate within every layer, so they are three Pre-LN sublayers of each of its
    2 layers, not 4 layers in alternating stages."""
    rep = inspect_vision_target("xclip_vision_model", probe=False)
    assert rep.layers == 2 and rep.placement_by_layer == ((Placement.PRE,) * 3,) * 2
    assert len(rep.stages) <= 1


def test_a_tower_without_residual_adds_lists_its_norms_and_reads_unknown() -> None:
    """Inkling's tower runs on a channels-last clip; its Linear + RMSNorm layers have no residual add, so the
    placement is ``unknown`` (not a guess) while both RMSNorms are still found."""
    assert _shapes(tower_inputs(build_vision("inkling_vision"))) == {"pixel_values": (1, 2, 32, 32, 3)}
    rep = inspect_vision_target("inkling_vision", probe=False)
    assert rep.placement is Placement.UNKNOWN and rep.layers == 0
    assert [n.operator for n in rep.norms] == [RMS, RMS]


def test_tower_inputs_are_seeded() -> None:
    model = build_vision("videomae")
    a, b, c = tower_inputs(model, seed=1), tower_inputs(model, seed=1), tower_inputs(model, seed=2)
    assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert not torch.equal(a["pixel_values"], c["pixel_values"])


def test_inspect_vision_without_inputs_builds_the_layout() -> None:
    """The Python entry point, given a tower and no input, builds the same layout as the CLI's."""
    rep = inspect_vision(build_vision("timesformer"), probe=False)
    assert (rep.operator, rep.placement, rep.layers) == (LN, Placement.PRE, 2)


# ----------------------------------------------------------------------------- chosen by running, not by names
class _Block(nn.Module):
    """``x + MLP(LayerNorm(x))``: one Pre-LN sublayer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _FlatPatchTower(nn.Module):
    """Reads ``(B, N, C p^2)`` flattened patches only: the plain image fails, the flattened layout runs."""

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig(num_channels=3, image_size=16, patch_size=4)
        self.proj = nn.Linear(3 * 16, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(2))

    def blocks(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.proj(pixel_values)
        for block in self.layers:
            h = block(h)
        return h

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 3:
            raise ValueError(f"expected (B, N, C p^2) patches, got {tuple(pixel_values.shape)}")
        return self.blocks(pixel_values)


class _GridTower(_FlatPatchTower):
    """Reads ``(N, C p^2)`` patches with a ``(t, h, w)`` grid under a name of its own choosing."""

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if grid_thw.shape != (1, 3) or pixel_values.shape[0] != int(grid_thw.prod()):
            raise ValueError("patches and grid disagree")
        return self.blocks(pixel_values)


def test_flattened_patches_are_found_by_running() -> None:
    assert _shapes(tower_inputs(_FlatPatchTower())) == {"pixel_values": (1, 16, 48)}
    rep = inspect_vision(_FlatPatchTower(), probe=False)
    assert (rep.operator, rep.placement, rep.layers) == (LN, Placement.PRE, 2)


def test_a_grid_argument_gets_patches_and_their_grid() -> None:
    inputs = tower_inputs(_GridTower())
    assert _shapes(inputs) == {"pixel_values": (16, 48), "grid_thw": (1, 3)}
    assert inputs["grid_thw"].tolist() == [[1, 4, 4]]


class _Refuses(_FlatPatchTower):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this tower runs on nothing")


def test_no_layout_runs_names_every_layout_tried() -> None:
    with pytest.raises(ValueError, match=r"no input layout runs _Refuses: .*\(1, 3, 16, 16\).*\(1, 16, 48\)"):
        tower_inputs(_Refuses())
    with pytest.raises(UntraceableModel, match="this tower runs on nothing"):
        inspect_vision(_Refuses(), probe=False)


def test_a_model_without_a_config_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="model must be a transformers vision tower with a config"):
        tower_inputs(nn.Linear(2, 2))
