"""The attention implementation the factory builds models with: transformers' default (``sdpa`` where the model
supports it, as ``from_config`` / ``from_pretrained`` pick it) unless one is chosen for a block of code
(:func:`attention_implementation`, the CLI's ``--attn-implementation``)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["ATTENTION_IMPLEMENTATIONS", "attention_implementation", "attention_kwargs", "choose_attention"]

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
"""The attention implementations a build may be asked for (None: transformers' default for the model)."""
_ATTENTION: contextvars.ContextVar[str | None] = contextvars.ContextVar("normatlas_attention", default=None)


@contextlib.contextmanager
def attention_implementation(name: str | None) -> Iterator[None]:
    """Build models inside this block with attention implementation ``name`` (one of
    :data:`ATTENTION_IMPLEMENTATIONS`; None: transformers' default, as ``from_pretrained`` picks it)."""
    if name is not None and name not in ATTENTION_IMPLEMENTATIONS:
        allowed = ", ".join(ATTENTION_IMPLEMENTATIONS)
        raise ValueError(f"attn_implementation={name!r} is not one of {allowed} (or None: transformers' default)")
    token = _ATTENTION.set(name)
    try:
        yield
    finally:
        _ATTENTION.reset(token)


def attention_kwargs() -> dict[str, str]:
    """``from_config``'s keyword for the chosen attention implementation ({} for transformers' default)."""
    name = _ATTENTION.get()
    return {} if name is None else {"attn_implementation": name}


def choose_attention(cfg: Any) -> None:
    """Set the chosen attention implementation on ``cfg`` (nothing when none is chosen)."""
    name = _ATTENTION.get()
    if name is not None:
        cfg._attn_implementation = name
