"""The verdict machinery on synthetic per-seed statistics, and the runner's metadata, cache and resume on a toy
experiment that trains nothing (so these tests take a second): holds / does not hold / inconclusive, divergence
and NaN as typed outcomes, the report on a truncated result.json, ``--scale`` and ``--quick``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from normatlas.cli import main
from normatlas.experiments.base import Experiment, Outcome, RunContext, Scale, Series, estimates
from normatlas.experiments.report import read_results, write_report
from normatlas.experiments.runner import SeedPlan, load_result, plan_seeds, run_experiment, use_agg
from normatlas.experiments.verdict import (
    Clause,
    Direction,
    Diverged,
    OnDivergence,
    Untested,
    Verdict,
    VerdictRule,
    as_statistic,
    decide,
)  # fmt: skip

RATIO = Clause("ratio", Direction.ABOVE, 2.0, "the ratio exceeds 2")
GAP = Clause("gap", Direction.BELOW, 0.1, "the gap is small")
RULE = VerdictRule((RATIO, GAP))
SEEDS = (0, 1, 2)


def per_seed(ratios: list[object], gaps: list[object] | None = None) -> list[dict[str, object]]:
    gaps = gaps if gaps is not None else [0.0] * len(ratios)
    return [{"ratio": r, "gap": g} for r, g in zip(ratios, gaps, strict=True)]


# ---------------------------------------------------------------- the rule over seeds
def test_holds_when_the_minimum_over_seeds_clears_the_threshold() -> None:
    verdict, clauses, reasons = decide(RULE, SEEDS, per_seed([2.1, 2.5, 3.0]))
    assert verdict is Verdict.HOLDS and reasons == []
    c = clauses[0]
    assert (c["min"], c["median"], c["max"]) == (2.1, 2.5, 3.0)
    assert c["margin_min"] == pytest.approx(0.1) and c["margin_max"] == pytest.approx(1.0)
    assert c["per_seed"] == {"0": 2.1, "1": 2.5, "2": 3.0} and c["threshold"] == 2.0


def test_does_not_hold_when_the_maximum_fails_and_says_which_clause() -> None:
    verdict, clauses, reasons = decide(RULE, SEEDS, per_seed([2.5, 2.6, 2.7], [0.2, 0.3, 0.4]))
    assert verdict is Verdict.DOES_NOT_HOLD
    assert [c["verdict"] for c in clauses] == ["holds", "does not hold"]
    assert len(reasons) == 1 and "the gap is small failed at every seed" in reasons[0] and "gap < 0.1" in reasons[0]
    assert clauses[1]["margin_max"] == pytest.approx(-0.1)


def test_inconclusive_when_the_threshold_lies_inside_the_spread() -> None:
    # the scaled-init case of issue 32: 1.53x at one seed, 2.36x at another, against 2x
    verdict, clauses, reasons = decide(RULE, SEEDS, per_seed([1.53, 2.36, 2.1]))
    assert verdict is Verdict.INCONCLUSIVE
    assert clauses[0]["verdict"] == "inconclusive" and "inside the seed spread [1.53, 2.36]" in reasons[0]


def test_a_failing_clause_outranks_an_inconclusive_one() -> None:
    verdict, _, reasons = decide(RULE, SEEDS, per_seed([1.5, 2.5, 2.5], [1.0, 1.0, 1.0]))
    assert verdict is Verdict.DOES_NOT_HOLD and len(reasons) == 2


def test_the_threshold_itself_fails() -> None:
    verdict, _, _ = decide(RULE, SEEDS, per_seed([2.0, 2.0, 2.0]))
    assert verdict is Verdict.DOES_NOT_HOLD


def test_a_divergence_leaves_the_seed_untested_and_names_its_step() -> None:
    # the covariate-shift case: the no-BN baseline went NaN at step 252 at one seed
    div = Diverged("the no BN net's training loss", 252)
    verdict, clauses, reasons = decide(RULE, SEEDS, per_seed([3.0, div, 3.0]))
    assert verdict is Verdict.INCONCLUSIVE
    assert clauses[0]["diverged_seeds"] == [1] and clauses[0]["per_seed"]["1"] == {"diverged": div.what, "step": 252}
    assert "seed 1: the no BN net's training loss diverged at step 252" in reasons[0]
    assert "could not be tested" in reasons[0]
    assert (clauses[0]["min"], clauses[0]["max"]) == (3.0, 3.0)  # the spread is over the seeds that ran


def test_a_nan_never_reads_as_does_not_hold() -> None:
    verdict, clauses, reasons = decide(RULE, SEEDS, per_seed([math.nan, 3.0, 3.0]))
    assert verdict is Verdict.INCONCLUSIVE and clauses[0]["diverged_seeds"] == [0]
    assert "not finite" in reasons[0]
    assert isinstance(as_statistic(math.inf, "x"), Diverged) and as_statistic(2, "x") == 2.0
    with pytest.raises(TypeError, match="statistic"):
        as_statistic(True, "x")


def test_the_rule_says_what_a_divergence_means() -> None:
    expects = VerdictRule((Clause("loss", Direction.BELOW, 5.0, "Post-LN without warm-up fails", OnDivergence.PASSES),))
    div = Diverged("Post-LN's training", 40)
    assert decide(expects, SEEDS, [{"loss": div}, {"loss": div}, {"loss": 4.0}])[0] is Verdict.HOLDS
    stable = VerdictRule((Clause("loss", Direction.BELOW, 5.0, "trains stably", OnDivergence.FAILS),))
    verdict, _, reasons = decide(stable, SEEDS, [{"loss": div}, {"loss": div}, {"loss": div}])
    assert verdict is Verdict.DOES_NOT_HOLD and "diverged at step 40" in reasons[0]


def test_an_untested_seed_is_inconclusive_with_its_reason() -> None:
    verdict, _, reasons = decide(RULE, SEEDS, per_seed([3.0, Untested("the run never spiked"), 3.0]))
    assert verdict is Verdict.INCONCLUSIVE and "the run never spiked" in reasons[0]


def test_bad_rules_and_statistics_are_named() -> None:
    with pytest.raises(ValueError, match="threshold"):
        Clause("x", Direction.ABOVE, math.nan, "x")
    with pytest.raises(TypeError, match="direction"):
        Clause("x", ">", 1.0, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two clauses"):
        VerdictRule((RATIO, RATIO))
    with pytest.raises(KeyError, match="gap"):
        decide(RULE, (0,), [{"ratio": 3.0}])
    with pytest.raises(ValueError, match="step"):
        Diverged("x", -1)


# ---------------------------------------------------------------- the runner on a toy experiment
CALLS: list[tuple[str, int]] = []


def toy_run(ctx: RunContext) -> Outcome:
    CALLS.append((ctx.scale.value, ctx.seed))
    plt = use_agg()
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot([0, 1], [0, ctx.seed], label="toy")
    ax.set(title="a toy claim", xlabel="x", ylabel="y")
    ratio: object = 2.5 + ctx.seed if ctx.seed != 7 else Diverged("the toy's loss", 3)
    return Outcome({"ratio": ratio, "gap": 0.01}, {"n": ctx.size(10, 1, paper=100)}, {"s": Series.of(x=[1])}, fig)


TOY = Experiment(
    name="toy-claim", number=99, title="toy", claim="a toy claim", guide_words="words", anchor="none",
    anchor_reports="nothing", rule=RULE, estimates_s=estimates(default=1, quick=1, paper=1), run=toy_run,
)  # fmt: skip


def test_metadata_and_per_seed_record(tmp_path: Path) -> None:
    rec = run_experiment(TOY, tmp_path, scale="quick", seeds=SEEDS)
    assert rec["verdict"] == "holds" and rec["holds"] is True and rec["seeds"] == [0, 1, 2]
    run = rec["run"]
    assert run["threads"] >= 1 and run["cpu"] and run["torch"] and run["wall_s"] >= 0 and run["peak_rss_mib"] > 0
    assert set(rec["seconds_per_seed"]) == {"0", "1", "2"} and rec["measured_per_seed"]["2"] == {"n": 1}
    assert rec["clauses"][0]["median"] == 3.5
    assert load_result(tmp_path / "toy-claim") == rec
    for s in SEEDS:
        assert (tmp_path / "toy-claim" / "seeds" / f"quick-seed{s}" / "outcome.json").is_file()


def test_a_killed_run_resumes_from_its_cache(tmp_path: Path) -> None:
    CALLS.clear()
    run_experiment(TOY, tmp_path, scale="quick", seeds=(0, 1))  # as if killed after two seeds
    (tmp_path / "toy-claim" / "seeds" / "quick-seed1" / "outcome.json").write_text('{"key": ')  # half-written
    messages: list[str] = []
    rec = run_experiment(TOY, tmp_path, scale="quick", seeds=SEEDS, progress=messages.append)
    assert CALLS == [("quick", 0), ("quick", 1), ("quick", 1), ("quick", 2)]
    assert rec["cached_seeds"] == [0] and any("read from the cache" in m for m in messages)
    run_experiment(TOY, tmp_path, scale="default", seeds=(0,))  # another scale: its own cache
    run_experiment(TOY, tmp_path, scale="quick", seeds=(0,), fresh=True)
    assert CALLS[-2:] == [("default", 0), ("quick", 0)]


def test_the_plan_reads_the_cache_and_runs_nothing(tmp_path: Path) -> None:
    CALLS.clear()
    run_experiment(TOY, tmp_path, scale="quick", seeds=(0, 2))
    plan = plan_seeds(TOY, tmp_path, scale="quick", seeds=SEEDS)
    assert plan == [SeedPlan("toy-claim", 0, True, 0.0), SeedPlan("toy-claim", 1, False, 1.0),
                    SeedPlan("toy-claim", 2, True, 0.0)]  # fmt: skip
    assert [p.cached for p in plan_seeds(TOY, tmp_path, scale="default", seeds=SEEDS)] == [False] * 3
    assert not any(p.cached for p in plan_seeds(TOY, tmp_path, scale="quick", seeds=SEEDS, fresh=True))
    assert CALLS == [("quick", 0), ("quick", 2)]  # planning ran nothing


def test_a_kept_cache_without_svg_still_aggregates(tmp_path: Path) -> None:
    # docs/results keeps each seed's outcome.json, PNG and CSVs, not its SVG: a later run reads it back
    run_experiment(TOY, tmp_path, scale="quick", seeds=SEEDS)
    for s in SEEDS:
        (tmp_path / "toy-claim" / "seeds" / f"quick-seed{s}" / "figure.svg").unlink()
    (tmp_path / "toy-claim" / "figure.svg").unlink()
    CALLS.clear()
    rec = run_experiment(TOY, tmp_path, scale="quick", seeds=SEEDS)
    assert CALLS == [] and rec["cached_seeds"] == [0, 1, 2]
    assert rec["files"] == ["s.csv", "figure.png"] and not (tmp_path / "toy-claim" / "figure.svg").exists()


def test_the_cache_key_reads_code_not_comments(tmp_path: Path) -> None:
    from normatlas.experiments import runner

    code = 'def run(ctx):\n    """What it does."""\n    return ctx.size(1, 2)  # a comment\n'
    assert runner._code_only(code) == runner._code_only("def run(ctx):\n\n    return ctx.size(1, 2)\n")
    assert runner._code_only(code) != runner._code_only("def run(ctx):\n    return ctx.size(1, 3)\n")
    assert runner._code_only('"""Module."""\nX = 1\n') == runner._code_only("X = 1  # one\n")
    # a seed cached under the raw-text key written before stop 42 is still read back
    run_experiment(TOY, tmp_path, scale="quick", seeds=(0,))
    outcome = tmp_path / "toy-claim" / "seeds" / "quick-seed0" / "outcome.json"
    rec = json.loads(outcome.read_text())
    assert rec["key"] == runner._cache_key(TOY, Scale.QUICK, 0)
    rec["key"] = runner._cache_key(TOY, Scale.QUICK, 0, legacy=True)
    assert rec["key"]["source"] != runner._cache_key(TOY, Scale.QUICK, 0)["source"]
    outcome.write_text(json.dumps(rec))
    CALLS.clear()
    assert run_experiment(TOY, tmp_path, scale="quick", seeds=(0,))["cached_seeds"] == [0] and CALLS == []
    rec["key"]["source"] = "0" * 16  # any other code: rerun
    outcome.write_text(json.dumps(rec))
    assert run_experiment(TOY, tmp_path, scale="quick", seeds=(0,))["cached_seeds"] == [] and CALLS == [("quick", 0)]


def test_cli_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert main(["experiments", "run", "scale-invariance", "geometry", "--quick", "--seeds", "2", "--plan",
                 "--out", str(out), "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert [r["to_run"] for r in doc["plan"]] == [[0, 1], [0, 1]] and doc["seconds"] == pytest.approx(2 * (2.5 + 0.5))
    assert not out.exists()  # nothing run, nothing written


def test_a_diverged_seed_reaches_the_record(tmp_path: Path) -> None:
    rec = run_experiment(TOY, tmp_path, scale="quick", seeds=(0, 7))
    assert rec["verdict"] == "inconclusive" and "diverged at step 3" in rec["reasons"][0]
    assert rec["clauses"][0]["per_seed"]["7"] == {"diverged": "the toy's loss", "step": 3}


def test_report_names_a_truncated_result_and_shows_the_rest(tmp_path: Path) -> None:
    run_experiment(TOY, tmp_path, scale="quick", seeds=(0,))
    bad = tmp_path / "broken-claim"
    bad.mkdir()
    text = (tmp_path / "toy-claim" / "result.json").read_text()
    (bad / "result.json").write_text(text[: len(text) // 2])
    records, problems = read_results(tmp_path)
    assert [r["name"] for r in records] == ["toy-claim"] and problems[0][0] == bad / "result.json"
    assert "not valid JSON" in problems[0][1]
    md, html, _, _ = write_report(tmp_path)
    assert "broken-claim/result.json" in md.read_text() and "toy-claim" in md.read_text()
    assert "broken-claim/result.json" in html.read_text()
    (bad / "result.json").write_text(json.dumps({"name": "broken-claim"}))
    assert "lacks the fields" in read_results(tmp_path)[1][0][1]


def test_each_scale_keeps_its_own_result_and_report(tmp_path: Path) -> None:
    """A run at another scale replaces the top-level result.json but not the first scale's kept copy; the report
    for a scale reads each experiment's kept result and links its figure."""
    quick = run_experiment(TOY, tmp_path, scale="quick", seeds=(0, 1))
    paper = run_experiment(TOY, tmp_path, scale="paper", seeds=(0,))
    folder = tmp_path / "toy-claim"
    assert load_result(folder) == paper and load_result(folder / "scales" / "paper") == paper
    assert load_result(folder / "scales" / "quick") == quick and quick["measured"] == {"n": 1}
    for name in ("figure.png", "figure.svg", "s.csv"):
        assert (folder / "scales" / "quick" / name).is_file()
    md, html, records, _ = write_report(tmp_path, "quick")
    assert md.name == "report-quick.md" and html.name == "report-quick.html"
    assert [r["scale"] for r in records] == ["quick"] and "toy-claim/scales/quick/figure.png" in md.read_text()
    assert "toy-claim/scales/quick/figure.png" in html.read_text()
    assert "Of 1 claim: 1 holds, 0 do not hold, 0 inconclusive." in md.read_text()
    assert write_report(tmp_path)[2][0]["scale"] == "paper"  # no scale: the latest run
    with pytest.raises(ValueError, match=re.escape("scales/default/result.json")):
        write_report(tmp_path, "default")
    with pytest.raises(ValueError, match="scale"):
        write_report(tmp_path, "huge")


def test_scales_pick_sizes() -> None:
    assert RunContext(scale=Scale.QUICK, seed=0).size(300, 20, paper=2000) == 20
    assert RunContext(scale="default", seed=0).size(300, 20, paper=2000) == 300
    assert RunContext(scale="paper", seed=0).size(300, 20, paper=2000) == 2000
    assert RunContext(scale="paper", seed=0).size(300, 20) == 300
    assert RunContext(scale="quick", seed=0).quick
    with pytest.raises(ValueError, match="scale='huge'"):
        RunContext(scale="huge", seed=0)  # type: ignore[arg-type]


def test_every_experiment_states_its_rule_and_estimates() -> None:
    from normatlas.experiments import experiments

    for exp in experiments():
        assert exp.rule.clauses and exp.expected == exp.rule.describe()
        assert exp.estimate_s(Scale.PAPER) >= exp.estimate_s(Scale.DEFAULT) >= exp.estimate_s(Scale.QUICK)


def test_cli_report_on_a_folder_with_only_a_truncated_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "result.json").write_text("{")
    assert main(["experiments", "report", "--out", str(tmp_path)]) == 2
    assert "broken/result.json" in capsys.readouterr().err


# ---------------------------------------------------------------- quick verdicts stable over three seeds
# Measured before they were asserted (quick scale, seeds 0, 1, 2, 2 threads): these hold at every seed with a
# clear margin. The others are inconclusive or do not hold at quick scale (docs/experiments.md says which and
# why); their directions are asserted where robust in test_experiments_claims_*.py, their verdicts nowhere.
STABLE_AT_QUICK = ("scale-invariance", "scaled-init", "geometry", "vlm-norm-gap", "bf16-headroom")
# Re-measured after experiments 4, 8, 9 and 10 were redesigned (quick, seeds 0-2, 1 thread): gradient-depth does not
# hold at every seed with every failing margin negative (Pre-LN's profile is further from level than Post-LN's:
# -0.55 .. -0.09). Experiments 8, 9 and 10 also do not hold at every seed at quick scale (8: the init transient
# trips the alarm in the control; 9: MiniLM's LayerNorm 12 is a line; 10: one epoch on 400 images), but they take
# minutes over three seeds, so their verdicts are not asserted here.
# covariate-shift held at quick scale on the digits; on the next-byte task (stop 45) its 400 quick steps are early
# training, and per seed it fails one clause or another (quick, seeds 0-2, 1 thread: loss spread no BN over BN 0.74,
# 1.06, 0.87; noisy BN minus BN -3.8, -3.5, -2.8 points against -3), straddling the thresholds, so its quick verdict
# is asserted nowhere (the paper scale decides it; docs/experiments.md).
STABLE_NOT_HOLDING_AT_QUICK = ("gradient-depth",)


@pytest.mark.parametrize("name", STABLE_AT_QUICK)
def test_quick_verdict_over_three_seeds(name: str) -> None:
    from .experiment_runs import quick_run

    rec = quick_run(name, SEEDS).record
    assert rec["seeds"] == [0, 1, 2]
    assert rec["verdict"] == "holds", rec["reasons"]


@pytest.mark.parametrize("name", STABLE_NOT_HOLDING_AT_QUICK)
def test_quick_verdict_that_does_not_hold_over_three_seeds(name: str) -> None:
    from .experiment_runs import quick_run

    rec = quick_run(name, SEEDS).record
    assert rec["verdict"] == "does not hold" and rec["reasons"], rec["clauses"]
