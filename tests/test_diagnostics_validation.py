"""The diagnostics API refuses what it cannot use, by name, and a diverged loss raises an alarm."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from normatlas.diagnostics import Monitor, param_groups
from normatlas.diagnostics.tinylm import TinyLM


@pytest.mark.parametrize("wd", [math.nan, math.inf, -math.inf, -0.1])
def test_param_groups_refuses_a_non_finite_or_negative_weight_decay(wd: float) -> None:
    with pytest.raises(ValueError, match=r"weight_decay=.* must be a finite number >= 0"):
        param_groups(nn.Linear(4, 4), weight_decay=wd)


def test_monitor_on_a_model_without_blocks_says_what_it_looks_for() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))  # nothing repeated
    with pytest.raises(ValueError, match="found no repeated blocks in Sequential") as info:
        Monitor(model)
    msg = str(info.value)
    assert "nn.ModuleList / nn.Sequential of >= 2 modules of one class" in msg and "blocks=[...]" in msg
    with pytest.raises(ValueError, match=r"blocks=\[\] was given"):
        Monitor(TinyLM(), blocks=[])
    with pytest.raises(TypeError, match=r"blocks\[0\] must be an nn.Module"):
        Monitor(TinyLM(), blocks=["layer0"])  # type: ignore[list-item]
    Monitor(model, metrics=["grad_norm", "output_norm"], print_alarms=False)  # what needs no blocks still works


@pytest.mark.parametrize("bad", [math.nan, math.inf, torch.tensor(math.nan)])
def test_a_nan_or_inf_loss_raises_an_alarm_on_every_step(bad: float | torch.Tensor) -> None:
    from normatlas.diagnostics.alarms import NonFiniteAlarm, default_alarms

    model = TinyLM()
    mon = Monitor(model, every=10, metrics=["grad_norm"], print_alarms=False)
    model(torch.randint(64, (2, 8)))
    assert mon.step(loss=2.5) == []  # step 0, measured
    events = mon.step(loss=bad)  # step 1, between measured steps
    assert [(e.alarm, e.key, e.step) for e in events] == [("nonfinite", "loss", 1)]
    assert "not finite" in str(events[0]) and mon.events == events
    assert any(isinstance(a, NonFiniteAlarm) for a in default_alarms())


def test_a_nan_loss_on_a_measured_step_is_recorded_and_alarmed(capsys: pytest.CaptureFixture[str]) -> None:
    model = TinyLM()
    mon = Monitor(model, every=1, metrics=["output_norm"])
    model(torch.randint(64, (2, 8)))
    events = mon.step(loss=torch.tensor(math.nan))
    assert [e.alarm for e in events] == ["nonfinite"] and math.isnan(mon.last["loss"])
    assert "ALARM nonfinite: loss = nan" in capsys.readouterr().out
    with pytest.raises(ValueError, match="loss must be a scalar"):
        mon.step(loss=torch.zeros(3))
