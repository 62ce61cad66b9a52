"""Shared fixtures of the tools tests: tiny transformers models (real config classes, shrunk) and one trained
byte Llama checkpoint (:func:`normatlas.tools.train_byte_llama` at 3 layers x 32, 40 steps), made once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .tiny_hf import randomise_, tiny_config

# The zoo default is 6 layers x 128 (docs/tools.md); the tests train 3 layers x 32 for 40 steps (a few seconds).
TINY_ZOO = dict(hidden_size=32, layers=3, heads=4, intermediate_size=64, context=64, steps=40, batch=8, seq=32)
_CACHE: dict[str, Path] = {}
IDS = torch.tensor([[5, 17, 3, 60, 22, 9, 41], [1, 2, 3, 4, 5, 6, 7]])  # (2, 7): a batch of token ids for the tools


def tool_model(model_type: str, layers: int = 4, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A seeded tiny transformers model: a causal LM, or for ``bert`` the encoder (``head=True``: with its MLM
    head); its gains and biases moved off their init, so a wrong gain would show."""
    import transformers

    head = overrides.pop("head", False)
    depth = {"n_layer": layers} if model_type == "gpt2" else {"num_hidden_layers": layers}
    cfg = tiny_config(model_type, **depth, **overrides)
    torch.manual_seed(0)
    if model_type == "bert":
        model: torch.nn.Module = transformers.BertForMaskedLM(cfg) if head else transformers.BertModel(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    randomise_(model, 0.3, vectors_only=True, generator=torch.Generator().manual_seed(1))
    return torch.nn.Module.to(model, dtype).eval()


@pytest.fixture(scope="session")
def byte_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained byte LlamaForCausalLM checkpoint folder (safetensors, config, byte tokenizer)."""
    if "byte_llama" not in _CACHE:
        from normatlas.tools import ByteLlama, train_byte_llama

        out = tmp_path_factory.mktemp("zoo") / "byte-llama"
        train_byte_llama(out, ByteLlama(**TINY_ZOO))  # type: ignore[arg-type]
        _CACHE["byte_llama"] = out
    return _CACHE["byte_llama"]
