"""Monitor on live models: records, peers for each statistic, sinks, BatchNorm, VLM gap, integrations."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from normatlas.diagnostics import CSVSink, JSONLSink, Metric, Monitor, attention_stats, sdpa_probs
from normatlas.diagnostics.health import cross_example_dependence
from normatlas.diagnostics.tinylm import TinyLM, collapse_experiment


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
    assert_close(rec["effective_lr/blocks.0.attn.q"], 0.02 / float(w.norm() ** 2), rtol=1e-5, atol=0)
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
    mon = Monitor(model, every=1, modality={"vision": model.proj, "text": model.embed}, print_alarms=False)
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
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics_overhead.py"
    spec = importlib.util.spec_from_file_location("diagnostics_overhead", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # up to three tries: a busy neighbour can inflate one tiny run (0.28 once in a fresh-clone CI run, against
    # 0.03-0.17 in twelve runs in a row here); hooks doing work on unmeasured steps would inflate every try
    tries = []
    for _ in range(3):
        res = mod.measure_overhead(d_model=64, n_layer=2, seq=32, batch=8, every=10, rounds=3)
        assert res["records"] == 4 and res["keys_per_record"] > 30
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
