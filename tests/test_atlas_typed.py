"""Issue 34's data: every record's design fields typed, one spelling per value, the fixes and slips with their
sources, and every model's papers in the bibliography."""

from __future__ import annotations

import enum
import re
from collections import defaultdict
from pathlib import Path

import pytest

from normatlas import atlas
from normatlas.atlas.design import DESIGN_FIELDS, RecordOperator, Unclear, allowed, parse_field, typed_design
from normatlas.atlas.papers import paper
from normatlas.vocabulary import ConnectorKind, EmbeddingScale, Injection, QKNormKind, RopeOrder

MODELS = atlas.models()
BY_NAME = {r["name"]: r for r in MODELS}
PAPER_KEYS = {p["key"] for p in atlas.papers()}
ESSAY = Path("/work/shared/essay/the-geometry-of-normalization.txt")


@pytest.mark.parametrize("rec", MODELS, ids=[r["name"] for r in MODELS])
def test_every_design_field_parses_into_its_enum(rec: dict) -> None:
    design = typed_design(rec)
    assert tuple(design) == DESIGN_FIELDS
    for field, value in design.items():
        if field in ("attn_softcap", "final_logit_softcap"):
            assert value is None or isinstance(value, (float, Unclear)), (field, value)
        elif field == "gain_convention":
            assert value is None or isinstance(value, enum.Enum)  # None: no gain ("none" in the data file)
        elif field in ("vision_tower_norm", "connector", "connector_norm"):
            assert value is None or isinstance(value, enum.Enum)  # None: not an image-text model
        else:
            assert isinstance(value, enum.Enum), (field, value)
        spelled = rec[field]
        if isinstance(value, enum.Enum):
            assert spelled == value.value  # one spelling: the enum's value, nothing else
    if rec["qk_norm"] == QKNormKind.NONE.value:
        assert design["qk_norm_rope"] is RopeOrder.NOT_APPLICABLE


@pytest.mark.parametrize(
    ("field", "value"),
    [("qk_norm", "yes"), ("qk_norm_rope", "before"), ("final_norm", "LayerNorm"), ("attn_softcap", -1.0),
     ("embedding_scale", 8.0), ("connector", "projector"), ("gain_convention", None)],
)  # fmt: skip
def test_a_bad_value_names_the_record_field_value_and_allowed(field: str, value: object) -> None:
    rec = dict(BY_NAME["Gemma 2"], **{field: value})
    with pytest.raises(ValueError) as err:
        atlas.validate_model(rec)
    msg = str(err.value)
    assert msg.startswith(f"model 'Gemma 2': {field}={value!r} is not one of")
    assert all(word in msg for word in allowed(field))


def _spelling_clashes(values: list[str]) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = defaultdict(set)
    for v in values:
        seen[v.casefold()].add(v)
    return {k: s for k, s in seen.items() if len(s) > 1}


def test_the_clash_finder_catches_llama_spelt_twice() -> None:
    assert _spelling_clashes(["LLaMA", "Llama", "Gemma"]) == {"llama": {"LLaMA", "Llama"}}


@pytest.mark.parametrize("field", ["family", "kind", *DESIGN_FIELDS])
def test_one_spelling_per_facet_value(field: str) -> None:
    """Values equal up to case are identical (the page's facets list each once)."""
    values = [str(r[field]) for r in MODELS if r[field] is not None]
    assert _spelling_clashes(values) == {}
    if field == "family":
        assert "LLaMA" not in values and "Llama" in values


def test_every_model_paper_key_is_in_the_bibliography() -> None:
    for rec in MODELS:
        assert set(rec["papers"]) <= PAPER_KEYS, rec["name"]
        for key in re.findall(r"paper:\s*([a-z][a-z0-9_]*)", rec["source"] + " " + (rec["essay_differs"] or "")):
            assert key in PAPER_KEYS, (rec["name"], key)


def test_years_come_from_the_papers() -> None:
    """A record's year is its first paper's (or was set before from its source); the records still without one
    have no paper of their own in the bibliography."""
    missing = {r["name"] for r in MODELS if r["year"] is None}
    assert missing == {"Qwen3-Next", "InternLM3", "MiniCPM-V 4.6", "Molmo2", "Qwen2.5-7B", "Kimi K2.5"}
    pairs = (("BERT", "bert2018"), ("DeepSeek", "deepseekv3_2024"), ("Pixtral", "pixtral2024"), ("BiT", "bit2019"))
    for name, key in pairs:
        assert BY_NAME[name]["year"] == paper(key)["year"]


# (model record, paper key, arXiv id): the papers issue 34 asked for, each confirmed and linked
LINKED = [
    ("Pixtral", "pixtral2024", "2410.07073"),
    ("CogVLM", "cogvlm2023", "2311.03079"),
    ("Mini-Gemini", "minigemini2024", "2403.18814"),
    ("OpenFlamingo", "openflamingo2023", "2308.01390"),
    ("Idefics (1)", "obelics2023", "2306.16527"),
    ("MiniCPM-V", "minicpmv2024", "2408.01800"),
    ("Qwen-VL", "qwenvl2023", "2308.12966"),
    ("CoCa", "coca2022", "2205.01917"),
    ("InternViT", "internvl2023", "2312.14238"),
    ("InternVL (2.5 / 3)", "internvl2023", "2312.14238"),
    ("BiT", "bit2019", "1912.11370"),
    ("OpenCLIP ViT", "openclip2022", "2212.07143"),
    ("Kimi", "kimik2_2025", "2507.20534"),
    ("Pangu Light", "pangu_light2025", "2505.20155"),
    ("NaViT", "navit2023", "2307.06304"),
]


@pytest.mark.parametrize(("name", "key", "arxiv"), LINKED, ids=[n for n, _, _ in LINKED])
def test_requested_papers_are_confirmed_and_linked(name: str, key: str, arxiv: str) -> None:
    p = paper(key)
    assert p["arxiv"] == arxiv and p["title"] and p["verified"], key
    assert key in BY_NAME[name]["papers"]


def test_got_ocr2_connector_has_no_norm() -> None:
    """The LayerNorms once cited are the vision encoder's neck (GotOcr2VisionNeck); GotOcr2MultiModalProjector is two
    strided convolutions and a Linear."""
    rec = BY_NAME["GOT-OCR 2.0"]
    assert (rec["vision_tower_norm"], rec["connector"], rec["connector_norm"]) == ("layernorm", "patch-merger", "none")
    assert "GotOcr2VisionNeck" in rec["source"] and "GotOcr2MultiModalProjector" in rec["source"]


def test_got_ocr2_neck_inspects_as_the_towers() -> None:
    pytest.importorskip("transformers")
    from normatlas.cli.atlas_cmd import inspected_row

    row = inspected_row("got_ocr2")
    assert (row["vision_tower_norm"], row["connector"], row["connector_norm"]) == ("layernorm", "patch-merger", "none")


def test_qk_norm_origin_is_henry_2020() -> None:
    henry, vit22b = paper("henry2020"), paper("vit22b2023")
    assert henry["title"] == "Query-Key Normalization for Transformers" and henry["arxiv"] == "2010.04245"
    assert henry["year"] < vit22b["year"]
    assert henry["essay_differs"] and "ViT-22B" in henry["essay_differs"]
    rec = BY_NAME["ViT-22B"]
    assert "henry2020" in rec["papers"] and "paper:henry2020" in rec["essay_differs"]
    assert rec["qk_norm"] == "unclear"  # the page read gives no kind: not the old non-vocabulary "yes"


def test_layerscale_init_slip_is_flagged() -> None:
    for text in (BY_NAME["CaiT"]["essay_differs"], paper("cait2021")["essay_differs"]):
        assert "~1e-4 or 1e-5" in text and all(v in text for v in ("0.1", "1e-5", "1e-6"))
        assert "paperswithcode.com/method/layerscale" in text


def test_glm_connector_norm_figure_named_for_two_models_is_flagged() -> None:
    for name in ("GLM-4.1V", "GLM-4.5V"):
        text = BY_NAME[name]["essay_differs"]
        assert "GLM-4.1V ≈ 4.6" in text and "GLM-4.5V" in text and "4.6–4.8" in text
    assert "GLM-4.5V" in paper("glm41v2025")["essay_differs"]


def test_pangu_record_split_into_ultra_and_light() -> None:
    assert "Pangu (38B)" not in BY_NAME
    ultra, light = BY_NAME["Pangu Ultra (135B)"], BY_NAME["Pangu Light"]
    assert ultra["papers"] == ["pangu_ultra2025"] and ultra["placement"] == "peri"
    assert light["papers"] == ["pangu_light2025"] and light["operator"] == "rmsnorm"
    assert paper("pangu_light2025")["arxiv"] == "2505.20155"
    assert "absorb" in light["source"] and "paper:pangu_light2025" in ultra["essay_differs"]


@pytest.mark.skipif(not ESSAY.exists(), reason="essay not present")
def test_flagged_essay_lines_say_what_the_flags_quote() -> None:
    lines = ESSAY.read_text().splitlines()
    assert "ViT-22B (2023) — where it was introduced" in lines[178]
    assert "~1e-4 or 1e-5" in lines[190]
    assert "GLM-4.1V ≈ 4.6" in lines[267] and "GLM-4.5V" in lines[278]
    assert "38B model" in lines[155] and "post-RMSNorm" in lines[155]


def test_navit_record() -> None:
    rec = BY_NAME["NaViT"]
    got = (rec["kind"], rec["operator"], rec["placement"], rec["papers"])
    assert got == ("vision", "layernorm", "pre", ["navit2023"])


def test_embedding_scale_kinds() -> None:
    assert EmbeddingScale.of(None, 64) is EmbeddingScale.NONE and EmbeddingScale.of(1.0, 64) is EmbeddingScale.NONE
    assert EmbeddingScale.of(8.0, 64) is EmbeddingScale.SQRT_D_MODEL
    assert EmbeddingScale.of(12.0, 64) is EmbeddingScale.CONSTANT


def test_parse_field_members() -> None:
    assert parse_field("m", "connector", "gated-cross-attention") is Injection.GATED_CROSS_ATTENTION
    assert parse_field("m", "connector", "patch-merger") is ConnectorKind.PATCH_MERGER
    assert parse_field("m", "operator", "batchnorm") is RecordOperator.BATCHNORM
    assert parse_field("m", "attn_softcap", 50) == 50.0 and parse_field("m", "attn_softcap", "none") is None
    assert parse_field("m", "final_norm", "unclear") is Unclear.UNCLEAR


def test_check_compares_every_typed_field() -> None:
    """A soft-cap, the embedding scale (as a kind, from the row's hidden size) and the QK-norm's RoPE order are
    compared like the operator: an agreement, or a disagreement naming both values."""
    gemma2 = {
        "operator": "rmsnorm", "placement": "peri", "qk_norm": "none", "qk_norm_rope": "n/a", "gain_convention": "1+w",
        "final_norm": "rmsnorm", "attn_softcap": 50.0, "final_logit_softcap": 30.0, "embedding_scale": 8.0,
        "hidden_size": 64,
    }  # fmt: skip
    rows = [r for r in atlas.check({"gemma2": gemma2}, include_agreements=True) if r["hf_model_type"] == "gemma2"]
    assert {r["field"] for r in rows} == set(DESIGN_FIELDS) - {"vision_tower_norm", "connector", "connector_norm"}
    assert all(r["verdict"] == "agrees" for r in rows)
    off = dict(gemma2, attn_softcap=None, embedding_scale=None, qk_norm_rope="before-rope")
    bad = {r["field"]: r for r in atlas.check({"gemma2": off}) if r["hf_model_type"] == "gemma2"}
    assert set(bad) == {"attn_softcap", "embedding_scale", "qk_norm_rope"}
    assert (bad["attn_softcap"]["curated"], bad["attn_softcap"]["inspected"]) == (50.0, "none")
    assert (bad["embedding_scale"]["curated"], bad["embedding_scale"]["inspected"]) == ("sqrt-d-model", "none")
