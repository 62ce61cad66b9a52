"""Which row of a learned absolute position table each token reads.

GPT-2 and BERT read row ``t`` at position ``t``. Others start further in, or count only the real tokens so that
padding does not shift the positions of what follows it. One rule covers them, with ``m`` the mask of counted
tokens and ``offset`` the row of the first counted token::

    row = cumsum(m) * m - 1 + offset        (a token that is not counted reads row offset - 1)

| rule | m | example |
|---|---|---|
| ``ARANGE`` | every token (so ``row = t + offset``) | GPT-2, BERT (offset 0) |
| ``FROM_MASK`` | ``attention_mask`` | OPT, BioGPT (offset 2) |
| ``FROM_PADDING`` | ``input_ids != pad_token_id`` | RoBERTa, XLM-R (offset ``pad_token_id + 1``) |
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

__all__ = ["PositionIds", "position_rows"]


class PositionIds(enum.Enum):
    """How the position of each token is counted (see the module docstring)."""

    ARANGE = "arange"  # 0, 1, ..., T-1 whatever the tokens
    FROM_MASK = "from_mask"  # counting the tokens the attention mask keeps
    FROM_PADDING = "from_padding"  # counting the tokens that are not the pad id


def position_rows(
    rule: PositionIds,
    offset: int,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    pad_token_id: int | None = None,
) -> Tensor:
    """The table row each token of ``input_ids`` (B, T) reads: (1, T) for ``ARANGE``, else (B, T)."""
    t = input_ids.shape[-1]
    if rule is PositionIds.ARANGE:
        return torch.arange(offset, offset + t, device=input_ids.device)[None]
    if rule is PositionIds.FROM_MASK:
        m = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
    elif rule is PositionIds.FROM_PADDING:
        if pad_token_id is None:
            raise ValueError("PositionIds.FROM_PADDING needs a pad_token_id")
        m = (input_ids != pad_token_id).to(torch.long)
    else:
        raise TypeError(f"rule={rule!r} must be a PositionIds")
    return torch.cumsum(m, dim=-1) * m - 1 + offset
