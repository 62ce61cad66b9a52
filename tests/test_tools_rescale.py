"""V-scale (:func:`normatlas.tools.rescale.v_scale`): the value-path rescale proven exact in float64 on tiny
transformers models (multi-head, grouped-query with 2 and 1 kv heads, q/k/v biases, and the fused QKV projections of
GPT-2 (a transposed Conv1D with bias), Phi-3 and GPT-NeoX (interleaved per head)), the weights really changed with
the GQA column layout checked, only the V rows of a fused tensor touched (and a wrong layout shown to break the
function), the refusals, the report, and the CLI hook on the trained byte Llama. The projections are found by the
port's dataflow reading; the tests spell out each family's layout from its transformers source instead."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from normatlas.cli import main
from normatlas.tools.outliers import max_logit_diff, quant_error
from normatlas.tools.rescale import head_layout, v_scale

from .tools_fixtures import IDS, tool_model

LAYERS = 4

# (model_type, config overrides, (heads, kv heads, head_dim)); the tiny configs are 32 wide with 4 heads
CASES = [
    ("llama", {"num_key_value_heads": 4}, (4, 4, 8)),  # multi-head (Llama-2-7B: 32 heads, 32 kv heads)
    ("llama", {"num_key_value_heads": 2}, (4, 2, 8)),  # GQA (Llama-3-8B: 32 heads, 8 kv heads)
    ("mistral", {"num_key_value_heads": 1}, (4, 1, 8)),  # multi-query: every q head reads the one kv head
    ("qwen2", {}, (4, 2, 8)),  # q/k/v biases: the v bias is scaled with its row
    ("llama", {"num_key_value_heads": 2, "head_dim": 16}, (4, 2, 16)),  # head_dim x heads != hidden_size
]


def _hf(config: Any) -> Any:
    """A seeded model of ``config`` (transformers' defaults: sdpa attention) in float64, gains and biases moved."""
    import transformers

    from .tiny_hf import randomise_

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise_(model, 0.3, vectors_only=True, generator=torch.Generator().manual_seed(1))
    return torch.nn.Module.to(model, torch.float64).eval()


def _phi3() -> Any:  # Phi-3-mini: 3072 wide, 32 layers, 32 heads; qkv_proj stacks [q | k | v] rows
    import transformers

    return _hf(transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       pad_token_id=0))  # fmt: skip


def _neox() -> Any:  # Pythia-160m: 768 wide, 12 layers, 12 heads; query_key_value is [q_h | k_h | v_h] per head
    import transformers

    return _hf(transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                          num_attention_heads=4, max_position_embeddings=64))  # fmt: skip


# family -> (model, (heads, kv heads, head_dim), the V rows of the fused projection in its (out, in) layout)
FUSED: dict[str, tuple[Any, tuple[int, int, int], list[int]]] = {
    "gpt2": (lambda: tool_model("gpt2", dtype=torch.float64), (4, 4, 8), list(range(64, 96))),  # Conv1D c_attn
    "phi3": (_phi3, (4, 2, 8), list(range(48, 64))),  # after 32 q rows and 16 k rows
    "gpt_neox": (_neox, (4, 4, 8), [h * 24 + 16 + d for h in range(4) for d in range(8)]),  # view(.., -1, 3 * hd)
}


def _fused(name: str, model: Any, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Layer ``i``'s fused QKV weight ``(out, in)``, its bias, and the output projection ``(out, in)``, spelled
    out per family from its transformers source."""
    if name == "gpt2":
        a = model.transformer.h[i].attn
        return a.c_attn.weight.T, a.c_attn.bias, a.c_proj.weight.T  # Conv1D stores (in, out)
    if name == "phi3":
        a = model.model.layers[i].self_attn
        return a.qkv_proj.weight, a.qkv_proj.bias, a.o_proj.weight
    a = model.gpt_neox.layers[i].attention
    return a.query_key_value.weight, a.query_key_value.bias, a.dense.weight


def _attn(model: torch.nn.Module, i: int) -> Any:
    return model.get_submodule(f"model.layers.{i}.self_attn")


def _s(a: Any, b: Any) -> torch.Tensor:
    """The scale read back from the weights: row j of the original v_proj over row j of the rescaled one."""
    return (a.v_proj.weight[:, 0] / b.v_proj.weight[:, 0]).detach()


@pytest.mark.parametrize(("model_type", "overrides", "layout"), CASES)
def test_v_scale_leaves_the_function_unchanged_in_float64(
    model_type: str, overrides: dict[str, int], layout: tuple[int, int, int]
) -> None:
    model = tool_model(model_type, dtype=torch.float64, **overrides)
    assert head_layout(model) == layout
    vs = v_scale(model, IDS)
    assert len(vs.rows) == LAYERS and vs.refusals == []
    with torch.no_grad():
        size = float(model(input_ids=IDS).logits.abs().max())
    assert vs.max_logit_diff < 1e-12 and vs.max_logit_diff / size < 1e-12
    assert max_logit_diff(model, vs.model, IDS) == vs.max_logit_diff
    heads, kv, hd = layout
    assert all(r["heads"] == f"{heads}q/{kv}kv x {hd}" for r in vs.rows)


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_qkv_projections_are_rescaled_exactly_in_float64(name: str) -> None:
    make, layout, _ = FUSED[name]
    model = make()
    assert model.config._attn_implementation == "sdpa"  # transformers' default, not an eager stand-in
    assert head_layout(model) == layout
    vs = v_scale(model, IDS)
    assert len(vs.rows) == LAYERS and vs.refusals == []
    with torch.no_grad():
        size = float(model(input_ids=IDS).logits.abs().max())
    assert vs.max_logit_diff / size < 1e-12
    heads, kv, hd = layout
    assert all(r["heads"] == f"{heads}q/{kv}kv x {hd}" for r in vs.rows)


@pytest.mark.parametrize("name", list(FUSED))
def test_only_the_v_rows_of_a_fused_projection_change(name: str) -> None:
    make, (heads, kv, hd), v_rows = FUSED[name]
    model = make()
    vs = v_scale(model, IDS)
    others = [r for r in range(_fused(name, model, 0)[0].shape[0]) if r not in set(v_rows)]
    v, rest = torch.tensor(v_rows), torch.tensor(others)
    for i in range(LAYERS):
        (wa, ba, oa), (wb, bb, ob) = _fused(name, model, i), _fused(name, vs.model, i)
        s = (wa[v, 0] / wb[v, 0]).detach()
        assert float(s.max() / s.min()) > 1.2
        torch.testing.assert_close(wb[v] * s[:, None], wa[v], rtol=1e-12, atol=0)
        torch.testing.assert_close(wb[rest], wa[rest], rtol=0, atol=0)  # q and k rows bit for bit
        if ba is not None:
            assert bb is not None
            torch.testing.assert_close(bb[v] * s, ba[v], rtol=1e-12, atol=0)
            torch.testing.assert_close(bb[rest], ba[rest], rtol=0, atol=0)
        col = torch.tensor([(h // (heads // kv)) * hd + d for h in range(heads) for d in range(hd)])
        torch.testing.assert_close(ob, oa * s[col][None, :], rtol=1e-12, atol=0)
    # the report's V output is the V columns of the fused output
    captured: list[torch.Tensor] = []
    owner = {"gpt2": "transformer.h.0.attn.c_attn", "phi3": "model.layers.0.self_attn.qkv_proj",
             "gpt_neox": "gpt_neox.layers.0.attention.query_key_value"}[name]  # fmt: skip
    with torch.no_grad():
        h = model.get_submodule(owner).register_forward_hook(lambda m, args, out: captured.append(out[..., v]))
        model(input_ids=IDS, use_cache=False)
        h.remove()
    assert vs.rows[0]["v_int8_before"] == pytest.approx(quant_error(captured[0], "int8", "tensor"), rel=1e-12)


@pytest.mark.parametrize(("model_type", "overrides", "layout"), CASES)
def test_the_scale_changes_the_weights_in_the_gqa_layout(
    model_type: str, overrides: dict[str, int], layout: tuple[int, int, int]
) -> None:
    heads, kv, hd = layout
    model = tool_model(model_type, dtype=torch.float64, **overrides)
    vs = v_scale(model, IDS)
    for i in range(LAYERS):
        a, b = _attn(model, i), _attn(vs.model, i)
        s = _s(a, b)  # (kv * hd,): each row divided by its s
        torch.testing.assert_close(b.v_proj.weight * s[:, None], a.v_proj.weight, rtol=1e-12, atol=0)
        assert float(s.max() / s.min()) > 1.2  # a real per-channel scale, not a constant
        assert s.min() == pytest.approx(vs.rows[i]["s_min"], rel=1e-12)
        if a.v_proj.bias is not None:
            torch.testing.assert_close(b.v_proj.bias * s, a.v_proj.bias, rtol=1e-12, atol=0)
        # o_proj column h * hd + d reads kv channel (h // (heads // kv)) * hd + d
        col = torch.tensor([(h // (heads // kv)) * hd + d for h in range(heads) for d in range(hd)])
        torch.testing.assert_close(b.o_proj.weight, a.o_proj.weight * s[col][None, :], rtol=1e-12, atol=0)
        torch.testing.assert_close(b.q_proj.weight, a.q_proj.weight, rtol=0, atol=0)  # untouched


def test_a_wrong_head_layout_would_change_the_function() -> None:
    """The check can fail: the o_proj scale tiled over heads (kv head h % kv) instead of repeated (h // n_rep)."""
    model = tool_model("llama", dtype=torch.float64, num_key_value_heads=2)
    vs = v_scale(model, IDS)
    heads, kv, hd = 4, 2, 8
    with torch.no_grad():
        for i in range(LAYERS):
            a, b = _attn(model, i), _attn(vs.model, i)
            s = _s(a, b)
            wrong = torch.tensor([(h % kv) * hd + d for h in range(heads) for d in range(hd)])
            b.o_proj.weight.copy_(a.o_proj.weight * s[wrong][None, :])
    assert max_logit_diff(model, vs.model, IDS) > 1e-6


def test_the_quant_report_is_well_formed() -> None:
    model = tool_model("llama", dtype=torch.float64, num_key_value_heads=2)
    vs = v_scale(model, IDS, alpha=0.5)
    keys = ["site", "heads", "v_int8_before", "v_int8_after", "o_in_int8_before", "o_in_int8_after",
            "o_w_int8_before", "o_w_int8_after", "s_min", "s_max"]  # fmt: skip
    assert [r["site"] for r in vs.rows] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    for r in vs.rows:
        assert list(r) == keys
        errs = [v for k, v in r.items() if "int8" in k]
        assert all(math.isfinite(e) and 0 < e < 0.05 for e in errs)
        assert 0 < r["s_min"] < r["s_max"]
    # the first layer's "after" v error is the quant error of the measured v_proj output divided by s
    a, b = _attn(model, 0), _attn(vs.model, 0)
    captured: list[torch.Tensor] = []
    with torch.no_grad():
        h = a.v_proj.register_forward_hook(lambda m, args, out: captured.append(out))
        model(input_ids=IDS, use_cache=False)
        h.remove()
    s = _s(a, b)
    assert vs.rows[0]["v_int8_before"] == pytest.approx(quant_error(captured[0], "int8", "tensor"), rel=1e-12)
    assert vs.rows[0]["v_int8_after"] == pytest.approx(quant_error(captured[0] / s, "int8", "tensor"), rel=1e-9)
    assert vs.model is not model and sum(p.numel() for p in vs.model.parameters()) == sum(
        p.numel() for p in model.parameters()
    )


def test_refusals_name_the_module_and_the_reason() -> None:
    model = tool_model("llama", dtype=torch.float64, num_key_value_heads=2)
    with pytest.raises(ValueError, match="alpha"):
        v_scale(model, IDS, alpha=1.5)
    # V read nonlinearly (a tanh after v_proj): caught by the per-module check, reverted
    bent = tool_model("llama", dtype=torch.float64, num_key_value_heads=2)
    _attn(bent, 1).v_proj.register_forward_hook(lambda m, args, out: torch.tanh(out))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn: its output moved .* not read linearly"):
        v_scale(bent, IDS)
    vs = v_scale(bent, IDS, strict=False)
    assert [r["site"] for r in vs.refusals] == ["model.layers.1.self_attn"] and len(vs.rows) == LAYERS - 1
    assert vs.max_logit_diff < 1e-12
    torch.testing.assert_close(_attn(vs.model, 1).v_proj.weight, _attn(bent, 1).v_proj.weight, rtol=0, atol=0)
    # a v_proj weight shared between layers: scaling one would scale the other
    tied = tool_model("llama", dtype=torch.float64, num_key_value_heads=2)
    _attn(tied, 2).v_proj.weight = _attn(tied, 0).v_proj.weight
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn: v_proj\.weight is shared with model\.layers"):
        v_scale(tied, IDS)
    vs = v_scale(tied, IDS, strict=False)  # both layers refused, each under its own attention module
    assert [r["site"] for r in vs.refusals] == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    assert len(vs.rows) == LAYERS - 2 and vs.max_logit_diff < 1e-12
    # MLA (DeepSeek-V3): V is part of the latent's up-projection; refused from the port's config, per layer
    import transformers

    mla = _hf(transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                                            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                            first_k_dense_replace=2))  # fmt: skip
    with pytest.raises(ValueError, match=r"refuses model\.layers\.0\.self_attn: MLA"):
        v_scale(mla, IDS)
    vs = v_scale(mla, IDS, strict=False)
    assert [r["site"] for r in vs.refusals] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert vs.rows == [] and vs.max_logit_diff == 0
    # a model the port cannot read (a BertModel: no head): the port's reason
    with pytest.raises(ValueError, match=r"the port cannot read BertModel.*cannot port: .*head"):
        v_scale(tool_model("bert", dtype=torch.float64), IDS)
    with pytest.raises(ValueError, match=r"the port cannot read Sequential.*no \.config"):
        v_scale(torch.nn.Sequential(torch.nn.Embedding(64, 8)), IDS)


def test_the_layout_is_read_from_the_dataflow_not_the_config() -> None:
    """A config whose head layout disagrees with the layers: the port reads the layers (2 kv heads), the config's
    num_key_value_heads (1) is never consulted, and the rescale is exact."""
    liar = tool_model("llama", dtype=torch.float64, num_key_value_heads=2)
    liar.config.num_key_value_heads = 1
    assert head_layout(liar) == (4, 2, 8)
    vs = v_scale(liar, IDS)
    assert vs.max_logit_diff < 1e-12 and [r["heads"] for r in vs.rows] == ["4q/2kv x 8"] * LAYERS


def test_the_cli_hook(byte_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["outliers", str(byte_llama), "--text", "def f(x):\n    return x", "--no-entropy", "--rescale", "v"]
    assert main([*argv, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["v_scaled"] == 3 and doc["v_refused"] == 0 and doc["v_max_abs_logit_diff_f64"] < 1e-12
    assert [r["site"] for r in doc["rescale"]] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert main([*argv, "--format", "table"]) == 0
    assert "V-scale (alpha 0.5)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["outliers", str(byte_llama), "--rescale", "k"])
    assert exit_.value.code == 2
    assert "--rescale" in capsys.readouterr().err
