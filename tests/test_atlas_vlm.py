"""The matrix's VLM rows and paper-sourced records: the part fields speak the inspector's kinds, every image-text
record linked to transformers is one the check runs whole, and ``check`` compares the tower, connector and
connector norm like any other field (fake inspected rows here; the live check is tests/test_atlas_data.py's slow
test and ``normatlas matrix --check``)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest

from normatlas import atlas
from normatlas.inspect.vlm import ConnectorKind

MODELS = atlas.models()
VLM_ROWS = [r for r in MODELS if r["kind"] == "vlm"]
LINKED_VLMS = [r for r in VLM_ROWS if r["hf_model_types"] and r["connector"] is not None]


def test_connector_values_are_the_inspectors_kinds() -> None:
    assert set(atlas.CONNECTORS) == {k.value for k in ConnectorKind} | {"gated-cross-attention"}


@pytest.mark.parametrize("rec", VLM_ROWS, ids=[r["name"] for r in VLM_ROWS])
def test_vlm_record_parts(rec: dict) -> None:
    """Each VLM row names its connector in the vocabulary; a row read from code carries all three parts."""
    for field, allowed in atlas.VLM_FIELDS.items():
        assert rec[field] is None or rec[field] in allowed, (rec["name"], field)
    if rec["status"] == "code" and rec["hf_model_types"]:
        assert None not in (rec["vision_tower_norm"], rec["connector"], rec["connector_norm"]), rec["name"]


@pytest.mark.parametrize("rec", LINKED_VLMS, ids=[r["name"] for r in LINKED_VLMS])
def test_linked_vlm_is_run_whole_by_the_check(rec: dict) -> None:
    """The check compares the parts only where it runs the model whole: every linked type is an image-text type."""
    from normatlas.factory import is_vlm_type

    warnings.filterwarnings("ignore")
    assert all(is_vlm_type(mt) for mt in rec["hf_model_types"]), rec["name"]


def test_vlm_rows_with_all_three_parts_from_code() -> None:
    full = [r["name"] for r in LINKED_VLMS if r["status"] == "code"]
    assert len(full) >= 18, full
    assert len(MODELS) >= 85


def _fake(rec: dict, **over: str) -> dict[str, dict[str, str]]:
    row = {f: rec[f] for f in ("operator", "placement", "qk_norm", "gain_convention", *atlas.VLM_FIELDS)}
    return {mt: {**row, **over} for mt in rec["hf_model_types"]}


def test_check_compares_the_vlm_parts() -> None:
    rec = next(r for r in MODELS if r["name"] == "Qwen2-VL")
    assert [r for r in atlas.check(_fake(rec)) if r["model"] == "Qwen2-VL"] == []  # every part agrees: no row
    rows = atlas.check(_fake(rec, connector="mlp", connector_norm="none"))
    got = {(r["field"], r["curated"], r["inspected"], r["verdict"]) for r in rows if r["model"] == "Qwen2-VL"}
    assert got == {
        ("connector", "patch-merger", "mlp", "DISAGREES"),
        ("connector_norm", "layernorm", "none", "DISAGREES"),
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"connector": "MLP projector"}, "connector='MLP projector' is not one of"),
        ({"vision_tower_norm": "batchnorm-family"}, "vision_tower_norm='batchnorm-family'"),
        ({"source": "paper: nosuchpaper2020 says so", "status": "paper"}, "paper:nosuchpaper2020"),
        ({"source": "a blog said so"}, "must start with one of essay, code:, paper:"),
        ({"status": "code"}, "status='code', expected 'paper'"),
    ],
)
def test_validate_model_refuses_bad_parts_and_sources(change: dict, match: str) -> None:
    rec = copy.deepcopy(next(r for r in MODELS if r["name"] == "DiT"))
    if "connector" in change or "vision_tower_norm" in change:
        rec = copy.deepcopy(next(r for r in MODELS if r["name"] == "LLaVA-1.5"))
    rec.update(change)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        atlas.validate_model(rec)


PAPER_ROWS = [r for r in MODELS if r["status"] == "paper"]


@pytest.mark.parametrize("rec", PAPER_ROWS, ids=[r["name"] for r in PAPER_ROWS])
def test_paper_sourced_record_cites_a_confirmed_paper(rec: dict) -> None:
    """A record read from a paper names a bibliography key whose page was confirmed (``verified``)."""
    key = rec["source"].split("paper:", 1)[1].split()[0]
    paper = next(p for p in atlas.papers() if p["key"] == key)
    assert paper["verified"], key
    assert "unclear" not in (rec["operator"], rec["placement"], rec["qk_norm"])


def test_unclear_records_resolved_by_code_or_paper() -> None:
    """The records the issue lists as resolvable (transformers has the model, or a confirmed page says)."""
    by = {r["name"]: r for r in MODELS}
    want = {
        "DiT": ("adaLN-Zero", "pre", "paper"),
        "CaiT": ("layernorm", "pre", "paper"),
        "ViT-22B": ("layernorm", "parallel", "unclear"),  # its QK-norm's kind is not stated (issue 34: no "yes")
        "DeepNet": ("layernorm", "post", "paper"),
        "NFNet": ("none", "none", "paper"),
        "InternViT": ("layernorm", "pre", "code"),
        "SigLIP 2": ("layernorm", "pre", "code"),
    }
    assert {n: (by[n]["operator"], by[n]["placement"], by[n]["status"]) for n in want} == want
    assert sum(r["status"] == "unclear" for r in MODELS) <= 17


def test_gemma_3n_embedding_scale_is_read() -> None:
    """Gemma 3n scales its token embeddings by sqrt(hidden_size) (Gemma3nTextScaledWordEmbedding); AltUp's
    widened streams hide it from the walk back, so it is read forwards from the lookup."""
    from normatlas.inspect import inspect_target

    warnings.filterwarnings("ignore")
    rep = inspect_target("gemma3n_text", probe=False)
    assert rep.embedding_scale == pytest.approx(math.sqrt(rep.hidden_size))


def test_batch_statistics_tower_reads_as_batchnorm() -> None:
    """ResNet normalises only with BatchNorm (modeling_resnet.py ResNetConvLayer): the check row says so."""
    from normatlas.cli.atlas_cmd import inspected_row

    warnings.filterwarnings("ignore")
    row = inspected_row("resnet")
    assert (row["operator"], row["placement"]) == ("batchnorm", "none")
