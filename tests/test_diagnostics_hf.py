"""HF decoder (Llama shrunk to 2 layers) under the Monitor: causal GQA attention found and measured exactly."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from normatlas.diagnostics import Monitor, attention_stats

from .tiny_hf import tiny_model

pytest.importorskip("transformers")


def test_causal_gqa_decoder_attention_matches_eager() -> None:
    """HF Llama shrunk to 2 layers, width 32, 4 query / 2 kv heads (original 7B: 32 layers, 4096, 32 / 8)."""
    model = tiny_model("llama", "LlamaModel", seed=0, vocab_size=100, attn_implementation="sdpa")
    ids = torch.randint(100, (2, 9))
    mon = Monitor(model, every=1, metrics=["attention", "residual"], print_alarms=False)
    with torch.no_grad():
        model(ids)
    mon.step()
    mon.detach()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, output_attentions=True)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()  # eager probs carry no mask: give it
    for i, probs in enumerate(eager.attentions):
        ref = attention_stats(probs, allowed=causal)
        assert_close(mon.last[f"attention/entropy/L{i}"], ref["entropy"], rtol=1e-4, atol=1e-5)
        assert_close(mon.last[f"attention/entropy_norm/L{i}"], ref["entropy_norm"], rtol=1e-4, atol=1e-5)
