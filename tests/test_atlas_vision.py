"""The vision records the atlas reads from code: each agrees with what ``inspect_vision`` reads off the tiny tower.

Before this file these records were ``unclear`` (CLIP ViT-L/14, SigLIP-SO400M, DINOv2, SAM) or BatchNorm-family
(SAM's neck, Mini-Gemini's ConvNeXt branch) although transformers' code says otherwise (issue 20's list).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import normatlas.atlas as atlas
from normatlas.inspect import inspect_vision_target
from normatlas.vocabulary import Operator, branch_scale_word

RECORDS = {r["name"]: r for r in atlas.models()}
TOWERS = {  # record -> the transformers vision model type its source names
    "CLIP ViT-L/14": "clip_vision_model",
    "SigLIP-SO400M": "siglip_vision_model",
    "DINOv2": "dinov2",
    "SAM": "sam_vision_model",
}


@pytest.mark.parametrize(("name", "model_type"), sorted(TOWERS.items()))
def test_vision_record_is_what_inspect_vision_reads(name: str, model_type: str) -> None:
    rec, r = RECORDS[name], inspect_vision_target(model_type, probe=False)
    assert rec["status"] == "code" and model_type in rec["source"]
    assert (rec["operator"], rec["placement"], rec["qk_norm"]) == (r.operator.value, r.placement.value, r.qk_norm.value)
    if rec["residual"] == "LayerScale":
        assert branch_scale_word(r.branch_scale) == "per-channel"


def test_sam_neck_normalises_with_layernorm_not_batch_statistics() -> None:
    rec, r = RECORDS["SAM"], inspect_vision_target("sam_vision_model", probe=False)
    assert rec["vision_tower_norm"] == "layernorm" and r.head_norm is Operator.LAYERNORM
    assert rec["essay_differs"] and "BatchNorm" in rec["essay_differs"]


def test_convnext_branch_has_no_batch_statistics() -> None:
    """Mini-Gemini's high-res branch is a ConvNeXt: no module of a tiny ConvNeXt computes batch statistics, and its
    norms are LayerNorms over the channels (found by behaviour, not by class name)."""
    import torch
    from transformers import ConvNextConfig, ConvNextModel

    from normatlas.analysis import probe
    from normatlas.longtail import read_batchnorm

    torch.manual_seed(0)
    model = ConvNextModel(ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32)).eval()
    assert all(read_batchnorm(m) is None for m in model.modules())
    facts = [f for m in model.modules() if not list(m.children()) if (f := probe(m)) is not None]
    assert facts and all(f.measured.center for f in facts)  # centred: LayerNorms, over channels first or last
    assert RECORDS["Mini-Gemini"]["vision_tower_norm"] == "layernorm"


def test_paligemma_gain_convention_is_read_from_code() -> None:
    """The record's gain convention was empty although the inspector reads PaliGemma's Gemma as (1 + w)."""
    from normatlas.inspect import inspect_target
    from normatlas.spec import GainConvention

    r = inspect_target("paligemma", probe=False)
    assert r.gain_convention is GainConvention.ONE_PLUS_W and RECORDS["PaliGemma"]["gain_convention"] == "1+w"
    assert RECORDS["PaliGemma"]["hf_model_types"] == ["paligemma"]  # so `matrix --check` keeps it true


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_connector_norm_is_the_patch_mergers(version: str) -> None:
    """Qwen2-VL / Qwen2.5-VL normalise each patch token in the patch merger (``ln_q``: LayerNorm / RMSNorm)
    before 2x2 rows are merged into the connector MLP; the records had no connector norm."""
    import torch

    from normatlas.inspect import inspect_vision

    if version == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig as Cfg
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower

        cfg = Cfg(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=8)
        name, op = "Qwen2-VL", Operator.LAYERNORM
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Cfg
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Tower

        cfg = Cfg(depth=2, hidden_size=32, out_hidden_size=48, num_heads=2, intermediate_size=64, patch_size=8,
                  fullatt_block_indexes=[1], window_size=16)  # fmt: skip
        name, op = "Qwen2.5-VL", Operator.RMSNORM
    torch.manual_seed(0)
    tower = Tower._from_config(cfg).eval()
    patches = torch.randn(16, 3 * cfg.temporal_patch_size * 8 * 8)
    r = inspect_vision(tower, patches, grid_thw=torch.tensor([[1, 4, 4]]), probe=False)
    rec = RECORDS[name]
    assert r.placement.value == "pre" and r.operator is op and r.merger_norm is op
    assert (rec["vision_tower_norm"], rec["connector_norm"]) == (op.value, op.value)
    assert rec["hf_model_types"] == [version] and rec["status"] == "code"


def test_pixtral_tower_is_pre_rmsnorm() -> None:
    r = inspect_vision_target("pixtral", probe=False)
    rec = RECORDS["Pixtral"]
    assert (r.operator, r.placement.value) == (Operator.RMSNORM, "pre") and rec["vision_tower_norm"] == "rmsnorm"
    assert rec["hf_model_types"] == ["mistral3"] and rec["status"] == "code"


def test_swin_v2_normalises_q_and_k_per_head_and_each_branch_output() -> None:
    """Swin-V2 (res-post-norm, cosine attention): L2 norms over each head's q and k, LayerNorms on the branch
    outputs, read from one recorded forward of a tiny Swinv2Model (``inspect --vision swinv2`` cannot place its
    windowed stream yet)."""
    import torch
    from transformers import Swinv2Config, Swinv2Model

    from normatlas.analysis import record
    from normatlas.inspect.norms import find_sites

    torch.manual_seed(0)
    cfg = Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    model = Swinv2Model(cfg).eval()
    sites = find_sites(record(model, (torch.randn(1, 3, 32, 32),)))
    head_dims = {16 // 2, 32 // 2}
    assert {s.size for s in sites if s.operator is Operator.L2} <= head_dims and any(
        s.operator is Operator.L2 for s in sites
    )
    assert any(s.operator is Operator.LAYERNORM for s in sites)
    rec = RECORDS["Swin-V2"]
    assert (rec["operator"], rec["placement"], rec["qk_norm"]) == ("layernorm", "res-post", "per-head")
