"""Absorbing post-branch RMSNorms with a frozen statistic (issue 33; :mod:`normatlas.surgery.absorb`).

The exact claim: in float64 the absorbed model equals the frozen-statistic model (each post-branch norm dividing by
its calibration mean rms) to ~1e-12. Against the original it is an approximation, measured, never asserted equal.
Models: OLMo 2 (post-branch norms, gain ``w``) and Gemma 2 (peri-norm, gain ``1 + w``) shrunk to 2 layers, width 32
(OLMo-2-1B: 16 layers, width 2048; Gemma-2-2B: 26 layers, width 2304), random weights, built offline from config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from normatlas.cli import main  # noqa: E402
from normatlas.inspect import inspect_model  # noqa: E402
from normatlas.spec import GainConvention  # noqa: E402
from normatlas.surgery import MANIFEST, absorb_post_norms, approximation, load_transformed, run_checks  # noqa: E402
from normatlas.surgery.verify import compare, model_output  # noqa: E402
from normatlas.vocabulary import SiteRole  # noqa: E402

SIZES = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
NO_SPECIAL = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "initializer_range": 0.1}


def _perturbed(model: nn.Module, seed: int) -> nn.Module:
    """Random gains (``w`` away from 1, ``1 + w`` away from 1), so the gain convention matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def olmo2(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Olmo2Config(**SIZES, **NO_SPECIAL)
    return _perturbed(transformers.Olmo2ForCausalLM(config).to(dtype), 1)


def gemma2(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**SIZES, head_dim=8, **NO_SPECIAL)
    return _perturbed(transformers.Gemma2ForCausalLM(config).to(dtype), 2)


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, **NO_SPECIAL)).double().eval()


def ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


PROBE = {"input_ids": ids(2, 12, 0)}
CALIBRATION = [{"input_ids": ids(4, 24, 1)}, {"input_ids": ids(1, 17, 2)}]
BUILDERS = {"olmo2": olmo2, "gemma2": gemma2}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_absorbed_equals_the_frozen_statistic_model_in_float64(name: str) -> None:
    model = BUILDERS[name]()
    surgery = absorb_post_norms(model, PROBE, CALIBRATION)
    outs = [n.module for n in inspect_model(model, PROBE).norms if n.role is SiteRole.OUT]
    assert [s.norm for s in surgery.stats] == outs and len(outs) == 4
    assert not surgery.refusals and not surgery.stock_equivalent
    runtime, reference = surgery.runtime(), surgery.reference(model)
    for x in (PROBE, {"input_ids": ids(3, 31, 7)}):
        got, _ = model_output(runtime, x)
        want, _ = model_output(reference, x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    run_checks(reference, surgery, PROBE)
    assert surgery.passed and all(c.max_rel <= 1e-12 for c in surgery.checks if c.dtype == "float64")
    assert all(s.tokens == 4 * 24 + 17 for s in surgery.stats)
    original = [p for n, p in model.named_parameters() if "layers" in n]
    assert all(torch.isfinite(p).all() for p in original)  # the input model is not modified
    torch.testing.assert_close(model_output(model, PROBE)[0], model_output(BUILDERS[name](), PROBE)[0])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_the_frozen_scale_is_the_measured_gain_over_the_mean_rms(name: str) -> None:
    """``scale * r`` is ``w`` (OLMo 2) or ``1 + w`` (Gemma 2, the inspector's typed gain convention), and ``r`` is
    the mean over calibration tokens of ``sqrt(mean(y^2) + eps)``, the divisor each norm computed."""
    model = BUILDERS[name]()
    conv = {n.module: n.gain_convention for n in inspect_model(model, PROBE).norms if n.role is SiteRole.OUT}
    assert set(conv.values()) == {GainConvention.ONE_PLUS_W if name == "gemma2" else GainConvention.W}
    surgery = absorb_post_norms(model, PROBE, CALIBRATION)
    seen: dict[str, list[torch.Tensor]] = {s.norm: [] for s in surgery.stats}
    hooks = []
    for s in surgery.stats:
        module = model.get_submodule(s.norm)
        eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 0.0)))

        def hook(_: nn.Module, args: tuple, __: torch.Tensor, name: str = s.norm, eps: float = eps) -> None:
            seen[name].append(torch.sqrt(args[0].double().pow(2).mean(-1) + eps).flatten())

        hooks.append(module.register_forward_hook(hook))
    for x in CALIBRATION:
        model_output(model, x)
    for h in hooks:
        h.remove()
    for s in surgery.stats:
        d = torch.cat(seen[s.norm])
        assert s.rms == pytest.approx(float(d.mean()), rel=1e-6)  # the norms compute in float32 inside
        assert s.cv == pytest.approx(
            float(d.std(unbiased=False) / d.mean()), rel=1e-3, abs=1e-6
        )  # d measured at float32 precision
        w = getattr(model.get_submodule(s.norm), "weight").detach().double()  # noqa: B009
        m = w + 1 if conv[s.norm] is GainConvention.ONE_PLUS_W else w
        torch.testing.assert_close(surgery.scales[s.norm] * s.rms, m, rtol=1e-12, atol=1e-12)


def test_against_the_original_it_is_an_approximation_and_says_how_far() -> None:
    model = gemma2()
    surgery = absorb_post_norms(model, PROBE, CALIBRATION)
    held = ids(2, 40, 9)
    a = approximation(model, surgery.runtime(), held)
    assert a["max_logit_diff"] > 1e-6  # not exact: tokens' own rms differ from the frozen one
    assert all(s.cv > 0 for s in surgery.stats)
    assert a["loss_change"] == pytest.approx(a["loss_after"] - a["loss_before"])
    ref = model_output(model, {"input_ids": held})[0]
    assert a["loss_before"] == pytest.approx(float(F.cross_entropy(ref[:, :-1].flatten(0, 1), held[:, 1:].flatten())))
    with pytest.raises(TypeError, match="ids must be an int64 tensor"):
        approximation(model, surgery.runtime(), held.float())


def test_a_model_without_post_norms_absorbs_nothing() -> None:
    surgery = absorb_post_norms(llama(), PROBE, CALIBRATION)
    assert not surgery.changed and not surgery.stats and not surgery.refusals
    assert "no norm on a sublayer's branch output" in surgery.notes[0]


# ----------------------------------------------------------------------------- refusals, on toy residual stacks
class BiasRMS(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.bias = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight + self.bias


class Branch(nn.Module):
    def __init__(self, dim: int, norm: nn.Module, after: str) -> None:
        super().__init__()
        self.up, self.down, self.norm, self.after = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), norm, after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(x)))
        if self.after == "gelu":  # the branch's last op is not the linear layer
            h = F.gelu(h)
        return self.norm(h)


class Toy(nn.Module):
    """Embedding, two residual blocks ``x + norm(branch(x))``, a final RMSNorm and a head."""

    def __init__(self, norm: str = "rms", after: str = "", tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        dim = 16
        make = {"rms": lambda: nn.RMSNorm(dim), "ln": lambda: nn.LayerNorm(dim), "bias": lambda: BiasRMS(dim)}[norm]
        self.emb = nn.Embedding(SIZES["vocab_size"], dim)
        blocks = [Branch(dim, make(), after) for _ in range(2)]
        if tie:
            blocks[1].down.weight = blocks[0].down.weight
        self.blocks = nn.ModuleList(blocks)
        self.final, self.head = nn.RMSNorm(dim), nn.Linear(dim, SIZES["vocab_size"], bias=False)
        self.double().eval()
        with torch.no_grad():
            for b in self.blocks:
                gain: Any = getattr(b, "norm").weight  # noqa: B009 - a Module attribute, typed Any
                if gain is not None:
                    gain.add_(0.2 * torch.randn_like(gain))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(self.final(x))


def test_a_toy_stack_absorbs_exactly_with_biased_linears() -> None:
    model = Toy()
    surgery = absorb_post_norms(model, PROBE, CALIBRATION)
    assert [s.linear for s in surgery.stats] == ["blocks.0.down", "blocks.1.down"]
    got, want = model_output(surgery.runtime(), PROBE)[0], model_output(surgery.reference(model), PROBE)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    check = compare(surgery.reference(model), surgery.runtime(), PROBE, torch.float64)
    assert check.max_rel <= 1e-12


@pytest.mark.parametrize(
    ("toy", "reason"),
    [
        (lambda: Toy(norm="ln"), "operator layernorm: it subtracts the mean"),
        (lambda: Toy(norm="bias"), "it has a bias"),
        (lambda: Toy(after="gelu"), "not a linear layer"),
        (lambda: Toy(tie=True), "is shared with"),
    ],
    ids=["layernorm", "bias", "not-linear", "tied"],
)
def test_refusals_name_the_module_and_the_reason(toy, reason: str) -> None:
    model = toy()
    with pytest.raises(ValueError, match=r"blocks\.0\.norm: .*" + reason.split(":")[0]) as err:
        absorb_post_norms(model, PROBE, CALIBRATION)
    assert reason in str(err.value) and "strict=False" in str(err.value)
    surgery = absorb_post_norms(model, PROBE, CALIBRATION, strict=False)
    assert [r.target for r in surgery.refusals] == ["blocks.0.norm", "blocks.1.norm"]
    assert all(reason in r.reason for r in surgery.refusals) and not surgery.changed


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"calibration_inputs=\[\] is empty"):
        absorb_post_norms(Toy(), PROBE, [])
    with pytest.raises(TypeError, match="strict=1 must be a bool"):
        absorb_post_norms(Toy(), PROBE, CALIBRATION, strict=1)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the command
def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))}


def _checkpoint(model: Any, path: Path) -> Path:
    from normatlas.tools.zoo import byte_tokenizer

    model.float().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(olmo2(), tmp_path_factory.mktemp("absorb") / "olmo2")


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_cli_dry_run_then_write_leaves_the_input_untouched(olmo2_dir: Path, tmp_path: Path, capsys) -> None:
    before = _digest(olmo2_dir)
    assert run(["absorb", str(olmo2_dir), "--dry-run", "--windows", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["result"] == "verified" and doc["written"] is False
    assert len(doc["calibration"]) == 4 and doc["approximation"][0]["tokens"] == 2 * 64
    assert all(c["passed"] for c in doc["checks"])
    out = tmp_path / "absorbed"
    argv = ["absorb", str(olmo2_dir), str(out), "--windows", "2", "--calibration-text", "def f(x):\n    return x\n"]
    assert run([*argv, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["written"] is True and doc["calibration"][0]["tokens"] == len("def f(x):\n    return x\n")
    assert _digest(olmo2_dir) == before
    assert not [p for p in tmp_path.iterdir() if p.name != "absorbed"]  # no temporary folder left
    _, runtime, manifest = load_transformed(out)
    assert all(isinstance(runtime.get_submodule(c["norm"]), nn.Identity) for c in manifest["calibration"])
    assert manifest["transform"] == "absorb" and manifest["stock_equivalent"] is False
    assert len(manifest["calibration"]) == 4 and "loss_change" in manifest["approximation"]
    assert [s["kind"] for s in manifest["swaps"]] == ["identity"] * 4
    assert (out / "tokenizer.json").is_file() and (out / MANIFEST).is_file()


def test_cli_on_a_model_without_post_norms_exits_3(tmp_path: Path, capsys) -> None:
    ckpt = _checkpoint(llama(), tmp_path / "llama")
    out = tmp_path / "out"
    assert run(["absorb", str(ckpt), str(out), "--windows", "1"]) == 3
    assert "nothing to change" in capsys.readouterr().out and not out.exists()
