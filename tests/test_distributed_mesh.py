"""The heavier distributed runs (``-m slow``): FSDP x TP on a 2 x 2 mesh of 4 gloo processes, and the TP + SP plan
of more transformers families (Qwen 3 with its per-head QK-norm, Gemma 2 with sandwich norms and (1 + w) gains,
Mistral, Qwen 2 with q / k / v biases, Gemma 3 with sandwich norms, QK-norm and sliding windows),
each against a single-process reference."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from normatlas.distributed import figures, spawn

pytestmark = pytest.mark.slow
HF_FAMILIES = ("qwen3", "gemma2", "mistral", "qwen2", "gemma3_text")  # llama and olmo2 run in the default suite


def four_rank_checks(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    return figures.fsdp_tp_check(rank, world, steps=3)


def hf_checks(rank: int, world: int) -> list[dict[str, Any]]:
    warnings.simplefilter("ignore")
    return [figures.tp_check(rank, world, steps=3, hf=name)[0] for name in HF_FAMILIES]


def test_fsdp_x_tp_2x2_matches_one_process_after_3_steps() -> None:
    for row in spawn(four_rank_checks, 4, timeout=900):
        # float64: logits, loss and gradients at the first step, weights after 3 AdamW steps
        assert row["logits"] <= 1e-12 and row["loss"] <= 1e-12 and row["grads"] <= 1e-12, row
        assert row["weights"] <= 1e-10, row
        assert row["findings_after_reduce"] == [] and row["findings_after_steps"] == [], row


def test_more_llama_family_models_tp_sp_match_one_process() -> None:
    for rows in spawn(hf_checks, 2, timeout=900):
        assert [r["model"] for r in rows] == list(HF_FAMILIES)
        for row in rows:
            assert row["logits"] <= 1e-5 and row["loss"] <= 1e-5 and row["grads"] <= 1e-5, row
            assert row["findings_after_steps"] == [], row
            assert row["pending"] and row["reduced"] == row["pending"], row
