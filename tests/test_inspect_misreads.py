"""Inspector misreads found on held-out architectures, each on the smallest model that shows it.

* RoPE in some layers only (Llama 4 / SmolLM3 ``no_rope_layers``): a NoPE layer's QK-norm input has the
  rotation of an earlier layer among its ancestors, through the residual stream; it is not after-RoPE.
* Layers that differ in RoPE order: the summary names the mix instead of ``n/a``.
* A per-layer scalar buffer multiplying the stream after each layer's last residual add: the final norm reads
  that product, and is still the final norm.
* Nested MoE / FFN sizes: the tiny config shrinks every sub-config and expert size with the rest.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from normatlas.inspect import InspectionReport, inspect_model
from normatlas.vocabulary import Operator, PlacementKind, QKNormKind, RopeOrder, SiteRole, SublayerKind

from .test_inspect_designs import rope  # the one hand-written RoPE of the toy designs

D, H, V, T = 32, 4, 50, 6
HD = D // H


class RMS(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Attn(nn.Module):
    """Per-head QK-norm in every layer; RoPE (``order``: ``before`` / ``after`` the norm) or none (``nope``)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.qn, self.kn, self.order = RMS(HD), RMS(HD), order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, H, HD).transpose(1, 2) for z in (self.q(x), self.k(x), self.v(x)))
        if self.order == "after":
            q, k = rope(q), rope(k)
        q, k = self.qn(q), self.kn(k)
        if self.order == "before":
            q, k = rope(q), rope(k)
        a = (q @ k.transpose(-1, -2) / math.sqrt(HD)).softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, D))


class Layer(nn.Module):
    """Pre-LN attention + MLP; with ``scalar`` the layer ends in ``h * layer_scalar`` (a one-element buffer)."""

    def __init__(self, order: str, scalar: float | None = None) -> None:
        super().__init__()
        self.attn, self.n1, self.n2 = Attn(order), RMS(D), RMS(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.scaled = scalar is not None
        self.register_buffer("layer_scalar", torch.tensor([scalar if scalar is not None else 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.n1(x))
        h = h + self.mlp(self.n2(h))
        return h * self.layer_scalar if self.scaled else h


class Toy(nn.Module):
    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.emb, self.layers = nn.Embedding(V, D), nn.ModuleList(layers)
        self.final, self.head = RMS(D), nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final(x))


def read(*layers: Layer) -> InspectionReport:
    torch.manual_seed(0)
    model = Toy(list(layers)).eval()
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    return inspect_model(model, (ids,), name="toy")


ORDER = {"after": RopeOrder.AFTER_ROPE, "before": RopeOrder.BEFORE_ROPE, "nope": RopeOrder.NO_ROPE}


@pytest.mark.parametrize(
    "orders",
    [
        ("after", "nope", "after", "nope"),  # Llama 4: QK-norm after RoPE, every fourth layer NoPE
        ("before", "nope", "before", "nope"),  # Qwen 3 / OLMo 2 order, SmolLM3's NoPE schedule
        ("nope", "after", "nope", "before"),
    ],
)
def test_nope_layer_is_not_after_rope_through_the_stream(orders: tuple[str, ...]) -> None:
    """A NoPE layer's QK-norm input descends from an earlier layer's rotation (through the residual stream);
    it was read after-RoPE. RoPE is looked for only between the projection and the norm."""
    rep = read(*(Layer(o) for o in orders))
    assert [a.layer for a in rep.attention] == list(range(len(orders)))
    assert [a.qk_norm for a in rep.attention] == [QKNormKind.PER_HEAD] * len(orders)
    assert [a.qk_norm_rope for a in rep.attention] == [ORDER[o] for o in orders]


@pytest.mark.parametrize(
    ("orders", "want"),
    [
        (("after", "nope"), RopeOrder.MIXED),
        (("before", "after"), RopeOrder.MIXED),
        (("before", "before"), RopeOrder.BEFORE_ROPE),
        (("nope", "nope"), RopeOrder.NO_ROPE),
    ],
)
def test_rope_order_summary_names_the_mix(orders: tuple[str, ...], want: RopeOrder) -> None:
    """Layers that differ in RoPE order: the summary says ``mixed``, not ``n/a``."""
    rep = read(*(Layer(o) for o in orders))
    assert rep.qk_norm_rope is want
    assert rep.summary_row()["qk_norm_rope"] == want.value


def test_final_norm_after_a_per_layer_scalar_buffer() -> None:
    """Every layer ends in ``h * layer_scalar`` (a registered one-element buffer) after its last residual add; the
    final norm reads that product, not the add, and is still the final norm (looked up through the scaling)."""
    rep = read(*(Layer("before", scalar=0.5) for _ in range(2)))
    assert rep.final_norm is Operator.RMSNORM
    assert rep.placement is PlacementKind.PRE
    assert [s.kind for s in rep.sublayers] == [SublayerKind.ATTENTION, SublayerKind.MLP] * 2
    assert [n.role for n in rep.norms].count(SiteRole.FINAL) == 1
    assert [n.role for n in rep.norms].count(SiteRole.PRE) == 4


def test_scalar_buffer_is_a_constant_not_a_learned_gain() -> None:
    """The buffer is read as a constant: it does not turn the final norm into the last sublayer's post-norm."""
    rep = read(Layer("before", scalar=2.0), Layer("before", scalar=2.0))
    assert all(not s.post for s in rep.sublayers)
    final = [n for n in rep.norms if n.role is SiteRole.FINAL]
    assert len(final) == 1 and final[0].layer is None


def _tiny(mt: str):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from normatlas.factory import tiny_config

    if mt not in CONFIG_MAPPING:
        pytest.skip(f"no {mt} in this transformers")
    return tiny_config(mt)


def test_dory_sections_shrink_with_the_stack() -> None:
    """Dory (36 layers: 8 input, 20 recurrent, 8 output) ran its 2 tiny layers twice with the sections left at
    8 / 20 / 8, and its config's own check refused it; the sections are cut with the depth, one layer each."""
    cfg = _tiny("dory")
    sections = (cfg.n_input_layers, cfg.n_recurrent_layers, cfg.n_output_layers)
    assert cfg.num_hidden_layers == 3 and sections == (1, 1, 1) and len(cfg.layer_types) == 3
    cfg.validate_architecture()


def test_dory_final_norm_is_found() -> None:
    """DoryModel.forward ends in ``self.norm(hidden_states)`` (an L2 norm) after the last layer, whose layers each
    begin by normalizing the stream (``input_layernorm``): the last norm is that layer's post-norm and the final
    norm; it was read as the post-norm only (final norm ``none``)."""
    from normatlas.factory import model_from_config

    rep = inspect_model(model_from_config(_tiny("dory")), name="dory")
    assert rep.operator is Operator.L2 and rep.final_norm is Operator.L2
    final = [n for n in rep.norms if n.role is SiteRole.FINAL]
    assert len(final) == 1 and final[0].index in rep.sublayers[-1].post
    assert rep.qk_norm is QKNormKind.PER_HEAD and rep.qk_norm_rope is RopeOrder.BEFORE_ROPE


def test_nested_expert_config_shrinks_with_the_model() -> None:
    """DBRX keeps its experts in a nested ``ffn_config`` whose ``hidden_size`` must mirror the model's (6144 / 10752
    in the 132B model): it stayed at the default width beside a 64-wide model. A sub-config of the model's width
    with no layer stack of its own is part of each layer and shrinks with it; a tower of its own keeps its sizes."""
    cfg = _tiny("dbrx")
    ffn = cfg.ffn_config
    assert (cfg.hidden_size, ffn.hidden_size, ffn.ffn_hidden_size, ffn.moe_num_experts) == (64, 64, 128, 4)


def test_depth_behind_a_property_is_shrunk() -> None:
    """LongCat-Flash derives ``num_hidden_layers`` (two attention sublayers per layer) from ``num_layers`` through a
    property with a setter, absent from ``to_dict``: the tiny model kept all 28 MoE layers (33 M parameters, past
    the sweep's time limit once traced). The property is set like any size."""
    from normatlas.factory import model_from_config

    cfg = _tiny("longcat_flash")
    assert (cfg.num_layers, cfg.num_hidden_layers, cfg.n_routed_experts) == (1, 2, 4)
    model = model_from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_towers_keep_their_sizes() -> None:
    """GIT's vision tower has the text model's width (768) but a layer stack of its own: not shrunk as a part."""
    cfg = _tiny("git")
    assert cfg.hidden_size == 64 and cfg.vision_config.hidden_size == 768


@pytest.mark.parametrize(
    ("mt", "placement"),
    [
        # Gemma4TextDecoderLayer ends in ``hidden_states *= self.layer_scalar`` (a one-element buffer), then
        # Gemma4TextModel.norm
        ("gemma4_text", PlacementKind.MIX),
        # MiniMaxDecoderLayer normalizes the stream first (its post-norms are the next layer's), MiniMaxModel.norm last
        ("minimax", PlacementKind.POST),
    ],
)
def test_final_norm_of_held_out_models(mt: str, placement: PlacementKind) -> None:
    from normatlas.factory import model_from_config

    rep = inspect_model(model_from_config(_tiny(mt)), name=mt)
    assert rep.final_norm is Operator.RMSNORM and rep.placement is placement
