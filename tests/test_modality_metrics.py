"""Per-modality diagnostics (normatlas.diagnostics.modality): the pure functions against element-wise references, the
Monitor metrics against the test's own hooks on a tiny VLM of our connectors, and on a transformers LLaVA built
offline from its config with random weights.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import Tensor, nn

from normatlas.blocks import ModelConfig, Rope
from normatlas.diagnostics import (
    DEFAULT_METRICS,
    ModalitySplit,
    Monitor,
    PartUpdates,
    VLMPart,
    VLMPath,
    image_attention_share,
    modality_norms,
    modality_report,
    modality_updates,
    update_ratio,
)
from normatlas.diagnostics.modality import part_parameters
from normatlas.longtail import TinyVLM, TinyVLMConfig
from normatlas.presets import RMSNorm


# ------------------------------------------------------------------ pure functions
def _ref_share(probs: Tensor, mask: Tensor, allowed: Tensor) -> tuple[float, float, int]:
    probs = probs.detach()
    shares, uniforms, queries = [], [], set()
    b, h, t, _ = probs.shape
    for i in range(b):
        for head in range(h):
            for q in range(t):
                if mask[i, q]:
                    continue
                img = [k for k in range(t) if mask[i, k] and allowed[i, head, q, k]]
                if not img:
                    continue
                queries.add((i, q))
                shares.append(sum(float(probs[i, head, q, k]) for k in img))
                uniforms.append(len(img) / int(allowed[i, head, q].sum()))
    return sum(shares) / len(shares), sum(uniforms) / len(uniforms), len(queries)


@pytest.mark.parametrize("causal", [True, False])
def test_image_attention_share_matches_loops(causal) -> None:
    b, h, t = 3, 2, 7
    logits = torch.randn(b, h, t, t)
    allowed = torch.ones(t, t, dtype=torch.bool).tril().expand(b, h, t, t) if causal else torch.ones(b, h, t, t).bool()
    logits = logits.masked_fill(~allowed, -math.inf)
    probs = logits.softmax(-1)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, 1:4], mask[1, 0], mask[2, 5] = True, True, True
    got = image_attention_share(probs, mask, logits)
    share, uniform, n = _ref_share(probs, mask, allowed)
    assert got["queries"] == n
    assert got["share"] == pytest.approx(share, rel=1e-6)
    assert got["uniform"] == pytest.approx(uniform, rel=1e-12)


def test_uniform_attention_has_the_uniform_share_and_no_image_gives_nan() -> None:
    t = 6
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    logits = torch.zeros(1, 1, t, t).masked_fill(~allowed, -math.inf)
    mask = torch.tensor([[False, True, True, False, False, False]])
    got = image_attention_share(logits.softmax(-1), mask, logits)
    assert got["share"] == pytest.approx(got["uniform"], rel=1e-6) and got["queries"] == 3  # float32 probs
    none = image_attention_share(logits.softmax(-1), torch.zeros(1, t, dtype=torch.bool), logits)
    assert math.isnan(none["share"]) and none["queries"] == 0


def test_modality_norms_and_update_ratio() -> None:
    x = torch.randn(2, 5, 7)
    mask = torch.tensor([[True, True, False, False, False], [False, False, False, True, False]])
    got = modality_norms(x, mask)
    img = torch.stack([x[0, 0], x[0, 1], x[1, 3]]).norm(dim=-1).mean()
    txt = torch.cat([x[0, 2:], x[1, :3], x[1, 4:]]).norm(dim=-1).mean()
    assert got["image"] == pytest.approx(float(img), rel=1e-6)
    assert got["text"] == pytest.approx(float(txt), rel=1e-6)
    assert got["ratio"] == pytest.approx(float(img / txt), rel=1e-6)
    a, b = [torch.randn(3, 4), torch.randn(5)], [torch.randn(3, 4), torch.randn(5)]
    want = math.sqrt(sum(float((q - p).pow(2).sum()) for p, q in zip(a, b, strict=True))) / math.sqrt(
        sum(float(p.pow(2).sum()) for p in a)
    )
    assert update_ratio(a, b) == pytest.approx(want, rel=1e-6)  # ours sums in float64


def test_modality_updates_match_per_token_loops() -> None:
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    y = x + 0.3 * torch.randn(2, 4, 6, dtype=torch.float64)
    y[0, 0] = -x[0, 0]  # a token turned around: 180 degrees, relative update 2
    mask = torch.tensor([[True, False, True, False], [False, False, True, False]])
    got = modality_updates(x, y, mask)
    rel, ang = {True: [], False: []}, {True: [], False: []}
    for i in range(2):
        for j in range(4):
            a, b = x[i, j], y[i, j]
            rel[bool(mask[i, j])].append(float((b - a).norm() / a.norm()))
            ang[bool(mask[i, j])].append(math.degrees(math.acos(float(a @ b / (a.norm() * b.norm())))))
    for side, key in ((True, "image"), (False, "text")):
        assert got[f"{key}_update"] == pytest.approx(sum(rel[side]) / len(rel[side]), rel=1e-12)
        assert got[f"{key}_rotation"] == pytest.approx(sum(ang[side]) / len(ang[side]), rel=1e-9)
    assert modality_updates(x, -x, mask)["image_rotation"] == pytest.approx(180.0)
    assert math.isnan(modality_updates(x, y, torch.zeros(2, 4, dtype=torch.bool))["image_update"])


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"image_mask must be a boolean \(B, T\) torch.Tensor"):
        modality_norms(torch.randn(2, 3, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=re.escape("image_mask has shape (2, 4); x (2, 3, 4) needs (2, 3)")):
        modality_norms(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"probs \(2, 3\) must be a \(B, H, T, T\)"):
        image_attention_share(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="image_mask='ids' must be a boolean"):
        ModalitySplit("ids")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="connector=None must be the connector"):
        VLMPath(None, torch.zeros(1, 2, dtype=torch.bool))  # type: ignore[arg-type]
    model = TinyVLM()
    with pytest.raises(ValueError, match="parts key='vision' is not a valid VLMPart; allowed: 'tower'"):
        part_parameters({"vision": model.tower})
    with pytest.raises(ValueError, match="is in parts 'language-model' and 'connector'"):
        part_parameters({VLMPart.LANGUAGE_MODEL: model, VLMPart.CONNECTOR: model.connector})
    with pytest.raises(TypeError, match=r"parts\['tower'\]=3 must be an nn.Module"):
        part_parameters({"tower": 3})


# ------------------------------------------------------------------ on a tiny VLM of our connectors
def _tiny(rope: bool = False) -> tuple[TinyVLM, tuple[Tensor, Tensor, Tensor]]:
    torch.manual_seed(0)
    lm = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, d_ff=64, norm=RMSNorm,
                     rope=Rope() if rope else None, max_positions=0 if rope else 32)  # fmt: skip
    model = TinyVLM(TinyVLMConfig(lm=lm))
    ids = torch.randint(64, (3, 13))
    mask = torch.zeros(3, 13, dtype=torch.bool)
    mask[0, 2:10], mask[1, 0:8], mask[2, 5:13] = True, True, True  # 8 image tokens each, different places
    return model, (ids, torch.randn(3, 16, 48), mask)


def test_metrics_on_tiny_vlm_equal_the_tests_own_hooks() -> None:
    model, (ids, pix, mask) = _tiny()
    seen: dict[str, list[Tensor]] = {"attn_in": [], "out": [], "conn_in": [], "conn_out": [], "lm_in": []}
    hooks = [
        model.connector.register_forward_pre_hook(lambda m, a: seen["conn_in"].append(a[0])),
        model.connector.register_forward_hook(lambda m, a, o: seen["conn_out"].append(o)),
        model.lm.layers[0].register_forward_pre_hook(lambda m, a: seen["lm_in"].append(a[0])),
    ]
    for blk in model.lm.layers:
        hooks.append(blk.attn.register_forward_pre_hook(lambda m, a: seen["attn_in"].append(a[0])))
        hooks.append(blk.register_forward_hook(lambda m, a, o: seen["out"].append(o)))
    rec = modality_report(model, (ids, pix, mask), mask, blocks=model.lm.layers, connector=model.connector)
    for h in hooks:
        h.remove()
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    for i, blk in enumerate(model.lm.layers):
        a, x = blk.attn, seen["attn_in"][i]
        q = a.q_proj(x).view(3, 13, 4, 8).transpose(1, 2)
        k = a.k_proj(x).view(3, 13, 4, 8).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2) * a.scale).masked_fill(~causal, -math.inf)
        share, uniform, _ = _ref_share(logits.softmax(-1), mask, causal.expand(3, 4, 13, 13))
        assert rec[f"modality_split/image_share/L{i}"] == pytest.approx(share, rel=1e-5)
        assert rec[f"modality_split/uniform_share/L{i}"] == pytest.approx(uniform, rel=1e-9)
        y = seen["out"][i]
        img, txt = y[mask].norm(dim=-1).mean(), y[~mask].norm(dim=-1).mean()
        assert rec[f"modality_split/image_norm/L{i}"] == pytest.approx(float(img), rel=1e-5)
        assert rec[f"modality_split/text_norm/L{i}"] == pytest.approx(float(txt), rel=1e-5)
        x_in = seen["lm_in"][0] if i == 0 else seen["out"][i - 1]
        upd = (y - x_in).norm(dim=-1) / x_in.norm(dim=-1)
        assert rec[f"modality_split/image_update/L{i}"] == pytest.approx(float(upd[mask].mean()), rel=1e-5)
        assert rec[f"modality_split/text_update/L{i}"] == pytest.approx(float(upd[~mask].mean()), rel=1e-5)
        # the essay's inertia: the long image rows (norm ~3.3) turn less than the short text tokens (~0.1)
        assert rec[f"modality_split/image_rotation/L{i}"] < rec[f"modality_split/text_rotation/L{i}"]
    assert rec["vlm_path/tower_norm"] == pytest.approx(float(seen["conn_in"][0].norm(dim=-1).mean()), rel=1e-6)
    conn = float(seen["conn_out"][0].norm(dim=-1).mean())
    assert rec["vlm_path/connector_norm"] == pytest.approx(conn, rel=1e-6)
    # embedding-stream injection: the image rows entering the LM are the connector's output, unchanged
    assert rec["vlm_path/lm_image_norm"] == pytest.approx(conn, rel=1e-6)
    lm_in = seen["lm_in"][0]
    assert rec["vlm_path/lm_text_norm"] == pytest.approx(float(lm_in[~mask].norm(dim=-1).mean()), rel=1e-6)
    assert rec["vlm_path/gap"] == pytest.approx(rec["vlm_path/lm_image_norm"] / rec["vlm_path/lm_text_norm"])


def test_part_updates_equal_the_sgd_step_and_a_frozen_part_is_zero() -> None:
    model, (ids, pix, mask) = _tiny(rope=True)
    for p in model.tower.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    parts = {"tower": model.tower, "connector": model.connector, VLMPart.LANGUAGE_MODEL: model.lm}
    mon = Monitor(model, every=1, metrics=[PartUpdates(parts)], blocks=model.lm.layers, print_alarms=False)
    want: dict[str, float] = {}
    for step in range(2):
        loss = model(ids, pix, mask).logsumexp(-1).mean()
        loss.backward()
        mon.step(loss=loss)
        if step == 0:
            for key, mod in (("connector", model.connector), ("language-model", model.lm)):
                ps = list(mod.parameters())
                num = sum(float((0.1 * p.grad).pow(2).sum()) for p in ps if p.grad is not None)
                want[key] = math.sqrt(num / sum(float(p.detach().pow(2).sum()) for p in ps))
            assert "part_update/connector" not in mon.last
        opt.step()
        opt.zero_grad()
    rec = mon.last
    assert rec["part_update/steps"] == 1
    assert rec["part_update/tower"] == 0.0
    assert rec["part_update/connector"] == pytest.approx(want["connector"], rel=1e-5)
    assert rec["part_update/language-model"] == pytest.approx(want["language-model"], rel=1e-5)


def test_metrics_run_beside_the_default_ones_with_a_mask_from_the_inputs() -> None:
    model, (ids, pix, mask) = _tiny()

    def from_inputs(args: tuple, kwargs: dict) -> Tensor:
        return args[2]  # TinyVLM's third argument is the image mask: the caller's choice, not a name we guess

    metrics = [*DEFAULT_METRICS, ModalitySplit(from_inputs), VLMPath(model.connector, from_inputs)]
    mon = Monitor(model, every=1, blocks=model.lm.layers, print_alarms=False, metrics=metrics)
    for shift in (0, 1):
        m = mask.roll(shift, 1)
        model(ids, pix, m).mean().backward()
        mon.step()
    rec = mon.last
    assert "attention/entropy/L0" in rec and "residual/rms/L2" in rec
    assert 0 < rec["modality_split/image_share/L2"] < 1 and rec["vlm_path/gap"] > 1
    assert "img/txt" in mon.summary()
    assert any(row.get("txt->img") for row in mon.layer_table())


# ------------------------------------------------------------------ on a transformers LLaVA built offline
@pytest.fixture(scope="module")
def llava() -> tuple[nn.Module, dict]:
    pytest.importorskip("transformers")
    from normatlas.factory.vlm import build_vlm
    from normatlas.factory.vlm_inputs import vlm_inputs

    model = build_vlm("llava", seed=0)
    return model, vlm_inputs(model, seed=0)


def test_modality_metrics_on_transformers_llava(llava) -> None:
    model, inputs = llava
    mask = inputs["input_ids"] == model.config.image_token_id  # from the input ids, by the config's id
    assert int(mask.sum()) == 16
    seen: list[Tensor] = []
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, a, o: seen.extend([a[0], o]))  # None
    layers = model.model.language_model.layers
    rec = modality_report(model, inputs, mask, blocks=layers, connector=model.model.multi_modal_projector)
    hook.remove()
    assert rec["vlm_path/tower_norm"] == pytest.approx(float(seen[0].norm(dim=-1).mean()), rel=1e-6)
    assert rec["vlm_path/connector_norm"] == pytest.approx(float(seen[1].norm(dim=-1).mean()), rel=1e-6)
    assert rec["vlm_path/lm_image_norm"] == pytest.approx(rec["vlm_path/connector_norm"], rel=1e-6)  # LLaVA's merge
    for i in range(len(layers)):
        assert 0 < rec[f"modality_split/image_share/L{i}"] < 1
        assert rec[f"modality_split/image_norm/L{i}"] > 0 and rec[f"modality_split/text_norm/L{i}"] > 0


def test_part_updates_on_transformers_llava(llava) -> None:
    model, inputs = llava
    model.train()
    inner = model.model
    parts = {"tower": inner.vision_tower, "connector": inner.multi_modal_projector,
             "language-model": [inner.language_model, model.lm_head]}  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, every=1, metrics=["grad_norm", PartUpdates(parts)], blocks=inner.language_model.layers,
                  print_alarms=False)  # fmt: skip
    try:
        for _ in range(2):
            out = model(**inputs, labels=inputs["input_ids"])
            out.loss.backward()
            mon.step()
            opt.step()
            opt.zero_grad()
    finally:
        mon.close()
        model.eval()
    rec = mon.last
    for part in ("tower", "connector", "language-model"):
        assert 0 < rec[f"part_update/{part}"] < 1


@pytest.mark.gpu
def test_metrics_and_masked_count_on_cuda_match_cpu() -> None:
    from normatlas.longtail.bn_stats import effective_sample_count

    model, (ids, pix, mask) = _tiny()
    cpu = modality_report(model, (ids, pix, mask), mask, blocks=model.lm.layers, connector=model.connector)
    model = model.cuda()
    dev = (ids.cuda(), pix.cuda(), mask.cuda())
    gpu = modality_report(model, dev, dev[2], blocks=model.lm.layers, connector=model.connector)
    keys = [k for k, v in cpu.items() if isinstance(v, float)]
    assert len(keys) > 20
    for k in keys:
        assert gpu[k] == pytest.approx(cpu[k], rel=2e-3, abs=1e-4), k
    x = torch.randn(4, 9, 3, dtype=torch.float64)
    m = torch.arange(9)[None, :] < torch.tensor([9, 2, 5, 7])[:, None]
    torch.testing.assert_close(
        effective_sample_count(x.cuda(), mask=m.cuda()).n_eff.cpu(), effective_sample_count(x, mask=m).n_eff
    )
