"""Inspect every vision-tower model type of the installed transformers with ``inspect --vision``, and count how far
each gets.

The types are the ones :func:`normatlas.factory.is_vision_type` calls an image encoder alone (a config with image
channels, no vocabulary and no text config). Each is built tiny offline (:func:`normatlas.factory.build_vision`),
given the input layout its config and signature ask for (:func:`normatlas.factory.tower_inputs`) and
inspected (:func:`normatlas.inspect.vision.inspect_vision`), in a forked child killed after ``--timeout`` seconds. One
line per type says where it stopped:

* ``ok``: operator and placement read (the line shows them, the final norm, layers and stages);
* ``ok (unread)``: it ran, but no residual add was found, so no placement (``unknown``: a tower without residual
  adds reads so, rightly);
* ``failed build``: the tower could not be made from its config (a missing package says so);
* ``failed inputs``: no input layout runs the tower (every layout tried is in the reason);
* ``failed run`` / ``failed read``: the recorded forward raised, or reading it did;
* ``died``: the child was killed after the timeout, or crashed.

    PYTHONPATH=src HF_HUB_OFFLINE=1 nice python benchmarks/vision_sweep.py --out benchmarks/results
"""

from __future__ import annotations

from typing import Any

from vlm_sweep import build_feed_inspect, limit_child, sweep_main

COLUMNS = ["model", "status", "operator", "placement", "final", "layers", "stages", "inputs", "reason", "seconds"]
STATUSES = ("ok", "ok (unread)", "failed build", "failed inputs", "failed run", "failed read", "died")


def one(mt: str) -> dict[str, Any]:
    """Build, feed and inspect one vision tower type; the row never raises."""
    limit_child()
    from normatlas.factory import build_vision, tower_inputs
    from normatlas.inspect.vision import inspect_vision

    rep, row = build_feed_inspect(
        mt,
        COLUMNS,
        build_vision,
        tower_inputs,
        lambda model, inputs: inspect_vision(model, inputs.pop("pixel_values"), name=mt, probe=False, **inputs),
        build_failures=(("failed build", ""), ("failed inputs", "")),
        describe=lambda inputs: {"inputs": " ".join(f"{k}{tuple(v.shape)}" for k, v in inputs.items())},
    )
    if rep is None:
        return row
    return row | {
        "status": "ok (unread)" if rep.placement.value == "unknown" else "ok",
        "operator": rep.operator.value,
        "placement": rep.placement.value,
        "final": rep.final_norm.value,
        "layers": rep.layers,
        "stages": len(rep.stages) or 1,
    }


def main() -> None:
    from normatlas.factory import is_vision_type

    sweep_main(__doc__, "vision-tower types", 120.0, is_vision_type, one, "vision_sweep", COLUMNS, STATUSES)


if __name__ == "__main__":
    main()
