"""Misread classes found on held-out models (issue 31), each on a hand-written model that shows it and, where one
does, the transformers type it was found on (built tiny from its config: the originals are thousands wide).

* A token mixer without attention (an SSM's causal conv and scan) is a ``mixer`` branch, and beside attention at
  one add an ``attention+mixer`` sublayer, never an MLP (Mamba, Falcon-H1).
* Derived SSM widths the shrink breaks (``heads x head_dim = expand x hidden``) are refitted so the tiny model runs
  (Mamba 2, Bamba, Zamba 2); a field the model reads from a sub-config is filled from its parent (DBRX).
* A norm without a gain says ``none`` as its gain convention, in the report, its JSON, its table rows.
* One norm module run before the layers and again as the final norm is both the embedding and the final norm.
* Layer 0 without a pre-norm of its own, fed by the embedding norm, keeps the other layers' placement (a note).
* Vision model types read from ``inspect`` without ``--vision``; the web API answers a model that does not build
  with a 422 naming the failure.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normatlas.inspect as inspect_pkg
from normatlas.cli import main
from normatlas.factory import build_target, example_inputs
from normatlas.factory.fit import build_filling, product_fixes
from normatlas.inspect import VisionReport, inspect_model, inspect_target
from normatlas.vocabulary import Operator, PlacementKind, SiteRole, SublayerKind

D, V, T = 16, 32, 8


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class RMS(nn.Module):
    def __init__(self, n: int, gain: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * self.w if self.w is not None else y


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o((q @ k.transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ v)


class Mixer(nn.Module):
    """A tiny SSM-like mixer: a causal depthwise conv over time, then a running (cumulative) sum; no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.conv, self.out = nn.Linear(D, D), nn.Conv1d(D, D, 3, groups=D, padding=2), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.inp(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.out(F.silu(h).cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


class HybridLayer(nn.Module):
    """``parallel``: x + attn(N(x)) + mixer(N(x)) (Falcon-H1, Hymba); else x + mixer(N(x)); then x + mlp(N(x))."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.n1, self.n2, self.mixer, self.mlp = RMS(D), RMS(D), Mixer(), mlp()
        self.attn = Attn() if parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        x = x + self.mixer(h) + (self.attn(h) if self.attn is not None else 0)
        return x + self.mlp(self.n2(x))


class Layer(nn.Module):
    """Pre-LN attention + MLP; without ``own_pre`` the attention reads the stream itself (no norm of its own)."""

    def __init__(self, n1: nn.Module | None, n2: nn.Module) -> None:
        super().__init__()
        self.n1, self.n2, self.attn, self.mlp = n1, n2, Attn(), mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x) if self.n1 is not None else x)
        return x + self.mlp(self.n2(x))


class LM(nn.Module):
    """Embedding, an optional embedding norm, layers, a final norm (``final``: the module, possibly the embedding
    norm itself, run a second time), a head."""

    def __init__(self, layers: list[nn.Module], emb_norm: nn.Module | None, final: nn.Module) -> None:
        super().__init__()
        self.emb, self.emb_norm, self.final = nn.Embedding(V, D), emb_norm, final
        self.layers, self.head = nn.ModuleList(layers), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = self.emb_norm(x) if self.emb_norm is not None else x
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final(x))


def ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(0)),)


def read(model: nn.Module) -> Any:
    torch.manual_seed(0)
    return inspect_model(model, ids())


# ----------------------------------------------------------------------------- 1. a mixer is not an MLP
@pytest.mark.parametrize("parallel", [True, False])
def test_a_token_mixer_is_its_own_branch_kind(parallel: bool) -> None:
    torch.manual_seed(0)
    rep = read(LM([HybridLayer(parallel) for _ in range(2)], None, RMS(D)))
    first = SublayerKind.ATTENTION_MIXER if parallel else SublayerKind.MIXER
    assert [s.kind for s in rep.sublayers] == [first, SublayerKind.MLP] * 2
    assert rep.placement_mlp.value == "pre"
    assert rep.placement_mixer.value == ("n/a" if parallel else "pre")
    assert rep.placement is (PlacementKind.MIX if parallel else PlacementKind.PRE)  # parallel mixer, then Pre-LN MLP


def test_an_mlp_with_a_cumulative_op_off_the_stream_path_stays_an_mlp() -> None:
    """Only ops fed by the sublayer's stream mix tokens: a cumsum over positions computed from nothing the stream
    feeds (a position table) leaves an MLP an MLP."""

    class PosMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f, self.table = mlp(), nn.Parameter(torch.randn(T, D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.f(x) * self.table.cumsum(0)

    class L(Layer):
        def __init__(self) -> None:
            super().__init__(RMS(D), RMS(D))
            self.mlp = PosMLP()

    rep = read(LM([L(), L()], None, RMS(D)))
    assert [s.kind for s in rep.sublayers] == [SublayerKind.ATTENTION, SublayerKind.MLP] * 2


@pytest.mark.parametrize(
    ("model_type", "kinds"),
    [("mamba", [SublayerKind.MIXER]), ("falcon_h1", [SublayerKind.ATTENTION_MIXER, SublayerKind.MLP])],
)
def test_transformers_ssm_mixers_read_as_mixers(model_type: str, kinds: list[SublayerKind]) -> None:
    rep = inspect_target(model_type, probe=False)
    assert [s.kind for s in rep.sublayers if s.layer == 0] == kinds


# ----------------------------------------------------------------------------- 2. derived SSM widths
class _Cfg:
    """A config-like object: fields as attributes, ``to_dict`` as a config has it."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def test_product_fixes_refit_heads_times_head_dim_to_expand_times_hidden() -> None:
    # Mamba 2's defaults (heads 128 x head_dim 64 = expand 2 x hidden 4096; 8 groups), shrunk to width 64, head 16
    before = {"hidden_size": 4096, "num_heads": 128, "head_dim": 64, "expand": 2, "n_groups": 8, "state_size": 128}
    shrunk = _Cfg(**(before | {"hidden_size": 64, "head_dim": 16}))
    fixes = product_fixes(shrunk, before, {"hidden_size", "head_dim"})
    assert fixes[0] == {"num_heads": 8}  # 8 x 16 = 2 x 64, and 8 groups still divide 8 heads
    assert not product_fixes(_Cfg(**before), before, set())  # nothing shrunk: nothing to refit


@pytest.mark.parametrize("model_type", ["mamba2", "bamba", "zamba2"])
def test_tiny_ssm_models_build_and_run(model_type: str) -> None:
    model, _, _ = build_target(model_type)
    with torch.no_grad():
        out = model(**example_inputs(model))
    assert torch.isfinite(out.logits).all()


def test_a_sub_config_field_the_model_reads_is_filled_from_its_parent() -> None:
    """transformers' default ``DbrxConfig()`` keeps ``rope_theta`` in ``rope_parameters``; its attention reads
    ``attn_config.rope_theta``."""
    from normatlas.factory import model_from_config, tiny_config

    cfg = tiny_config("dbrx")
    assert not hasattr(cfg.attn_config, "rope_theta")
    model = build_filling(cfg, model_from_config)
    assert cfg.attn_config.rope_theta == cfg.rope_parameters["rope_theta"]
    assert sum(p.numel() for p in model.parameters()) > 0


def test_build_filling_reraises_what_no_config_holds() -> None:
    def build(_: Any) -> None:
        raise AttributeError("no such thing", name="nowhere", obj=object())

    with pytest.raises(AttributeError, match="no such thing"):
        build_filling(_Cfg(), build)


# ----------------------------------------------------------------------------- 3. no gain says none
def test_a_norm_without_gain_says_none_everywhere() -> None:
    torch.manual_seed(0)
    rep = read(LM([Layer(RMS(D, False), RMS(D, False)) for _ in range(2)], None, RMS(D, False)))
    assert rep.operator is Operator.RMSNORM and rep.gain_convention is None  # typed: no gain
    doc = json.loads(json.dumps(rep.to_dict()))
    assert doc["gain_convention"] == "none"
    assert {n["gain_convention"] for n in doc["norms"]} == {"none"}
    assert rep.summary_row()["gain_convention"] == "none"


def test_a_norm_with_gain_keeps_its_convention() -> None:
    rep = read(LM([Layer(RMS(D), RMS(D)) for _ in range(2)], None, RMS(D)))
    assert rep.to_dict()["gain_convention"] == "w"


# ----------------------------------------------------------------------------- 4. one module, run twice
@pytest.mark.parametrize("shared_layers", [False, True])
def test_one_norm_module_before_the_layers_and_as_the_final_norm(shared_layers: bool) -> None:
    torch.manual_seed(0)
    norm = RMS(D)
    layers = [Layer(norm if shared_layers else RMS(D), norm if shared_layers else RMS(D)) for _ in range(2)]
    rep = read(LM(layers, norm, norm))
    assert rep.embedding_norm is Operator.RMSNORM and rep.final_norm is Operator.RMSNORM
    roles = [n.role for n in rep.norms]
    assert roles[0] is SiteRole.EMBEDDING and roles[-1] is SiteRole.FINAL
    assert rep.norms[0].module == rep.norms[-1].module  # the same module object, read as two sites
    assert rep.placement is PlacementKind.PRE


# ----------------------------------------------------------------------------- 7. layer 0 fed by the embedding norm
def test_layer0_fed_by_the_embedding_norm_keeps_the_scheme_of_the_other_layers() -> None:
    torch.manual_seed(0)
    rep = read(LM([Layer(None, RMS(D)), Layer(RMS(D), RMS(D))], RMS(D), RMS(D)))
    assert rep.placement is PlacementKind.PRE and rep.placement_attention.value == "pre"
    assert rep.embedding_norm_as_pre and rep.embedding_norm is Operator.RMSNORM
    assert rep.sublayers[0].placement is PlacementKind.NONE  # the per-sublayer record keeps what the graph shows
    assert any("embedding norm feeds it" in n for n in rep.notes)


def test_layer0_without_norm_and_no_embedding_norm_is_still_a_mix() -> None:
    rep = read(LM([Layer(None, RMS(D)), Layer(RMS(D), RMS(D))], None, RMS(D)))
    assert rep.placement is PlacementKind.MIX and not rep.embedding_norm_as_pre


# ----------------------------------------------------------------------------- 8. vision types from inspect, the web
@pytest.mark.parametrize("model_type", ["vit", "clip_vision_model", "convnext", "bit", "swinv2"])
def test_vision_model_types_read_without_the_vision_flag(model_type: str) -> None:
    rep = inspect_target(model_type, probe=False)
    assert isinstance(rep, VisionReport) and rep.operator is not Operator.NONE
    assert rep.placement is not PlacementKind.UNKNOWN


def test_cli_inspect_routes_a_vision_type(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "vit", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == 17 and doc["final_norm"] == "layernorm"


def test_web_inspect_answers_a_build_failure_with_422(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from normatlas.web.inspect_api import Unreadable, run_target

    def broken(target: str, **_: Any) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(inspect_pkg, "inspect_target", broken)
    with pytest.raises(Unreadable, match="cannot build or inspect swinv2: IndexError"):
        run_target("swinv2")


def test_web_server_maps_unreadable_to_422_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from tests.web_helpers import running

    from .test_web_api import call

    def broken(target: str, **_: Any) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(inspect_pkg, "inspect_target", broken)
    with running(tmp_path, None) as srv:  # the inspection is a job: it fails with the status a 422 would carry
        doc = call(srv, "POST", "/api/inspect", {"model_type": "swinv2"})[2]
        while doc["state"] not in ("done", "failed"):
            doc = call(srv, "GET", f"/api/inspect/job/{doc['job']}")[2]
    assert doc["state"] == "failed" and doc["status"] == 422 and "IndexError" in doc["error"]
