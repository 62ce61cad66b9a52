"""Token ids for the tools: the held-out standard-library text in a model's tokenizer, cut to the model's windows,
and the check that a tokenizer belongs to its model."""

from __future__ import annotations

from typing import Any

__all__ = ["WINDOW", "check_ids", "heldout_ids", "window_len"]


def check_ids(model: Any, ids: Any, what: str) -> None:
    """Refuse token ids the model's vocabulary does not have (a tokenizer that does not belong to the model)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    top = max((int(i) for i in (ids.flatten().tolist() if hasattr(ids, "flatten") else ids)), default=-1)
    if isinstance(vocab, int) and top >= vocab:
        raise ValueError(
            f"{what} has token id {top}, but the model's vocabulary has {vocab} entries: the folder's tokenizer "
            "does not belong to its model"
        )


WINDOW = 128  # tokens per window of held-out text


def window_len(model: Any, seq: int = WINDOW) -> int:
    """The tokens per held-out window for ``model``: ``seq``, or fewer where its config's
    ``max_position_embeddings`` allows fewer."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(seq, int(limit)) if isinstance(limit, int) and limit > 1 else seq


def heldout_ids(tokenizer: Any) -> list[int]:
    """The held-out standard-library text (:func:`.zoo.heldout_bytes`) as the tokenizer's ids, no special tokens."""
    from transformers.utils import logging

    from .zoo import heldout_bytes

    text = heldout_bytes().decode("utf-8", errors="replace")
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # "sequence longer than the model's maximum": it is cut into windows after
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    finally:
        logging.set_verbosity(level)
