"""Shared test settings: seeded, deterministic, CPU."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from .tools_fixtures import byte_llama  # noqa: F401  (the session's trained byte Llama checkpoint, a fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton kernels are tested on CPU under the interpreter; the mode is read when triton is first
    # imported, and torch.compile may import triton before the Triton tests run, so set it up front.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# A suite started as a background job of a non-interactive shell (`make test &`, nohup, some CI runners) inherits
# SIGINT ignored, and passes it to every process it starts: the Ctrl-C tests would see no Ctrl-C. Put Python's own
# handler back, as an interactive start has it (the commands' children then start with the default disposition).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

try:
    from hypothesis import settings

    settings.register_profile("normatlas", max_examples=40, deadline=None, derandomize=True)
    settings.load_profile("normatlas")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
