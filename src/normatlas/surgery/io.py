"""Read checkpoints safely, write them atomically, and load a transformed one back.

Reading: only ``config.json`` (JSON) and ``*.safetensors`` are ever read; a pickle
(``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``) is refused, never unpickled. The
model is built from ``config.json``'s architecture (a transformers class) and every
tensor is checked against it by name and shape before loading.

Writing: everything goes into a temporary folder beside the target, which is renamed
into place only when complete and verified (every tensor read back bitwise equal, the model rebuilt
from the folder reproducing the verified output bitwise), so a failure leaves no output behind. The folder holds
``model.safetensors`` (the transformed weights in the stock module structure),
``config.json`` (transformers loads it) and ``normatlas_surgery.json`` (the runtime
swaps, what changed and the measured proof). :func:`load_transformed` rebuilds the
runtime model: stock structure, weights, then the swaps.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .report import Surgery, Swap, apply_swaps

__all__ = ["MANIFEST", "load_checkpoint", "load_transformed", "save_surgery"]

MANIFEST = "normatlas_surgery.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise ValueError(
                f"refusing to read {path}: a pickle file can run code when loaded; "
                "convert it to safetensors first (normatlas never unpickles)"
            )
        raise ValueError(f"checkpoint={str(path)!r} must be a folder with config.json and *.safetensors")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(path)!r} does not exist")
    files = sorted(path.glob("*.safetensors"))
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not files:
        what = f"only pickle weights ({', '.join(pickles)})" if pickles else "no *.safetensors file"
        raise ValueError(
            f"refusing {path}: it has {what}; normatlas reads weights from safetensors only, never from pickles"
        )
    return files


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except Exception as exc:
            raise ValueError(
                f"{f} is not a valid safetensors file ({type(exc).__name__}: {exc}); if it is a "
                "pickle renamed, convert it properly: normatlas never unpickles"
            ) from exc
    return out


def _build(path: Path, config_updates: dict[str, Any] | None = None) -> nn.Module:
    import transformers

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json")
    config = transformers.AutoConfig.from_pretrained(str(path))
    for k, v in (config_updates or {}).items():
        setattr(config, k, v)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ValueError(
            f"config.json architectures={getattr(config, 'architectures', None)!r} does not name a "
            "transformers model class"
        )
    model = cls(config)
    return model.eval()


@torch.no_grad()
def _load_into(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    expected = model.state_dict()
    buffers = {n for n, _ in model.named_buffers()}
    missing = [k for k in expected if k not in tensors]
    tied = {k for k in missing if _is_tied(model, k, tensors)}
    missing = [k for k in missing if k not in tied]
    if missing:
        raise ValueError(
            f"{where} is missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} that "
            f"config.json's {type(model).__name__} needs"
        )
    unexpected = [k for k in tensors if k not in expected and k not in buffers]
    if unexpected:
        raise ValueError(f"{where} has tensor(s) {unexpected[:5]} that {type(model).__name__} does not have")
    for k, v in tensors.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(
                f"{where}: tensor {k!r} has shape {tuple(v.shape)} but config.json's "
                f"{type(model).__name__} needs {tuple(expected[k].shape)}"
            )
    model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False)


def _is_tied(model: nn.Module, key: str, tensors: dict[str, torch.Tensor]) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and any(q is p and n in tensors for n, q in params.items() if n != key)


def load_checkpoint(path: str | os.PathLike[str]) -> nn.Module:
    """Build the transformers model ``config.json`` names and load its safetensors weights, checked."""
    root = Path(path)
    files = _safetensors_files(root)
    tensors = _read_tensors(files)
    model = _build(root)
    _load_into(model, tensors, root)
    return model


def load_transformed(path: str | os.PathLike[str]) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """Load a folder written by :func:`save_surgery`: (stock-structure model, runtime model, manifest)."""
    root = Path(path)
    manifest_file = root / MANIFEST
    if not manifest_file.is_file():
        raise ValueError(f"{root} has no {MANIFEST}; it was not written by normatlas surgery")
    manifest = json.loads(manifest_file.read_text())
    stock = load_checkpoint(root)
    swaps = [Swap(**s) for s in manifest.get("swaps", [])]
    import copy

    runtime = apply_swaps(copy.deepcopy(stock), swaps)
    return stock, runtime, manifest


def _dedup(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors sharing storage with an earlier one (tied weights; transformers re-ties them)."""
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    out = {}
    for k, v in state.items():
        key = (v.data_ptr(), tuple(v.shape))
        if key in seen:
            continue
        seen[key] = k
        out[k] = v.detach().contiguous().clone()
    return out


@torch.no_grad()
def _check_written(state: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``state`` must read back from ``written`` bitwise equal (same dtype and shape); a key
    left out must be tied to (share storage with) a written one, and nothing else may be in the file."""
    extra = sorted(k for k in written if k not in state)
    if extra:
        raise ValueError(f"the written file has tensor(s) {extra[:5]} that the model does not have")
    for k, v in state.items():
        got = written.get(k)
        if got is None:
            twin = next(
                (n for n, t in state.items() if n in written and t.data_ptr() == v.data_ptr() and t.shape == v.shape),
                None,
            )
            if twin is None:
                raise ValueError(f"tensor {k!r} is missing from the written file")
            got = written[twin]
        if got.dtype != v.dtype or got.shape != v.shape:
            raise ValueError(
                f"written tensor {k!r} does not read back equal (read {got.dtype} {tuple(got.shape)}, "
                f"expected {v.dtype} {tuple(v.shape)})"
            )
        if not torch.equal(got, v.detach().cpu()):
            raise ValueError(f"written tensor {k!r} does not read back equal (its values differ)")


def _rebuild(surgery: Surgery, folder: Path, written: dict[str, torch.Tensor]) -> tuple[nn.Module, nn.Module]:
    """(stock, runtime) models rebuilt from the written ``folder``: from its config.json for a transformers
    model, else the in-memory module structure (a copy) with the written tensors loaded, strictly."""
    if (folder / "config.json").is_file():
        stock, runtime, _ = load_transformed(folder)
        return stock, runtime
    import copy

    stock = copy.deepcopy(surgery.stock).eval()
    _load_into(stock, written, folder)
    return stock, apply_swaps(copy.deepcopy(stock), surgery.swaps)


def save_surgery(surgery: Surgery, out: str | os.PathLike[str], *, force: bool = False, inputs: Any = None) -> Path:
    """Write ``surgery`` atomically, only when its proof passed. Before publishing, the written safetensors
    are read back and every tensor must equal the in-memory one bitwise; the model is rebuilt from the
    written folder (config.json, or the in-memory structure for a non-transformers model) and must hold the
    same tensors; and the rebuilt runtime model's output must be bitwise the in-memory one's on ``inputs``
    (default: :func:`.verify.probe_inputs` for a transformers model). A model that has neither ``inputs``
    nor a transformers config is refused: its output could not be compared."""
    from safetensors.torch import load_file, save_file

    from .verify import model_output, probe_inputs

    if not surgery.checks:
        raise ValueError("refusing to write: the surgery has not been verified (run run_checks first)")
    if not surgery.passed:
        failed = [f"{c.model}/{c.dtype} max_rel={c.max_rel:.3g}" for c in surgery.checks if not c.passed]
        raise ValueError(f"refusing to write: verification failed the tolerance ({'; '.join(failed)})")
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ValueError(f"output={str(target)!r} exists and is not a folder; pass a folder path to write into")
    if target.exists() and any(target.iterdir()) and not force:
        raise ValueError(f"output={str(target)!r} exists and is not empty; pass force=True to replace it")
    model = surgery.stock
    config = getattr(model, "config", None)
    if inputs is None and config is not None:
        try:
            inputs = probe_inputs(model)
        except ValueError:
            inputs = None
    if inputs is None:
        raise ValueError(
            "refusing to write: inputs=None and the model has no transformers config to make probe inputs "
            "from, so the written model's output cannot be compared; pass inputs="
        )
    for parent in (target.parent, *target.parent.parents):
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"output={str(target)!r}: {str(parent)!r} is a file, not a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file(_dedup(model.state_dict()), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if config is not None:
            config.architectures = [type(model).__name__]
            (tmp / "config.json").write_text(config.to_json_string())
        (tmp / MANIFEST).write_text(json.dumps(surgery.manifest(), indent=2, default=str))
        ref = model.state_dict()
        written = load_file(str(tmp / "model.safetensors"))
        _check_written(ref, written)  # the file itself
        stock, reloaded = _rebuild(surgery, tmp, written)
        _check_written(ref, {k: v for k, v in stock.state_dict().items() if k in written})  # what loads from it
        if not torch.equal(model_output(reloaded, inputs)[0], model_output(surgery.runtime(), inputs)[0]):
            raise ValueError("the reloaded runtime model does not reproduce the verified output")
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
