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
    assert tuple(rec) == atlas.MODEL_FIELDS
    assert rec["name"] and rec["family"] and rec["kind"]
    assert rec["source"].startswith("essay"), "every record names its source"
    assert rec["operator"] in atlas.OPERATORS
    assert rec["placement"] in atlas.PLACEMENTS and rec["qk_norm"] in atlas.QK_NORMS
    assert rec["year"] is None or 2015 <= rec["year"] <= 2026
    unclear = "unclear" in (rec["operator"], rec["placement"], rec["qk_norm"])
    assert rec["status"] == ("unclear" if unclear else "essay")


@pytest.mark.parametrize(
    "rec", [r for r in MODELS if r["hf_model_types"]], ids=[r["name"] for r in MODELS if r["hf_model_types"]]
)
def test_hf_model_types_exist(rec: dict) -> None:
    mapping = pytest.importorskip("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    for mt in rec["hf_model_types"]:
        assert mt in mapping, mt


@pytest.mark.parametrize("rec", PAPERS, ids=[r["key"] for r in PAPERS])
def test_paper_record(rec: dict) -> None:
    assert tuple(rec) == atlas.PAPER_FIELDS
    assert len(rec["question"]) > 10 and rec["group"].endswith("?"), rec
    assert rec["source"].startswith("essay") and rec["named_as"]
    if rec["arxiv"] is None:
        assert rec["arxiv_status"] == "unverified" and rec["title"] is None  # titles only where confirmed
    else:
        assert rec["arxiv_status"] == "confirmed" and rec["title"]
        assert re.fullmatch(r"\d{4}\.\d{4,5}", rec["arxiv"])
        yy, mm = int(rec["arxiv"][:2]), int(rec["arxiv"][2:4])
        assert 1 <= mm <= 12 and (rec["year"] is None or abs(2000 + yy - rec["year"]) <= 1)


def test_keys_and_names_unique() -> None:
    assert len({r["key"] for r in PAPERS}) == len(PAPERS)
    assert len({r["name"] for r in MODELS}) == len(MODELS)


@pytest.mark.skipif(not ESSAY.exists(), reason="essay not present")
@pytest.mark.parametrize(
    "name",
    [
        "Chameleon",
        "OLMo 2",
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
    assert all(r["qk_norm"] == "yes" for r in atlas.filter_models(qk_norm="yes"))
    assert {r["name"] for r in atlas.filter_models(query="NFNet")} >= {"Flamingo", "NFNet"}
    assert all("attention" in (r["group"] + r["question"]).lower() for r in atlas.filter_papers(group="attention"))


@pytest.mark.parametrize("kw", [{"operator": "batchnorm9"}, {"placement": "sideways"}, {"qk_norm": "maybe"}])
def test_bad_filter_names_parameter_and_choices(kw: dict) -> None:
    ((name, value),) = kw.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r}.*is not one of"):
        atlas.filter_models(**kw)


def test_check_reports_disagreements_and_resolutions() -> None:
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


def test_cli_matrix_papers_and_check(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["matrix", "--family", "Qwen", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
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
    rows = json.loads(capsys.readouterr().out)
    olmo = [r for r in rows if r["hf_model_type"] == "olmo2"]
    assert olmo and all(r["verdict"] == "resolves unclear" for r in olmo)  # operator was unclear in the essay
    assert main(["matrix", "--operator", "nope"]) == 2
    assert "operator='nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_live_check_against_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", "--check", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["verdict"] == "resolves unclear" for r in rows)
