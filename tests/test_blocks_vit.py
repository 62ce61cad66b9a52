"""Ported HF ViT-style image classifiers give the same logits and gradients as our ViTEncoder (fp32, <= 1e-5).

``vit`` is the Pre-LN LayerNorm encoder of Dosovitskiy et al. (2021); ``dinov2`` adds LayerScale on both
branches (Oquab et al., 2023: the essay's LayerScale in a shipped model) and a head on [class token, mean of
patch tokens]. Each is built tiny (2 layers, width 64, 32x32 images, 8x8 patches) from its config class,
offline, with every parameter randomised (so LayerScale's per-channel gains and the LayerNorm biases matter),
then ported with ``from_hf`` (derived from the dataflow, :mod:`normatlas.port`; the old key maps' results are in
tests/data/port_keymaps.json); each model is built once per module.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from normatlas.blocks import Activation, Gate, ViTEncoder, ViTPool  # noqa: E402
from normatlas.port import from_hf, to_hf_state_dict  # noqa: E402

OLD = json.loads((Path(__file__).parent / "data" / "port_keymaps.json").read_text())
HF_CLASS = {"vit": "ViTForImageClassification", "dinov2": "Dinov2ForImageClassification"}

_VIT = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_labels=10)
# Original sizes for reference: ViT-B/16 768/12L at 224px; DINOv2-S/14 384/12L, LayerScale init 1e-5 (HF: 1.0).
CASES = {
    "vit": ("ViTConfig", "ViTForImageClassification", dict(_VIT, intermediate_size=128)),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", dict(_VIT, mlp_ratio=2, layerscale_value=0.1)),
}


def _build(name: str, **change):
    cfg_cls, model_cls, kw = CASES[name]
    cfg = getattr(transformers, cfg_cls)(**{**kw, **change})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))  # every gain, bias, LayerScale and weight away from its init
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
    hf = _build(request.param)
    ours = from_hf(hf).eval()
    return request.param, hf, ours


def _images(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 3, 32, 32, generator=g), torch.randn(3, 10, generator=g)


def test_structure_is_what_the_architecture_says(pair):
    name, hf, ours = pair
    assert isinstance(ours, ViTEncoder)
    assert type(hf).__name__ == HF_CLASS[name]
    blocks = ours.blocks()
    assert all(b.attn_pre_norm is not None and b.attn_after_norm is None for b in blocks)  # Pre-LN
    if name == "dinov2":
        assert ours.config.pool is ViTPool.CLS_AND_MEAN and ours.config.placement.gate is Gate.VECTOR
        gamma = blocks[0].attn_residual.gate.gamma
        torch.testing.assert_close(gamma, hf.dinov2.encoder.layer[0].layer_scale1.lambda1, atol=0, rtol=0)
    else:
        assert ours.config.pool is ViTPool.CLS and ours.config.placement.gate is Gate.NONE


def test_same_logits(pair):
    _, hf, ours = pair
    images, _ = _images(1)
    with torch.no_grad():
        ref = hf(pixel_values=images).logits
        got = ours(images)
    assert got.shape == (3, 10) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_same_gradients(pair):
    _, hf, ours = pair
    images, upstream = _images(2)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    x_ref, x_got = images.clone().requires_grad_(), images.clone().requires_grad_()
    (hf(pixel_values=x_ref).logits * upstream).sum().backward()
    (ours(x_got) * upstream).sum().backward()
    torch.testing.assert_close(x_got.grad, x_ref.grad, atol=1e-5, rtol=1e-4)
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    mapped = to_hf_state_dict(ours, None, grads)
    hf_params = dict(hf.named_parameters())
    trained = {k for k, p in hf_params.items() if p.grad is not None}
    assert set(mapped) == trained, set(mapped) ^ trained
    for key, g in mapped.items():
        torch.testing.assert_close(g, hf_params[key].grad, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_round_trip_state_dict_loads(pair):
    name, hf, ours = pair
    fresh = _build(name)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    missing, unexpected = fresh.load_state_dict(to_hf_state_dict(ours), strict=False)
    assert not unexpected
    assert set(missing) == set(ours.hf_port.unused), missing  # DINOv2's mask token: never read by the forward
    images, _ = _images(3)
    with torch.no_grad():
        torch.testing.assert_close(fresh(pixel_values=images).logits, hf(pixel_values=images).logits, atol=0, rtol=0)


def test_matches_the_old_key_map(pair):
    """The derived port links every parameter as the deleted key map did (names, transposes) and sets its fields."""
    name, _, ours = pair
    old = OLD[name]
    links = {lk.ours: lk for lk in ours.hf_port.links}
    assert set(links) == set(old["mapping"])
    for key, (theirs, _, _, _) in old["mapping"].items():
        assert theirs in links[key].theirs and links[key].rows is None and not links[key].transpose, key
    cfg = ours.config
    for field in ("image_size", "patch_size", "in_chans", "num_classes", "pool", "d_ff", "qkv_bias", "mlp_bias"):
        value = getattr(cfg, field)
        assert getattr(value, "value", value) == old["config"][field], field
    assert cfg.plan(0)[1](8).spec.to_dict() == old["config"]["norm_spec"]


@pytest.mark.parametrize(
    "name, change, check",
    [
        ("dinov2", dict(use_swiglu_ffn=True), lambda c: c.gated and c.activation is Activation.SILU),
        ("vit", dict(hidden_act="relu"), lambda c: not c.gated and c.activation is Activation.RELU),
    ],
)
def test_configs_the_key_maps_refused_now_port(name, change, check):
    """DINOv2's SwiGLU FFN (one fused projection, split in halves) and a ReLU ViT: read, not refused."""
    hf = _build(name, **change)
    ours = from_hf(hf)
    assert check(ours.config)
    images, _ = _images(5)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), hf(pixel_values=images).logits, atol=1e-5, rtol=0)


def test_a_renamed_classifier_ports_the_same():
    """Every module and parameter of DINOv2 renamed: the same config and the same links (mapped back by identity)."""
    from normatlas.port import port

    from .renamer import old_names, renamed

    hf = _build("dinov2")
    twin = renamed(hf)
    p1, _ = port(hf)
    p2, _ = port(twin)
    assert p2.config == p1.config
    back = old_names(hf, twin)
    assert [(lk.ours, tuple(back[t] for t in lk.theirs)) for lk in p2.links] == [
        (lk.ours, lk.theirs) for lk in p1.links
    ]
