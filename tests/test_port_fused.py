"""Models as users load them: fused attention cores (sdpa, flex attention) read like eager attention (issue 31).

transformers' default attention is ``sdpa`` (``from_pretrained`` and ``from_config`` pick it); the port, the
inspector and the diagnostics read a fused call from its own arguments (:mod:`normatlas.analysis.attention_calls`),
never by reloading the model with another attention. Each test below builds or loads the model the way a user does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from normatlas.analysis.attention_calls import fused_call  # noqa: E402
from normatlas.analysis.graph import record  # noqa: E402
from normatlas.cli import main  # noqa: E402
from normatlas.factory import attention_implementation, build_target  # noqa: E402
from normatlas.inspect import inspect_model  # noqa: E402
from normatlas.port import PortError, from_hf, port  # noqa: E402

from .tiny_hf import randomise_, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
VOCAB = 97
_DEC = dict(width=64, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)


def _ids(seed: int = 1, t: int = 9) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, t), generator=torch.Generator().manual_seed(seed))


def _same_logits(hf: nn.Module, ours: nn.Module, t: int = 9) -> float:
    ids = _ids(t=t)
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, ours(ids)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
    return float((got - ref).abs().max())


USER_PATH = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "granite", "olmo3", "exaone4", "gpt2"]
"""Issue 31's must-show families: each saved, then loaded back as a user loads it."""


@pytest.mark.parametrize("model_type", USER_PATH)
def test_from_pretrained_defaults_port_exactly(model_type: str, tmp_path: Path) -> None:
    """Saved, then loaded back with ``from_pretrained`` and transformers' defaults: the user's path.
    Logits within 1e-4 of the source in fp32 (measured: <= 2e-6), and the model is never switched to eager."""
    config = dict(_DEC, max_position_embeddings=64) if model_type != "gpt2" else dict(width=64, vocab_size=VOCAB)
    randomise_(tiny_model(model_type, **config), 0.1).save_pretrained(tmp_path, safe_serialization=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    default = hf.config._attn_implementation
    # transformers' own choice: sdpa, except Gemma 2, which has no sdpa path (sdpa cannot soft-cap its logits)
    assert default == ("eager" if model_type == "gemma2" else "sdpa")
    ours = from_hf(hf)
    assert hf.config._attn_implementation == default  # never switched behind the user's back
    assert _same_logits(hf, ours) <= 1e-4


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_sdpa_and_eager_read_the_same_design(impl: str) -> None:
    """Mistral's sliding window comes from sdpa's boolean ``attn_mask``, Qwen3's causal band from ``is_causal``."""
    for model_type, extra in (("mistral", dict(sliding_window=4)), ("qwen3", {})):
        hf = randomise_(tiny_model(model_type, attn_implementation=impl, **_DEC, **extra), 0.1)
        p, ours = port(hf)
        assert hf.config._attn_implementation == impl
        assert p.config.causal and p.config.layer_windows == ((4, 4) if extra else None)
        _same_logits(hf, ours)


def test_flex_attention_ports_with_its_mask_and_softcap() -> None:
    """Flex attention (transformers compiles it; the recorder runs its Python eagerly): the window comes from the
    block mask's ``mask_mod``, Gemma 2's soft-cap from ``score_mod``."""
    hf = randomise_(
        tiny_model("gemma2", attn_implementation="flex_attention", **_DEC, sliding_window=4,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=24),
        0.1,
    )  # fmt: skip
    p, _ = port(hf)
    assert hf.config._attn_implementation == "flex_attention"
    assert p.config.attn_softcap == 5.0 and p.config.layer_windows == (4, None)
    assert p.max_abs_diff is not None and p.max_abs_diff < 1e-4


class _Attn(nn.Module):
    """One attention layer calling sdpa with positional arguments and a float mask (0 allowed, -inf masked)."""

    def __init__(self, bias: float = 0.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.bias, self.dropout = bias, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        band = torch.ones(t, t, dtype=torch.bool).tril()
        i = torch.arange(t, dtype=torch.float32)
        mask = torch.zeros(t, t).masked_fill(~band, -math.inf) + self.bias * band * i[:, None] * i[None, :]  # not ALiBi
        y = F.scaled_dot_product_attention(q, k, v, mask, self.dropout, False, scale=0.3)
        return self.o(y.transpose(1, 2).reshape(b, t, 16))


def test_fused_call_reads_positional_arguments_and_float_masks() -> None:
    g = record(_Attn(), torch.randn(1, 6, 16))
    (call,) = [c for n in g.nodes if (c := fused_call(g, n)) is not None]
    assert call.scale == 0.3 and not call.causal and call.dropout == 0.0
    assert torch.equal(call.mask(6, 6), torch.ones(6, 6, dtype=torch.bool).tril())
    assert call.bias is not None and not bool(call.bias.any())  # -inf masks; the allowed entries add nothing


def test_an_additive_bias_in_an_sdpa_mask_is_refused_by_name() -> None:
    from normatlas.inspect.attention import find_cores
    from normatlas.port.measure import scores_of

    g = record(_Attn(bias=0.5), torch.randn(1, 6, 16))
    (core,) = find_cores(g, [], 1, set(), 0)
    with pytest.raises(PortError, match="additive bias on the attention scores"):
        scores_of(g, core, 0)


def test_sdpa_dropout_is_refused_by_name() -> None:
    from normatlas.inspect.attention import find_cores
    from normatlas.port.measure import scores_of

    g = record(_Attn(dropout=0.1), torch.randn(1, 6, 16))
    (core,) = find_cores(g, [], 1, set(), 0)
    with pytest.raises(PortError, match=r"dropout_p=0.1 \(put the model in eval mode\)"):
        scores_of(g, core, 0)


def test_inspector_reads_the_same_design_whatever_the_attention() -> None:
    rows = []
    for impl in ("eager", "sdpa", "flex_attention"):
        hf = tiny_model("olmo3", attn_implementation=impl, **_DEC, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        r = inspect_model(hf, {"input_ids": _ids(t=8)}, probe=False)
        rows.append((r.placement.value, r.qk_norm.value, r.qk_norm_rope.value, r.operator.value))
    assert rows[0] == rows[1] == rows[2] == ("res-post", "flattened", "before-rope", "rmsnorm")


def test_monitor_attention_entropy_is_the_same_for_eager_sdpa_and_flex() -> None:
    from normatlas.diagnostics import Monitor

    entropies = []
    for impl in ("eager", "sdpa", "flex_attention"):
        hf = tiny_model("llama", attn_implementation=impl, seed=3, **_DEC)
        randomise_(hf, 0.3, generator=torch.Generator().manual_seed(4))  # peaked maps, not near-uniform ones
        mon = Monitor(hf, every=1)
        with torch.no_grad():
            out = hf(input_ids=_ids(t=8), labels=_ids(t=8))
        mon.step(loss=out.loss)
        rec = mon.history.records[-1]
        entropies.append([v for k, v in sorted(rec.items()) if k.startswith("attention/entropy/L") and "/h" in k])
    assert len(entropies[0]) == 8  # 2 layers x 4 heads
    assert min(entropies[0]) < 0.8 * math.log(8)  # the test can tell maps apart
    torch.testing.assert_close(torch.tensor(entropies[1]), torch.tensor(entropies[0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(entropies[2]), torch.tensor(entropies[0]), atol=1e-5, rtol=0)


def test_builds_follow_transformers_default_unless_chosen() -> None:
    model, _, _ = build_target("llama")
    assert model.config._attn_implementation == "sdpa"
    with attention_implementation("eager"):
        assert build_target("llama")[0].config._attn_implementation == "eager"
    assert build_target("llama", attn_implementation="flex_attention")[0].config._attn_implementation == (
        "flex_attention"
    )
    with pytest.raises(ValueError, match=r"attn_implementation='flash' is not one of eager, sdpa, flex_attention"):
        build_target("llama", attn_implementation="flash")


def test_cli_port_check_on_a_checkpoint_loaded_with_defaults(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    randomise_(tiny_model("qwen2", **_DEC), 0.1).save_pretrained(tmp_path, safe_serialization=True)
    for extra in ([], ["--attn-implementation", "eager"]):
        assert main(["port", str(tmp_path), "--check", "--format", "json", *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        check = {r["compared"]: r for r in doc["check"]}
        assert check["logits"]["max_abs_diff"] <= 1e-5 and check["gradients"]["max_rel_diff"] <= 1e-5
    with pytest.raises(SystemExit) as exit_:  # argparse's own usage error
        main(["port", "llama", "--attn-implementation", "flash"])
    assert exit_.value.code == 2
    assert "is not one of eager, sdpa, flex_attention" in capsys.readouterr().err
