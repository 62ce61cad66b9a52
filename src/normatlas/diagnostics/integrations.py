"""Training-framework hooks for :class:`~normatlas.diagnostics.Monitor` (each optional, lazily imported).

* plain loops: call ``monitor.step(loss=...)`` after ``backward()``, before ``zero_grad()``;
* transformers: ``trainer.add_callback(hf_callback(monitor))``. Gradients are read in
  ``on_pre_optimizer_step`` (they are still there, after the Trainer's clipping), the
  record is closed in ``on_step_end``; the loss comes from the model output's ``loss``;
* Lightning: ``Trainer(callbacks=[lightning_callback(monitor)])``, gradients in
  ``on_before_optimizer_step``, the record closed in ``on_train_batch_end``.
"""

from __future__ import annotations

from typing import Any

from .monitor import Monitor

__all__ = ["hf_callback", "lightning_callback"]


def _grads_then_step(monitor: Monitor) -> tuple[Any, Any]:
    """Split ``monitor.step`` so gradients can be read before the optimizer zeroes them."""

    def close(loss: Any = None) -> None:
        monitor.step(loss=loss)  # the gradients were read already: read_gradients runs once per step

    return monitor.read_gradients, close


def hf_callback(monitor: Monitor) -> Any:
    """A ``transformers.TrainerCallback`` driving ``monitor`` (needs transformers)."""
    try:
        from transformers import TrainerCallback
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("hf_callback needs transformers: pip install transformers") from exc
    read_grads, close = _grads_then_step(monitor)

    class NormatlasCallback(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            read_grads()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            close(None)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            monitor.detach()

    return NormatlasCallback()


def lightning_callback(monitor: Monitor) -> Any:
    """A Lightning ``Callback`` driving ``monitor`` (needs ``lightning`` or ``pytorch_lightning``)."""
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback  # type: ignore[assignment]
        except ImportError as exc:
            raise ImportError("lightning_callback needs lightning: pip install lightning") from exc
    read_grads, close = _grads_then_step(monitor)

    class NormatlasLightningCallback(Callback):  # type: ignore[misc]
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            read_grads()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            close(loss)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            monitor.detach()

    return NormatlasLightningCallback()
