"""``experiments run --jobs N``: the seeds the cache lacks, run in worker processes (normatlas.experiments.pool).

The workers are spawned processes running the package's own experiments (a toy defined in a test module does not
exist in them), so these tests use the two fastest real ones at quick scale: geometry and scale-invariance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from normatlas.cli import main
from normatlas.experiments import experiment
from normatlas.experiments.base import Scale
from normatlas.experiments.pool import SeedTask, fill_cache, makespan, seed_tasks, worker_threads
from normatlas.experiments.runner import run_experiment, run_seed

NAMES = ("geometry", "scale-invariance")


def test_tasks_group_the_experiments_that_share_a_trained_set(tmp_path: Path) -> None:
    exps = [experiment(n) for n in ("geometry", "variance-depth", "curse-of-depth")]
    run_seed(exps[0], tmp_path, scale="quick", seed=0)  # cached: no task for it
    tasks = seed_tasks(exps, tmp_path, scale="quick", seeds=(0, 1))
    assert {(t.names, t.seed) for t in tasks} == {
        (("variance-depth", "curse-of-depth"), 0), (("variance-depth", "curse-of-depth"), 1), (("geometry",), 1),
    }  # fmt: skip
    assert [t.estimate_s for t in tasks] == sorted((t.estimate_s for t in tasks), reverse=True)  # longest first
    depth = next(t for t in tasks if t.seed == 0)
    assert depth.estimate_s == exps[1].estimate_s(Scale.QUICK) + exps[2].estimate_s(Scale.QUICK)
    assert len(seed_tasks(exps, tmp_path, scale="quick", seeds=(0, 1), fresh=True)) == 4


def test_makespan_and_threads() -> None:
    tasks = [SeedTask(("a",), 0, 10.0), SeedTask(("b",), 0, 6.0), SeedTask(("c",), 0, 5.0), SeedTask(("d",), 0, 1.0)]
    assert makespan(tasks, 1) == 22.0
    assert makespan(tasks, 2) == 11.0  # a | b, c then d on the first free worker: 10 + 1 and 6 + 5
    assert makespan(tasks, 8) == 10.0
    assert worker_threads(1) >= 1 and worker_threads(10_000) == 1


def test_workers_give_the_numbers_of_one_process(tmp_path: Path) -> None:
    exps = [experiment(n) for n in NAMES]
    seeds = (0, 1)
    tasks = seed_tasks(exps, tmp_path / "jobs", scale="quick", seeds=seeds)
    done = fill_cache(tasks, tmp_path / "jobs", scale="quick", jobs=2)
    assert sorted(done) == [(n, s) for n in sorted(NAMES) for s in seeds]
    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads(2))  # the workers' thread count, so the floating-point path is the same
    try:
        for exp in exps:
            ran = [s for n, s in done if n == exp.name]
            rec = run_experiment(exp, tmp_path / "jobs", scale="quick", seeds=seeds, ran_elsewhere=ran)
            ref = run_experiment(exp, tmp_path / "one", scale="quick", seeds=seeds)
            assert rec["cached_seeds"] == [] and ref["cached_seeds"] == []  # the workers' seeds are this run's
            assert rec["verdict"] == ref["verdict"]
            assert [c["per_seed"] for c in rec["clauses"]] == [c["per_seed"] for c in ref["clauses"]]
            assert rec["run"]["threads_per_seed"] == {str(s): worker_threads(2) for s in seeds}
            assert rec["run"]["seeds_run_in_workers"] == list(seeds) and ref["run"]["seeds_run_in_workers"] == []
    finally:
        torch.set_num_threads(threads)


def test_a_failed_task_is_named_and_the_finished_seeds_stay(tmp_path: Path) -> None:
    tasks = [SeedTask(("no-such-claim",), 3, 2.0), SeedTask(("geometry",), 0, 1.0)]
    with pytest.raises(RuntimeError, match=r"no-such-claim seed 3 failed in a worker: ValueError"):
        fill_cache(tasks, tmp_path, scale="quick", jobs=2)
    assert (tmp_path / "geometry" / "seeds" / "quick-seed0" / "outcome.json").is_file()  # it ran beside it
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="jobs="):
            fill_cache(tasks, tmp_path, scale="quick", jobs=bad)  # type: ignore[arg-type]


def test_cli_jobs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    args = ["experiments", "run", "geometry", "--quick", "--seeds", "2", "--out", str(out)]
    assert main([*args, "--plan", "--jobs", "2"]) == 0
    assert "as 2 workers" in capsys.readouterr().out
    assert main([*args, "--jobs", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["verdict"], r["cached_seeds"]) for r in doc["experiments"]] == [("holds", [])]
    assert main([*args, "--jobs", "2", "--json"]) == 0  # everything cached now: no worker starts
    assert all(r["cached_seeds"] == [0, 1] for r in json.loads(capsys.readouterr().out)["experiments"])
    with pytest.raises(SystemExit):
        main([*args, "--jobs", "0"])
    assert "--jobs" in capsys.readouterr().err


def test_cli_names_a_seed_that_failed_in_a_worker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a-file"
    out.write_text("not a folder")
    assert main(["experiments", "run", "geometry", "--quick", "--seeds", "1", "--jobs", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "geometry seed 0 failed in a worker" in err and "run the same command again" in err
    assert "Traceback" not in err
