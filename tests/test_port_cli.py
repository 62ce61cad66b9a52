"""``normatlas port``: the derived design and mapping, ``--check``'s fp32 comparison, refusals and bad targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from normatlas.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_model_type_with_check_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "port", "qwen2", "--check", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    design = {(r["part"], r["field"]): r["value"] for r in doc["design"]}
    assert design[("attention", "qkv / out bias")] == "True / False"  # Qwen2's q/k/v biases, read from the model
    assert design[("norm", "operator")] == "rmsnorm"
    check = {r["compared"]: r for r in doc["check"]}
    assert check["logits"]["max_abs_diff"] <= 1e-5
    assert check["gradients"]["tensors"] == 27 and check["gradients"]["max_rel_diff"] <= 1e-5


def test_a_checkpoint_folder_ports_its_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.tiny_hf import tiny_model

    hf = tiny_model("mistral", width=32, sliding_window=4)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    code, out, _ = run(capsys, "port", str(tmp_path), "--check", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert {r["compared"]: r["max_abs_diff"] for r in doc["check"]}["logits"] <= 1e-5
    assert any(r["field"] == "causal / windows" and r["value"] == "True / (4, 4)" for r in doc["design"])


def test_a_refusal_names_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "port", "phimoe")
    assert code == 1
    assert "cannot port into our Block" in out and "routed mixture of experts" in out


def test_unknown_model_type_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "port", "no_such_arch_xyz")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "unknown model type" in err


def test_an_image_classifier_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import torch
    import transformers

    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path, safe_serialization=True)
    code, out, _ = run(capsys, "port", str(tmp_path), "--check", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert {r["field"]: r["value"] for r in doc["design"]}["image / patch / pool / classes"] == "32 / 8 / cls / 3"
    assert {r["compared"]: r["max_abs_diff"] for r in doc["check"]}["logits"] <= 1e-5
