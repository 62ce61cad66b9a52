"""Monitor on live models: records, peers for each statistic, sinks, BatchNorm, VLM gap, integrations."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from normatlas.diagnostics import AttentionCapture, CSVSink, JSONLSink, Metric, Monitor, attention_stats, sdpa_probs
from normatlas.diagnostics.health import cross_example_dependence
from normatlas.diagnostics.tinylm import TinyLM, collapse_experiment

from .scripts import load_benchmark


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _train(model: nn.Module, mon: Monitor | None, steps: int, seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for _ in range(steps):
        ids = torch.randint(64, (4, 16))
        logits = model(ids)
        outs.append(logits.detach())
        F.cross_entropy(logits.reshape(-1, 64), ids.roll(-1, 1).reshape(-1)).backward()
        if mon is not None:
            mon.step()
        opt.step()
        opt.zero_grad()
    return outs


def test_monitor_does_not_change_training_and_records_every_n() -> None:
    torch.manual_seed(0)
    a = TinyLM(qk_norm=True)
    b = TinyLM(qk_norm=True)
    b.load_state_dict(a.state_dict())
    mon = Monitor(b, every=3, print_alarms=False)
    plain, watched = _train(a, None, 7), _train(b, mon, 7)
    for x, y in zip(plain, watched, strict=True):
        assert_close(y, x, rtol=0, atol=0)
    assert [r["step"] for r in mon.history.records] == [0, 3, 6]
    rec = mon.last
    for key in (
        "output_norm",
        "grad_norm/total",
        "grad_norm/L0",
        "residual/rms/L1",
        "attention/entropy/L0/h3",
        "attention/max_logit/L1",
        "massive/max_ratio/L0",
        "headroom/bf16_log2",
        "ngrams/max_repeats",
    ):
        assert key in rec, key
    assert set(mon.scale_invariant) == {"blocks.0.attn.q", "blocks.0.attn.k", "blocks.1.attn.q", "blocks.1.attn.k"}
    mon.detach()
    _train(b, mon, 3)
    assert len(mon.history.records) == 3  # detached: nothing more


def test_grad_norms_and_effective_lr_match_independent_computation() -> None:
    torch.manual_seed(1)
    model = TinyLM(qk_norm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    mon = Monitor(model, every=1, optimizer=opt, metrics=["grad_norm", "effective_lr"], print_alarms=False)
    ids = torch.randint(64, (2, 8))
    F.cross_entropy(model(ids).reshape(-1, 64), ids.reshape(-1)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.stack([g.double().norm() for g in grads]).norm()
    l1 = torch.stack([p.grad.double().norm() for p in model.blocks[1].parameters()]).norm()
    mon.step()
    rec = mon.last
    assert_close(rec["grad_norm/total"], float(total), rtol=1e-5, atol=0)
    assert_close(rec["grad_norm/L1"], float(l1), rtol=1e-5, atol=0)
    w = model.blocks[0].attn.q.weight.detach().double()
    assert mon.effective_lr_power == 1  # Adam normalizes the update: the angular step is ~ lr / ||W||
    assert_close(rec["effective_lr/blocks.0.attn.q"], 0.02 / float(w.norm()), rtol=1e-5, atol=0)
    assert rec["weight_growth/blocks.0.attn.q"] == 1.0


class EagerAttn(nn.Module):
    """Hand-written softmax attention; same weights as :class:`SdpaAttn`."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(16, 32, bias=False)

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.qk(x).view(x.shape[0], x.shape[1], 2, 2, 8).permute(2, 0, 3, 1, 4)
        return q, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.scores(x)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
        return x + (p @ k).transpose(1, 2).reshape(x.shape)


class SdpaAttn(EagerAttn):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.scores(x)
        return x + F.scaled_dot_product_attention(q, k, k).transpose(1, 2).reshape(x.shape)


def test_attention_found_in_eager_and_fused_code_alike() -> None:
    torch.manual_seed(2)
    eager = nn.Sequential(EagerAttn(), EagerAttn())
    fused = nn.Sequential(SdpaAttn(), SdpaAttn())
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(3, 10, 16)
    recs = []
    for model in (eager, fused):
        mon = Monitor(model, every=1, metrics=["attention", "residual"], print_alarms=False)
        with torch.no_grad():
            model(x)
        mon.step()
        recs.append(mon.last)
    q, k = eager[0].scores(x)
    ref = attention_stats(sdpa_probs(q.double(), k.double())[1])
    for rec in recs:
        assert_close(rec["attention/entropy/L0"], ref["entropy"], rtol=1e-5, atol=1e-6)
        assert_close(rec["attention/entropy/L1"], recs[0]["attention/entropy/L1"], rtol=1e-5, atol=1e-6)
    assert_close(recs[1]["attention/max_logit/L0"], recs[0]["attention/max_logit/L0"], rtol=1e-5, atol=1e-6)


def test_user_supplied_attention_hook() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mon = Monitor(model, every=1, metrics=["attention"], print_alarms=False)
    probs = torch.full((1, 1, 3, 3), 1 / 3)
    mon.record_attention(5, probs)
    mon.step()
    assert_close(mon.last["attention/entropy/L5"], math.log(3), rtol=1e-6, atol=0)


def test_jsonl_and_csv_sinks_roundtrip(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = TinyLM()
    j, c = tmp_path / "m.jsonl", tmp_path / "m.csv"
    mon = Monitor(
        model, every=2, sinks=[JSONLSink(j), CSVSink(c)], metrics=["grad_norm", "output_norm"], print_alarms=False
    )
    _train(model, mon, 4)
    mon.close()
    lines = [json.loads(line) for line in j.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 2]
    assert lines[1]["output_norm"] == pytest.approx(mon.history.records[1]["output_norm"])
    rows = c.read_text().splitlines()
    assert rows[0] == "step,key,value" and any(r.startswith("2,grad_norm/total,") for r in rows)


def test_tensorboard_sink_when_installed(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from normatlas.diagnostics import TensorBoardSink

    sink = TensorBoardSink(tmp_path)
    sink.write({"step": 0, "loss": 1.5, "grad_norm/L0": 0.25})
    sink.write({"step": 10, "loss": 1.25})
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 1.5), (10, 1.25)]
    assert [e.value for e in acc.Scalars("grad_norm/L0")] == [0.25]


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


def test_batchnorm_fails_cross_example_check_and_eval_mode_passes() -> None:
    torch.manual_seed(4)
    model, x = BNNet(), torch.randn(8, 6)
    rm = model.bn.running_mean.clone()
    train = cross_example_dependence(model.train(), x)
    assert not train.passed and train.leak > 1e-3
    assert_close(model.bn.running_mean, rm, rtol=0, atol=0)  # the check restores running stats
    assert cross_example_dependence(model.eval(), x).passed
    ln = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).train()
    assert cross_example_dependence(ln, x).passed
    assert not cross_example_dependence(TinyLM().train(), torch.randint(64, (3, 8))).leak > 1e-5
    with pytest.raises(ValueError, match=r"must hold >= 2 examples"):
        cross_example_dependence(model, x[:1])


def test_batchnorm_health_reports_train_eval_gap() -> None:
    torch.manual_seed(5)
    model = BNNet().train()
    mon = Monitor(model, every=1, metrics=["batchnorm"], print_alarms=False)
    model(torch.randn(64, 6) * 5 + 3)  # far from the initial running stats (0, 1)
    mon.step()
    x = torch.randn(64, 6) * 5 + 3
    h = model.fc(x).detach()
    ref = ((h.mean(0) - model.bn.running_mean) / (model.bn.running_var + 1e-5).sqrt()).abs().mean()
    model(x)
    mon.step()
    assert_close(mon.last["batchnorm/mean_gap/bn"], float(ref), rtol=1e-4, atol=1e-6)
    assert mon.last["batchnorm/var_logratio/bn"] > 0


def test_vlm_modality_gap_through_hooks() -> None:
    class ToyVLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 16)
            self.embed = nn.Embedding(20, 16)

        def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.proj(pixels), self.embed(ids)], dim=1)

    torch.manual_seed(6)
    model = ToyVLM()
    with torch.no_grad():
        model.proj.weight.mul_(30)
    # no repeated blocks here, so none of the per-block metrics (residual, massive, headroom): refused by name
    with pytest.raises(ValueError, match="found no repeated blocks in ToyVLM; the metrics headroom, massive, residual"):
        Monitor(model, modality={"vision": model.proj, "text": model.embed})
    mon = Monitor(
        model,
        every=1,
        metrics=["output_norm"],
        modality={"vision": model.proj, "text": model.embed},
        print_alarms=False,
    )
    pixels, ids = torch.randn(2, 4, 8), torch.randint(20, (2, 5))
    model(pixels, ids)
    mon.step()
    with torch.no_grad():
        v = model.proj(pixels).norm(dim=-1).mean()
        t = model.embed(ids).norm(dim=-1).mean()
    assert_close(mon.last["modality/gap"], float(v / t), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="modality keys"):
        Monitor(model, modality={"image": model.proj})


def test_repeated_ngram_batch_raises_alarm(capsys: pytest.CaptureFixture[str]) -> None:
    model = TinyLM(block_size=64)
    mon = Monitor(model, every=1, metrics=["ngrams"])
    ids = torch.randint(64, (2, 64))
    ids[0] = torch.tensor([3, 4]).repeat(32)  # 32 repeats of a 2-gram: OLMo 2's cut-off
    model(ids)
    events = mon.step()
    assert [e.key for e in events] == ["ngrams/flagged"]
    assert "ALARM threshold" in capsys.readouterr().out


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="every=0"):
        Monitor(TinyLM(), every=0)
    with pytest.raises(ValueError, match="metrics"):
        Monitor(TinyLM(), metrics=["nonsense"])
    with pytest.raises(TypeError, match="model must be"):
        Monitor("model")  # type: ignore[arg-type]


def test_entropy_collapse_alarm_precedes_loss_spike_without_qk_norm_only() -> None:
    """High-LR tiny LM (seeded, ~20 s): the alarm fires, then the loss spikes; QK-norm prevents both."""
    bare = collapse_experiment(qk_norm=False)
    assert bare["alarm_step"] is not None and bare["spike_step"] is not None
    assert bare["alarm_step"] < bare["spike_step"]
    qk = collapse_experiment(qk_norm=True)
    assert qk["alarm_step"] is None and qk["spike_step"] is None


def test_overhead_cheap_version() -> None:
    """Cheap run of benchmarks/diagnostics_overhead.py; the < 5% claim is measured by the script itself.

    On a shared 2-core runner a tiny run is noisy, so this bound only catches gross regressions
    (e.g. hooks doing work on unmeasured steps)."""
    mod = load_benchmark("diagnostics_overhead")
    # up to five tries of five rounds: a busy neighbour can inflate one tiny run (0.28 once in a fresh-clone CI run,
    # 0.25-0.27 in all three tries of three rounds in another, with a null overhead of 0.08, against -0.06-0.17 in
    # runs here); hooks doing work on unmeasured steps would inflate every try
    tries = []
    for _ in range(5):
        res = mod.measure_overhead(d_model=64, n_layer=2, seq=32, batch=8, every=10, rounds=5)
        assert res["records"] == 6 and res["keys_per_record"] > 30
        tries.append(res)
        if res["overhead"] < 0.25:
            break
    assert min(r["overhead"] for r in tries) < 0.25, tries


def test_plot_helper(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from normatlas.diagnostics.plot import layer_series, plot_metrics

    model = TinyLM()
    mon = Monitor(model, every=1, metrics=["residual", "output_norm"], print_alarms=False)
    _train(model, mon, 3)
    assert list(layer_series(mon.history, "residual/rms")) == ["L0", "L1"]
    plot_metrics(mon.history, ["residual/rms", "output_norm"], tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="metric='nope'"):
        plot_metrics(mon.history, ["nope"])
    assert Metric("residual") is Metric.RESIDUAL


def test_blocks_residual_add_gives_exact_branch_ratios() -> None:
    """Optional: models built from normatlas.blocks expose each residual add as a module."""
    blocks_model = pytest.importorskip("normatlas.blocks.model")
    from normatlas.blocks.residual import ResidualAdd

    torch.manual_seed(8)
    from normatlas.presets import RMSNorm

    model = blocks_model.TransformerLM(blocks_model.ModelConfig(norm=RMSNorm))
    adds = [n for n, m in model.named_modules() if isinstance(m, ResidualAdd)]
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, o, n=n: seen.__setitem__(n, (a[0].detach(), a[1].detach())))
        for n, m in model.named_modules()
        if isinstance(m, ResidualAdd)
    ]
    mon = Monitor(model, every=1, metrics=["residual", "attention"], print_alarms=False)
    model(torch.randint(256, (2, 12)))
    mon.step()
    for h in hooks:
        h.remove()
    assert adds and len(mon.blocks) == 2
    for n in adds:
        x, b = seen[n]
        ref = b.double().pow(2).mean().sqrt() / x.double().pow(2).mean().sqrt()
        assert_close(mon.last[f"residual_add/branch_ratio/{n}"], float(ref), rtol=1e-5, atol=0)
    assert "attention/entropy/L1" in mon.last


def test_cnn_channels_first_and_progress_line(capsys: pytest.CaptureFixture[str]) -> None:
    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.bn(self.conv(x))

    torch.manual_seed(9)
    model = nn.Sequential(Res(), Res(), Res())
    mon = Monitor(model, every=1, channels_first=True, print_progress=True, print_alarms=False)
    x = torch.randn(2, 8, 5, 5)
    x[1, 3, 2, 4] = 300.0  # a massive activation at position (2, 4) = token 14, channel 3 of example 1
    model(x).sum().backward()
    mon.step(loss=1.0)
    rec = mon.last
    h = x + model[0].bn(model[0].conv(x))  # bn in train mode: same batch, same statistics
    ref = h.detach().double().movedim(1, -1).flatten(1, 2)
    assert_close(rec["residual/rms/L0"], float(ref.pow(2).mean().sqrt()), rtol=1e-5, atol=0)
    assert (rec["massive/token/L0"], rec["massive/channel/L0"]) == (14, 3)
    assert "batchnorm/mean_gap/0.bn" in rec and "grad_norm/L2" in rec
    assert capsys.readouterr().out.startswith("step 0 | loss 1 | out-norm")


class _PostLN(nn.Module):
    """``ln(lin(x) [+ x])``: the residual written in place, as Post-LN code often does."""

    def __init__(self, bias: bool, inplace: bool) -> None:
        super().__init__()
        self.lin, self.ln, self.inplace = nn.Linear(16, 16, bias=bias), nn.LayerNorm(16), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.inplace:
            h += x
        return self.ln(h)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1, bias=True), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def _output_moves_when_weight_scales(block: nn.Module, x: torch.Tensor) -> bool:
    """Ground truth in train mode (BatchNorm on batch statistics), on a copy."""
    block = copy.deepcopy(block).train()
    w = block.get_submodule("lin" if hasattr(block, "lin") else "conv").weight
    with torch.no_grad():
        before = block(x)
        w.mul_(3.0)
        after = block(x)
    return not torch.allclose(before, after, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "shape", "invariant"),
    [
        (lambda: _PostLN(bias=False, inplace=False), (4, 5, 16), True),
        (lambda: _PostLN(bias=False, inplace=True), (4, 5, 16), False),  # shares storage with the LN input
        (lambda: _PostLN(bias=True, inplace=False), (4, 5, 16), False),  # only (W, b) is invariant
        (lambda: _ConvBN(), (4, 3, 6, 6), True),  # BatchNorm's centring cancels the conv bias
    ],
)
def test_scale_invariant_linears_are_exactly_those_whose_weight_can_scale(
    make: Callable[[], nn.Module], shape: tuple[int, ...], invariant: bool
) -> None:
    torch.manual_seed(7)
    x = torch.randn(shape)
    model = nn.Sequential(make(), make())
    for blk in model:
        assert _output_moves_when_weight_scales(blk, x) is not invariant  # the ground truth
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, every=1, optimizer=opt, metrics=["effective_lr"], print_alarms=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model(x).sum().backward()
    mon.step()
    lin = "lin" if hasattr(model[0], "lin") else "conv"
    assert mon.scale_invariant == ([f"0.{lin}", f"1.{lin}"] if invariant else [])
    if invariant:
        w = model[0].get_submodule(lin).weight.detach().double()
        assert mon.effective_lr_power == 2
        assert_close(mon.last[f"effective_lr/0.{lin}"], 0.1 / float(w.norm() ** 2), rtol=1e-5, atol=0)
    assert not any(k.startswith("effective_lr/") for k in mon.last) or invariant
    # the extra traced forward left the BatchNorm statistics as one forward leaves them
    ref = nn.Sequential(make(), make())
    ref.load_state_dict(state)
    ref.train()(x)
    for k, v in ref.state_dict().items():
        assert_close(model.state_dict()[k], v, rtol=0, atol=0)


class _Overflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 1e39  # overflows float32 to inf


def test_inf_activation_is_reported_not_raised() -> None:
    torch.manual_seed(8)
    model = nn.Sequential(_Overflow(), _Overflow())
    mon = Monitor(model, every=1, print_alarms=False)
    model(torch.randn(2, 3, 4))  # before the fix: "math domain error" from the forward hook
    events = mon.step()
    rec = mon.last
    assert rec["headroom/bf16_log2"] == -math.inf and rec["headroom/fp16_log2"] == -math.inf
    assert rec["headroom/nonfinite_share"] > 0 and rec["headroom/nonfinite_share/L0"] > 0
    fired = {e.key for e in events}
    assert "headroom/nonfinite_share" in fired


def test_sdpa_probs_match_sdpa_causal_with_fewer_queries_than_keys() -> None:
    """SDPA's is_causal is top-left aligned (torch docs: ``tril(diagonal=0)``), also for Tq != Tk."""
    g = torch.Generator().manual_seed(9)
    for tq, tk in ((3, 7), (7, 3), (5, 5)):
        q = torch.randn(2, 3, tq, 8, generator=g, dtype=torch.float64)
        k = torch.randn(2, 3, tk, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, 3, tk, 8, generator=g, dtype=torch.float64)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        _, probs = sdpa_probs(q, k, is_causal=True)
        assert_close(probs.double() @ v, ref, rtol=1e-5, atol=1e-6)


def test_dropout_in_train_mode_is_not_cross_example_dependence() -> None:
    torch.manual_seed(10)
    x = torch.randn(8, 6)
    drop = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Dropout(0.1), nn.Linear(16, 3)).train()
    before = torch.random.get_rng_state()
    res = cross_example_dependence(drop, x)
    assert res.passed and res.leak == 0.0, res
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left as it was
    bn = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 3)).train()
    assert not cross_example_dependence(bn, x).passed


def test_captured_logits_mark_finite_masks_as_masked() -> None:
    """Eager attention with an additive finfo.min mask and SDPA with a float mask give the same entropy
    as the causal map they encode; the probabilities are SDPA's."""
    torch.manual_seed(11)
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    float_mask = torch.zeros(6, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    logits, probs = sdpa_probs(q, k, float_mask)
    assert torch.equal(torch.isinf(logits[0, 0]), ~causal)
    assert_close(probs @ v, F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask), rtol=1e-5, atol=1e-6)
    ref = attention_stats(probs, allowed=causal)
    got = []
    with AttentionCapture(lambda p, lg: got.append(attention_stats(p, lg))):
        torch.softmax(q @ k.transpose(-1, -2) / 2.0 + float_mask, dim=-1)
        F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
    assert len(got) == 2
    for st in got:
        assert_close(st["entropy_norm"], ref["entropy_norm"], rtol=1e-5, atol=1e-6)
