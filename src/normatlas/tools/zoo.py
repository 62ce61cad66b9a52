"""A trained decoder to run the tools on: a tiny transformers ``LlamaForCausalLM`` over bytes, saved as a
checkpoint folder any transformers user can load (``from_pretrained``, safetensors, a tokenizer).

The model is built with ``from_config`` (transformers' default attention, sdpa) at vocabulary 256 (one token per
byte), trained on the Python standard library's own sources (:func:`normatlas.experiments.data.stdlib_bytes`) with
AdamW, and saved with ``save_pretrained`` beside a byte tokenizer (:func:`byte_tokenizer`: token id == byte value,
a ``tokenizers`` BPE without merges over the GPT-2 byte alphabet). The last 10% of the corpus is never trained on:
:func:`heldout_bytes` is the text the tools measure on (the tuned lens fits on it, pruning measures its loss on it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._io import atomic_write, dumps

__all__ = [
    "CORPUS_BYTES",
    "ByteLlama",
    "byte_llama_config",
    "byte_tokenizer",
    "heldout_bytes",
    "train_byte_llama",
    "train_bytes",
]

CORPUS_BYTES = 1_000_000
"""The corpus: the first CORPUS_BYTES of the standard library's top-level ``.py`` files (sorted by name)."""
HELD_OUT_SHARE = 0.1
TRAINING_FILE = "normatlas_training.json"


def train_bytes() -> Tensor:
    """The bytes the zoo models train on (the corpus without its held-out tail), as int64."""
    from ..experiments.data import stdlib_bytes

    data = stdlib_bytes(CORPUS_BYTES).long()
    return data[: int(data.numel() * (1 - HELD_OUT_SHARE))]


def heldout_bytes() -> bytes:
    """The corpus's last 10%: standard-library source no zoo model was trained on."""
    from ..experiments.data import stdlib_bytes

    data = stdlib_bytes(CORPUS_BYTES)
    return bytes(data[int(data.numel() * (1 - HELD_OUT_SHARE)) :].tolist())


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of a byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer() -> Any:
    """A transformers fast tokenizer whose token ids are the text's UTF-8 bytes (vocabulary 256, no specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class ByteLlama:
    """The sizes and the training of a zoo byte Llama (defaults: the decoder docs/tools.md measures)."""

    hidden_size: int = 128
    layers: int = 6
    heads: int = 4
    intermediate_size: int = 384
    context: int = 256
    steps: int = 400
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "layers", "heads", "intermediate_size", "context", "steps", "batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of heads={self.heads}")
        if self.seq > self.context:
            raise ValueError(f"seq={self.seq} must be <= context={self.context}")
        if not (0 < self.lr < math.inf):
            raise ValueError(f"lr={self.lr!r} must be a positive finite number")


def byte_llama_config(spec: ByteLlama) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=spec.context,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _lr(spec: ByteLlama, step: int) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_byte_llama(
    out: str | os.PathLike[str],
    spec: ByteLlama | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train a byte Llama on standard-library sources and save it in ``out`` (a new or empty folder) with
    ``save_pretrained`` (safetensors) and :func:`byte_tokenizer`; returns the training record (also written as
    ``normatlas_training.json``: sizes, seed, first and last losses, held-out loss in nats per byte)."""
    from transformers import LlamaForCausalLM

    spec = spec or ByteLlama()
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not an empty folder; choose a new folder")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM._from_config(byte_llama_config(spec))
    data = train_bytes()
    gen = torch.Generator().manual_seed(spec.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95)
    )
    losses: list[float] = []
    model.train()
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(spec, step)
        starts = torch.randint(0, data.numel() - spec.seq - 1, (spec.batch,), generator=gen)
        chunk = data[starts[:, None] + torch.arange(spec.seq + 1)[None]]
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None and (step % 25 == 0 or step == spec.steps - 1):
            progress(f"step {step + 1}/{spec.steps} loss {losses[-1]:.3f}")
    model.eval()
    held = torch.tensor(list(heldout_bytes()), dtype=torch.long)
    n = (held.numel() - 1) // spec.seq
    x = held[: n * spec.seq + 1]
    with torch.no_grad():
        logits = model(input_ids=x[:-1].view(n, spec.seq), use_cache=False).logits
        heldout = float(F.cross_entropy(logits.flatten(0, 1), x[1:].view(n, spec.seq).flatten()))
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    byte_tokenizer().save_pretrained(target)
    record = {
        "model": "LlamaForCausalLM (bytes)",
        "spec": asdict(spec),
        "corpus": f"the first {CORPUS_BYTES} bytes of the standard library's top-level .py sources, last 10% held out",
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "heldout_loss": heldout,
        "heldout_bits_per_byte": heldout / math.log(2),
    }
    atomic_write(target / TRAINING_FILE, dumps(record, indent=2))
    return record
