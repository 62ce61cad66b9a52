"""The depth claims' shared trained set (experiments/depth_set.py) and experiment 18's pieces.

The set is trained once per seed and scale and read back by experiments 3, 5 and 6: a read-back member must be the
model that was trained (same weights, same logs), a damaged or stale cache must be retrained, never half-read.
Experiment 18's verdict rests on how a pair of runs becomes a statistic: a diverged run without warm-up is the
predicted failure (a Diverged), a diverged run with warm-up leaves the set-up untested.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from normatlas.experiments import RunContext
from normatlas.experiments import depth_set as ds
from normatlas.experiments import e18_post_ln_warmup as e18
from normatlas.experiments.lm import TrainConfig
from normatlas.experiments.verdict import Diverged, Untested

from .experiment_runs import quick_run


def ctx(tmp: Path | None, seed: int = 0) -> RunContext:
    return RunContext(scale="quick", seed=seed, shared=tmp)


def test_a_member_is_trained_once_and_read_back_identical(tmp_path: Path) -> None:
    first = ds.member(ctx(tmp_path), "Post-LN")
    assert not first.cached and first.diverged_at is None
    folder = tmp_path / "depth-set" / "quick-seed0" / "post-ln"
    assert (folder / "log.json").is_file() and (folder / "model.safetensors").is_file()
    again = ds.member(ctx(tmp_path), "Post-LN")
    assert again.cached
    assert again.trajectory == first.trajectory and again.losses == first.losses
    for (k, a), (k2, b) in zip(first.model.state_dict().items(), again.model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(first.model.eval()(x), again.model.eval()(x))


def test_the_set_is_deterministic_and_not_cached_without_a_folder() -> None:
    a, b = ds.member(ctx(None), "LNS"), ds.member(ctx(None), "LNS")
    assert not a.cached and not b.cached and a.losses == b.losses and a.trajectory == b.trajectory
    c = ds.member(ctx(None, seed=1), "LNS")
    assert c.losses != a.losses


def test_a_damaged_or_stale_cache_is_retrained(tmp_path: Path) -> None:
    first = ds.member(ctx(tmp_path), "Pre-LN")
    folder = tmp_path / "depth-set" / "quick-seed0" / "pre-ln"
    (folder / "log.json").write_text('{"key": ')  # a run killed while writing
    assert not ds.member(ctx(tmp_path), "Pre-LN").cached
    log = json.loads((folder / "log.json").read_text())
    log["key"]["source"] = "0" * 16  # made by other code
    (folder / "log.json").write_text(json.dumps(log))
    assert not ds.member(ctx(tmp_path), "Pre-LN").cached
    (folder / "model.safetensors").write_bytes(b"\0" * 8)  # truncated weights beside a valid log
    again = ds.member(ctx(tmp_path), "Pre-LN")
    assert not again.cached and again.losses == first.losses


def test_members_see_the_same_batches_and_differ_only_by_design() -> None:
    """Same seed and batches: Pre-LN and its scaled-init twin start from different projections only."""
    plain, scaled = ds.member(ctx(None), "Pre-LN"), ds.member(ctx(None), "Pre-LN + scaled init")
    assert scaled.init_variance[-1] < plain.init_variance[-1]  # GPT-2's init shrinks what the blocks write
    assert plain.trajectory[0][0] == 0 and plain.trajectory[-1][0] == ds.setup(ctx(None)).train.steps


def test_unknown_member_is_named() -> None:
    with pytest.raises(ValueError, match="label='Pre-RMS'"):
        ds.member(ctx(None), "Pre-RMS")


def test_paper_scale_is_the_deep_long_set() -> None:
    s = ds.setup(RunContext(scale="paper", seed=0))
    assert s.n_layers == 24 and s.train.steps == 2000 and s.d_model == 32
    assert "Mix-LN" not in s.members and "Mix-LN" in ds.setup(ctx(None)).members  # no clause reads Mix-LN


def _runs(cold: dict[str, object], warm: dict[str, object]) -> dict[tuple[str, int, str], dict[str, object]]:
    return {("Post-LN", 12, "no warm-up"): cold, ("Post-LN", 12, "warm-up"): warm}


def test_warmup_gap_statistics() -> None:
    ok = {"diverged_at": None, "held_out": 2.0}
    assert e18._gap(_runs({"diverged_at": None, "held_out": 2.5}, ok), "Post-LN", 12) == pytest.approx(0.5)
    diverged = e18._gap(_runs({"diverged_at": 17, "held_out": None}, ok), "Post-LN", 12)
    assert isinstance(diverged, Diverged) and diverged.step == 17
    both = e18._gap(_runs({"diverged_at": 17, "held_out": None}, {"diverged_at": 40, "held_out": None}), "Post-LN", 12)
    assert isinstance(both, Untested) and "step 40" in both.why


def test_unigram_entropy_and_block_gradients() -> None:
    assert e18.unigram_entropy(torch.arange(256).repeat(3)) == pytest.approx(math.log(256), rel=1e-12)
    assert e18.unigram_entropy(torch.full((100,), 7)) == 0.0
    lm = e18.xiong_model(RunContext(scale="quick", seed=0), "Post-LN", 3, 32)
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(lm(x).flatten(0, 1), x.flatten()).backward()
    want = [math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in b.parameters())) for b in lm.blocks()]
    assert e18.block_grad_norms(lm) == pytest.approx(want, rel=1e-12)


def test_post_ln_warmup_quick_record_matches_its_runs() -> None:
    run = quick_run("post-ln-warmup")
    m, stats = run.record["measured"], run.outcome.statistics
    shallow, deep = m["depths"][0], m["depths"][-1]  # quick: 2 and 4 layers, both at most 20
    assert deep <= e18.DIES_ABOVE

    def gap(d: int) -> float:
        return m[f"held_out_post_ln_{d}_no_warm_up"] - m[f"held_out_post_ln_{d}_warm_up"]

    assert stats["post_ln_gap_under_20"] == pytest.approx(gap(deep))
    assert stats["post_ln_gap_growth"] == pytest.approx(gap(deep) - gap(shallow))
    assert stats["post_ln_warmup_under_20_over_unigram"] == pytest.approx(
        m[f"held_out_post_ln_{deep}_warm_up"] / m["unigram_entropy_nats"]
    )
    # no depth above 20 layers at quick scale: the "dies above ~20 layers" clause is untested, so the verdict is
    # at best inconclusive there
    assert isinstance(stats["post_ln_warmup_over_20_over_unigram"], Untested)
    assert run.record["verdict"] != "holds"
    assert 2.5 < m["unigram_entropy_nats"] < math.log(256)
    for kind in ("post_ln", "pre_ln"):
        assert math.isfinite(m[f"step0_grad_backward_slope_{kind}"])


def test_warmup_title_says_what_the_deepest_runs_show() -> None:
    def runs(post: tuple[float | None, float | None], pre: tuple[float, float]) -> dict[tuple[str, int, str], dict]:
        out = {}
        for kind, (cold, warm) in (("Post-LN", post), ("Pre-LN", pre)):
            for arm, held in (("no warm-up", cold), ("warm-up", warm)):
                out[(kind, 12, arm)] = {"held_out": held, "diverged_at": 9 if held is None else None, "losses": []}
        return out

    h1 = 3.14
    assert "Post-LN stalls at the unigram level with and without warm-up" in e18._title(
        runs((3.19, 3.19), (1.9, 1.95)), (3, 12), h1
    )
    assert "Post-LN stalls at the unigram level without warm-up only" in e18._title(
        runs((3.1, 2.0), (1.9, 1.95)), (3, 12), h1
    )
    assert "Post-LN without warm-up diverges (step 9)" in e18._title(runs((None, 2.0), (1.9, 1.95)), (3, 12), h1)
    assert "Pre-LN without warm-up ends 0.05 nats/byte better" in e18._title(runs((2.1, 2.0), (1.9, 1.95)), (3, 12), h1)


def test_warmup_title_names_the_warmup_depth_and_the_deepest() -> None:
    # paper scale's depths: the warm-up clauses' depth is 12 (the deepest of at most 20 layers), the deepest 24
    out = {}
    for depth, post in ((6, (1.6, 1.7)), (12, (3.15, 2.8)), (24, (3.15, 3.15))):
        for kind, pair in (("Post-LN", post), ("Pre-LN", (1.6, 1.6))):
            for arm, held in zip(("no warm-up", "warm-up"), pair, strict=True):
                out[(kind, depth, arm)] = {"held_out": held, "diverged_at": None, "losses": [held] * 400}
    title = e18._title(out, (6, 12, 24), 3.14)
    assert title.startswith("At 12 layers: Post-LN stalls at the unigram level without warm-up only")
    assert "at 24: Post-LN stalls at the unigram level with and without warm-up" in title
    # the 12-layer warm-up run trains (2.0 nats/byte over steps 100-199), then falls back to the unigram level
    out[("Post-LN", 12, "warm-up")] = {
        "held_out": 3.15,
        "diverged_at": None,
        "losses": [3.2] * 100 + [2.0] * 100 + [3.15] * 200,
    }
    title = e18._title(out, (6, 12, 24), 3.14)
    assert title.startswith(
        "At 12 layers: Post-LN with warm-up trains, then falls back to the unigram level (step ~200)"
    )


def test_fell_back_at_reads_window_means_after_the_best_window() -> None:
    h1 = 3.0  # the unigram level: 0.97 * 3.0 = 2.91
    assert e18.fell_back_at([3.0] * 300, h1) is None  # never trained
    assert e18.fell_back_at([3.0] * 100 + [2.0] * 200, h1) is None  # trained and stayed trained
    assert e18.fell_back_at([3.0] * 100 + [2.0] * 100 + [2.5] * 100 + [2.95] * 100, h1) == 300
    assert e18.fell_back_at([2.0] * 99, h1) is None  # shorter than one window
    assert e18.fell_back_at([2.0] * 100 + [math.nan] * 100, h1) is None  # a divergence is reported as such elsewhere
    assert e18.warmup_depth((6, 12, 24)) == 12 and e18.warmup_depth((2, 4)) == 4


def test_both_warmup_arms_share_the_inverse_sqrt_decay_after_the_tenth() -> None:
    steps = 2000
    arms = [e18.arm_config(arm, steps, batch=8, seq=64) for arm in e18.ARMS]
    cold, warm = arms
    assert cold.lr_at(0) == cold.lr_at(199) == e18.LR  # the full rate from step 0
    assert warm.lr_at(0) == pytest.approx(e18.LR / 200) and warm.lr_at(199) == pytest.approx(e18.LR)
    for step in (200, 201, 799, 1999):  # the same rate from the tenth on: the arms differ in the first tenth only
        assert cold.lr_at(step) == warm.lr_at(step) == pytest.approx(e18.LR * math.sqrt(200 / (step + 1)))
    assert warm.lr_at(1999) == pytest.approx(e18.LR * math.sqrt(0.1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": "linear"}, r"schedule='linear' must be 'constant', 'cosine' or 'inverse-sqrt'"),
        ({"decay_start": 10}, r"decay_start=10 needs schedule='inverse-sqrt' \(got 'constant'\)"),
        ({"schedule": "inverse-sqrt", "decay_start": 0}, r"decay_start=0 needs schedule='inverse-sqrt'"),
    ],
)
def test_train_config_names_a_bad_schedule(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_inverse_sqrt_decays_from_the_warmups_end_by_default() -> None:
    cfg = TrainConfig(steps=100, lr=1.0, warmup=4, schedule="inverse-sqrt")
    assert [cfg.lr_at(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cfg.lr_at(15) == pytest.approx(0.5)  # sqrt(4 / 16)
