"""Tiny HF ``transformers`` configs and models for the tests, in one place.

Each family is its real config class with the defaults kept and only the sizes shrunk (litgpt style):
2 layers, ``width`` wide, 4 attention heads (2 key/value heads where the family has GQA), head
dimension ``width // 4``, feed-forward ``2 * width``. Whatever else a test depends on (token ids,
position limits, soft-caps, ``use_qk_norm``, ``do_layer_norm_before`` ...) it passes as an override,
so the call site states it.

Not to be confused with :func:`normatlas.factory.tiny_config`, which shrinks the *defaults* of
any model type for the inspector; this module pins the exact sizes the port and surgery tests assert on.
"""

from __future__ import annotations

from typing import Any

import torch

CONFIGS: dict[str, str] = {
    "llama": "LlamaConfig",  # Llama-3-8B: 4096 wide, 32 layers
    "qwen3": "Qwen3Config",  # Qwen3-8B: 4096 / 36L, QK-norm per head
    "gemma2": "Gemma2Config",  # Gemma-2-9B: 3584 / 42L, (1 + w) gains, sandwich norms
    "gemma3_text": "Gemma3TextConfig",  # Gemma-3-4B text: 2560 / 34L, plus QK-norm
    "olmo2": "Olmo2Config",  # OLMo-2-7B: 4096 / 32L, post-branch norms, QK-norm over the projection
    "cohere": "CohereConfig",  # Command-R: 8192 / 40L, parallel block, LayerNorm without bias
    "glm4": "Glm4Config",  # GLM-4-9B: 4096 / 40L
    "gpt2": "GPT2Config",  # GPT-2 small: 768 / 12L, Pre-LN LayerNorm, tied head
    "opt": "OPTConfig",  # OPT-125m: 768 / 12L, Pre-LN LayerNorm (OPT-350m: Post-LN)
    "bert": "BertConfig",  # BERT-base: 768 / 12L, Post-LN
    "mistral": "MistralConfig",  # Mistral-7B: 4096 / 32L, GQA 8 kv heads
    "qwen2": "Qwen2Config",  # Qwen2-7B: 3584 / 28L, q/k/v biases
    "granite": "GraniteConfig",  # Granite-3.0-8B: 4096 / 40L, embedding / residual / attention / logit multipliers
    "olmo3": "Olmo3Config",  # OLMo-3-7B: 4096 / 32L, post-branch norms, flattened QK-norm, sliding windows
    "nemotron": "NemotronConfig",  # Nemotron-4-15B: 6144 / 32L, LayerNorm with a 1 + w gain, ReLU squared MLP
    "exaone4": "Exaone4Config",  # EXAONE-4.0-32B: 5120 / 64L, post-branch norms, QK-norm, NoPE global layers
}
"""HF ``model_type`` -> config class name (the original size of each family in the comment)."""


def _sizes(model_type: str, width: int, vocab_size: int) -> dict[str, Any]:
    """The family's own spelling of 2 layers, ``width`` wide, 4 heads (2 kv), feed-forward ``2 * width``."""
    if model_type == "gpt2":
        return dict(vocab_size=vocab_size, n_embd=width, n_layer=2, n_head=4, n_positions=32)
    common = dict(vocab_size=vocab_size, hidden_size=width, num_hidden_layers=2, num_attention_heads=4)
    if model_type == "opt":
        return dict(common, ffn_dim=2 * width, max_position_embeddings=32, word_embed_proj_dim=width)
    if model_type == "bert":
        return dict(common, intermediate_size=2 * width, max_position_embeddings=32, type_vocab_size=2)
    return dict(common, num_key_value_heads=2, head_dim=width // 4, intermediate_size=2 * width)


def tiny_config(model_type: str, *, width: int = 32, vocab_size: int = 64, **overrides: Any) -> Any:
    """The config of ``model_type`` (a key of :data:`CONFIGS`) at 2 layers, ``width`` wide, 4 heads.

    ``overrides`` go to the config class as keyword arguments and win over the shrunk sizes.
    """
    import transformers

    if model_type not in CONFIGS:
        raise ValueError(f"model_type={model_type!r} has no tiny config; supported: {', '.join(sorted(CONFIGS))}")
    return getattr(transformers, CONFIGS[model_type])(**{**_sizes(model_type, width, vocab_size), **overrides})


def tiny_model(model_type: str, model_class: str | None = None, *, seed: int = 0, **config: Any) -> torch.nn.Module:
    """A freshly initialised model of :func:`tiny_config` ``(model_type, **config)`` in eval mode.

    The global RNG is seeded with ``seed`` right before the model is built (its state afterwards is what
    the caller's next draw sees). ``model_class`` names a transformers class (e.g. ``"BertForMaskedLM"``,
    ``"LlamaModel"``); by default ``AutoModelForCausalLM`` picks it.
    """
    import transformers

    cfg = tiny_config(model_type, **config)
    torch.manual_seed(seed)
    if model_class is None:
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return getattr(transformers, model_class)(cfg).eval()


def randomise_(
    model: torch.nn.Module, scale: float, *, vectors_only: bool = False, generator: torch.Generator | None = None
) -> torch.nn.Module:
    """Add ``scale * N(0, 1)`` to every parameter (only the 1-D ones, gains and biases, if ``vectors_only``),
    in place, drawing from ``generator`` (the global RNG if None), so that no gain, bias or weight sits at
    its initial value and a wrong gain convention or a wrong fold shows in the output."""
    with torch.no_grad():
        for p in model.parameters():
            if not vectors_only or p.dim() == 1:
                p.add_(scale * torch.randn(p.shape, dtype=p.dtype, generator=generator))
    return model
