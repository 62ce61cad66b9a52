"""inspect_vision on tiny vision towers built offline from transformers config classes.

Every expectation below was checked against the installed transformers source
(models/<name>/modeling_<name>.py): CLIP vision normalizes the patch+position embeddings
(``pre_layrnorm``) before pre-LN blocks and LayerNorms only the CLS row after them
(``last_hidden_state[:, 0, :]`` -> ``post_layernorm``); SigLIP has pre-LN blocks, a
``post_layernorm`` on every token and a LayerNorm inside its attention-pooling head; ViT
and DINOv2 have pre-LN blocks and a final LayerNorm on every token, DINOv2 with LayerScale
(``hidden_state * lambda1``, a per-channel parameter); Qwen2-VL's tower has pre-LN blocks
and its PatchMerger LayerNorms each token then views 4 tokens as one row
(``ln_q(x).view(-1, hidden_size)``). All use nn.LayerNorm(eps=config eps, or 1e-6 in
Qwen2-VL). Sizes shrunk from e.g. CLIP ViT-L/14 (hidden 1024, 24 layers, 16 heads, 224 px).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from normatlas.inspect import UntraceableModel  # noqa: E402
from normatlas.inspect.vision import VisionReport, default_pixel_values, inspect_vision  # noqa: E402
from normatlas.vocabulary import GainConvention, Operator, QKNormKind, branch_scale_word, layer_placement_words  # noqa: E402
from normatlas.vocabulary import PlacementKind as Placement  # noqa: E402

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
)
PATCHES = (32 // 8) ** 2


def _tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    cfg_cls, model_cls = {
        "clip": (transformers.CLIPVisionConfig, transformers.CLIPVisionModel),
        "siglip": (transformers.SiglipVisionConfig, transformers.SiglipVisionModel),
        "vit": (transformers.ViTConfig, transformers.ViTModel),
        "dinov2": (transformers.Dinov2Config, transformers.Dinov2Model),
    }[kind]
    return model_cls(cfg_cls(**TINY)).eval()


def _roles(report: VisionReport) -> list[str]:  # the roles as the report spells them
    return [n.role.value for n in report.norms]


def _blocks_pre_ln(report: VisionReport, eps: float) -> None:
    assert report.placement is Placement.PRE
    assert report.placement_by_layer == ((Placement.PRE,) * 2,) * 2
    assert report.layers == 2 and report.hidden_size == 32
    assert report.operator is Operator.LAYERNORM
    assert report.eps == pytest.approx(eps)
    assert report.bias and report.gain_convention is GainConvention.W
    assert _roles(report).count("pre") == 4


def test_clip_vision_embedding_ln_pre_blocks_pooled_ln() -> None:
    model = _tiny("clip")
    report = inspect_vision(model)  # with the perturbation probe cross-check
    _blocks_pre_ln(report, model.config.layer_norm_eps)
    assert report.tokens == PATCHES + 1  # the class embedding is prepended
    assert report.embedding_norm is Operator.LAYERNORM
    assert report.final_norm is Operator.NONE  # last_hidden_state is not normalized
    assert report.pooled_norm is Operator.LAYERNORM
    assert report.head_norm is Operator.NONE and report.merger_norm is Operator.NONE
    roles = _roles(report)
    assert roles[0] == "embedding" and roles[-1] == "pooled"
    assert all(n.probe.get("agrees") for n in report.norms)


def test_siglip_vision_pre_blocks_final_and_head_ln() -> None:
    model = _tiny("siglip")
    report = inspect_vision(model, probe=False)
    _blocks_pre_ln(report, model.config.layer_norm_eps)
    assert report.tokens == PATCHES  # no class token
    assert report.embedding_norm is Operator.NONE
    assert report.final_norm is Operator.LAYERNORM
    assert report.head_norm is Operator.LAYERNORM
    assert report.pooled_norm is Operator.NONE
    assert _roles(report)[-2:] == ["final", "head"]


def test_siglip_without_head_has_no_head_norm() -> None:
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(**TINY, vision_use_head=False)
    report = inspect_vision(transformers.SiglipVisionModel(cfg).eval(), probe=False)
    assert report.final_norm is Operator.LAYERNORM
    assert report.head_norm is Operator.NONE and "head" not in _roles(report)


@pytest.mark.parametrize("kind", ["vit", "dinov2"])
def test_vit_and_dinov2_pre_blocks_final_ln(kind: str) -> None:
    model = _tiny(kind)
    report = inspect_vision(model, probe=False)
    _blocks_pre_ln(report, model.config.layer_norm_eps)
    assert report.tokens == PATCHES + 1
    assert report.final_norm is Operator.LAYERNORM
    assert report.embedding_norm is report.pooled_norm is report.head_norm is Operator.NONE
    assert branch_scale_word(report.branch_scale) == ("per-channel" if kind == "dinov2" else None)  # DINOv2 LayerScale


def test_qwen2_vl_tower_merger_norm() -> None:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(0)  # Qwen2-VL-7B: embed_dim 1280, depth 32, 16 heads, patch 14
    cfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=8)
    model = Qwen2VisionTransformerPretrainedModel._from_config(cfg).eval()
    patches = torch.randn(16, 3 * cfg.temporal_patch_size * 8 * 8)  # the flattened 4x4 patch grid
    report = inspect_vision(model, patches, grid_thw=torch.tensor([[1, 4, 4]]), probe=False)
    _blocks_pre_ln(report, 1e-6)
    assert report.tokens == 16
    assert report.merger_norm is Operator.LAYERNORM
    assert report.final_norm is Operator.NONE  # the merger's LN is the only norm on the last stream
    assert _roles(report)[-1] == "merger"


def test_read_from_dataflow_not_names() -> None:
    model = _tiny("clip")
    model.post_layernorm = nn.Identity()  # same name path, no norm arithmetic
    for layer in model.encoder.layers:  # type: ignore[union-attr]
        layer.layer_norm1 = nn.RMSNorm(32, eps=1e-6)  # a LayerNorm's name, an RMSNorm's arithmetic
        layer.layer_norm2 = nn.RMSNorm(32, eps=1e-6)
    report = inspect_vision(model, probe=False)
    assert report.operator is Operator.RMSNORM and report.eps == pytest.approx(1e-6)
    assert report.placement is Placement.PRE
    assert report.embedding_norm is Operator.LAYERNORM
    assert report.pooled_norm is Operator.NONE


def test_report_serializes() -> None:
    row = inspect_vision(_tiny("clip"), probe=False).summary_row()
    assert row["pooled_norm"] == "layernorm" and row["embedding_norm"] == "layernorm"
    assert row["tokens"] == PATCHES + 1 and row["placement"] == "pre"


def test_default_pixel_values_seeded_shape() -> None:
    model = _tiny("vit")
    a, b = default_pixel_values(model, seed=3), default_pixel_values(model, seed=3)
    assert a.shape == (1, 3, 32, 32)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_inputs_raise() -> None:
    model = _tiny("vit")
    with pytest.raises(TypeError, match=r"pixel_values must be a torch\.Tensor, got list"):
        inspect_vision(model, [[0.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"floating-point.*torch\.int64"):
        inspect_vision(model, torch.zeros(1, 3, 32, 32, dtype=torch.long))
    with pytest.raises(ValueError, match=r"pixel_values is required.*image_size"):
        inspect_vision(nn.Linear(4, 4))
    with pytest.raises(UntraceableModel, match="cannot run ViTModel"):
        inspect_vision(model, torch.randn(1, 5, 32, 32))  # 5 channels into a 3-channel patch conv


# --------------------------------------------------------------------------- staged towers, read over every stage
# Facts from transformers 5's modeling files. ConvNeXt (modeling_convnext.py): ConvNextEmbeddings normalises the
# patchify conv's output (channels-first ConvNextLayerNorm); each ConvNextStage after the first opens with a
# downsampling layer [channels-first LayerNorm, strided conv]; ConvNextLayer is dwconv -> permute -> LayerNorm ->
# pwconv1 -> act -> pwconv2 -> ``layer_scale_parameter * x`` (config.layer_scale_init_value * ones(dim), None when
# the value is 0) -> permute back -> residual add; ConvNextModel LayerNorms the global average
# (``self.layernorm(last_hidden_state.mean([-2, -1]))``). ConvNeXt V2 (modeling_convnextv2.py) is the same with
# ConvNextV2GRN (an L2 norm over H, W divided by its mean over channels) after the activation instead of LayerScale.
# Swin (modeling_swin.py): SwinEmbeddings LayerNorm, pre-LN SwinLayer, SwinPatchMerging LayerNorms the 4 x dim
# concatenation before its reduction, SwinModel's final LayerNorm. Swin V2 (modeling_swinv2.py): norms at the branch
# ends (``shortcut + layernorm_before(attention)``, ``x + layernorm_after(mlp)``), cosine attention
# (F.normalize of q and k), Swinv2PatchMerging reduces, then LayerNorms. ResNet (modeling_resnet.py): conv -> BN ->
# act layers, a conv + BN shortcut when the channels or stride change. BiT (modeling_bit.py, preactivation):
# GroupNorm + act before each conv (norm1 on the stream), WeightStandardizedConv2d standardizes its weight with
# ``F.batch_norm(weight, None, None, training=True)``, BitModel's final GroupNorm; no BatchNorm on activations.
# Sizes shrunk from e.g. ConvNeXt-T (hidden_sizes 96..768, depths 3, 3, 9, 3, 224 px) to four narrow stages whose
# depths differ, on a 64 px image (32 px for Swin: 16 x 16 patches, window 4).
DEPTHS = [1, 2, 1, 2]
WIDTHS = [8, 16, 24, 32]


def _convnext(version: int = 1, **kw: object) -> nn.Module:
    torch.manual_seed(0)
    cfg_cls, model_cls = {
        1: (transformers.ConvNextConfig, transformers.ConvNextModel),
        2: (transformers.ConvNextV2Config, transformers.ConvNextV2Model),
    }[version]
    return model_cls(cfg_cls(hidden_sizes=WIDTHS, depths=DEPTHS, image_size=64, **kw)).eval()


def _assert_stage_geometry(report: VisionReport, widths: list[int], depths: list[int], side: int) -> None:
    assert [s.index for s in report.stages] == list(range(len(widths)))
    assert [s.layers for s in report.stages] == depths
    assert [s.width for s in report.stages] == widths
    assert [s.positions for s in report.stages] == [(side >> k) ** 2 for k in range(len(widths))]
    assert report.layers == sum(depths) and report.hidden_size == widths[-1]
    assert report.tokens == report.stages[-1].positions


def test_convnext_every_stage_layer_scale_and_downsampling_norms() -> None:
    model = _convnext(layer_scale_init_value=0.25)
    report = inspect_vision(model, probe=False)
    _assert_stage_geometry(report, WIDTHS, DEPTHS, 16)
    assert [s.shape for s in report.stages] == [(1, c, 16 >> k, 16 >> k) for k, c in enumerate(WIDTHS)]
    for stage, depth in zip(report.stages, DEPTHS, strict=True):
        assert stage.operator is Operator.LAYERNORM
        assert stage.placement is Placement.NONE  # the LayerNorm follows the depthwise conv: inside the branch
        assert stage.placement_by_layer == ((Placement.NONE,),) * depth
        assert stage.inner_norms == depth
        assert branch_scale_word(stage.branch_scale) == "per-channel" and stage.layer_scale_init == 0.25
        assert stage.downsample_norms == (Operator.LAYERNORM,)  # stage 0: the stem's; then the downsampling layer's
        assert stage.batch_stat_norms == stage.weight_standardization == stage.response_norms == 0
    assert report.operator is Operator.LAYERNORM and report.eps == pytest.approx(1e-6)
    assert report.placement is Placement.NONE
    assert branch_scale_word(report.branch_scale) == "per-channel" and report.layer_scale_init == 0.25
    assert report.embedding_norm is Operator.LAYERNORM and report.downsample_norm is Operator.LAYERNORM
    assert report.pooled_norm is Operator.LAYERNORM  # LayerNorm of the global average
    assert report.final_norm is report.head_norm is Operator.NONE
    assert report.batch_stat_norms == 0


def test_convnext_without_layer_scale() -> None:
    report = inspect_vision(_convnext(layer_scale_init_value=0.0), probe=False)
    assert len(report.stages) == 4
    assert branch_scale_word(report.branch_scale) is None and report.layer_scale_init is None
    assert all(branch_scale_word(s.branch_scale) is None for s in report.stages)


def test_convnext_reading_ignores_names() -> None:
    import random

    from tests.renamer import old_names, renamed
    from tests.test_rename_invariance import lying_scheme, relabel

    model = _convnext()
    twin = renamed(model, lying_scheme(random.Random("convnext"), root=model))
    back = old_names(model, twin)
    x = default_pixel_values(model)
    a, b = (inspect_vision(m, x, name="m", probe=False).to_dict() for m in (model, twin))
    for d in (a, b):
        d.pop("seconds")
    for norm in b["norms"]:
        norm["module"] = relabel(norm["module"], back)
    assert a == b
    assert a["layer_scale_init"] == pytest.approx(1e-6) and len(a["stages"]) == 4


def test_convnextv2_grn_is_an_other_norm() -> None:
    report = inspect_vision(_convnext(2), probe=False)
    _assert_stage_geometry(report, WIDTHS, DEPTHS, 16)
    assert [s.response_norms for s in report.stages] == DEPTHS
    assert report.response_norms == sum(DEPTHS)
    grn = [n for n in report.norms if n.operator is Operator.OTHER]
    assert sorted(n.size for n in grn) == sorted(4 * c for c, d in zip(WIDTHS, DEPTHS, strict=True) for _ in range(d))
    assert all(n.eps == pytest.approx(1e-6) for n in grn)
    assert any("GRN" in note for note in report.notes)
    assert branch_scale_word(report.branch_scale) is None  # no LayerScale in V2
    assert all(s.operator is Operator.LAYERNORM for s in report.stages)  # GRN is not the blocks' operator


def _swin(version: int) -> nn.Module:
    torch.manual_seed(0)  # Swin-T: embed_dim 96, depths 2, 2, 6, 2, heads 3, 6, 12, 24, window 7, 224 px
    cfg_cls, model_cls = {
        1: (transformers.SwinConfig, transformers.SwinModel),
        2: (transformers.Swinv2Config, transformers.Swinv2Model),
    }[version]
    cfg = cfg_cls(image_size=32, patch_size=2, embed_dim=8, depths=[1, 2, 1], num_heads=[1, 2, 2], window_size=4)
    return model_cls(cfg).eval()


@pytest.mark.parametrize("version", [1, 2])
def test_swin_every_stage_patch_merging_norms(version: int) -> None:
    report = inspect_vision(_swin(version), probe=False)
    _assert_stage_geometry(report, [8, 16, 32], [1, 2, 1], 16)
    scheme = "pre" if version == 1 else "res-post"
    for stage, depth in zip(report.stages, [1, 2, 1], strict=True):
        assert stage.operator is Operator.LAYERNORM
        assert layer_placement_words(stage.placement_by_layer) == [f"{scheme}/{scheme}"] * depth
        assert branch_scale_word(stage.branch_scale) is None
    assert report.placement is Placement(scheme)
    assert [s.downsample_norms for s in report.stages[1:]] == [(Operator.LAYERNORM,)] * 2  # the patch mergings
    assert report.embedding_norm is report.final_norm is Operator.LAYERNORM
    assert report.downsample_norm is Operator.LAYERNORM
    assert report.qk_norm is (QKNormKind.NONE if version == 1 else QKNormKind.PER_HEAD)  # V2: cosine attention


def test_resnet_every_stage_batch_statistics() -> None:
    torch.manual_seed(0)  # ResNet-50: embedding 64, hidden_sizes 256..2048, depths 3, 4, 6, 3
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[16, 32, 48], depths=[1, 2, 3])
    report = inspect_vision(transformers.ResNetModel(cfg).eval(), probe=False)
    _assert_stage_geometry(report, [16, 32, 48], [1, 2, 3], 16)  # the stem's conv and max-pool: 64 px -> 16
    assert report.operator is Operator.NONE and report.placement is Placement.NONE  # BatchNorm: no operator of ours
    # the stem's BN; three BN per bottleneck; the first block of each stage adds its shortcut's BN
    assert [s.batch_stat_norms for s in report.stages] == [1 + 4, 4 + 3, 4 + 3 + 3]
    assert report.batch_stat_norms == 22 and report.weight_standardization == 0


def test_bit_weight_standardization_is_not_batch_statistics() -> None:
    from transformers.models.bit.modeling_bit import WeightStandardizedConv2d

    torch.manual_seed(0)  # BiT-M R50x1: embedding 64, hidden_sizes 256..2048, depths 3, 4, 6, 3, 32 groups
    cfg = transformers.BitConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 2], num_groups=4)
    model = transformers.BitModel(cfg).eval()
    report = inspect_vision(model, torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)))
    _assert_stage_geometry(report, [16, 32], [1, 2], 16)
    convs = sum(isinstance(m, WeightStandardizedConv2d) for m in model.modules())
    assert report.weight_standardization == convs == sum(s.weight_standardization for s in report.stages)
    assert report.batch_stat_norms == 0
    assert report.operator is Operator.GROUPNORM and report.placement is Placement.PRE  # pre-activation
    assert report.final_norm is Operator.GROUPNORM and report.embedding_norm is Operator.NONE
    assert all(n.probe.get("agrees") for n in report.norms if n.probe)


def test_dinov2_layer_scale_init_read_from_the_parameter() -> None:
    torch.manual_seed(0)
    model = transformers.Dinov2Model(transformers.Dinov2Config(**TINY, layerscale_value=0.5)).eval()
    report = inspect_vision(model, probe=False)
    assert len(report.stages) == 1 and report.stages[0].layers == 2
    assert branch_scale_word(report.branch_scale) == "per-channel" and report.layer_scale_init == 0.5


def test_pooling_head_is_not_a_stage() -> None:
    report = inspect_vision(_tiny("siglip"), probe=False)  # the head's residual add reads a learned probe
    assert len(report.stages) == 1 and report.head_norm is Operator.LAYERNORM
    assert report.stages[0].placement_by_layer == ((Placement.PRE,) * 2,) * 2


def test_build_vision_finds_the_model_class_of_an_unregistered_tower_config() -> None:
    from normatlas.factory import build_vision

    # AutoModel has no entry for AltCLIPVisionConfig; modeling_altclip.py defines AltCLIPVisionModel for it
    model = build_vision("altclip_vision_model")
    assert type(model) is transformers.AltCLIPVisionModel
    report = inspect_vision(model, probe=False)
    assert report.placement is Placement.PRE and report.pooled_norm is Operator.LAYERNORM  # CLIP's layout


def test_sam_relative_position_add_is_not_a_stage() -> None:
    # modeling_sam.py: SamVisionLayer is pre-LN (layer_norm1 before windowed attention, layer_norm2 before the MLP);
    # SamVisionAttention adds its decomposed relative position to the scores (``attn_weights + rel_pos``, a residual
    # add in shape only, inside the attention branch); SamVisionNeck LayerNorms (channels-first) after each of its
    # two convolutions. SAM ViT-B: hidden 768, 12 layers, 1024 px, patch 16, window 14.
    torch.manual_seed(0)
    cfg = transformers.SamVisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4, mlp_dim=64,
        output_channels=16, window_size=4, global_attn_indexes=[1],
    )  # fmt: skip
    report = inspect_vision(transformers.SamVisionModel(cfg).eval(), probe=False)
    assert len(report.stages) == 1 and report.stages[0].placement_by_layer == ((Placement.PRE,) * 2,) * 2
    assert report.stages[0].shape == (1, 8, 8, 32) and report.hidden_size == 32  # (B, H, W, C) tokens
    assert [n.operator for n in report.norms if n.role.value == "head"] == [Operator.LAYERNORM] * 2  # the neck
