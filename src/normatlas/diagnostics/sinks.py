"""Where records go: memory, JSONL, CSV (long format), TensorBoard when installed.

A record is a flat ``{key: number}`` dict with a ``step`` key; keys look like
``residual/rms/L3`` (metric / statistic / layer).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from typing import Any

from .._io import dumps

__all__ = ["CSVSink", "JSONLSink", "MemorySink", "Sink", "TensorBoardSink"]


class Sink:
    def write(self, record: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemorySink(Sink):
    """Keeps every record; ``series(key)`` gives ``(steps, values)``."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: Mapping[str, Any]) -> None:
        self.records.append(dict(record))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.records if key in r]
        return [s for s, _ in pts], [v for _, v in pts]

    def keys(self) -> list[str]:
        return sorted({k for r in self.records for k in r if k != "step"})


class JSONLSink(Sink):
    """One JSON object per record (non-finite floats written as null: :func:`normatlas._io.dumps`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: Mapping[str, Any]) -> None:
        self.fh.write(dumps(record) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class CSVSink(Sink):
    """Long format ``step,key,value``: keys may differ between records."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.fh = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - closed in close()
        self.writer = csv.writer(self.fh)
        if new:
            self.writer.writerow(["step", "key", "value"])

    def write(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        for k, v in record.items():
            if k != "step":
                self.writer.writerow([step, k, v])
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class TensorBoardSink(Sink):
    """Scalars to TensorBoard via ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("TensorBoardSink needs the tensorboard package: pip install tensorboard") from exc
        self.writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record.get("step", 0))
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()
