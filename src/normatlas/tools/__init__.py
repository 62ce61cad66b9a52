"""Practitioner tools on real checkpoints: the logit lens through the final norm, depth pruning by norm
geometry, the embedding-table scan, outliers and quantization at the norms (:mod:`.outliers`), and a trained
byte Llama to run them on (:mod:`.zoo`).

Each tool reads the model's structure from one recorded forward pass (:mod:`.reading`, built on the inspector's
phases), never from module names. Checkpoints are read under the one load policy
(:func:`normatlas.surgery.load_checkpoint`: config.json and safetensors, never a pickle); real text is the Python
standard library's own sources (:func:`.zoo.heldout_bytes`: text no zoo model was trained on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .embeddings import EmbeddingScan, embedding_figure, scan_embeddings, token_table
from .lens import LensResult, TunedFit, fit_tuned_gains, lens_figure, logit_lens, windows
from .outliers import (
    Smoothing,
    matrix_entropy,
    max_logit_diff,
    quant_error,
    quantize,
    site_report,
    smooth,
    stream_entropy,
)
from .prune import (
    PrunePlan,
    PruneResult,
    block_scores,
    choose,
    choose_block,
    is_causal,
    layer_scores,
    plan_prune,
    prune,
    prune_figure,
    prune_surgery,
    quality,
    run_prune,
)
from .reading import Layer, NoHead, Reading, ToolError, capture_stream, model_inputs, read_model, skipping
from .rescale import VScaling, head_layout, v_scale
from .text import check_ids, heldout_ids, window_len
from .zoo import ByteLlama, byte_tokenizer, heldout_bytes, train_byte_llama

__all__ = [
    "ByteLlama",
    "EmbeddingScan",
    "Layer",
    "LensResult",
    "NoHead",
    "PrunePlan",
    "PruneResult",
    "Reading",
    "Smoothing",
    "ToolError",
    "TunedFit",
    "VScaling",
    "block_scores",
    "byte_tokenizer",
    "capture_stream",
    "check_ids",
    "choose",
    "choose_block",
    "embedding_figure",
    "fit_tuned_gains",
    "head_layout",
    "heldout_bytes",
    "heldout_ids",
    "is_causal",
    "layer_scores",
    "lens_figure",
    "load",
    "logit_lens",
    "matrix_entropy",
    "max_logit_diff",
    "model_inputs",
    "plan_prune",
    "prune",
    "prune_figure",
    "prune_surgery",
    "quality",
    "quant_error",
    "quantize",
    "read_model",
    "run_prune",
    "scan_embeddings",
    "site_report",
    "skipping",
    "smooth",
    "stream_entropy",
    "token_table",
    "train_byte_llama",
    "v_scale",
    "window_len",
    "windows",
]


def load(path: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a checkpoint folder: the model under the one load policy, the tokenizer offline from
    the folder's own files (a folder without them is refused)."""
    from ..checkpoint import TOKENIZER_FILES, locate, tokenizer_files
    from ..surgery import load_checkpoint

    root = Path(path)
    locate(root)
    if not tokenizer_files(root):
        raise FileNotFoundError(
            f"{root} has no tokenizer (no {', '.join(TOKENIZER_FILES[:3])} or other tokenizer file); the tools run "
            "real text, so the folder needs the tokenizer the model was trained with"
        )
    from transformers import AutoTokenizer

    model = load_checkpoint(root).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds here; one true line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ValueError(f"cannot load the tokenizer in {root} ({type(exc).__name__}: {first})") from exc
    return model, tokenizer
