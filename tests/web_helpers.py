"""A normatlas web server in a thread, for the API and browser tests."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from normatlas.experiments import Experiment, Outcome, RunContext, Series
from normatlas.experiments.base import estimates
from normatlas.experiments.runner import run_experiment, use_agg
from normatlas.experiments.verdict import Clause, Direction, VerdictRule
from normatlas.functional import normalize
from normatlas.spec import Axis, Layout, NormSpec
from normatlas.web import AtlasServer, Config, make_server


@contextlib.contextmanager
def running(root: Path, experiments: Path | None = None) -> Iterator[AtlasServer]:
    """A server on a free loopback port, serving until the block ends; its socket is closed after."""
    server = make_server("127.0.0.1", 0, Config(root, experiments))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _depth_run(ctx: RunContext) -> Outcome:
    """The stream's variance by depth under Pre-LN (x + F(N(x))) and Post-LN (N(x + F(x))), F a random linear map."""
    plt = use_agg()
    g = ctx.generator()
    d, depth = 32, 6
    spec = NormSpec(layout=Layout.BTD, reduce=frozenset({Axis.FEATURE}), bias=False)
    rows = []
    for name in ("pre_ln", "post_ln"):
        x = torch.randn(4, 8, d, generator=g)
        for layer in range(1, depth + 1):
            w = torch.randn(d, d, generator=g) / d**0.5
            x = x + normalize(x, spec) @ w if name == "pre_ln" else normalize(x + x @ w, spec)
            rows.append((name, layer, float(x.var())))
    pre = [v for n, _, v in rows if n == "pre_ln"]
    post = [v for n, _, v in rows if n == "post_ln"]
    fig, ax = plt.subplots(figsize=(4, 3))
    for name, ys in (("pre_ln", pre), ("post_ln", post)):
        ax.plot(range(1, depth + 1), ys, label=name)
    ax.set(title="Pre-LN's stream variance grows with depth", xlabel="layer", ylabel="variance")
    ax.legend()
    measured = {"pre_last": pre[-1], "post_last": post[-1]}
    series = {"variance": Series(("placement", "layer", "variance"), rows)}
    statistics = {"pre_last_over_first": pre[-1] / pre[0], "post_last_error": abs(post[-1] - 1)}
    return Outcome(statistics, measured, series, fig, notes="test fixture")


POST_LN_AT_ONE = Clause("post_last_error", Direction.BELOW, 0.1, "Post-LN's stays at one")

DEPTH_EXPERIMENT = Experiment(
    name="variance-depth",
    number=1,
    title="stream variance by depth",
    claim="Pre-LN's residual stream grows with depth; Post-LN's stays at one",
    guide_words="the residual stream grows with depth",
    anchor="xiong2020",
    anchor_reports="(test fixture)",
    rule=VerdictRule((Clause("pre_last_over_first", Direction.ABOVE, 1.0, "Pre-LN's stream grows"), POST_LN_AT_ONE)),
    estimates_s=estimates(default=1.0, quick=1.0, paper=1.0),
    run=_depth_run,
)


def write_experiments(out: Path) -> dict[str, Any]:
    """``out/variance-depth/`` written by the real runner from the tiny experiment above."""
    return run_experiment(DEPTH_EXPERIMENT, out, scale="quick", seeds=(0,))


# the same run judged against a clause it fails: a "does not hold" result whose reasons the page must show
FAILING_EXPERIMENT = dataclasses.replace(
    DEPTH_EXPERIMENT,
    name="variance-flat",
    number=2,
    title="stream variance stays flat",
    claim="Pre-LN's residual stream stays at one with depth",
    guide_words="(test fixture: a claim the run refutes)",
    rule=VerdictRule(
        (Clause("pre_last_over_first", Direction.BELOW, 1.0, "Pre-LN's stream stays flat"), POST_LN_AT_ONE)
    ),
)


def write_failing_experiment(out: Path) -> dict[str, Any]:
    """``out/variance-flat/``: a result that does not hold, with its reasons and per-clause data."""
    return run_experiment(FAILING_EXPERIMENT, out, scale="quick", seeds=(0,))
