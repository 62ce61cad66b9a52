"""Count the collectives (and their bytes) that a piece of training code issues, with a TorchDispatchMode.

Every collective PyTorch's distributed engine issues, from DTensor's redistributions (functional collectives,
``_c10d_functional.*``) to FSDP2's all-gathers and reduce-scatters and DDP-free ``torch.distributed`` calls
(``c10d.*``), is a dispatcher op; :class:`CollectiveCounter` sees each one and records its name and payload.
The op set is the one ``torch.distributed.tensor.debug.CommDebugMode`` counts; this counter adds bytes.

Payload: the bytes of the largest tensor argument of the call (a list argument counts as the sum of its tensors),
i.e. the whole buffer the collective moves on this rank: the gathered output of an all-gather, the unsharded
input of a reduce-scatter, the tensor of an all-reduce. The mode is thread-local (it does not see collectives
issued from other threads); on CPU the backward runs on the calling thread, so it sees the whole step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CollectiveCounter", "CollectiveStats", "count_collectives"]

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_KINDS = ("gather", "scatter", "reduce", "all_to_all", "alltoall", "broadcast")  # not wait_tensor, barrier, send


def _payload(args: tuple, kwargs: dict) -> int:
    best = 0
    for a in (*args, *kwargs.values()):
        leaves = [t for t in tree_leaves(a) if isinstance(t, Tensor)]
        best = max(best, sum(t.numel() * t.element_size() for t in leaves))
    return best


def _name(func: Any) -> str:
    packet = getattr(func, "_overloadpacket", func)
    return str(getattr(packet, "__name__", packet)).rstrip("_")


@dataclass
class CollectiveStats:
    """Counts and payload bytes per collective kind (e.g. ``allgather_base``, ``reduce_scatter_tensor``)."""

    counts: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    @property
    def total_count(self) -> int:
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def rows(self) -> list[dict[str, Any]]:
        """One row per collective kind, sorted by name (for tables and CSV)."""
        return [{"collective": k, "count": self.counts[k], "bytes": self.bytes[k]} for k in sorted(self.counts)]


class CollectiveCounter(TorchDispatchMode):
    """A dispatch mode recording every collective op run inside it into :attr:`stats`."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = CollectiveStats()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ns = getattr(getattr(func, "_schema", None), "name", "").split("::")[0]
        if ns in _NAMESPACES:
            name = _name(func)
            if any(k in name for k in _KINDS):
                self.stats.counts[name] += 1
                self.stats.bytes[name] += _payload(args, kwargs)
        return func(*args, **kwargs)


def count_collectives(fn: Callable[[], Any]) -> tuple[Any, CollectiveStats]:
    """Run ``fn()`` under a :class:`CollectiveCounter`; return its result and the collectives it issued."""
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be a callable taking no arguments")
    with CollectiveCounter() as counter:
        out = fn()
    return out, counter.stats
