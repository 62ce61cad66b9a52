"""Read checkpoints under the one load policy, write them atomically, and load a transformed one back.

Reading (:mod:`normatlas.checkpoint`): only ``config.json`` (JSON) and safetensors are ever read; a pickle is
refused, never unpickled. The model is built from ``config.json``'s architecture (a transformers class), every
tensor is checked against it by name and shape, and every tensor keeps its stored dtype (a bfloat16 checkpoint
loads as bfloat16, an int32 buffer stays int32).

Writing (:func:`save_surgery`): the output location is checked first (:func:`.output.check_output`: never the
input, inside it or around it; ``force`` replaces only an earlier normatlas output). Everything goes into a
temporary folder beside the target, which is renamed into place only when complete and verified (every tensor
read back bitwise equal, the model rebuilt from the folder reproducing the verified output bitwise), so a
failure, Ctrl-C or SIGTERM leaves no output behind. The folder holds the transformed weights in the stock module
structure, each tensor in its own dtype, sharded as the input was (same shard names, with
``model.safetensors.index.json``); ``config.json`` (transformers loads it; its ``dtype`` is the weights');
every other file of the input (tokenizer, generation config, chat template, README, subfolders), copied; and
``normatlas_surgery.json`` (the runtime swaps, what changed and the measured proof; also the marker that lets
a later ``force`` replace the folder). Weights in other formats (a stale ``pytorch_model.bin``) are not copied:
they hold the untransformed values. :func:`load_transformed` rebuilds the runtime model: stock structure,
weights, then the swaps.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._io import dumps, read_json
from ..capacity import check_disk, human_bytes
from ..checkpoint import (
    INDEX,
    PICKLE_SUFFIXES,
    Checkpoint,
    check_build_memory,
    header_tensors,
    is_weight_file,
    locate,
    on_meta,
    read_tensors,
    storage_dtype,
)
from .output import MANIFEST, WRITING, check_output, dir_mode, file_mode, interruptible
from .report import NothingToChange, Surgery, Swap, apply_swaps

__all__ = ["MANIFEST", "PICKLE_SUFFIXES", "check_output", "load_checkpoint", "load_transformed", "save_surgery"]


def _build(ckpt: Checkpoint) -> nn.Module:
    """The model config.json names, built: its tensors first compared with the safetensors headers and its size
    with the memory available, on the meta device, so a mismatch or a model too large is one line up front."""
    construct = _constructor(ckpt)
    meta = on_meta(construct)
    if meta is not None:
        _check_tensors(meta, header_tensors(ckpt), ckpt.root)
        check_build_memory(meta, f"{ckpt.root}", weights=sum(f.stat().st_size for f in ckpt.files))
    return construct().eval()


def _constructor(ckpt: Checkpoint) -> Callable[[], nn.Module]:
    """A function building the transformers model class config.json's ``architectures`` names from it."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(ckpt.root))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{ckpt.root / 'config.json'}: transformers cannot read it as a config ({first})") from exc
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ValueError(
            f"config.json architectures={getattr(config, 'architectures', None)!r} does not name a "
            "transformers model class"
        )
    return lambda: cls(config)


@torch.no_grad()
def _load_into(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Check ``tensors`` against ``model`` by name, shape and kind, then install them with their own dtype
    (the Parameter objects stay, so tied weights stay tied)."""
    expected = _check_tensors(model, tensors, where)
    for k, v in tensors.items():
        if k in expected:
            prefix, _, attr = k.rpartition(".")
            owner = model.get_submodule(prefix)
            slot = owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)
            if slot is None:
                raise ValueError(f"{where}: tensor {k!r} has no parameter or buffer to load into")
            slot.data = v


def _check_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """``tensors`` (real, or meta ones from the headers) against ``model`` (real or on the meta device) by name,
    shape and kind: a ValueError naming the first tensor that differs; returns the model's state dict."""
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
        if k not in expected:
            continue
        want = expected[k]
        if tuple(v.shape) != tuple(want.shape):
            raise ValueError(
                f"{where}: tensor {k!r} has shape {tuple(v.shape)} but config.json's "
                f"{type(model).__name__} needs {tuple(want.shape)}"
            )
        if v.is_floating_point() != want.is_floating_point() or v.is_complex() != want.is_complex():
            raise ValueError(
                f"{where}: tensor {k!r} is {str(v.dtype).replace('torch.', '')} but config.json's "
                f"{type(model).__name__} computes with a {str(want.dtype).replace('torch.', '')} tensor there"
            )
    return expected


def _is_tied(model: nn.Module, key: str, tensors: dict[str, torch.Tensor]) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and any(q is p and n in tensors for n, q in params.items() if n != key)


def load_checkpoint(path: str | os.PathLike[str]) -> nn.Module:
    """Build the transformers model ``config.json`` names and load its safetensors weights, checked, each
    tensor in its stored dtype. Before anything is read or allocated, the model's tensors are compared with the
    safetensors headers and its size with the memory available (one-line ValueErrors)."""
    ckpt = locate(path)
    model = _build(ckpt)
    tensors, _ = read_tensors(ckpt)
    _load_into(model, tensors, ckpt.root)
    return model


def load_transformed(path: str | os.PathLike[str]) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """Load a folder written by :func:`save_surgery`: (stock-structure model, runtime model, manifest)."""
    root = Path(path)
    manifest_file = root / MANIFEST
    if not manifest_file.is_file():
        raise ValueError(f"{root} has no {MANIFEST}; it was not written by normatlas surgery")
    manifest = read_json(manifest_file)
    stock = load_checkpoint(root)
    swaps = [Swap.from_dict(s) for s in manifest.get("swaps", [])]
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
    stock = copy.deepcopy(surgery.stock).eval()
    _load_into(stock, written, folder)
    return stock, apply_swaps(copy.deepcopy(stock), surgery.swaps)


def _shards(state: dict[str, torch.Tensor], source: Checkpoint | None) -> dict[str, dict[str, torch.Tensor]]:
    """Mirror the input's sharding: each tensor goes to the shard file it came from (a tensor new to the
    output, such as an untied head, to the last shard); an unsharded input gives one model.safetensors."""
    if source is None or not source.sharded:
        return {"model.safetensors": state}
    home = source.names
    order = [f.name for f in source.files]
    out: dict[str, dict[str, torch.Tensor]] = {f: {} for f in order}
    for k, v in state.items():
        out[home.get(k, order[-1])][k] = v
    return {f: part for f, part in out.items() if part}


def _copy_others(source: Checkpoint, dest: Path) -> tuple[list[str], list[str]]:
    """Copy every file of the input that is not weights and not rewritten here (config.json, the manifest),
    subfolders included, with the umask's modes: (copied, skipped weight files), relative paths."""
    copied: list[str] = []
    skipped: list[str] = []
    for folder, dirs, files in os.walk(source.root):
        rel = Path(folder).relative_to(source.root)
        dirs.sort()
        for d in dirs:
            (dest / rel / d).mkdir(exist_ok=True)
            os.chmod(dest / rel / d, dir_mode())
        for name in sorted(files):
            relname = str(rel / name) if rel != Path(".") else name
            src = Path(folder) / name
            if rel == Path(".") and name in ("config.json", MANIFEST, INDEX):
                continue
            if is_weight_file(src):
                if src not in source.files:  # the input's own shards are rewritten, not skipped
                    skipped.append(relname)
                continue
            shutil.copyfile(src, dest / relname)
            os.chmod(dest / relname, file_mode(src.stat().st_mode))
            copied.append(relname)
    return copied, skipped


def _write_state(tmp: Path, shards: dict[str, dict[str, torch.Tensor]], indexed: bool) -> list[str]:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    for fname, part in shards.items():
        try:
            save_file(part, str(tmp / fname), metadata={"format": "pt"})
        except SafetensorError as exc:  # an I/O error inside the writer: an OSError, so it is reported as one
            text = str(exc)
            full = "StorageFull" in text or "No space left" in text or "code: 28" in text
            raise OSError(errno.ENOSPC if full else errno.EIO, os.strerror(errno.ENOSPC) if full else text) from exc
    names = list(shards)
    if indexed:
        total = sum(t.numel() * t.element_size() for part in shards.values() for t in part.values())
        weight_map = {k: f for f, part in shards.items() for k in sorted(part)}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX).write_text(dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names


def _bytes_needed(shards: dict[str, dict[str, torch.Tensor]], source: Checkpoint | None) -> int:
    """What the output folder will hold: the tensors, the input's other files copied beside them, and 1 MB for
    config.json, the index and the manifest (safetensors' headers are small against any tensor)."""
    tensors = sum(t.numel() * t.element_size() for part in shards.values() for t in part.values())
    others = 0
    if source is not None:
        for folder, _, files in os.walk(source.root):
            for name in files:
                path = Path(folder) / name
                if not is_weight_file(path):
                    with contextlib.suppress(OSError):
                        others += path.stat().st_size
    return tensors + others + 1_000_000


def _refuse_unwritable(surgery: Surgery) -> None:
    if not surgery.checks:
        raise ValueError("refusing to write: the surgery has not been verified (run run_checks first)")
    if not surgery.passed:
        failed = [f"{c.model}/{c.dtype} max_rel={c.max_rel:.3g}" for c in surgery.checks if not c.passed]
        raise ValueError(f"refusing to write: verification failed the tolerance ({'; '.join(failed)})")
    if not surgery.changed:
        raise NothingToChange(f"nothing to change: {surgery.transform}: {surgery.nothing_reason()}; nothing written")


def _comparison_inputs(model: nn.Module, inputs: Any) -> Any:
    """The inputs the written model's output is compared on: the caller's, else probe inputs from its config."""
    from .verify import probe_inputs

    if inputs is None and getattr(model, "config", None) is not None:
        try:
            inputs = probe_inputs(model)
        except ValueError:
            inputs = None
    if inputs is None:
        raise ValueError(
            "refusing to write: inputs=None and the model has no transformers config to make probe inputs "
            "from, so the written model's output cannot be compared; pass inputs="
        )
    return inputs


def _write_folder(tmp: Path, surgery: Surgery, shards: dict[str, dict[str, torch.Tensor]], src: Any) -> list[str]:
    """The weights (sharded like the source), config.json, the source's other files and the manifest, in ``tmp``;
    returns the shard file names."""
    model, config = surgery.stock, getattr(surgery.stock, "config", None)
    stored = storage_dtype(t for shard in shards.values() for t in shard.values())
    written_files = _write_state(tmp, shards, indexed=src is not None and src.sharded)
    if config is not None:
        config.architectures = [type(model).__name__]
        if stored is not None:
            config.dtype = stored  # config.json says what the weights are
        (tmp / "config.json").write_text(config.to_json_string())
        written_files.append("config.json")
    copied, skipped = _copy_others(src, tmp) if src is not None else ([], [])
    manifest = surgery.manifest()
    manifest["dtype"] = None if stored is None else str(stored).replace("torch.", "")
    manifest["files"] = {"weights": [f for f in written_files if f != "config.json"], "copied": copied}
    if skipped:
        manifest["files"]["not_copied"] = skipped
    (tmp / MANIFEST).write_text(dumps(manifest, indent=2))
    for f in [*written_files, MANIFEST]:
        os.chmod(tmp / f, file_mode())
    return list(shards)


def _verify_folder(
    tmp: Path, surgery: Surgery, shard_files: list[str], ref: dict[str, torch.Tensor], inputs: Any
) -> None:
    """The written files hold the in-memory tensors bitwise, the model rebuilt from them too, and its runtime
    output is bitwise the in-memory runtime model's."""
    from safetensors.torch import load_file

    from .verify import model_output

    written: dict[str, torch.Tensor] = {}
    for fname in shard_files:
        written.update(load_file(str(tmp / fname)))
    _check_written(ref, written)  # the files themselves
    stock, reloaded = _rebuild(surgery, tmp, written)
    _check_written(ref, {k: v for k, v in stock.state_dict().items() if k in written})  # what loads from it
    if not torch.equal(model_output(reloaded, inputs)[0], model_output(surgery.runtime(), inputs)[0]):
        raise ValueError("the reloaded runtime model does not reproduce the verified output")


def _publish(tmp: Path, target: Path) -> None:
    """Move the verified temp folder into place (an earlier output is replaced only after the move)."""
    (tmp / WRITING).unlink()
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def save_surgery(
    surgery: Surgery,
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    inputs: Any = None,
    source: str | os.PathLike[str] | None = None,
    force_hint: str = "force=True",
) -> Path:
    """Write ``surgery`` atomically, only when its proof passed and it changes something
    (:class:`.report.NothingToChange` otherwise).

    ``source`` is the input checkpoint folder: the output must not be it, lie inside it or contain it; its
    sharding is mirrored and its other files are copied. ``force`` replaces an earlier normatlas output, never
    another folder. Before publishing, the written safetensors are read back and every tensor must equal the
    in-memory one bitwise (dtype included); the model is rebuilt from the written folder (config.json, or the
    in-memory structure for a non-transformers model) and must hold the same tensors; and the rebuilt runtime
    model's output must be bitwise the in-memory one's on ``inputs`` (default: :func:`.verify.probe_inputs` for a
    transformers model). A model that has neither ``inputs`` nor a transformers config is refused: its output
    could not be compared."""
    _refuse_unwritable(surgery)
    plan = check_output(out, source=source, force=force, force_hint=force_hint)
    for msg in plan.removed:
        warnings.warn(msg, stacklevel=2)
    target = plan.target
    src = locate(source) if source is not None else None
    inputs = _comparison_inputs(surgery.stock, inputs)
    ref = surgery.stock.state_dict()
    shards = _shards(_dedup(ref), src)
    need = _bytes_needed(shards, src)
    check_disk(target.parent, need, f"writing {target.name}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"could not create {target.parent}: {exc.strerror or exc}") from exc
    with interruptible():
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, dir_mode())
            (tmp / WRITING).write_text(dumps({"pid": os.getpid()}))
            shard_files = _write_folder(tmp, surgery, shards, src)
            _verify_folder(tmp, surgery, shard_files, ref, inputs)
            _publish(tmp, target)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
            size = f" in {target.parent} (the output needs about {human_bytes(need)})" if full else ""
            raise OSError(
                exc.errno, f"could not write {target}: {exc.strerror or exc}{size}; nothing was written"
            ) from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
