"""The whole-VLM inspector: tower, connector and language model read off one image + text run.

Two kinds of evidence: toy image-text models whose three parts are known by construction (every connector kind,
each injection, a tower read at its second-to-last layer), and transformers' own VLMs built tiny offline, checked
against what their modeling files do (cited per row). Plus: renaming every module and parameter changes nothing,
and bad inputs are refused with the parameter named.
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from normatlas.factory import is_vlm_type
from normatlas.inspect import UntraceableModel
from normatlas.inspect.vlm import ConnectorKind, Injection, inspect_vlm, inspect_vlm_target
from normatlas.vocabulary import Operator, PlacementKind, QKNormKind, branch_scale_word
from tests.renamer import old_names, renamed
from tests.test_rename_invariance import lying_scheme, relabel

D, V, P = 16, 32, 12  # width, vocabulary, flattened patch size
IMAGE = V - 1  # the image placeholder id


# --------------------------------------------------------------------------- toy parts
class Block(nn.Module):
    """x + MLP(N(x)): a Pre-norm residual MLP block (its norm given)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.up, self.down = norm, nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class CrossBlock(nn.Module):
    """x + tanh(g) * Attn(N(x), image): Flamingo's gated cross-attention (``gate=False``: no tanh gate)."""

    def __init__(self, gate: bool) -> None:
        super().__init__()
        self.norm, self.q, self.k, self.v = nn.RMSNorm(D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.gate = nn.Parameter(torch.full((1,), 0.5)) if gate else None

    def forward(self, x: Tensor, image: Tensor) -> Tensor:
        q = self.q(self.norm(x))
        att = torch.softmax(q @ self.k(image).transpose(-1, -2) / math.sqrt(D), dim=-1) @ self.v(image)
        return x + (torch.tanh(self.gate) * att if self.gate is not None else att)


class Connector(nn.Module):
    """One connector of each kind, on (B, 16 patches, D) tower features."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(4 * D if kind == "merger" else D)
        self.a = nn.Linear(4 * D if kind == "merger" else D, D)
        self.b = nn.Linear(D, D)
        self.queries = nn.Parameter(torch.randn(4, D))

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "linear":
            return self.a(x) / 4.0
        if self.kind == "mlp":
            return self.b(nn.functional.gelu(self.a(x)))
        if self.kind == "merger":  # 4 rows -> one row of 4 D, normalised, projected
            return self.b(nn.functional.gelu(self.a(self.norm(x.reshape(x.shape[0], -1, 4 * D)))))
        if self.kind == "pooling":  # 4 x 4 patches -> 2 x 2, normalised
            grid = x.transpose(1, 2).reshape(x.shape[0], D, 4, 4)
            pooled = nn.functional.avg_pool2d(grid, 2).flatten(2).transpose(1, 2)
            return self.a(self.norm(pooled))
        # resampler: 4 learned queries attend to the patches
        att = torch.softmax(self.queries @ self.a(x).transpose(-1, -2), dim=-1)
        return self.b(att @ x)


class ToyVLM(nn.Module):
    """Tower (patch embedding, 2 Pre-LN blocks, final LayerNorm) -> connector -> LM (2 Pre-RMSNorm blocks,
    final RMSNorm), the image rows placed at the placeholder tokens; or the image read by cross-attention."""

    def __init__(self, connector: str = "mlp", tap: int = -1, cross: str | None = None) -> None:
        super().__init__()
        self.patch = nn.Linear(P, D)
        self.tower = nn.ModuleList([Block(nn.LayerNorm(D)) for _ in range(2)])
        self.tower_norm = nn.LayerNorm(D)
        self.tap, self.connector = tap, Connector(connector)
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(nn.RMSNorm(D)) for _ in range(2)])
        self.cross = CrossBlock(cross == "gated") if cross else None
        self.final, self.head = nn.RMSNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
        x, states = self.patch(pixel_values), []
        for block in self.tower:
            x = block(x)
            states.append(x)
        feats = self.connector(self.tower_norm(x) if self.tap == -1 else states[self.tap])
        h = self.embed(input_ids)
        if self.cross is None:
            h = h.masked_scatter((input_ids == IMAGE).unsqueeze(-1), feats)
        for i, block in enumerate(self.layers):
            h = block(h)
            if self.cross is not None and i == 0:
                h = self.cross(h, feats)
        return self.head(self.final(h))


def toy_inputs(tokens: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V - 1, (1, 3), generator=gen).tolist()[0] + [IMAGE] * tokens + [2, 3]
    return {"input_ids": torch.tensor([ids]), "pixel_values": torch.randn(1, 16, P, generator=gen)}


TOKENS = {"linear": 16, "mlp": 16, "merger": 4, "pooling": 4, "resampler": 4}
KINDS = {
    "linear": ConnectorKind.LINEAR,
    "mlp": ConnectorKind.MLP,
    "merger": ConnectorKind.PATCH_MERGER,
    "pooling": ConnectorKind.POOLING,
    "resampler": ConnectorKind.RESAMPLER,
}
NORMS = {"merger": [Operator.LAYERNORM], "pooling": [Operator.LAYERNORM]}


def _toy(kind: str, **kw: Any) -> tuple[ToyVLM, dict[str, Tensor]]:
    torch.manual_seed(0)
    return ToyVLM(kind, **kw).eval(), toy_inputs(TOKENS[kind])


@pytest.mark.parametrize("kind", list(KINDS))
def test_toy_connector_kind_norms_and_token_counts(kind: str) -> None:
    model, x = _toy(kind)
    rep = inspect_vlm(model, x, name=kind)
    assert rep.connector.kind is KINDS[kind]
    assert rep.connector.norms == NORMS.get(kind, [])
    assert (rep.connector.tokens_in, rep.connector.tokens_out) == (16, TOKENS[kind])
    assert rep.connector.row_merge == (4 if kind in ("merger", "pooling") else None)
    assert rep.connector.scale == (0.25 if kind == "linear" else None)
    assert rep.injection is Injection.EMBEDDING_STREAM


def test_toy_tower_and_language_model_are_read_apart() -> None:
    rep = inspect_vlm(*_toy("mlp"))
    v, lm = rep.vision, rep.language
    assert (v.operator, v.placement, v.layers, v.final_norm) == (
        Operator.LAYERNORM, PlacementKind.PRE, 2, Operator.LAYERNORM,
    )  # fmt: skip
    assert (lm.operator, lm.placement, lm.layers, lm.final_norm) == (
        Operator.RMSNORM, PlacementKind.PRE, 2, Operator.RMSNORM,
    )  # fmt: skip
    assert rep.tower_layers_run == 2 and rep.batch_stat_norms == 0


def test_toy_tower_read_at_its_second_to_last_layer() -> None:
    """The language model reads layer 0 of 2 (LLaVA's vision_feature_layer=-2): one layer run, final norm unused."""
    rep = inspect_vlm(*_toy("mlp", tap=0))
    assert rep.tower_layers_run == 1
    assert rep.connector.kind is ConnectorKind.MLP and rep.connector.norms == []


@pytest.mark.parametrize(
    ("cross", "want"), [("plain", Injection.CROSS_ATTENTION), ("gated", Injection.GATED_CROSS_ATTENTION)]
)
def test_toy_cross_attention_injection(cross: str, want: Injection) -> None:
    model, x = _toy("mlp", cross=cross)
    x["input_ids"] = x["input_ids"][:, :4]  # no placeholders: the image enters as keys / values
    assert inspect_vlm(model, x).injection is want


def _assert_same_report(a: dict, b: dict, back: dict) -> None:
    """Two VLM reports equal once timings are dropped and the twin's module labels are mapped back."""
    for d in (a, b):
        d.pop("seconds")
        for part in ("vision", "language"):
            d[part].pop("seconds")
    b["connector"]["modules"] = sorted(relabel(m, back) for m in b["connector"]["modules"])
    for part in ("vision", "language"):
        for norm in b[part]["norms"]:
            norm["module"] = relabel(norm["module"], back)
    assert a == b


def test_toy_report_is_rename_invariant() -> None:
    model, x = _toy("merger")
    twin = renamed(model, lying_scheme(random.Random("vlm"), root=model))
    back = old_names(model, twin)
    a, b = inspect_vlm(model, x, name="m").to_dict(detail=True), inspect_vlm(twin, x, name="m").to_dict(detail=True)
    _assert_same_report(a, b, back)


def test_bad_inputs_are_refused_with_the_parameter_named() -> None:
    model, x = _toy("mlp")
    with pytest.raises(ValueError, match="pixel_values"):
        inspect_vlm(model, {"input_ids": x["input_ids"]})
    with pytest.raises(UntraceableModel, match="image \\+ text"):
        inspect_vlm(model, {**x, "pixel_values": torch.randn(1, 16, P + 1)})
    with pytest.raises(ValueError, match="no vision_config"):
        inspect_vlm_target("llama")


class TowerModule(nn.Module):
    """The tower as one module call: patch embedding, 2 Pre-LN blocks, its own final LayerNorm (``final=False``:
    none, like Pixtral)."""

    def __init__(self, final: bool) -> None:
        super().__init__()
        self.patch = nn.Linear(P, D)
        self.blocks = nn.ModuleList([Block(nn.LayerNorm(D)) for _ in range(2)])
        self.final = nn.LayerNorm(D) if final else nn.Identity()

    def forward(self, pixel_values: Tensor) -> Tensor:
        x = self.patch(pixel_values)
        for block in self.blocks:
            x = block(x)
        return self.final(x)


class Projector(nn.Module):
    """Mistral 3's projector shape: a norm on every token at the tower's width, then linear-GELU-linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b = nn.RMSNorm(D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(nn.functional.gelu(self.a(self.norm(x))))


class ToyTowered(nn.Module):
    """A tower module and a projector module, the image rows placed at the placeholders of a 2-layer LM."""

    def __init__(self, tower_final: bool) -> None:
        super().__init__()
        self.tower, self.projector = TowerModule(tower_final), Projector()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(nn.RMSNorm(D)) for _ in range(2)])
        self.final, self.head = nn.RMSNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
        h = self.embed(input_ids)
        h = h.masked_scatter((input_ids == IMAGE).unsqueeze(-1), self.projector(self.tower(pixel_values)))
        for block in self.layers:
            h = block(h)
        return self.head(self.final(h))


@pytest.mark.parametrize("tower_final", [False, True])
def test_a_norm_outside_the_tower_call_is_the_connectors(tower_final: bool) -> None:
    """Mistral 3's shape: a norm on every token of the tower's last stream value, run by the projector's module,
    is the connector's norm, not the tower's final norm; a final norm the tower's own call runs stays the tower's."""
    torch.manual_seed(0)
    rep = inspect_vlm(ToyTowered(tower_final).eval(), toy_inputs(16))
    assert rep.vision.final_norm is (Operator.LAYERNORM if tower_final else Operator.NONE)
    assert (rep.connector.kind, rep.connector.norms, rep.connector.norm_widths) == (
        ConnectorKind.MLP, [Operator.RMSNORM], [D],
    )  # fmt: skip
    assert not rep.notes  # the tower was found as a module call


class ToyVQ(nn.Module):
    """Chameleon's shape: a Pre-LN tower, the nearest code of a codebook per patch (argmin), the code ids looked up
    in the language model's own embedding table and placed at the placeholders."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = TowerModule(final=True)
        self.codebook = nn.Parameter(torch.randn(8, D))
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(nn.RMSNorm(D)) for _ in range(2)])
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
        h = self.embed(input_ids)
        codes = torch.cdist(self.tower(pixel_values), self.codebook.unsqueeze(0)).argmin(-1)
        h = h.masked_scatter((input_ids == IMAGE).unsqueeze(-1), self.embed(codes + 4))
        for block in self.layers:
            h = block(h)
        return self.head(h)


def test_toy_discrete_tokens() -> None:
    """The image reaches the language model only through integer code ids: vq-tokens, injected as tokens."""
    torch.manual_seed(0)
    rep = inspect_vlm(ToyVQ().eval(), toy_inputs(16))
    assert (rep.connector.kind, rep.injection) == (ConnectorKind.VQ_TOKENS, Injection.TOKENS)
    assert rep.vision.final_norm is Operator.LAYERNORM and rep.connector.norms == []
    assert rep.check_row()["connector"] == "vq-tokens"


class QueryResampler(nn.Module):
    """4 learned queries, LayerNormed before they attend to the patches (BLIP-2's Q-Former normalises its queries)."""

    def __init__(self) -> None:
        super().__init__()
        self.queries, self.qnorm = nn.Parameter(torch.randn(4, D)), nn.LayerNorm(D)
        self.k, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        q = self.qnorm(self.queries)
        att = torch.softmax(q @ self.k(x).transpose(-1, -2) * D**-0.5, dim=-1)  # a scaled score
        return self.out(att @ x)


def test_toy_resampler_norm_on_its_learned_queries_is_the_connectors() -> None:
    """The queries' LayerNorm is computed from parameters alone (not from the image), yet it is the connector's;
    the scaled score (q k^T times a constant) still reads as an attention."""
    model, _ = _toy("mlp")
    model.connector = QueryResampler()
    rep = inspect_vlm(model.eval(), toy_inputs(4))
    assert rep.connector.kind is ConnectorKind.RESAMPLER and rep.connector.norms == [Operator.LAYERNORM]


# --------------------------------------------------------------------------- transformers' VLMs, tiny
# (model type, tower operator, tower placement, connector kind, connector norms, language operator, extra checks)
# read from transformers 5's modeling files: LLaVA's projector is linear-GELU-linear on hidden_states[-2]
# (modeling_llava.py: LlavaMultiModalProjector, vision_feature_layer=-2); Qwen2-VL's PatchMerger normalises with
# LayerNorm ``ln_q`` then views 4 rows as one (modeling_qwen2_vl.py), Qwen2.5-VL's with Qwen2RMSNorm; PaliGemma's
# projector is one Linear and the features are divided by sqrt(text hidden_size) (modeling_paligemma.py);
# Gemma 3's projector average-pools then RMSNorms (Gemma3MultiModalProjector: avg_pool, mm_soft_emb_norm);
# Idefics3 pixel-shuffles then one Linear (Idefics3Connector); InternVL pixel-shuffles, LayerNorms, MLPs
# (InternVLMultiModalProjector) on an InternViT with LayerScale (lambda_1 / lambda_2); Ovis 2's visual tokenizer
# softmaxes over a visual vocabulary and multiplies by its embedding table (Ovis2VisualEmbeddingTable); LLaVA-NeXT
# projects every any-resolution tile with LLaVA's MLP and appends an image_newline row per line (no norm).
HF = [
    ("llava", Operator.LAYERNORM, ConnectorKind.MLP, [], Operator.RMSNORM),
    ("qwen2_vl", Operator.LAYERNORM, ConnectorKind.PATCH_MERGER, [Operator.LAYERNORM], Operator.RMSNORM),
    ("qwen2_5_vl", Operator.RMSNORM, ConnectorKind.PATCH_MERGER, [Operator.RMSNORM], Operator.RMSNORM),
    ("paligemma", Operator.LAYERNORM, ConnectorKind.LINEAR, [], Operator.RMSNORM),
    ("gemma3", Operator.LAYERNORM, ConnectorKind.POOLING, [Operator.RMSNORM], Operator.RMSNORM),
    ("idefics3", Operator.LAYERNORM, ConnectorKind.PATCH_MERGER, [], Operator.RMSNORM),
    ("internvl", Operator.LAYERNORM, ConnectorKind.PATCH_MERGER, [Operator.LAYERNORM], Operator.RMSNORM),
    ("ovis2", Operator.RMSNORM, ConnectorKind.SOFT_TOKENS, [Operator.LAYERNORM], Operator.RMSNORM),
    ("llava_next", Operator.LAYERNORM, ConnectorKind.MLP, [], Operator.RMSNORM),  # any-resolution: base + one tile
    # DeepseekVLAligner: linear1-GELU-linear2, no norm (modeling_deepseek_vl.py; get_image_features on its
    # DeepseekVLModel, not the head); Kimi_K25MultimodalProjection: pre_norm LayerNorm(projection_hidden_size = the
    # tower width), then view merge_kernel_size 2 x 2 rows as one, in_proj-GELU-out_proj (modeling_kimi_k25.py; its
    # tower reads (C, p, p) patches with image_grid_thw)
    ("deepseek_vl", Operator.LAYERNORM, ConnectorKind.MLP, [], Operator.RMSNORM),
    ("kimi_k25", Operator.LAYERNORM, ConnectorKind.PATCH_MERGER, [Operator.LAYERNORM], Operator.RMSNORM),
]


@pytest.fixture(scope="module")
def hf_reports() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    return {row[0]: inspect_vlm_target(row[0], probe=False) for row in HF}


@pytest.mark.parametrize("row", HF, ids=[r[0] for r in HF])
def test_transformers_vlm_three_parts(row: tuple[Any, ...], hf_reports: dict[str, Any]) -> None:
    model_type, tower, kind, norms, lm = row
    rep = hf_reports[model_type]
    assert rep.vision.operator is tower and rep.vision.placement is PlacementKind.PRE
    assert rep.connector.kind is kind and rep.connector.norms == norms
    assert rep.language.operator is lm
    assert rep.injection is Injection.EMBEDDING_STREAM and rep.image_tokens == rep.connector.tokens_out
    if model_type == "llava_next":  # the newline rows: more rows reach the language model than leave the tower
        assert rep.connector.tokens_out > rep.connector.tokens_in


def test_transformers_vlm_specifics(hf_reports: dict[str, Any]) -> None:
    llava, pali, gemma, intern = (hf_reports[k] for k in ("llava", "paligemma", "gemma3", "internvl"))
    assert llava.tower_layers_run == llava.vision.layers - 1  # hidden_states[-2]
    assert pali.connector.scale is None  # transformers 5 no longer divides the features by sqrt(hidden_size)
    assert pali.language.embedding_scale == pytest.approx(math.sqrt(64))  # Gemma's sqrt(hidden_size)
    assert gemma.language.placement is PlacementKind.PERI and gemma.language.qk_norm is QKNormKind.PER_HEAD
    assert branch_scale_word(intern.vision.branch_scale) == "per-channel"
    assert hf_reports["qwen2_vl"].connector.row_merge == 4
    kimi = hf_reports["kimi_k25"].connector
    assert (kimi.norm_widths, kimi.row_merge) == ([64], 4)  # the LayerNorm runs at the tower width, before the merge


# The image-text models that need more than one image and its placeholders, each read whole, checked against its
# modeling file (transformers 5.24, models/<name>/modeling_<name>.py):
# * mllama: MllamaVisionModel runs a local then a gated global encoder of Pre-LN layers (input_layernorm /
#   post_attention_layernorm nn.LayerNorm; layernorm_post sits between the two encoders, nothing after the global
#   one) and concatenates the last state with intermediate_layers_indices' states; multi_modal_projector is one
#   nn.Linear; MllamaCrossAttentionDecoderLayer adds cross_attn_attn_gate.tanh() * attention; q_norm / k_norm
#   (MllamaTextRMSNorm) only in MllamaTextCrossAttention, none in MllamaTextSelfAttention.
# * chameleon: ChameleonVQVAEEncoder's resnet blocks GroupNorm before each conv (norm1 / norm2), norm_out GroupNorm
#   at the end; ChameleonVQVAEVectorQuantizer takes the argmin over the codebook, get_image_tokens maps the ids to
#   BPE ids, embed_tokens embeds them; ChameleonAttention q_norm / k_norm LayerNorm((heads, head_dim)).
# * idefics2: Idefics2VisionTransformer (Pre-LN, post_layernorm), Idefics2Connector: modality_projection MLP, then
#   Idefics2PerceiverResampler: resampler_depth (3) layers of input_latents_norm / input_context_norm /
#   post_attention_layernorm (Idefics2RMSNorm) and a final norm; resampler_n_latents (64) rows out.
# * blip-2: Blip2VisionModel (Pre-LN, post_layernorm on every token and on the pooled one); the Q-Former
#   LayerNorms its num_query_tokens (32) learned queries (Blip2QFormerModel.layernorm), then per layer the
#   self-attention output LayerNorm, the cross-attention one (every cross_attention_frequency = 2 layers: layer 0
#   of 2) and the query FFN's: 1 + 3 + 2 = 6; language_projection one Linear; the OPT language model is Pre-LN.
# * vipllava: VipLlavaMultiModalProjector.projector_layernorm is nn.LayerNorm(len(vision_feature_layer) *
#   vision hidden_size) over the concatenated taps, then linear-act-linear; the CLIP tower's post_layernorm only
#   reads the pooled CLS row.
# * mistral3: Mistral3MultiModalProjector.norm (Mistral3RMSNorm over the tower width) runs before the patch merger;
#   PixtralVisionModel has ln_pre before its transformer and no norm after it.
WHOLE = ["mllama", "chameleon", "idefics2", "blip-2", "vipllava", "mistral3"]


@pytest.fixture(scope="module")
def whole_reports() -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    return {mt: inspect_vlm_target(mt, probe=False) for mt in WHOLE}


def test_mllama_tiles_and_gated_cross_attention(whole_reports: dict[str, Any]) -> None:
    rep = whole_reports["mllama"]
    v, c, lm = rep.vision, rep.connector, rep.language
    assert (v.operator, v.placement, v.final_norm) == (Operator.LAYERNORM, PlacementKind.PRE, Operator.NONE)
    assert v.layers == 3  # 2 local layers + 1 gated global layer (num_global_layers shrunk to 1)
    assert (c.kind, c.norms, c.taps) == (ConnectorKind.LINEAR, [], 2)  # last state + one intermediate layer
    assert rep.injection is Injection.GATED_CROSS_ATTENTION
    assert (lm.operator, lm.placement, lm.qk_norm) == (Operator.RMSNORM, PlacementKind.PRE, QKNormKind.MIXED)
    assert rep.check_row()["connector"] == "gated-cross-attention"
    # the self-attention layer has no QK-norm, the cross-attention layer normalises its text queries (q_norm, in
    # the language model) and its keys, computed from the image alone (k_norm: in the image part, after the
    # connector's output, so neither the connector's nor the language model's)
    assert [(a.layer, a.qk_norm) for a in lm.attention] == [(0, QKNormKind.NONE), (1, QKNormKind.PER_HEAD)]
    assert [n.role.value for n in lm.norms].count("qk") == 1
    assert rep.image_key_norm is QKNormKind.PER_HEAD and c.norms == []
    assert [n for n in rep.notes if "layer 1's cross-attention takes keys computed from the image alone" in n]


def test_chameleon_image_becomes_vq_tokens(whole_reports: dict[str, Any]) -> None:
    rep = whole_reports["chameleon"]
    v, c, lm = rep.vision, rep.connector, rep.language
    assert (v.operator, v.placement, v.final_norm) == (Operator.GROUPNORM, PlacementKind.PRE, Operator.GROUPNORM)
    assert (c.kind, c.norms, rep.injection) == (ConnectorKind.VQ_TOKENS, [], Injection.TOKENS)
    assert c.tokens_out == rep.image_tokens == 16  # an 8 x 8 image, one downsampling: 4 x 4 codes
    assert (lm.operator, lm.placement, lm.qk_norm) == (Operator.RMSNORM, PlacementKind.PRE, QKNormKind.PER_HEAD_GAINS)


@pytest.mark.parametrize(
    ("model_type", "norms", "tokens_out", "lm"),
    [
        ("idefics2", [Operator.RMSNORM] * 10, 64, Operator.RMSNORM),
        ("blip-2", [Operator.LAYERNORM] * 6, 32, Operator.LAYERNORM),
    ],
)
def test_resampler_connectors(
    model_type: str, norms: list[Operator], tokens_out: int, lm: Operator, whole_reports: dict[str, Any]
) -> None:
    rep = whole_reports[model_type]
    v, c = rep.vision, rep.connector
    assert (v.operator, v.placement, v.final_norm) == (Operator.LAYERNORM, PlacementKind.PRE, Operator.LAYERNORM)
    assert (c.kind, c.norms, c.tokens_out, c.taps) == (ConnectorKind.RESAMPLER, norms, tokens_out, 1)
    assert rep.injection is Injection.EMBEDDING_STREAM and rep.language.operator is lm


def test_vipllava_layernorm_over_concatenated_taps(whole_reports: dict[str, Any]) -> None:
    rep = whole_reports["vipllava"]
    c = rep.connector
    assert (rep.vision.final_norm, rep.vision.pooled_norm) == (Operator.NONE, Operator.LAYERNORM)
    assert (c.kind, c.norms, c.taps) == (ConnectorKind.MLP, [Operator.LAYERNORM], 2)
    assert c.norm_widths == [2 * 64]  # two tapped layers of the width-64 tower, concatenated


def test_mistral3_projector_norm_is_the_connectors_not_pixtrals(whole_reports: dict[str, Any]) -> None:
    """Pixtral has no norm after its transformer; the RMSNorm on every token at the tower's width is the projector's
    (it used to read as the tower's final norm)."""
    rep = whole_reports["mistral3"]
    v, c = rep.vision, rep.connector
    assert (v.operator, v.placement, v.final_norm) == (Operator.RMSNORM, PlacementKind.PRE, Operator.NONE)
    assert (c.kind, c.norms, c.norm_widths, c.row_merge) == (ConnectorKind.PATCH_MERGER, [Operator.RMSNORM], [64], 4)
    row = rep.check_row()
    assert (row["vision_tower_norm"], row["connector"], row["connector_norm"]) == ("rmsnorm", "patch-merger", "rmsnorm")
    assert v.embedding_norm is Operator.RMSNORM  # ln_pre, on the patch embeddings before the transformer


def test_is_vlm_type_reads_transformers_registry() -> None:
    assert is_vlm_type("llava") and is_vlm_type("qwen2_vl")
    assert is_vlm_type("chameleon")  # no vision_config: a VQ image tokenizer (vq_config)
    assert not is_vlm_type("llama") and not is_vlm_type("clip") and not is_vlm_type("not-a-model")


# --------------------------------------------------------------------------- more transformers VLMs
def test_transformers_vlm_report_is_rename_invariant() -> None:
    """LLaVA renamed with lying names (a norm called ``q_proj``, a projector called ``layernorm``...): same report."""
    from normatlas.factory import build_vlm, vlm_inputs

    warnings.filterwarnings("ignore")
    model = build_vlm("llava")
    x = vlm_inputs(model)
    twin = renamed(model, lying_scheme(random.Random("llava"), root=model))
    back = old_names(model, twin)
    a = inspect_vlm(model, x, name="llava", probe=False).to_dict(detail=True)
    b = inspect_vlm(twin, x, name="llava", probe=False).to_dict(detail=True)
    _assert_same_report(a, b, back)


def test_transformers_gated_cross_attention_vlm() -> None:
    """Idefics (1) reads the image through cross-attention layers gated by tanh(alpha) (modeling_idefics.py
    IdeficsGatedCrossAttentionLayer); with the default config (no perceiver resampler) nothing lies between the
    tower and those layers' key / value projections, which belong to the language model."""
    warnings.filterwarnings("ignore")
    rep = inspect_vlm_target("idefics", probe=False)
    assert rep.injection is Injection.GATED_CROSS_ATTENTION
    assert rep.connector.kind is ConnectorKind.NONE and rep.connector.projections == 0
    assert (rep.vision.operator, rep.language.operator, rep.language.placement) == (
        Operator.LAYERNORM, Operator.RMSNORM, PlacementKind.PRE,
    )  # fmt: skip
    assert rep.check_row()["connector"] == "gated-cross-attention"
