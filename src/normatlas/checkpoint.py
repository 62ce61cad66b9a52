"""One load policy for every command that reads a checkpoint folder's weights (fold, convert, verify,
diagnose, inspect).

A checkpoint is a folder with ``config.json`` (parsed as JSON first, so a broken one is one clear line)
and its weights as safetensors: one ``*.safetensors`` file, or shards listed by
``model.safetensors.index.json``. A pickle (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``,
``*.pickle``) is never unpickled: a folder whose weights are only pickles is refused with one message,
:data:`PICKLE_MESSAGE`. A tensor name found in two shards is refused by name (loading would silently
keep one of them). :func:`locate` checks all of that without reading a tensor, so commands run it before
any heavy work; :func:`read_tensors` then reads every tensor with its stored dtype and the shard it came from.

Sizes are checked before anything is allocated: :func:`on_meta` builds the model config.json describes with no
memory (the meta device), its tensors are compared with the safetensors headers (:func:`header_tensors`, names,
shapes and dtypes with no tensor read), and :func:`check_build_memory` refuses in one line a model and weights
that do not fit in the memory available.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._io import read_json
from .capacity import check_memory, human_bytes

__all__ = [
    "INDEX",
    "PICKLE_MESSAGE",
    "PICKLE_SUFFIXES",
    "TOKENIZER_FILES",
    "WEIGHT_SUFFIXES",
    "Checkpoint",
    "check_build_memory",
    "header_tensors",
    "is_weight_file",
    "locate",
    "model_bytes",
    "on_meta",
    "read_config",
    "read_tensors",
    "storage_dtype",
    "tokenizer_files",
]

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Weight formats other than safetensors: never read, and never copied beside transformed weights (they would
# hold the untransformed ones).
WEIGHT_SUFFIXES = (*PICKLE_SUFFIXES, ".safetensors", ".h5", ".msgpack", ".onnx", ".gguf", ".ot", ".tflite")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
PICKLE_MESSAGE = (
    "a pickle can run code when it is loaded, so normatlas reads weights from safetensors only; convert the "
    "checkpoint to safetensors first (e.g. transformers' save_pretrained(..., safe_serialization=True))"
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder that passed the policy: its config and its safetensors shards, in order."""

    root: Path
    config: dict[str, Any]
    files: tuple[Path, ...]
    index: dict[str, str] | None  # tensor name -> shard file name, from model.safetensors.index.json
    names: dict[str, str]  # every tensor name -> the shard file name holding it (read from the file headers)

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1 or self.index is not None


def is_weight_file(path: Path) -> bool:
    """A weights file in any format, or an index of shards (``*.safetensors.index.json``, ``*.bin.index.json``)."""
    name = path.name.lower()
    if name.endswith(".index.json"):
        return name[: -len(".index.json")].endswith(WEIGHT_SUFFIXES)
    return name.endswith(WEIGHT_SUFFIXES)


def read_config(root: Path) -> dict[str, Any]:
    """``root/config.json`` as a dict, or a one-line ``ValueError`` naming the file and what is wrong."""
    cfg = root / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{root} has no config.json (a checkpoint folder needs config.json + *.safetensors)")
    data = read_json(cfg)
    if not isinstance(data, dict):
        raise ValueError(f"{cfg} must hold a JSON object, not a JSON {type(data).__name__}")
    return data


def _refuse_file(path: Path) -> None:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ValueError(f"refusing to read {path}: {PICKLE_MESSAGE}")
    raise ValueError(f"checkpoint={str(path)!r} must be a folder with config.json and *.safetensors, not a file")


def _read_index(root: Path) -> dict[str, str]:
    file = root / INDEX
    data = read_json(file)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{file} has no weight_map from tensor names to shard files")
    for shard in dict.fromkeys(weight_map.values()):
        if Path(shard).name != shard or not (root / shard).is_file():
            raise ValueError(f"{file} lists shard {shard!r}, which is not a file in {root}")
    return weight_map


def locate(path: str | os.PathLike[str], *, weights: bool = True) -> Checkpoint:
    """Check a checkpoint folder against the load policy without reading a tensor.

    ``weights=False`` accepts a folder with no weight file at all (a config-only folder, as ``inspect`` builds
    random weights from); a folder whose only weights are pickles is refused either way.
    """
    root = Path(path)
    if root.is_file():
        _refuse_file(root)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(root)!r} does not exist")
    config = read_config(root)
    index = _read_index(root) if (root / INDEX).is_file() else None
    files = (
        tuple(root / s for s in dict.fromkeys(index.values()))
        if index is not None
        else tuple(sorted(root.glob("*.safetensors")))
    )
    if not files:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(f"refusing {root}: its weights are pickles only ({', '.join(pickles)}); {PICKLE_MESSAGE}")
        if weights:
            raise ValueError(
                f"refusing {root}: it has no *.safetensors file (normatlas reads weights from safetensors)"
            )
    return Checkpoint(root, config, files, index, _names(root, files, index))


def _names(root: Path, files: tuple[Path, ...], index: dict[str, str] | None) -> dict[str, str]:
    """Tensor name -> shard, from the safetensors headers alone; a name in two shards, or in another shard than
    the index says, is refused by name."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                keys = list(h.keys())
        except Exception as exc:
            raise ValueError(
                f"{f} is not a valid safetensors file ({type(exc).__name__}: {exc}); if it is a pickle renamed, "
                f"convert it properly: {PICKLE_MESSAGE}"
            ) from exc
        for name in keys:
            if name in names:
                raise ValueError(
                    f"refusing {root}: tensor {name!r} is in both {names[name]} and {f.name}; "
                    "loading would silently keep one of them"
                )
            if index is not None and index.get(name) != f.name:
                where = index.get(name)
                said = f"lists it in {where}" if where else "does not list it"
                raise ValueError(f"refusing {root}: tensor {name!r} is in {f.name} but {INDEX} {said}")
            names[name] = f.name
    if index is not None:
        absent = [n for n in index if n not in names]
        if absent:
            raise ValueError(f"refusing {root}: {INDEX} lists tensor(s) {absent[:5]} that no shard holds")
    return names


def read_tensors(ckpt: Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a located checkpoint with its stored dtype, and the shard file name each came from."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in ckpt.files:
        try:
            part = load_file(str(f))
        except Exception as exc:
            raise ValueError(f"{f} is not a valid safetensors file ({type(exc).__name__}: {exc})") from exc
        if set(part) != {n for n, s in ckpt.names.items() if s == f.name}:
            raise ValueError(f"{f} changed while it was being read")
        tensors.update(part)
    return tensors, dict(ckpt.names)


def storage_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The floating dtype holding the most elements (the checkpoint's dtype), or None when none is floating."""
    count: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.is_floating_point():
            count[t.dtype] = count.get(t.dtype, 0) + t.numel()
    return max(count, key=lambda d: count[d]) if count else None


def tokenizer_files(root: Path) -> list[str]:
    """The tokenizer files present in ``root`` (see :data:`TOKENIZER_FILES`)."""
    return [n for n in TOKENIZER_FILES if (root / n).is_file()]


# safetensors' dtype names (its header's "dtype") -> torch
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", torch.uint8), "F8_E5M2": getattr(torch, "float8_e5m2", torch.uint8),
}  # fmt: skip


def header_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as an empty meta tensor of its stored shape and dtype, from the safetensors
    headers alone (nothing is read or allocated); a dtype torch lacks reads as uint8."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in ckpt.files:
        with safe_open(str(f), framework="pt") as h:
            names = list(h.keys())
            for name in names:
                part = h.get_slice(name)
                dtype = _DTYPES.get(part.get_dtype(), torch.uint8)
                out[name] = torch.empty(tuple(part.get_shape()), dtype=dtype, device="meta")
    return out


def on_meta(construct: Callable[[], nn.Module]) -> nn.Module | None:
    """The model ``construct()`` builds, on the meta device (shapes and dtypes, no memory, no initialisation), or
    None for a model whose construction computes on its tensors (a meta tensor has no values to compute with)."""
    try:
        with torch.device("meta"):
            return construct()
    except Exception:  # the real build that follows reports any error of the config itself
        return None


def model_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (shared ones once); works on a meta model."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen.setdefault(id(t), t.numel() * t.element_size())
    return sum(seen.values())


def check_build_memory(meta: nn.Module, what: str, weights: int = 0) -> None:
    """A ValueError of one line when building ``meta``'s model for real (plus reading ``weights`` bytes of
    safetensors) needs more memory than is available: the parameter count, the bytes, the memory free."""
    params = sum(p.numel() for p in meta.parameters())
    read = f" and reading {human_bytes(weights)} of weights" if weights else ""
    check_memory(model_bytes(meta) + weights, f"{what}: building its {params:,} parameters{read}")
