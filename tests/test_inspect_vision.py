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
from normatlas.vocabulary import GainConvention, Operator  # noqa: E402
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
    assert report.placement_by_layer == ["pre/pre", "pre/pre"]
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
    assert report.branch_scale == ("per-channel" if kind == "dinov2" else None)  # DINOv2 LayerScale


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
