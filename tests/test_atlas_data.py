"""The knowledge base: every model and paper record is checked, filters, the CLI, and --check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from normatlas import atlas
from normatlas.cli import main

MODELS = atlas.models()
PAPERS = atlas.papers()
ESSAY = Path("/work/shared/essay/the-geometry-of-normalization.txt")


@pytest.mark.parametrize("rec", MODELS, ids=[r["name"] for r in MODELS])
def test_model_record(rec: dict) -> None:
    atlas.validate_model(rec)
    assert tuple(rec) == atlas.MODEL_FIELDS
    assert rec["name"] and rec["family"] and rec["kind"]
    assert rec["source"].startswith(atlas.SOURCES), "every record names its source"
    assert rec["operator"] in atlas.OPERATORS
    assert rec["placement"] in atlas.PLACEMENTS and rec["qk_norm"] in atlas.QK_NORMS
    assert rec["year"] is None or 2015 <= rec["year"] <= 2026
    atlas.typed_design(rec)  # every design field parses into its vocabulary enum
    unclear = "unclear" in (rec["operator"], rec["placement"], rec["qk_norm"])
    assert rec["status"] in atlas.STATUSES
    by_source = (
        "code" if rec["source"].startswith("code:") else "paper" if rec["source"].startswith("paper:") else "essay"
    )
    assert rec["status"] == ("unclear" if unclear else by_source)
    if rec["essay_differs"] is not None:  # the record states the code (or paper); the essay's claim is kept beside it
        assert rec["source"].startswith(("code:", "paper:")) and rec["essay_differs"].startswith("essay")


def _cited_lines(text: str) -> list[int]:
    return [int(n) for group in re.findall(r"\blines? (\d+(?:, \d+)*)", text) for n in group.split(", ")]


@pytest.mark.skipif(not ESSAY.exists(), reason="essay not present")
@pytest.mark.parametrize(
    "rec", [r for r in MODELS if _cited_lines(r["source"] + (r["essay_differs"] or ""))], ids=lambda r: r["name"]
)
def test_cited_essay_lines_name_the_family(rec: dict) -> None:
    lines = ESSAY.read_text().splitlines()
    for n in _cited_lines(rec["source"] + (rec["essay_differs"] or "")):
        # case-blind: the data spells a family once (Llama); the essay may spell it its own way (LLaMA)
        named = rec["family"].lower() in lines[n - 1].lower()
        assert named, f"{rec['name']}: essay line {n} does not name {rec['family']}"


def test_essay_differences_are_the_code_checked_corrections() -> None:
    diff = {r["name"]: r for r in atlas.essay_differences()}
    assert set(diff) == {
        "Phi-1 / Phi-1.5 / Phi-2",
        "OLMoE",
        "ChatGLM2-6B",
        "GLM-4",
        "GLM-4-0414",
        "GLM-4.1V",
        "GLM-4.5V",
        "CogVLM",
        "Chameleon (7B)",
        "Gemma 3n",
        "Kimi",
        "SAM",  # the neck is a channels-first LayerNorm, not BatchNorm-family (tests/test_atlas_vision.py)
        "Mini-Gemini",  # the ConvNeXt branch and the connector normalise with LayerNorm, not BatchNorm-family
        "EVA",  # the stem is one Conv2d with no norm (baaivision/EVA PatchEmbed), not BatchNorm-family
        "Molmo2",  # the attentional-pooling connector has no norm (the essay: LayerNorms on queries and keys)
        "ViT-22B",  # QK-norm's origin: Henry et al. 2020 came first (paper:henry2020; tests/test_atlas_typed.py)
        "CaiT",  # LayerScale init by depth 0.1 / 1e-5 / 1e-6, not ~1e-4 or 1e-5
        "Pangu Ultra (135B)",  # the essay's 'Pangu, 2025' merges Pangu Ultra and Pangu Light
        "Pangu Light",
    }
    assert (diff["Phi-1 / Phi-1.5 / Phi-2"]["operator"], diff["Phi-1 / Phi-1.5 / Phi-2"]["placement"]) == (
        "layernorm",
        "parallel",
    )
    assert diff["OLMoE"]["placement"] == "pre" and diff["OLMoE"]["qk_norm"] == "flattened"
    assert diff["GLM-4"]["placement"] == "pre" and diff["GLM-4-0414"]["placement"] == "peri"
    assert diff["GLM-4.1V"]["placement"] == "peri" and diff["GLM-4.5V"]["placement"] == "pre"
    assert diff["Kimi"]["qk_norm"] == "none" and diff["Kimi"]["hf_model_types"] == ["deepseek_v3"]  # MLA, QK-Clip
    assert all(r["source"].startswith(("code:", "paper:")) for r in diff.values())
    # the essay's own claims stay where they hold: GLM-130B / ChatGLM-6B (DeepNorm Post-LN), Phi-3, OLMo 2
    by_name = {r["name"]: r for r in MODELS}
    assert by_name["Gemma 3n"]["gain_convention"] == "w" and by_name["Gemma 3"]["gain_convention"] == "1+w"
    assert by_name["GLM-130B"]["placement"] == by_name["ChatGLM-6B"]["placement"] == "post"
    assert (by_name["Phi-3"]["operator"], by_name["Phi-3"]["placement"]) == ("rmsnorm", "pre")
    assert by_name["OLMo 2"]["placement"] == by_name["Chameleon (34B)"]["placement"] == "res-post"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"status": "essay"}, r"status='essay', expected 'code'"),
        ({"placement": "sideways"}, r"placement='sideways' is not one of"),
        ({"source": "essay §09"}, r"status='code', expected 'essay'"),
        ({"essay_differs": "the essay says pre"}, r"essay_differs=.* must be None or quote the essay"),
    ],
)
def test_validate_model_names_the_record_and_field(change: dict, match: str) -> None:
    rec = dict(next(r for r in MODELS if r["name"] == "OLMoE"), **change)
    with pytest.raises(ValueError, match="model 'OLMoE': " + match):
        atlas.validate_model(rec)


def test_validate_model_wants_code_beside_an_essay_difference() -> None:
    essay_sourced = next(r for r in MODELS if r["status"] == "essay")  # a record sourced from the essay alone
    rec = dict(essay_sourced, essay_differs="essay §09 says so")
    with pytest.raises(ValueError, match="essay_differs is set, so source must name the code"):
        atlas.validate_model(rec)
    moved = {k: rec[k] for k in reversed(atlas.MODEL_FIELDS)}
    with pytest.raises(ValueError, match="fields are"):
        atlas.validate_model(moved)


def test_chameleon_34b_swin_norm_path_inspects_as_recorded() -> None:
    """No model type defaults to ``swin_norm=True``, so the live check cannot reach the 34B record; build it."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from normatlas.factory import example_inputs, tiny_config
    from normatlas.inspect import inspect_model

    torch.manual_seed(0)
    cfg = tiny_config("chameleon", swin_norm=True)  # the 34B design, shrunk to 2 layers, width 64 (TINY)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    except (ValueError, KeyError):
        model = AutoModel.from_config(cfg, attn_implementation="eager").eval()
    row = inspect_model(model, example_inputs(model), name="chameleon swin_norm", probe=False).summary_row()
    rec = next(r for r in MODELS if r["name"] == "Chameleon (34B)")
    # the 34B record is not linked (no model type defaults to swin_norm): every typed field compared here instead
    design = atlas.typed_design(rec)
    for field in atlas.DESIGN_FIELDS:
        got = atlas.inspected_value(field, dict(row, model="chameleon swin_norm"))
        if got is not atlas.MISSING and design[field] is not None:
            assert got == design[field], field


@pytest.mark.parametrize(
    "rec", [r for r in MODELS if r["hf_model_types"]], ids=[r["name"] for r in MODELS if r["hf_model_types"]]
)
def test_hf_model_types_exist(rec: dict) -> None:
    mapping = pytest.importorskip("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    for mt in rec["hf_model_types"]:
        assert mt in mapping, mt


def test_keys_and_names_unique() -> None:
    assert len({r["key"] for r in PAPERS}) == len(PAPERS)
    assert len({r["name"] for r in MODELS}) == len(MODELS)


@pytest.mark.skipif(not ESSAY.exists(), reason="essay not present")
@pytest.mark.parametrize(
    "name",
    [
        "Chameleon (7B)",
        "Chameleon (34B)",
        "OLMo 2",
        "OLMoE",
        "GLM-130B",
        "Phi-3",
        "Gemma 3n",
        "PaliGemma 2",
        "Qwen2.5-VL",
        "Pixtral",
        "Flamingo",
        "Molmo",
        "CogVLM",
        "ViT-22B",
        "Swin-V2",
        "DeepNet",
        "CogView",
        "nGPT",
        "InternViT",
    ],
)
def test_models_named_by_the_essay_are_covered(name: str) -> None:
    assert name.split(" (")[0].split("-")[0] in ESSAY.read_text()
    assert any(r["name"] == name for r in MODELS)


def test_filters() -> None:
    gemma = atlas.filter_models(family="gemma")
    assert gemma and all("gemma" in r["family"].lower() for r in gemma)
    peri = atlas.filter_models(placement="peri")
    assert {"Gemma 2", "Gemma 3", "CogView"} <= {r["name"] for r in peri}
    per_head = atlas.filter_models(qk_norm="per-head")
    assert per_head and all(r["qk_norm"] == "per-head" for r in per_head)
    assert {"Qwen 3", "Gemma 3", "Qwen3-8B"} <= {r["name"] for r in per_head}  # once the non-vocabulary 'yes'
    assert {r["name"] for r in atlas.filter_models(query="NFNet")} >= {"Flamingo", "NFNet"}
    assert all("attention" in (r["group"] + r["question"]).lower() for r in atlas.filter_papers(group="attention"))


@pytest.mark.parametrize("kw", [{"operator": "batchnorm9"}, {"placement": "sideways"}, {"qk_norm": "maybe"}])
def test_bad_filter_names_parameter_and_choices(kw: dict) -> None:
    ((name, value),) = kw.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r}.*is not one of"):
        atlas.filter_models(**kw)


def _unclear(monkeypatch: pytest.MonkeyPatch, name: str, field: str) -> None:
    """The atlas with one record's field made "unclear" (every linked record in the data is resolved from the code)."""
    recs = [dict(r, **({field: "unclear"} if r["name"] == name else {})) for r in atlas.models()]
    monkeypatch.setattr(atlas, "models", lambda: [dict(r) for r in recs])


def test_check_reports_disagreements_and_resolutions(monkeypatch: pytest.MonkeyPatch) -> None:
    _unclear(monkeypatch, "GPT-2", "operator")
    fake = {
        "gemma2": {"operator": "rmsnorm", "placement": "pre", "qk_norm": "none", "gain_convention": "1+w"},
        "gpt2": {"operator": "layernorm", "placement": "pre", "qk_norm": "none", "gain_convention": "w"},
    }
    rows = atlas.check(fake)
    g2 = [r for r in rows if r["hf_model_type"] == "gemma2"]
    assert [(r["field"], r["verdict"]) for r in g2] == [("placement", "DISAGREES")]
    gpt2 = {r["field"]: r for r in rows if r["hf_model_type"] == "gpt2"}
    assert gpt2["operator"]["verdict"] == "resolves unclear" and gpt2["operator"]["inspected"] == "layernorm"
    assert any(r["verdict"].startswith("error: not inspected") for r in rows)
    agree = atlas.check(fake, include_agreements=True)
    assert any(r["verdict"] == "agrees" and r["hf_model_type"] == "gpt2" for r in agree)


def test_cli_matrix_papers_and_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["matrix", "--family", "Qwen", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    assert rows and all("qwen" in r["family"].lower() for r in rows)
    assert main(["matrix", "--placement", "res-post", "--format", "csv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("name,") and any(line.startswith("OLMo 2,") for line in out)
    assert main(["papers", "--search", "Peri-LN"]) == 0
    assert "2502.02732" in capsys.readouterr().out
    sweep = tmp_path / "m.json"
    sweep.write_text(
        json.dumps(
            [
                {
                    "model": "olmo2",
                    "operator": "rmsnorm",
                    "placement": "res-post",
                    "qk_norm": "flattened",
                    "gain_convention": "w",
                    "error": "",
                }
            ]
        )
    )
    assert main(["matrix", "--check", "--from", str(sweep), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checks"]
    assert not [r for r in rows if r["hf_model_type"] == "olmo2"]  # every field agrees: no row without --agreements
    _unclear(monkeypatch, "OLMo 2", "operator")
    assert main(["matrix", "--check", "--from", str(sweep), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checks"]
    olmo = [r for r in rows if r["hf_model_type"] == "olmo2"]
    assert [(r["field"], r["verdict"], r["inspected"]) for r in olmo] == [("operator", "resolves unclear", "rmsnorm")]
    with pytest.raises(SystemExit):  # refused by argparse, by name, with the choices
        main(["matrix", "--operator", "nope"])
    assert "argument --operator: 'nope' is not one of layernorm, rmsnorm" in capsys.readouterr().err


# (model, hf_model_type, field) rows the live check may report as DISAGREES, each with its reason. Keep it empty:
# a disagreement means the matrix misstates transformers' code, and the fix is the data (the code's design in the
# fields, the essay's claim in essay_differs), not an entry here.
LIVE_DISAGREEMENTS_ALLOWED: dict[tuple[str, str, str], str] = {}
# Model types the inspector cannot build yet: its failure, not the matrix's, so their rows go unchecked here.
LIVE_ERRORS_ALLOWED: dict[str, str] = {}


@pytest.mark.slow
def test_live_check_against_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", "--check", "--agreements", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checks"]
    # a linked record left "unclear" where the code says what it is: the fix is the data (the code's design, sourced)
    assert [r for r in rows if r["verdict"] == "resolves unclear"] == []
    agreed = {(r["hf_model_type"], r["field"]) for r in rows if r["verdict"] == "agrees"}
    for mt in ("gemma3n_text", "glm4v", "glm4v_moe"):  # their tiny configs once failed to build or to run
        assert {(mt, f) for f in ("operator", "placement", "qk_norm", "gain_convention")} <= agreed, mt
    disagree = {(r["model"], r["hf_model_type"], r["field"]) for r in rows if r["verdict"] == "DISAGREES"}
    assert disagree - set(LIVE_DISAGREEMENTS_ALLOWED) == set(), [r for r in rows if r["verdict"] == "DISAGREES"]
    assert set(LIVE_DISAGREEMENTS_ALLOWED) <= disagree, "an allowed disagreement is gone: drop it from the list"
    errors = [r for r in rows if r["verdict"].startswith("error") and r["hf_model_type"] not in LIVE_ERRORS_ALLOWED]
    assert errors == []


def test_design_fields_speak_the_design_vocabulary() -> None:
    """Every record's design fields are values of normatlas.vocabulary (or the record-level operators, or
    ``unclear``), so the matrix and the inspector compare members, not spellings; there is no ``yes``."""
    from normatlas.atlas.design import RecordOperator, Unclear
    from normatlas.spec import parse_enum
    from normatlas.vocabulary import Operator, PlacementKind, QKNormKind

    for rec in MODELS:
        for field, enum_type in (("operator", Operator), ("placement", PlacementKind), ("qk_norm", QKNormKind)):
            if rec[field] not in {m.value for m in (*Unclear, *RecordOperator)}:
                assert parse_enum(enum_type, rec[field], name=field).value == rec[field], (rec["name"], field)
    assert "yes" not in {r["qk_norm"] for r in MODELS}
