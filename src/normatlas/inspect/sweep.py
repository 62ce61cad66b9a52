"""Sweep every decoder-only architecture in the installed transformers, or every encoder-decoder.

Each model type with a causal-LM class (encoder-decoders excluded: :func:`decoder_model_types`), or each type whose
config says ``is_encoder_decoder`` (:func:`encoder_decoder_model_types`, with the encoder stack's columns:
:data:`ENCODER_DECODER_COLUMNS`), is built tiny from its config class (random weights, offline) and inspected;
failures are kept as rows with an ``error`` column, never raised.
"""

from __future__ import annotations

import csv
import functools
import io
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._io import atomic_write, dumps

__all__ = [
    "ENCODER_DECODER_COLUMNS",
    "decoder_model_types",
    "encoder_decoder_counts",
    "encoder_decoder_model_types",
    "sweep",
    "write_sweep",
]

COLUMNS = [
    "model",
    "operator",
    "eps",
    "eps_placement",
    "gain_convention",
    "bias",
    "cast_order",
    "placement",
    "placement_attention",
    "placement_mlp",
    "placement_mixer",
    "residual_scale",
    "branch_scale",
    "depth_scaling",
    "qk_norm",
    "qk_norm_rope",
    "v_norm",
    "attn_softcap",
    "final_norm",
    "final_logit_softcap",
    "embedding_scale",
    "embedding_norm",
    "layers",
    "seconds",
    "error",
]


ENCODER_DECODER_COLUMNS = [
    *COLUMNS[:-3],
    "placement_cross_attention",
    "stack",
    *(f"encoder_{k}" for k in ("layers", "operator", "placement", "placement_attention", "placement_mlp")),
    *(f"encoder_{k}" for k in ("final_norm", "embedding_norm", "embedding_scale")),
    *COLUMNS[-3:],
]
"""An encoder-decoder sweep's columns: the decoder's (the headline), its cross-attention, the encoder's."""


def encoder_decoder_model_types() -> list[str]:
    """Model types of the installed transformers whose config says ``is_encoder_decoder`` (every one, a detection
    transformer's or a speech model's included)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = []
    for mt in sorted(CONFIG_MAPPING.keys()):
        try:
            if getattr(CONFIG_MAPPING[mt], "is_encoder_decoder", False) is True:
                out.append(mt)
        except (KeyError, ImportError):
            continue
    return out


def encoder_decoder_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """An encoder-decoder sweep's counts: ``read`` (both stacks found, a placement each), ``not read`` (built and
    run, but not read as two placed stacks) and ``could not build`` (an error row)."""
    counts = {"read": 0, "not read": 0, "could not build": 0}
    for r in rows:
        placed = r.get("placement") not in (None, "unknown") and r.get("encoder_placement") not in (None, "unknown")
        key = "could not build" if r.get("error") else "read" if r.get("stack") and placed else "not read"
        counts[key] += 1
    return counts


def decoder_model_types() -> list[str]:
    """Model types of the installed transformers that have a causal-LM head and are not encoder-decoders."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            if getattr(CONFIG_MAPPING[mt], "is_encoder_decoder", False) is True:
                continue
        except KeyError:
            continue
        out.append(mt)
    return out


def _one(mt: str, columns: list[str] = COLUMNS) -> dict[str, Any]:
    import warnings

    from . import inspect_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rep = inspect_target(mt, probe=False)
            row = {c: rep.summary_row().get(c) for c in columns}
            row["error"] = ""
        except Exception as exc:  # a per-architecture error column, by design
            msg = str(exc).splitlines()[0][:160] if str(exc) else ""
            row = {c: None for c in columns} | {"model": mt, "error": f"{type(exc).__name__}: {msg}"}
    return row


def _child(fn: Callable[[str], dict[str, Any]], mt: str, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    conn.send(fn(mt))
    conn.close()


def run_isolated(
    fn: Callable[[str], dict[str, Any]], mt: str, timeout: float
) -> tuple[dict[str, Any] | None, str]:  # fmt: skip
    """``fn(mt)`` in a forked process (one intra-op thread), killed after ``timeout`` seconds: its row, or None
    and why there is none (timed out, or the child's exit code). A sweep's unit of isolation: one architecture
    that hangs or crashes the interpreter costs its own row only."""
    import multiprocessing as mp
    import signal
    import threading

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    # A Ctrl-C that lands while the process forks is raised inside the fork's after-fork hooks, which swallow it
    # ("Exception ignored in ..."), and the sweep would go on. Around the fork it is only noted, then raised.
    noted: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: noted.append(signum)) if main else None
    proc = ctx.Process(target=_child, args=(fn, mt, send), daemon=True)
    try:
        proc.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if noted:
        proc.kill()
        proc.join()
        raise KeyboardInterrupt
    send.close()
    row = None
    if recv.poll(timeout):
        try:
            row = recv.recv()
        except EOFError:  # the child died before sending its row (killed, or a crash in native code)
            row = None
    proc.join(1)
    if proc.is_alive():
        proc.kill()
        proc.join()
    reason = f"timed out after {timeout:.0f} s" if proc.exitcode in (None, -9) else f"exit code {proc.exitcode}"
    return row, reason


def _isolated(mt: str, timeout: float, columns: list[str] = COLUMNS) -> dict[str, Any]:
    """Run one architecture in a forked process, killed after ``timeout`` seconds."""
    row, reason = run_isolated(functools.partial(_one, columns=columns), mt, timeout)
    return row if row is not None else {c: None for c in columns} | {"model": mt, "error": f"Timeout: {reason}"}


def sweep(
    model_types: Iterable[str] | None = None,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    timeout: float | None = 60.0,
    columns: list[str] = COLUMNS,
) -> list[dict[str, Any]]:
    """Inspect each model type; one row per type (``error`` set where it could not be built or traced).

    With ``timeout`` each architecture runs in a forked child killed after that many
    seconds (some default configs stay large after shrinking); ``None`` runs in-process. ``columns``: the row's
    fields (:data:`ENCODER_DECODER_COLUMNS` for encoder-decoders).
    """
    import transformers  # noqa: F401  (imported once, before forking)

    types = list(model_types) if model_types is not None else decoder_model_types()
    try:
        from tqdm import tqdm

        it: Iterable[str] = tqdm(types, desc="inspect", unit="arch", disable=not progress)
    except ImportError:  # pragma: no cover
        it = types
    rows = []
    for mt in it:
        t0 = time.perf_counter()
        row = _one(mt, columns) if timeout is None else _isolated(mt, timeout, columns)
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def write_sweep(rows: list[dict[str, Any]], out_dir: str | Path, columns: list[str] = COLUMNS) -> tuple[Path, Path]:
    """Write ``transformers_matrix.json`` and ``.csv`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jp, cp = out / "transformers_matrix.json", out / "transformers_matrix.csv"
    atomic_write(jp, dumps(rows, indent=1))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(cp, buf.getvalue())
    return jp, cp
