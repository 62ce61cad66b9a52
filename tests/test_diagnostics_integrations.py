"""Real framework runs: a transformers Trainer and a Lightning Trainer driving the Monitor."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from normatlas.diagnostics import Monitor
from normatlas.diagnostics.integrations import hf_callback, lightning_callback
from normatlas.diagnostics.tinylm import TinyLM, bag_batches


class LMWithLoss(nn.Module):
    """TinyLM returning ``{"loss", "logits"}`` as transformers' Trainer expects."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.lm(input_ids)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def _examples(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": x[i], "labels": y[i]} for x, y in bag_batches(n // 4, batch=4) for i in range(4)]


def test_transformers_trainer(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LMWithLoss()
    mon = Monitor(model, every=1, metrics=["grad_norm", "output_norm", "residual"], print_alarms=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_grad_norm=1e9,
        learning_rate=1e-3,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_examples(12), callbacks=[hf_callback(mon)])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert len(mon.history.records) == 3 == len(logged)
    for rec, log in zip(mon.history.records, logged, strict=True):
        assert_close(rec["grad_norm/total"], float(log["grad_norm"]), rtol=1e-4, atol=0)  # Trainer's own norm
        assert_close(rec["loss"], float(log["loss"]), rtol=1e-4, atol=1e-4)
        assert "residual/rms/L1" in rec and math.isfinite(rec["output_norm"])
    assert not mon._handles  # detached at the end of training


def test_lightning_trainer() -> None:
    if importlib.util.find_spec("lightning") is None:
        mon = Monitor(TinyLM(), print_alarms=False)
        with pytest.raises(ImportError, match="pip install lightning"):
            lightning_callback(mon)
        return
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = TinyLM()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.lm(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(1)
    module = Module()
    mon = Monitor(module.lm, every=2, metrics=["grad_norm", "attention"], print_alarms=False)
    grads: list[float] = []

    class Spy(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
            grads.append(float(torch.stack([p.grad.norm() for p in pl_module.parameters()]).norm()))

    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lightning_callback(mon), Spy()],
    )
    x, y = (torch.cat(t) for t in zip(*bag_batches(4, batch=4), strict=True))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer.fit(module, train_dataloaders=loader)
    assert [r["step"] for r in mon.history.records] == [0, 2]
    for rec, g in zip(mon.history.records, grads[::2], strict=True):
        assert_close(rec["grad_norm/total"], g, rtol=1e-5, atol=0)
        assert "loss" in rec and "attention/entropy/L1" in rec
