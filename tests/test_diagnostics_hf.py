"""HF decoder (Llama shrunk to 2 layers) under the Monitor: causal GQA attention found and measured exactly."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from normatlas.diagnostics import Monitor, attention_stats

pytest.importorskip("transformers")


def test_causal_gqa_decoder_attention_matches_eager() -> None:
    """HF Llama shrunk to 2 layers, width 32, 4 query / 2 kv heads (original 7B: 32 layers, 4096, 32 / 8)."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        attn_implementation="sdpa",
    )
    model = LlamaModel(cfg).eval()
    ids = torch.randint(100, (2, 9))
    mon = Monitor(model, every=1, metrics=["attention", "residual"], print_alarms=False)
    with torch.no_grad():
        model(ids)
    mon.step()
    mon.detach()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, output_attentions=True)
    for i, probs in enumerate(eager.attentions):
        ref = attention_stats(probs)
        assert_close(mon.last[f"attention/entropy/L{i}"], ref["entropy"], rtol=1e-4, atol=1e-5)
        assert_close(mon.last[f"attention/entropy_norm/L{i}"], ref["entropy_norm"], rtol=1e-4, atol=1e-5)
