"""The package's one file writer and one JSON encoding.

* :func:`atomic_write` puts bytes, text or whatever a ``write(path)`` callable writes at ``path`` so that a reader
  sees the old file or the whole new one, never a part: the data goes into a temporary file beside ``path`` whose
  name is unique (``mkstemp``: two writers of one path never share a temporary), is flushed to disk (``fsync``) and
  renamed over ``path`` (``os.replace``). On any failure the temporary is removed and ``path`` is left as it was.
* :func:`jsonable` and :func:`dumps` are the one encoding policy: **a non-finite float (NaN, inf, -inf) is written
  as ``null``**, as JavaScript's ``JSON.stringify`` does, so every document is strict JSON (RFC 8259) that a browser,
  ``jq`` and ``json.loads`` all read. Enums are written as their value, tensors and arrays as (nested) lists, objects
  with a ``to_json()`` method as what it returns; anything else as ``str(value)``, or a TypeError with
  ``strict=True``. :func:`read_json` reads a file back, naming it in one line when it is not JSON; reading is lenient
  where writing is strict (``NaN`` / ``Infinity`` tokens that other writers leave still read, as floats).

Layer 0: it imports nothing of ours, so every layer may write through it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "dumps", "jsonable", "read_json"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file (mkstemp gives 0o600)


def atomic_write(
    path: str | os.PathLike[str], data: bytes | str | Callable[[Path], object], *, encoding: str = "utf-8"
) -> Path:
    """Write ``data`` to ``path`` atomically and return ``path`` as a :class:`~pathlib.Path`.

    ``data`` is ``bytes``, ``str`` (encoded with ``encoding``) or a callable ``write(tmp)`` that writes the whole
    file at the path it is given (``figure.savefig``, ``shutil.copyfile``, ``safetensors.save_file``). The parent
    folder is created when missing. The temporary is ``.NAME.XXXXXXXX.tmp`` plus ``path``'s suffix (so a writer
    that reads the format off the suffix still can), unique per call."""
    if not isinstance(data, (bytes, bytearray, str)) and not callable(data):
        raise TypeError(f"atomic_write: data={type(data).__name__} must be bytes, str or a callable write(path)")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{target.suffix}", dir=target.parent)
    tmp = Path(name)
    try:
        if callable(data):
            os.close(fd)
            fd = -1
            data(tmp)
            fd = os.open(tmp, os.O_RDONLY)
        else:
            blob = data.encode(encoding) if isinstance(data, str) else bytes(data)
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    _sync_folder(target.parent)
    return target


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every platform opens folders)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def jsonable(value: Any, *, strict: bool = False) -> Any:
    """``value`` as JSON values under the package's one policy (see the module's docstring): non-finite floats
    become ``None``. ``strict=True`` raises a TypeError for a value of no JSON meaning instead of writing its str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value.value if isinstance(value, Enum) else value
    if isinstance(value, Enum):
        return jsonable(value.value, strict=strict)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, strict=strict) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v, strict=strict) for v in value]
    for method in ("to_json", "tolist", "item"):  # our records; tensors and arrays; 0-d scalars
        convert = getattr(value, method, None)
        if callable(convert):
            try:
                return jsonable(convert(), strict=strict)
            except (TypeError, ValueError, RuntimeError):
                if strict:
                    raise
    if strict:
        raise TypeError(f"value {value!r} of type {type(value).__name__} is not a JSON scalar, list or object")
    return str(value)


def dumps(value: Any, *, indent: int | None = None, sort_keys: bool = False, strict: bool = False) -> str:
    """``value`` as strict JSON text under the one policy (:func:`jsonable`; never ``NaN`` or ``Infinity``)."""
    return json.dumps(jsonable(value, strict=strict), indent=indent, sort_keys=sort_keys, allow_nan=False)


def read_json(path: str | os.PathLike[str]) -> Any:
    """``path`` parsed as UTF-8 JSON; a ValueError naming the file and where it breaks when it is not (truncated,
    malformed, not text). A missing file raises the OSError ``open`` raises."""
    file = Path(path)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON (truncated or malformed? line {exc.lineno} column {exc.colno}: "
                         f"{exc.msg})") from None  # fmt: skip
