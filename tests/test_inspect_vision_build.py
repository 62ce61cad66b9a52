"""build_vision on the towers whose tiny build used to fail: the model class found, the shrink kept consistent.

Each expectation below was checked against the installed transformers source
(models/<name>/modeling_<name>.py). Class lookup: BridgeTower's tower reads its image as ``image``
(``BridgeTowerVisionModel.forward(image, ...)``); IDEFICS' is a plain module in ``idefics/vision.py``
(``IdeficsVisionTransformer``, CLIP's layout: ``pre_layrnorm`` on the embeddings, pre-LN blocks, ``post_layernorm``
on the CLS row); PP-Chart2Table has no modeling file, its model is ``GotOcr2ForConditionalGeneration`` and its tower
GOT-OCR2's SAM-style encoder (pre-LN blocks, two channels-first LayerNorms in the neck). Shrink: EoMT adds its
queries before the last ``num_blocks`` layers (pre-LN with LayerScale, a final ``layernorm``, a LayerNorm2d in the
mask head's upscale block); MobileViTV2 unfolds ``patch_size`` patches from feature maps down to 1/32 (pre-norm
``GroupNorm(1)`` transformer blocks between BatchNorm convolutions); RADIO's patch projection reads ``patch_dim =
num_channels * patch_size**2`` (pre-LN, LayerScale, no final norm); SAM 2's Hiera stem is ``embed_dim_per_stage[0]``
wide (pre-LN multi-scale blocks, no final norm); Sapiens2 derives its per-layer key/value heads (pre-RMSNorm, per-head
q/k RMSNorm, a final RMSNorm); ViTPose's backbone has one MLP (``num_experts = 1``: pre-LN, a final LayerNorm).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from normatlas.factory import build_vision  # noqa: E402
from normatlas.inspect import inspect_vision_target  # noqa: E402
from normatlas.inspect.vision import VisionReport  # noqa: E402
from normatlas.vocabulary import Operator, QKNormKind  # noqa: E402
from normatlas.vocabulary import PlacementKind as Placement  # noqa: E402


def _read(model_type: str) -> VisionReport:
    return inspect_vision_target(model_type, probe=False)


# ----------------------------------------------------------------------------- the model class
def test_bridgetower_tower_reads_its_image_argument() -> None:
    model = build_vision("bridgetower_vision_model")
    assert type(model).__name__ == "BridgeTowerVisionModel"  # forward(image, ...): not named pixel_values
    rep = _read("bridgetower_vision_model")
    assert rep.operator is Operator.LAYERNORM and rep.placement_mlp.value == "pre"
    assert rep.head_norm is Operator.LAYERNORM  # ln_post on the stacked hidden states of every layer


@pytest.mark.xfail(
    strict=True,
    reason="reader: BridgeTower runs nn.MultiheadAttention on a (tokens, batch, width) stream; ln_pre and ln_1 "
    "read as other and the attention sublayer is not found",
)
def test_bridgetower_attention_side_is_read() -> None:
    rep = _read("bridgetower_vision_model")
    assert rep.embedding_norm is Operator.LAYERNORM and rep.placement_attention.value == "pre"


def test_idefics_tower_is_a_plain_module_of_its_package() -> None:
    model = build_vision("idefics_vision")
    assert type(model).__name__ == "IdeficsVisionTransformer"  # the largest, not IdeficsVisionEmbeddings
    rep = _read("idefics_vision")
    assert (rep.operator, rep.placement, rep.embedding_norm, rep.final_norm, rep.pooled_norm) == (
        Operator.LAYERNORM, Placement.PRE, Operator.LAYERNORM, Operator.NONE, Operator.LAYERNORM,
    )  # fmt: skip


def test_pp_chart2table_tower_is_got_ocr2s_encoder() -> None:
    model = build_vision("pp_chart2table_vision")
    assert type(model).__name__ == "GotOcr2VisionEncoder"  # modeling_got_ocr2.py, not exported at the top
    rep = _read("pp_chart2table_vision")
    assert (rep.operator, rep.placement, rep.final_norm, rep.head_norm) == (
        Operator.LAYERNORM, Placement.PRE, Operator.NONE, Operator.LAYERNORM,
    )  # fmt: skip
    assert [n.module for n in rep.norms if n.role.value == "head"] == ["neck.layer_norm1", "neck.layer_norm2"]


@pytest.mark.parametrize(
    ("model_type", "cls"),
    [("videomt", "VideomtForUniversalSegmentation"), ("unlimited_ocr_vision_encoder", "UnlimitedOcrVisionEncoder")],
)
def test_tower_found_by_its_main_input(model_type: str, cls: str) -> None:
    """Built (``pixel_values_videos`` / ``patch_embeds`` first); running them needs a video / a SAM feature map."""
    assert type(build_vision(model_type)).__name__ == cls


# ----------------------------------------------------------------------------- the shrink
@pytest.mark.parametrize("model_type", ["eomt", "eomt_dinov3"])
def test_eomt_keeps_a_layer_before_its_queries(model_type: str) -> None:
    assert build_vision(model_type).config.num_blocks == 1  # 4 of 24 layers; 2 layers keep one outside
    rep = _read(model_type)
    assert (rep.operator, rep.placement, rep.final_norm, rep.head_norm, rep.embedding_norm) == (
        Operator.LAYERNORM, Placement.PRE, Operator.LAYERNORM, Operator.LAYERNORM, Operator.NONE,
    )  # fmt: skip
    assert rep.layer_scale_init == pytest.approx(1.0)
    assert [s.layers for s in rep.stages] == [1, 1] and rep.tokens == 200 + 5 + 16  # queries join at layer 1


def test_mobilevitv2_keeps_a_patch_its_last_map_holds() -> None:
    cfg = build_vision("mobilevitv2").config
    assert (cfg.patch_size, cfg.image_size) == (2, 64)  # the original patch; 64 / output_stride 32 = 2
    rep = _read("mobilevitv2")
    assert rep.operator is Operator.GROUPNORM and rep.final_norm is Operator.GROUPNORM
    assert rep.batch_stat_norms > 0 and rep.placement is Placement.MIX
    assert [s.placement for s in rep.stages] == [Placement.NONE, Placement.PRE, Placement.PRE, Placement.PRE]


def test_radio_patch_dim_follows_the_patch_size() -> None:
    assert build_vision("radio").config.patch_dim == 3 * 8 * 8  # derived in __post_init__, once 3 * 16 * 16
    rep = _read("radio")
    assert (rep.operator, rep.placement, rep.final_norm) == (Operator.LAYERNORM, Placement.PRE, Operator.NONE)
    assert rep.layer_scale_init == pytest.approx(1.0)


def test_sam2_hiera_stage_widths_shrink_with_the_stem() -> None:
    cfg = build_vision("sam2_hiera_det_model").config
    assert cfg.embed_dim_per_stage == [64, 128, 256, 512] and cfg.hidden_size == 64
    assert cfg.num_attention_heads == 1  # never grown to the tiny 4
    rep = _read("sam2_hiera_det_model")
    assert (rep.operator, rep.placement, rep.final_norm) == (Operator.LAYERNORM, Placement.PRE, Operator.NONE)
    assert [s.width for s in rep.stages] == [64, 128, 256, 512]


def test_sapiens2_key_value_heads_are_derived_again() -> None:
    cfg = build_vision("sapiens2").config
    assert cfg.num_key_value_heads_per_layer == [4, 4] and cfg.stage_names == ["stem", "stage1", "stage2"]
    rep = _read("sapiens2")
    assert (rep.operator, rep.placement, rep.final_norm) == (Operator.RMSNORM, Placement.PRE, Operator.RMSNORM)
    assert rep.qk_norm is QKNormKind.PER_HEAD


def test_vitpose_backbone_is_not_grown_into_experts() -> None:
    assert build_vision("vitpose_backbone").config.num_experts == 1
    rep = _read("vitpose_backbone")
    assert (rep.operator, rep.placement, rep.final_norm) == (Operator.LAYERNORM, Placement.PRE, Operator.LAYERNORM)
    assert rep.eps == pytest.approx(1e-12)


@pytest.mark.parametrize("kwargs", [{"image_size": 0}, {"patch_size": -8}, {"image_size": 32.0}])
def test_build_vision_refuses_bad_sizes(kwargs: dict[str, object]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        build_vision("vit", **kwargs)  # type: ignore[arg-type]
