"""Encoder-decoders read as two stacks, and a vision tower's patch-embedding norm around its position add (issue 31).

Hand-written encoder-decoders whose design is known (Pre-LN and Post-LN, with and without final and embedding
norms, stacks of one length and of two) are read field by field; transformers' T5, BART, mBART, Marian, Pegasus,
Whisper and T5Gemma are built tiny and checked against their modeling files; a patch-embedding norm is the
embedding norm whether the position embedding (and a CLS token) joins the patches before it or after it.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from normatlas.inspect import inspect_model, inspect_target, inspect_vision
from normatlas.inspect.sweep import ENCODER_DECODER_COLUMNS, encoder_decoder_counts, encoder_decoder_model_types
from normatlas.vocabulary import Operator, PlacementKind, SiteRole, SublayerKind

D, V = 32, 50


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        src = x if memory is None else memory  # cross-attention: keys and values from the encoder's output
        scores = self.q(x) @ self.k(src).transpose(-1, -2) / math.sqrt(D)
        return self.o(torch.softmax(scores, -1) @ self.v(src))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _norm(rms: bool) -> nn.Module:
    return nn.RMSNorm(D, eps=1e-6) if rms else nn.LayerNorm(D)


class _Layer(nn.Module):
    """Self-attention, optionally cross-attention, then an MLP; each sublayer Pre-LN or Post-LN."""

    def __init__(self, pre: bool, cross: bool, rms: bool) -> None:
        super().__init__()
        self.pre = pre
        self.branches = nn.ModuleList([_Attention(), *([_Attention()] if cross else []), _MLP()])
        self.norms = nn.ModuleList(_norm(rms) for _ in self.branches)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        for i, (branch, norm) in enumerate(zip(self.branches, self.norms, strict=True)):
            cross = i == 1 and len(self.branches) == 3

            def f(h: torch.Tensor, branch: nn.Module = branch, cross: bool = cross) -> torch.Tensor:
                return branch(h, memory) if cross else branch(h)

            x = x + f(norm(x)) if self.pre else norm(x + f(x))
        return x


class _EncoderDecoder(nn.Module):
    """A token encoder-decoder: ``(input_ids, decoder_input_ids) -> logits``."""

    def __init__(self, pre: bool, final: bool, embedding_norm: bool, rms: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.enc_embed, self.dec_embed = nn.Embedding(V, D), nn.Embedding(V, D)
        self.enc_pos, self.dec_pos = nn.Parameter(torch.randn(16, D)), nn.Parameter(torch.randn(16, D))
        self.encoder = nn.ModuleList(_Layer(pre, False, rms) for _ in range(layers))
        self.decoder = nn.ModuleList(_Layer(pre, True, rms) for _ in range(layers))
        self.enc_in = _norm(rms) if embedding_norm else nn.Identity()
        self.dec_in = _norm(rms) if embedding_norm else nn.Identity()
        self.enc_out = _norm(rms) if final else nn.Identity()
        self.dec_out = _norm(rms) if final else nn.Identity()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        x = self.enc_in(self.enc_embed(input_ids) + self.enc_pos[: input_ids.shape[1]])
        for layer in self.encoder:
            x = layer(x)
        memory = self.enc_out(x)
        y = self.dec_in(self.dec_embed(decoder_input_ids) + self.dec_pos[: decoder_input_ids.shape[1]])
        for layer in self.decoder:
            y = layer(y, memory)
        return self.head(self.dec_out(y))


def _read(model: nn.Module, enc_len: int = 8, dec_len: int = 8):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    ids = torch.randint(0, V, (1, enc_len))
    dec = torch.randint(0, V, (1, dec_len))
    return inspect_model(model.eval(), {"input_ids": ids, "decoder_input_ids": dec}, probe=False)


@pytest.mark.parametrize("dec_len", [8, 5], ids=["one-length", "two-lengths"])
@pytest.mark.parametrize(
    ("pre", "final", "embedding_norm", "rms"),
    [(True, True, False, True), (True, False, True, False), (False, False, True, False), (False, True, False, True)],
    ids=["pre-final-rms", "pre-embnorm", "post-embnorm", "post-final-rms"],
)
def test_hand_written_encoder_decoder(pre: bool, final: bool, embedding_norm: bool, rms: bool, dec_len: int) -> None:
    torch.manual_seed(0)
    rep = _read(_EncoderDecoder(pre, final, embedding_norm, rms), 8, dec_len)
    enc = rep.encoder
    assert enc is not None and (rep.stack, enc.stack) == ("decoder", "encoder")
    kind = PlacementKind.PRE if pre else PlacementKind.POST
    op = Operator.RMSNORM if rms else Operator.LAYERNORM
    for stack, subs in ((enc, 2), (rep, 3)):
        assert stack.layers == 2
        assert stack.hidden_size == D
        assert stack.operator is op
        assert stack.bias is (not rms)
        assert stack.placement is kind
        assert stack.placement_attention.value == kind.value
        assert stack.placement_mlp.value == kind.value
        assert stack.placement_by_layer == ((kind,) * subs,) * 2
        assert stack.final_norm is (op if final else Operator.NONE)
        assert stack.embedding_norm is (op if embedding_norm else Operator.NONE)
    assert [s.kind for s in enc.sublayers] == [SublayerKind.ATTENTION, SublayerKind.MLP] * 2
    assert [s.kind for s in rep.sublayers] == [
        SublayerKind.ATTENTION,
        SublayerKind.CROSS_ATTENTION,
        SublayerKind.MLP,
    ] * 2
    assert rep.placement_cross_attention.value == kind.value and enc.placement_cross_attention.value == "n/a"
    assert [a.cross for a in rep.attention] == [False, True] * 2
    assert [a.cross for a in enc.attention] == [False] * 2
    assert {n.role for n in enc.norms} <= {SiteRole.PRE, SiteRole.POST, SiteRole.FINAL, SiteRole.EMBEDDING}
    roles = [n.role for n in rep.norms]
    assert SiteRole.OTHER not in roles and len(enc.norms) + len(rep.norms) == 10 + 2 * (final + embedding_norm)
    doc = rep.to_dict()
    assert doc["encoder"]["stack"] == "encoder" and doc["encoder"]["placement"] == kind.value
    row = rep.summary_row()
    assert row["stack"] == "decoder" and row["encoder_placement"] == kind.value
    assert row["encoder_final_norm"] == (op.value if final else "none")


def test_one_stack_reads_as_before() -> None:
    """A decoder-only model keeps one report: no encoder, no stack field in its row, no cross-attention."""
    torch.manual_seed(0)
    layers = nn.ModuleList(_Layer(True, False, False) for _ in range(2))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.layers, self.norm = nn.Embedding(V, D), layers, nn.LayerNorm(D)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    rep = inspect_model(Decoder().eval(), torch.randint(0, V, (1, 8)), probe=False)
    assert rep.encoder is None and rep.stack is None and rep.placement is PlacementKind.PRE
    assert rep.placement_cross_attention.value == "n/a" and "stack" not in rep.summary_row()


# ----------------------------------------------------------------------------- transformers, tiny
_MODELS: dict[str, object] = {}


def _target(model_type: str):  # type: ignore[no-untyped-def]
    if model_type not in _MODELS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODELS[model_type] = inspect_target(model_type, probe=False)
    return _MODELS[model_type]


# model type -> (operator, gain, bias, placement, final norm, embedding norm, embedding scale): the same in both
# stacks, each read off modeling_<type>.py; the original sizes (each config's defaults) in the comments.
ENCODER_DECODERS = {
    # T5LayerNorm: x * rsqrt(mean(x^2) + eps) * w, no mean, no bias; T5LayerFF / T5LayerSelfAttention add
    # dropout(branch(layer_norm(x))); T5Stack ends in final_layer_norm (t5: d_model 512, 6 + 6 layers, 8 heads)
    "t5": ("rmsnorm", "w", False, "pre", "rmsnorm", "none", None),
    # BartEncoderLayer / BartDecoderLayer: residual + branch, then self_attn_layer_norm / encoder_attn_layer_norm /
    # final_layer_norm; layernorm_embedding on embeddings + positions, no norm after the layers
    # (d_model 1024, 12 + 12 layers, 16 heads)
    "bart": ("layernorm", "w", True, "post", "none", "layernorm", None),
    # MBart: the norms before each branch, layernorm_embedding and a final layer_norm in each stack (1024, 12 + 12)
    "mbart": ("layernorm", "w", True, "pre", "layernorm", "layernorm", None),
    # Marian: BART's Post-LN layers with no layernorm_embedding and no final norm (1024, 12 + 12)
    "marian": ("layernorm", "w", True, "post", "none", "none", None),
    # Pegasus: Pre-LN layers and a final layer_norm per stack, no embedding norm (1024, 12 + 12)
    "pegasus": ("layernorm", "w", True, "pre", "layernorm", "none", None),
    # Whisper: conv stem on the mel features (encoder), Pre-LN layers, a final layer_norm per stack
    # (d_model 384, 4 + 4 layers, 6 heads, 80 mel bins)
    "whisper": ("layernorm", "w", True, "pre", "layernorm", "none", None),
    # T5Gemma: Gemma 2's sandwich (pre_* and post_* RMSNorm around every branch, cross-attention included),
    # weight (1 + w), embeddings times sqrt(hidden_size) (8 at width 64), a final norm per stack (2304 wide, 26 layers)
    "t5gemma": ("rmsnorm", "1+w", False, "peri", "rmsnorm", "none", 8.0),
}


@pytest.mark.parametrize("model_type", list(ENCODER_DECODERS))
def test_transformers_encoder_decoder(model_type: str) -> None:
    op, gain, bias, place, final, emb, scale = ENCODER_DECODERS[model_type]
    rep = _target(model_type)
    assert rep.encoder is not None, rep.notes
    for stack, subs in ((rep.encoder, 2), (rep, 3)):
        row = stack.summary_row()
        assert (row["operator"], row["gain_convention"], row["bias"]) == (op, gain, bias)
        assert (row["placement"], row["final_norm"], row["embedding_norm"]) == (place, final, emb)
        assert stack.layers == 2 and row["placement_by_layer"] == " ".join(["/".join([place] * subs)] * 2)
    assert rep.embedding_scale == scale
    assert rep.placement_cross_attention.value == place
    kinds = [s.kind for s in rep.sublayers]
    assert kinds == [SublayerKind.ATTENTION, SublayerKind.CROSS_ATTENTION, SublayerKind.MLP] * 2
    assert SublayerKind.CROSS_ATTENTION not in {s.kind for s in rep.encoder.sublayers}


def test_sweep_lists_and_counts() -> None:
    types = encoder_decoder_model_types()
    assert {"t5", "bart", "whisper", "marian"} <= set(types) and "llama" not in types
    assert {"stack", "placement_cross_attention", "encoder_placement"} <= set(ENCODER_DECODER_COLUMNS)
    rows: list[dict[str, object]] = [
        {"stack": "decoder", "placement": "pre", "encoder_placement": "pre", "error": ""},
        {"stack": None, "placement": "post", "encoder_placement": None, "error": ""},
        {"stack": None, "placement": None, "encoder_placement": None, "error": "ValueError: x"},
    ]
    assert encoder_decoder_counts(rows) == {"read": 1, "not read": 1, "could not build": 1}


# ----------------------------------------------------------------------------- patch-embedding norms
class _Tower(nn.Module):
    """A ViT-like tower: conv patches, a LayerNorm on them and a position table added after it (``order``
    ``"norm-then-pos"``), before it (``"pos-then-norm"``) or after a CLS token is prepended (``"norm-cls-pos"``)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.patch = nn.Conv2d(3, D, 4, 4)
        self.patch_norm = nn.LayerNorm(D)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, 17 if order == "norm-cls-pos" else 16, D))
        self.layers = nn.ModuleList(_Layer(True, False, False) for _ in range(2))
        self.final = nn.LayerNorm(D)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        if self.order == "norm-then-pos":
            x = self.patch_norm(x) + self.pos
        elif self.order == "pos-then-norm":
            x = self.patch_norm(x + self.pos)
        else:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.patch_norm(x)], 1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.final(x)


@pytest.mark.parametrize("order", ["norm-then-pos", "pos-then-norm", "norm-cls-pos"])
def test_patch_embedding_norm_either_side_of_the_position_add(order: str) -> None:
    torch.manual_seed(0)
    rep = inspect_vision(_Tower(order).eval(), torch.randn(1, 3, 16, 16), probe=False)
    assert rep.embedding_norm is Operator.LAYERNORM
    assert rep.final_norm is Operator.LAYERNORM and rep.placement is PlacementKind.PRE
    roles = {n.module: n.role for n in rep.norms}
    assert roles["patch_norm"] is SiteRole.EMBEDDING
    assert SiteRole.OTHER not in roles.values()


def test_pvt_patch_norm_before_its_position_add() -> None:
    """PvtPatchEmbeddings: ``layer_norm(patches)``, then ``dropout(embeddings + position_embeddings)`` (before this
    reading: an ``other`` norm and no embedding norm). Staged tower, 4 stages kept (PVT-tiny: widths 64-512)."""
    from normatlas.inspect import inspect_vision_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = inspect_vision_target("pvt", probe=False)
    assert rep.embedding_norm is Operator.LAYERNORM and rep.placement is PlacementKind.PRE
    first = next(n for n in rep.norms if n.role is SiteRole.EMBEDDING)
    assert first.size == 64  # the first stage's width, not the last stage's


# ----------------------------------------------------------------------------- the CLI
def test_cli_encoder_decoder_sweep_and_refusal(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    from normatlas.cli import main

    assert main(["inspect", "t5", "--encoder-decoder"]) != 0
    assert "--encoder-decoder: only with --all-transformers" in capsys.readouterr().err
    out = Path(str(tmp_path))
    code = main(["inspect", "--all-transformers", "--encoder-decoder", "--only", "t5", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "encoder-decoders: read 1, not read 0, could not build 0" in printed
    (row,) = json.loads((out / "transformers_matrix.json").read_text())
    assert (row["stack"], row["placement"], row["encoder_placement"]) == ("decoder", "pre", "pre")
    assert (row["placement_cross_attention"], row["encoder_final_norm"]) == ("pre", "rmsnorm")
    header = (out / "transformers_matrix.csv").read_text().splitlines()[0].split(",")
    assert header == ENCODER_DECODER_COLUMNS


def test_a_hybrid_reading_its_first_embeddings_is_one_stack() -> None:
    """Zamba 2 (1.2B: 2048 wide, 38 Mamba 2 layers and 2 shared attention blocks) feeds its shared blocks the
    first embeddings beside the stream: a later branch reads an earlier stream value without attending to it,
    so there is no encoder and decoder, one stack (before this rule it split in two)."""
    from normatlas.inspect import inspect_target

    report = inspect_target("zamba2")
    assert report.encoder is None and report.stack != "decoder"
