"""Image-text models whose ``get_image_features`` needs more than the image, read whole.

Each is built tiny offline, fed the batch its config describes (:mod:`normatlas.factory.vlm_inputs`: a patch grid,
pooling indices, merge sizes, an instruction, a high-resolution copy) and checked against its modeling file
(transformers 5.24, models/<name>/modeling_<name>.py, cited per row). Plus the config refits that make them run and
the check that image features come in rows of the language model's width.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from normatlas.factory import build_vlm
from normatlas.factory.vlm_inputs import _count_tokens, _feature_arguments
from normatlas.inspect.vlm import ConnectorKind, Injection, inspect_vlm_target
from normatlas.vocabulary import Operator, PlacementKind, QKNormKind, branch_scale_word

L, R = Operator.LAYERNORM, Operator.RMSNORM

# (model type, tower: operator / final norm / layer scale, connector: kind / norms / norm widths / tokens out,
#  language model: operator / qk_norm / gain convention)
# * minicpmv4_6 / minicpmv4_7: MiniCPMV4_6VisionEncoderLayer layer_norm1 / layer_norm2 (nn.LayerNorm, Pre-LN),
#   post_layernorm after the encoder; MiniCPMV4_6ViTWindowAttentionMerger merges 2 x 2 patches after layer
#   insert_layer_id (4 x 4 -> 2 x 2); MiniCPMV4_6Merger views 2 x 2 rows as one and runs DownsampleMLP: pre_norm
#   nn.LayerNorm(4 * hidden) -> linear-GELU-linear (2 x 2 -> 1 token); the text model is qwen3_5_text:
#   Qwen3_5RMSNorm multiplies by (1 + weight), q_norm / k_norm Qwen3_5RMSNorm(head_dim).
# * minicpm_ocr: the same tower without the window merger in its run (16 patches -> 4 tokens), same merger and LM.
# * molmo2: Molmo2VisionEncoderLayer layer_norm1 / layer_norm2 (Pre-LN), no norm after the layers; Molmo2Adapter
#   concatenates two vision_feature_layer states, attends from each pooling window's mean to its patches
#   (image_pooling_2d) and runs a SwiGLU MLP, no norm; Molmo2RMSNorm (weight * x), q_norm / k_norm on head_dim
#   (qk_norm_type "qwen3").
# * nemotron_h_omni: the RADIO tower's layers norm1 / norm2 (nn.LayerNorm) with RadioLayerScale on both branches;
#   pixel_shuffle (2 x 2 rows -> 1), then the projector's NemotronH_Omni_RMSNorm(4 * hidden) -> linear-relu2-linear;
#   the nemotron_h language model Pre-RMSNorm blocks, no QK-norm.
# * video_llama_3: a Pre-LN tower with post_layernorm, then pixel_unshuffle's bilinear interpolate to (h / m, w / m)
#   and VideoLlama3Projector linear-GELU-linear; the qwen2 language model.
# * instructblip: the Q-Former LayerNorms its queries together with the instruction's embeddings
#   (InstructBlipQFormerEmbeddings.layernorm), then per layer the self-attention output LayerNorm, the
#   cross-attention one (layer 0 of 2), the query FFN's and the instruction FFN's (the last layer's reaches the
#   queries through the concatenation the query slice then drops): 1 + 4 + 3 = 8; the OPT language model is Pre-LN.
# * deepseek_vl_hybrid: the SigLIP tower (Pre-LN, post_layernorm); DeepseekVLHybridAligner: vision_proj and
#   high_res_vision_proj, concatenated, GELU, proj (no norm); the high-resolution SAM encoder has an input of its own.
ROWS: list[tuple[Any, ...]] = [
    ("minicpmv4_6", (L, L, None), (ConnectorKind.PATCH_MERGER, [L], [256], 1), (R, QKNormKind.PER_HEAD, "1+w")),
    ("minicpmv4_7", (L, L, None), (ConnectorKind.PATCH_MERGER, [L], [256], 1), (R, QKNormKind.PER_HEAD, "1+w")),
    ("minicpm_ocr", (L, L, None), (ConnectorKind.PATCH_MERGER, [L], [256], 4), (R, QKNormKind.PER_HEAD, "1+w")),
    ("molmo2", (L, Operator.NONE, None), (ConnectorKind.RESAMPLER, [], [], 4), (R, QKNormKind.PER_HEAD, "w")),
    (
        "nemotron_h_omni",
        (L, Operator.NONE, "per-channel"),
        (ConnectorKind.PATCH_MERGER, [R], [256], 4),
        (R, QKNormKind.NONE, "w"),
    ),
    ("video_llama_3", (L, L, None), (ConnectorKind.POOLING, [], [], 4), (R, QKNormKind.NONE, "w")),
    ("instructblip", (L, L, None), (ConnectorKind.RESAMPLER, [L] * 8, [64] * 8, 32), (L, QKNormKind.NONE, "w")),
    ("deepseek_vl_hybrid", (L, L, None), (ConnectorKind.MLP, [], [], 16), (R, QKNormKind.NONE, "w")),
]


@pytest.fixture(scope="module")
def reports() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    return {row[0]: inspect_vlm_target(row[0], probe=False) for row in ROWS}


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_three_parts(row: tuple[Any, ...], reports: dict[str, Any]) -> None:
    model_type, (tower, final, scale), (kind, norms, widths, tokens), (lm, qk, gain) = row
    rep = reports[model_type]
    v, c, lang = rep.vision, rep.connector, rep.language
    assert (v.operator, v.final_norm, branch_scale_word(v.branch_scale)) == (tower, final, scale)
    assert (c.kind, c.norms, c.norm_widths, c.tokens_out, rep.image_tokens) == (kind, norms, widths, tokens, tokens)
    assert rep.injection is Injection.EMBEDDING_STREAM
    assert (lang.operator, lang.placement, lang.qk_norm) == (lm, PlacementKind.PRE, qk)
    assert lang.gain_convention is not None and lang.gain_convention.value == gain
    assert v.placement is PlacementKind.PRE
    assert rep.tower_layers_run == v.layers == 2  # every shrunk tower layer reaches the language model


def test_check_rows_for_the_atlas(reports: dict[str, Any]) -> None:
    """The fields ``matrix --check`` compares, for the records MiniCPM-V 4.6 and Molmo2."""
    keys = ("operator", "placement", "qk_norm", "gain_convention", "vision_tower_norm", "connector", "connector_norm")
    minicpm, molmo = ([reports[m].check_row()[k] for k in keys] for m in ("minicpmv4_6", "molmo2"))
    assert minicpm == ["rmsnorm", "pre", "per-head", "1+w", "layernorm", "patch-merger", "layernorm"]
    assert molmo == ["rmsnorm", "pre", "per-head", "w", "layernorm", "resampler", "none"]


def test_molmo2_taps_two_layers_and_counts_its_flat_features(reports: dict[str, Any]) -> None:
    """Molmo2 concatenates two tower layers and adds its features to the placeholders' embeddings as one flat
    vector (modeling_molmo2.py: ``inputs_embeds[mask] + image_features.reshape(-1)``): its rows are still counted."""
    c = reports["molmo2"].connector
    assert (c.taps, c.tokens_in, c.tokens_out) == (2, 16, 4)


def test_molmo2_tower_placement(reports: dict[str, Any]) -> None:
    """Molmo2VisionModel adds ``positional_embedding[None].to(hidden_states)`` to the patch embedding: the cast's
    reference tensor gives a dtype, not a value, so that add is no residual branch."""
    v = reports["molmo2"].vision
    assert (v.placement, v.layers) == (PlacementKind.PRE, 2)


def test_a_second_image_input_is_not_the_connectors(reports: dict[str, Any]) -> None:
    """DeepSeek-VL hybrid's SAM encoder reads high_res_pixel_values: its LayerNorms and rel-pos interpolations are
    neither the connector's norms nor its pooling; the report says a second image input was left unread."""
    rep = reports["deepseek_vl_hybrid"]
    assert rep.connector.projections == 2 and rep.connector.norms == []
    assert any("second image input" in n for n in rep.notes)


def test_minicpm_tower_merges_tokens_between_its_layers(reports: dict[str, Any]) -> None:
    """The window merger runs after layer 0 (insert_layer_id refitted into the 2-layer tower): layer 1 runs on the
    merged 2 x 2 tokens, and both layers count as run."""
    rep = reports["minicpmv4_6"]
    assert rep.vision.tokens == 4 and rep.connector.tokens_in == 4 and rep.tower_layers_run == 2


# --------------------------------------------------------------------------- the build refits and the batch
def test_config_refits() -> None:
    """Layer indices, per-patch tables and widths the shrunk configs must agree on (each used to break the run)."""
    warnings.filterwarnings("ignore")
    minicpm, molmo, hybrid = (build_vlm(m).config for m in ("minicpmv4_6", "molmo2", "deepseek_vl_hybrid"))
    assert minicpm.vision_config.insert_layer_id == minicpm.insert_layer_id == 0  # 6 of 12 -> inside 2 layers
    assert molmo.adapter_config.vision_feature_layer == [1, 0]  # [24, 18] of 25 layers: the last, an inner one
    assert molmo.vision_config.num_position_embeddings == 16  # 27 x 27 patches -> 4 x 4
    assert molmo.adapter_config.text_hidden_size == molmo.text_config.hidden_size
    assert molmo.image_patch_id == molmo.text_config.vocab_size - 1  # image_token_id is an alias of it
    sam = hybrid.high_res_vision_config
    assert sam.num_hidden_layers == 2 and sam.global_attn_indexes == [0, 1] and sam.image_size == 64


def test_feature_arguments_are_read_from_every_get_image_features() -> None:
    """VideoLLaMA 3's head names pixel_values and image_grid_thw (the grid optional); its base model requires
    image_merge_sizes as well: the union, required where any of them requires it."""
    warnings.filterwarnings("ignore")
    args = _feature_arguments(build_vlm("video_llama_3"))
    assert args["image_merge_sizes"] and args["image_grid_thw"] and args["pixel_values"]


class Features(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(4, self.width)


def test_image_features_must_be_rows_of_the_language_width() -> None:
    """4 rows of 128 values are 8 rows of 64 values, but not the language model's rows: refused, shapes named."""
    assert _count_tokens(Features(64), {"pixel_values": torch.zeros(1)}, 64) == 4
    with pytest.raises(ValueError, match=r"shapes \[\(4, 128\)\] are not rows of the language width 64"):
        _count_tokens(Features(128), {"pixel_values": torch.zeros(1)}, 64)
