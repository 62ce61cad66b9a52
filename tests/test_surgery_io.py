"""Checkpoint I/O: atomic writes, load-back, stock transformers loading, and clear refusals of bad input
(a pickle, a missing tensor, a wrong shape) that leave no output behind."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from normatlas.cli import main  # noqa: E402
from normatlas.surgery import (  # noqa: E402
    MANIFEST,
    fold_batchnorm,
    freeze_batchnorm,
    ln_to_rms,
    load_checkpoint,
    load_transformed,
    model_output,
    probe_inputs,
    run_checks,
    save_surgery,
)

from .test_surgery_hf import tiny  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "gpt2"
    tiny("gpt2").save_pretrained(path)
    return path


def _out(model, x):
    with torch.no_grad():
        return model_output(model, x)[0]


def test_ln_to_rms_written_loads_back_and_in_stock_transformers(gpt2_dir, tmp_path) -> None:
    model = load_checkpoint(gpt2_dir)
    x = probe_inputs(model)
    s = ln_to_rms(model, x)
    run_checks(model, s, x)
    out = save_surgery(s, tmp_path / "rms", inputs=x)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", MANIFEST])
    assert [p.name for p in tmp_path.iterdir()] == ["rms"]  # no temp folder left
    _, runtime, manifest = load_transformed(out)
    assert manifest["transform"] == "ln-to-rms" and manifest["stock_equivalent"]
    ref = _out(model, x)
    tol = dict(rtol=0, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(_out(runtime, x), ref, **tol)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # stock code, stock LayerNorm
    assert plain.lm_head.weight is not plain.transformer.wte.weight
    torch.testing.assert_close(_out(plain, x), ref, **tol)


def test_pickle_is_refused(tmp_path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    model = tiny("llama")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_checkpoint(folder)
    with pytest.raises(ValueError, match=r"refusing to read .*pytorch_model\.bin: a pickle"):
        load_checkpoint(folder / "pytorch_model.bin")
    (folder / "pytorch_model.bin").rename(folder / "model.safetensors")  # a pickle in disguise
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_checkpoint(folder)


def _corrupt(src, dst, edit) -> None:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = safetensors_torch.load_file(str(src / "model.safetensors"))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(dst / "model.safetensors"))


def test_missing_tensor_and_wrong_shape_give_clear_errors_and_no_output(gpt2_dir, tmp_path) -> None:
    missing = tmp_path / "missing"
    _corrupt(gpt2_dir, missing, lambda t: t.pop("transformer.h.1.ln_2.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['transformer.h.1.ln_2.weight'\]"):
        load_checkpoint(missing)
    shape = tmp_path / "shape"
    _corrupt(gpt2_dir, shape, lambda t: t.update({"transformer.h.0.ln_1.bias": torch.zeros(31)}))
    with pytest.raises(ValueError, match=r"transformer.h.0.ln_1.bias.*shape \(31,\).*needs \(32,\)"):
        load_checkpoint(shape)
    for bad in (missing, shape):
        assert main(["convert", "ln-rms", str(bad), str(tmp_path / f"{bad.name}-out")]) == 2
        assert not (tmp_path / f"{bad.name}-out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["missing", "shape"]


def test_cli_fold_then_verify(gpt2_dir, tmp_path, capsys) -> None:
    out = tmp_path / "folded"
    assert main(["fold", str(gpt2_dir), str(out)]) == 0
    text = capsys.readouterr().out
    assert "folded" in text and "wrote" in text
    assert main(["verify", str(gpt2_dir), str(out)]) == 0
    text = capsys.readouterr().out
    assert "verification after reload" in text and " NO" not in text
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["checks"] and all(c["passed"] for c in manifest["checks"])
    assert main(["fold", str(gpt2_dir), str(out)]) == 2  # never overwrites silently


def test_cli_refuses_pickles_with_exit_2(tmp_path, capsys) -> None:
    folder = tmp_path / "p"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "model.pt")
    assert main(["fold", str(folder), str(tmp_path / "o")]) == 2
    assert "pickle" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _resnet():
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = transformers.ResNetForImageClassification(cfg).eval()  # ResNet-50: 64/256..2048, depths 3-4-6-3
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif n.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=gen))
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.mark.parametrize("transform", [fold_batchnorm, freeze_batchnorm])
def test_batchnorm_fold_and_freeze_round_trip(transform, tmp_path) -> None:
    from normatlas.longtail import FrozenBatchNorm

    model = _resnet()
    x = probe_inputs(model)
    s = transform(model, x)
    run_checks(model, s, x)
    assert s.passed and len(s.changes) == 8 and not s.refusals, s.check_rows()
    out = save_surgery(s, tmp_path / "bn")
    _, runtime, _ = load_transformed(out)
    bns = [m for m in runtime.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns == []
    if transform is freeze_batchnorm:
        assert sum(isinstance(m, FrozenBatchNorm) for m in runtime.modules()) == 8
    ref = _out(model, x)
    torch.testing.assert_close(_out(runtime, x), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
