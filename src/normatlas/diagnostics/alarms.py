"""Alarms over the monitor's records: trend, spike, threshold and entropy collapse.

Each alarm watches the keys matching an ``fnmatch`` pattern (``"attention/entropy_norm_min/*"``),
keeps its own history per key, and returns :class:`AlarmEvent` s. All are deterministic
functions of the recorded values.

* :class:`TrendAlarm` - Chameleon's early warning: the final layer's output norm grows
  steadily before the loss diverges. Fires when the least-squares growth of ``log(value)``
  over the last ``window`` records exceeds ``log(growth)``.
* :class:`SpikeDetector` - OLMo 2 diagnosed on gradient-norm spikes: fires when a value
  exceeds ``mean + z * std`` of the previous ``window`` values and ``ratio`` x their median.
* :class:`ThresholdAlarm` - a fixed bound (fp16 headroom, inf/NaN activations, flagged n-gram batches).
* :class:`NonFiniteAlarm` - a value that is NaN or infinite: by default the loss, which the
  :class:`Monitor` checks on every step (a diverged run is never reported as "no alarms").
* :class:`EntropyCollapseAlarm` - Zhai et al. 2023: a layer's normalized attention entropy
  (mean over heads; 1 = uniform, 0 = one-hot) falls below ``floor`` or below ``fraction`` of
  its first recorded value, i.e. the layer's attention is within 10% of one-hot by default.
  Non-finite values (NaN: no query could attend to two keys) are skipped.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "Alarm",
    "AlarmEvent",
    "EntropyCollapseAlarm",
    "NonFiniteAlarm",
    "SpikeDetector",
    "ThresholdAlarm",
    "TrendAlarm",
]


@dataclass(frozen=True)
class AlarmEvent:
    step: int
    alarm: str
    key: str
    value: float
    message: str

    def __str__(self) -> str:
        return f"[normatlas step {self.step}] ALARM {self.alarm}: {self.message}"


class Alarm:
    """Base: ``check(step, record)`` -> events for the keys matching ``pattern``."""

    name = "alarm"

    def __init__(self, pattern: str, once: bool = True) -> None:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern={pattern!r} must be a non-empty fnmatch pattern")
        self.pattern = pattern
        self.once = once
        self.fired: set[str] = set()

    def check(self, step: int, record: Mapping[str, object]) -> list[AlarmEvent]:
        events = []
        for key, value in record.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not fnmatch.fnmatch(key, self.pattern):
                continue
            msg = self.observe(key, float(value))
            if msg is not None and not (self.once and key in self.fired):
                self.fired.add(key)
                events.append(AlarmEvent(step, self.name, key, float(value), msg))
        return events

    def observe(self, key: str, value: float) -> str | None:
        raise NotImplementedError


class TrendAlarm(Alarm):
    name = "trend"

    def __init__(self, pattern: str = "output_norm", window: int = 8, growth: float = 1.5, once: bool = True) -> None:
        super().__init__(pattern, once)
        if window < 3 or growth <= 1.0:
            raise ValueError(f"window={window!r} must be >= 3 and growth={growth!r} > 1")
        self.window, self.growth = window, growth
        self.hist: dict[str, deque[float]] = {}

    def observe(self, key: str, value: float) -> str | None:
        h = self.hist.setdefault(key, deque(maxlen=self.window))
        if value > 0 and math.isfinite(value):
            h.append(math.log(value))
        if len(h) < self.window:
            return None
        n = len(h)
        xm, ym = (n - 1) / 2, sum(h) / n
        slope = sum((i - xm) * (y - ym) for i, y in enumerate(h)) / sum((i - xm) ** 2 for i in range(n))
        fitted = math.exp(slope * (n - 1))
        if fitted > self.growth:
            return f"{key} grew x{fitted:.2f} over the last {n} records (now {value:.4g}); threshold x{self.growth}"
        return None


class SpikeDetector(Alarm):
    name = "spike"

    def __init__(
        self, pattern: str = "grad_norm/*", window: int = 20, z: float = 6.0, ratio: float = 3.0, once: bool = False
    ) -> None:
        super().__init__(pattern, once)
        if window < 4 or z <= 0 or ratio <= 1:
            raise ValueError(f"window={window!r} must be >= 4, z={z!r} > 0 and ratio={ratio!r} > 1")
        self.window, self.z, self.ratio = window, z, ratio
        self.hist: dict[str, deque[float]] = {}

    def observe(self, key: str, value: float) -> str | None:
        h = self.hist.setdefault(key, deque(maxlen=self.window))
        msg = None
        if len(h) >= max(4, self.window // 2):
            mean, std, med = statistics.fmean(h), statistics.pstdev(h), statistics.median(h)
            if not math.isfinite(value) or (value > mean + self.z * std and value > self.ratio * med):
                msg = f"{key} = {value:.4g} spiked above rolling mean {mean:.4g} + {self.z} std ({std:.3g})"
        if math.isfinite(value):
            h.append(value)
        return msg


class ThresholdAlarm(Alarm):
    name = "threshold"

    def __init__(self, pattern: str, above: float | None = None, below: float | None = None, once: bool = True) -> None:
        super().__init__(pattern, once)
        if above is None and below is None:
            raise ValueError("give above= or below= (or both)")
        self.above, self.below = above, below

    def observe(self, key: str, value: float) -> str | None:
        if self.above is not None and value > self.above:
            return f"{key} = {value:.4g} > {self.above:.4g}"
        if self.below is not None and value < self.below:
            return f"{key} = {value:.4g} < {self.below:.4g}"
        return None


class NonFiniteAlarm(Alarm):
    """Fires when a value is NaN or +-inf (a threshold cannot: every comparison with NaN is false)."""

    name = "nonfinite"

    def __init__(self, pattern: str = "loss", once: bool = True) -> None:
        super().__init__(pattern, once)

    def observe(self, key: str, value: float) -> str | None:
        if math.isfinite(value):
            return None
        return f"{key} = {value} is not finite: the run has diverged (check the learning rate, fp16 overflow, bad data)"


class EntropyCollapseAlarm(Alarm):
    name = "entropy-collapse"

    def __init__(
        self, pattern: str = "attention/entropy_norm/*", floor: float = 0.1, fraction: float = 0.1, once: bool = True
    ) -> None:
        super().__init__(pattern, once)
        if not 0 <= floor < 1 or not 0 < fraction < 1:
            raise ValueError(f"floor={floor!r} must lie in [0, 1) and fraction={fraction!r} in (0, 1)")
        self.floor, self.fraction = floor, fraction
        self.first: dict[str, float] = {}

    def observe(self, key: str, value: float) -> str | None:
        if not math.isfinite(value):
            return None
        first = self.first.setdefault(key, value)
        if value < self.floor or value < self.fraction * first:
            return (
                f"{key}: normalized attention entropy {value:.3f} (first {first:.3f}) "
                f"fell below floor {self.floor} or {self.fraction:.0%} of its first value"
            )
        return None


def default_alarms() -> list[Alarm]:
    """The alarms a :class:`Monitor` starts with."""
    return [
        NonFiniteAlarm("loss"),
        TrendAlarm("output_norm"),
        SpikeDetector("grad_norm/total"),
        EntropyCollapseAlarm(),
        ThresholdAlarm("headroom/fp16_log2", below=0.0),
        ThresholdAlarm("headroom/nonfinite_share", above=0.0),
        ThresholdAlarm("ngrams/flagged", above=0.0),
    ]
