"""Per-modality diagnostics of an image-text model (the essay's VLM section), split by an image-token mask.

Which tokens are image tokens is never read from names: the caller gives a boolean ``(B, T)`` mask, or a function
of the model's inputs that returns it (``lambda args, kwargs: kwargs["input_ids"] == image_token_id``). The parts
of the model are given as module references (:class:`VLMPart` -> module).

Pure functions:

* :func:`image_attention_share`: per text query, the attention probability on image keys; averaged over the text
  queries that may attend to at least one image key, and beside it the share a uniform attention over the
  allowed keys would give (the ratio says whether text looks at the image more or less than chance);
* :func:`modality_norms`: mean per-token L2 norm of the image and of the text tokens of an activation;
* :func:`modality_updates`: per modality, how far a block moves its tokens (relative update, rotation angle);
* :func:`update_ratio`: ``||W_after - W_before|| / ||W_before||`` over a group of parameters.

Monitor metrics (pass them in ``Monitor(metrics=[...])``; the Monitor's ``blocks`` should be the language model's
layers, e.g. ``blocks=model.model.language_model.layers``):

* :class:`ModalitySplit` (``modality_split/...``): per layer, the text-to-image attention share, the output
  norm of each modality and each modality's update (relative size and rotation);
* :class:`VLMPath` (``vlm_path/...``): the norm gap along the VLM path in one record: the tower output as the
  connector reads it, the connector's output, and the language model's input stream (first block) split into its
  image and text tokens; ``vlm_path/gap`` = LM-input image norm / text norm;
* :class:`PartUpdates` (``part_update/<part>``): the update-to-weight ratio of each part's parameters between two
  measured steps (the optimizer steps in between; ``every=1``: one step).

:func:`modality_report` runs the first two on one forward and returns the record.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..spec import parse_enum
from .attention import AttentionCapture
from .metric_base import Column, Hook, MonitorMetric, Row, Scope, first_tensor
from .metrics import masked_logits

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = [
    "ImageMask",
    "ModalitySplit",
    "PartUpdates",
    "VLMPart",
    "VLMPath",
    "image_attention_share",
    "modality_norms",
    "modality_report",
    "modality_updates",
    "part_parameters",
    "update_ratio",
]

ImageMask = Tensor | Callable[[tuple[Any, ...], dict[str, Any]], Tensor]
"""A boolean ``(B, T)`` tensor, or a function of the model's ``(args, kwargs)`` that returns one."""


class VLMPart(enum.Enum):
    """The three parts of an image-text model whose parameters are measured apart."""

    TOWER = "tower"
    CONNECTOR = "connector"
    LANGUAGE_MODEL = "language-model"


def _mask(mask: object, name: str = "image_mask") -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a boolean (B, T) torch.Tensor (True at image tokens), got {got}")
    return mask


def image_attention_share(probs: Tensor, image_mask: Tensor, logits: Tensor | None = None) -> dict[str, float]:
    """How much of the text queries' attention goes to image keys, in one self-attention map.

    ``probs``: ``(B, H, T, T)``; ``image_mask``: boolean ``(B, T)``, True at image tokens (queries and keys share
    it); ``logits``: the map's logits, whose masked entries (``-inf`` or a large negative additive mask) say which
    keys each query may attend to (without them every key is allowed). Returns ``share``: the mean over heads and
    over the text queries that may attend to an image key of the probability on image keys; ``uniform``: the same
    mean of (allowed image keys / allowed keys); ``queries``: how many text queries counted. NaN where none count.
    """
    if not isinstance(probs, Tensor) or probs.dim() != 4 or probs.shape[-1] != probs.shape[-2]:
        got = tuple(probs.shape) if isinstance(probs, Tensor) else type(probs).__name__
        raise ValueError(f"probs {got} must be a (B, H, T, T) self-attention map")
    m = _mask(image_mask)
    b, _, t, _ = probs.shape
    if tuple(m.shape) != (b, t):
        raise ValueError(f"image_mask has shape {tuple(m.shape)}; probs {tuple(probs.shape)} need {(b, t)}")
    p = probs.detach().double()
    m = m.to(p.device)
    allowed = torch.ones_like(p, dtype=torch.bool) if logits is None else ~masked_logits(logits.to(p.device))
    img_k = m[:, None, None, :]
    share = (p * img_k).sum(-1)  # (B, H, T)
    n_img = (allowed & img_k).sum(-1).double()
    uniform = n_img / allowed.sum(-1).clamp_min(1).double()
    count = (~m)[:, None, :] & (n_img > 0)  # text queries that may see an image key
    n = int(count.sum())
    if n == 0:
        return {"share": math.nan, "uniform": math.nan, "queries": 0}
    return {
        "share": float(share[count].mean()),
        "uniform": float(uniform[count].mean()),
        "queries": int(count.any(1).sum()),  # text queries counted in at least one head
    }


def modality_norms(x: Tensor, image_mask: Tensor) -> dict[str, float]:
    """Mean per-token L2 norm of the image tokens (``image``) and the text tokens (``text``) of ``x`` ``(B, T, D)``,
    and ``ratio = image / text``; NaN for a modality with no token."""
    if not isinstance(x, Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x {got} must be a (B, T, D) tensor")
    m = _mask(image_mask)
    if tuple(m.shape) != tuple(x.shape[:2]):
        raise ValueError(f"image_mask has shape {tuple(m.shape)}; x {tuple(x.shape)} needs {tuple(x.shape[:2])}")
    norms = x.detach().double().norm(dim=-1)
    m = m.to(norms.device)
    img = float(norms[m].mean()) if bool(m.any()) else math.nan
    txt = float(norms[~m].mean()) if bool((~m).any()) else math.nan
    return {"image": img, "text": txt, "ratio": img / txt if txt > 0 else math.nan}


def modality_updates(x: Tensor, y: Tensor, image_mask: Tensor) -> dict[str, float]:
    """How far one block moves each modality's tokens (the essay's representational inertia: a Pre-LN update of
    about fixed size rotates a short token far and a long one little): per token ``||y - x|| / ||x||`` and the angle
    between ``x`` and ``y`` in degrees, averaged over the image (``image_update``, ``image_rotation``) and the text
    tokens (``text_update``, ``text_rotation``); NaN for a modality with no token."""
    if not isinstance(x, Tensor) or not isinstance(y, Tensor) or x.shape != y.shape or x.dim() != 3:
        got = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (x, y)]
        raise ValueError(f"x and y {got} must be (B, T, D) tensors of one shape")
    m = _mask(image_mask)
    if tuple(m.shape) != tuple(x.shape[:2]):
        raise ValueError(f"image_mask has shape {tuple(m.shape)}; x {tuple(x.shape)} needs {tuple(x.shape[:2])}")
    a, b = x.detach().double(), y.detach().double()
    rel = (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-300)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-300).clamp(-1.0, 1.0)
    angle = torch.rad2deg(torch.arccos(cos))
    m = m.to(rel.device)
    out: dict[str, float] = {}
    for side, where in (("image", m), ("text", ~m)):
        some = bool(where.any())
        out[f"{side}_update"] = float(rel[where].mean()) if some else math.nan
        out[f"{side}_rotation"] = float(angle[where].mean()) if some else math.nan
    return out


def update_ratio(before: Sequence[Tensor], after: Sequence[Tensor]) -> float:
    """``||after - before|| / ||before||`` over a group of tensors (Frobenius norms of the concatenation)."""
    if len(before) != len(after) or not before:
        raise ValueError(
            f"before and after must hold the same non-zero number of tensors, got {len(before)}, {len(after)}"
        )
    num = sum(float((a.detach().double() - b.double()).pow(2).sum()) for a, b in zip(after, before, strict=True))
    den = sum(float(b.double().pow(2).sum()) for b in before)
    return math.sqrt(num / den) if den > 0 else math.inf


def _modules(value: object, name: str) -> list[nn.Module]:
    mods = [value] if isinstance(value, nn.Module) else list(value) if isinstance(value, (list, tuple)) else None
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise TypeError(f"{name}={value!r:.80} must be an nn.Module or a list of them")
    return mods


def part_parameters(
    parts: Mapping[VLMPart | str, nn.Module | Sequence[nn.Module]],
) -> dict[VLMPart, list[nn.Parameter]]:
    """Each part's parameters (a parameter once, in module order); a parameter in two parts is refused."""
    if not isinstance(parts, Mapping) or not parts:
        raise TypeError(f"parts={parts!r:.80} must be a non-empty mapping VLMPart -> module(s)")
    out: dict[VLMPart, list[nn.Parameter]] = {}
    owner: dict[int, VLMPart] = {}
    for key, value in parts.items():
        part = parse_enum(VLMPart, key, name="parts key")
        params = list(dict.fromkeys(p for mod in _modules(value, f"parts[{part.value!r}]") for p in mod.parameters()))
        for p in params:
            if owner.setdefault(id(p), part) is not part:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in parts {owner[id(p)].value!r} and {part.value!r}; "
                    "give each part modules that share no parameter"
                )
        out[part] = params
    return out


class _Masked(MonitorMetric):
    """The image mask of the current forward, from the model's inputs."""

    def __init__(self, image_mask: ImageMask) -> None:
        if not (isinstance(image_mask, Tensor) or callable(image_mask)):
            raise TypeError(
                f"image_mask={image_mask!r:.60} must be a boolean (B, T) tensor or a function (args, kwargs) -> one"
            )
        if isinstance(image_mask, Tensor):
            _mask(image_mask)
        self.image_mask = image_mask
        self._current: Tensor | None = None

    def on_model_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Row | None:
        m = self.image_mask if isinstance(self.image_mask, Tensor) else self.image_mask(args, kwargs)
        self._current = _mask(m, "image_mask (as computed from the inputs)").detach()
        return None

    def mask_for(self, x: Tensor) -> Tensor | None:
        """The mask rows of a sampled activation ``x`` ``(B', T, ...)``, or None when the shapes disagree."""
        m = self._current
        if m is None or x.dim() < 2 or x.shape[0] > m.shape[0] or x.shape[1] != m.shape[1]:
            return None
        return m[: x.shape[0]]


class ModalitySplit(_Masked):
    """Per language-model layer: the text-to-image attention share (:func:`image_attention_share` of the first
    self-attention map over the whole sequence computed inside the block), the block output's mean token norm per
    modality (:func:`modality_norms`) and how far the block moves each modality's tokens (:func:`modality_updates`)."""

    key = "modality_split"
    hooks = frozenset({Hook.MODEL_INPUT, Hook.STREAM, Hook.MODEL_OUTPUT})
    per_block = True
    columns = (
        Column("modality_split/image_share", "txt->img", "text queries' attention on image keys", scope=Scope.LAYER,
               table=True, fmt=".3f"),
        Column("modality_split/uniform_share", "uniform", "the same share under uniform attention", scope=Scope.LAYER,
               table=True, fmt=".3f"),
        Column("modality_split/image_norm", "img norm", "mean L2 norm of the image tokens", scope=Scope.LAYER,
               table=True),
        Column("modality_split/text_norm", "txt norm", "mean L2 norm of the text tokens", scope=Scope.LAYER,
               table=True),
        Column("modality_split/norm_ratio", "img/txt", "image norm / text norm", "x", scope=Scope.LAYER, table=True,
               summary="img/txt", worst="max"),
        Column("modality_split/image_update", "img upd", "image tokens' mean ||y - x|| / ||x|| in the block",
               scope=Scope.LAYER),
        Column("modality_split/text_update", "txt upd", "text tokens' mean ||y - x|| / ||x|| in the block",
               scope=Scope.LAYER),
        Column("modality_split/image_rotation", "img rot", "image tokens' mean angle(x, y)", "deg", scope=Scope.LAYER,
               table=True, fmt=".3g"),
        Column("modality_split/text_rotation", "txt rot", "text tokens' mean angle(x, y)", "deg", scope=Scope.LAYER,
               table=True, fmt=".3g"),
    )  # fmt: skip

    def __init__(self, image_mask: ImageMask) -> None:
        super().__init__(image_mask)
        self._capture: AttentionCapture | None = None
        self._share: dict[int, dict[str, float]] = {}

    def on_block_start(self, layer: int) -> None:
        self.release()

        def seen(probs: Tensor, logits: Tensor | None) -> None:
            m = self._current
            if layer in self._share or m is None or probs.dim() != 4 or probs.shape[0] > m.shape[0]:
                return
            if probs.shape[-1] != m.shape[1] or probs.shape[-2] != m.shape[1]:
                return  # not a self-attention over the whole sequence (a cross-attention, a decode step)
            self._share[layer] = image_attention_share(probs, m[: probs.shape[0]], logits)

        self._capture = AttentionCapture(seen, self.monitor.max_examples)
        self._capture.__enter__()

    def on_block_end(self, layer: int) -> None:
        self.release()

    def on_block(self, layer: int, x: Tensor | None, y: Tensor) -> Row | None:
        row: dict[str, object] = {}
        share = self._share.get(layer)
        if share is not None:
            row[self.columns[0].at(layer)] = share["share"]
            row[self.columns[1].at(layer)] = share["uniform"]
        m = self.mask_for(y)
        if m is not None and y.dim() == 3:
            n = modality_norms(y, m)
            row.update({c.at(layer): n[k] for c, k in zip(self.columns[2:5], ("image", "text", "ratio"), strict=True)})
            if x is not None:
                u = modality_updates(x, y, m)
                row.update({c.at(layer): u[c.key.split("/")[1]] for c in self.columns[5:]})
        return row

    def on_model_output(self, output: Any) -> Row | None:
        self.release()
        self._current, self._share = None, {}
        return None

    def release(self) -> None:
        if self._capture is not None:
            cap, self._capture = self._capture, None
            cap.__exit__(None, None, None)


class VLMPath(_Masked):
    """The norm gap along the VLM path: the connector's input (the tower output it reads) and output, and the
    language model's input stream (its first block's input) split by modality; ``gap`` = LM-input image norm / text
    norm (the essay's 30-90x at the tower, 4.6-57 after the connector)."""

    key = "vlm_path"
    hooks = frozenset({Hook.MODEL_INPUT, Hook.MODULE_INPUT, Hook.MODULE_OUTPUT, Hook.STREAM, Hook.STEP})
    columns = (
        Column("vlm_path/tower_norm", "tower", "mean token norm of the tower output the connector reads"),
        Column("vlm_path/connector_norm", "connector", "mean token norm of the connector's output"),
        Column("vlm_path/lm_image_norm", "LM img", "mean norm of the image tokens entering the language model"),
        Column("vlm_path/lm_text_norm", "LM txt", "mean norm of the text tokens entering the language model"),
        Column("vlm_path/gap", "gap", "LM-input image norm / text norm", "x", summary="vlm gap"),
    )

    def __init__(self, connector: nn.Module, image_mask: ImageMask) -> None:
        super().__init__(image_mask)
        if not isinstance(connector, nn.Module):
            raise TypeError(f"connector={connector!r:.60} must be the connector nn.Module")
        self.connector = connector

    def modules(self) -> Iterable[nn.Module]:
        return [self.connector]

    def on_module_input(self, module: nn.Module, args: tuple[Any, ...]) -> Row | None:
        t = first_tensor(args)
        return None if t is None else {"vlm_path/tower_norm": _mean_norm(t)}

    def on_module_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Row | None:
        t = first_tensor(output)
        return None if t is None else {"vlm_path/connector_norm": _mean_norm(t)}

    def on_block(self, layer: int, x: Tensor | None, y: Tensor) -> Row | None:
        m = None if layer != 0 or x is None else self.mask_for(x)
        if m is None or x is None or x.dim() != 3:
            return None
        n = modality_norms(x, m)
        return {"vlm_path/lm_image_norm": n["image"], "vlm_path/lm_text_norm": n["text"]}

    def on_step(self, record: Mapping[str, object]) -> Row | None:
        self._current = None
        img, txt = record.get("vlm_path/lm_image_norm"), record.get("vlm_path/lm_text_norm")
        if not isinstance(img, float) or not isinstance(txt, float):
            return None
        return {"vlm_path/gap": img / txt if txt > 0 else math.nan}


def _mean_norm(t: Tensor) -> float:
    return float(t.detach().double().norm(dim=-1).mean())


class PartUpdates(MonitorMetric):
    """``part_update/<part>``: ``||W_now - W_then|| / ||W_then||`` of each part's parameters (:func:`update_ratio`),
    ``then`` the previous measured step (read before its optimizer step), and ``part_update/steps`` the optimizer
    steps between them. The first measured step has no value. Holds a copy of the parts' parameters between
    measured steps (on their device)."""

    key = "part_update"
    hooks = frozenset({Hook.STEP})
    columns = (
        Column("part_update", "update/weight", "||delta W|| / ||W|| of a part since the last measured step",
               scope=Scope.MODULE),
        Column("part_update/steps", "steps", "optimizer steps the update spans"),
    )  # fmt: skip

    def __init__(self, parts: Mapping[VLMPart | str, nn.Module | Sequence[nn.Module]]) -> None:
        self.parts = part_parameters(parts)
        self._then: dict[VLMPart, list[Tensor]] | None = None
        self._step = 0

    def on_step(self, record: Mapping[str, object]) -> Row | None:
        row: dict[str, object] = {}
        now = self.monitor.step_count
        if self._then is not None:
            for part, params in self.parts.items():
                row[self.columns[0].at(part.value)] = update_ratio(self._then[part], list(params))
            row["part_update/steps"] = now - self._step
        self._then = {part: [p.detach().clone() for p in params] for part, params in self.parts.items()}
        self._step = now
        return row


def modality_report(
    model: nn.Module,
    inputs: Mapping[str, Any] | Sequence[Any],
    image_mask: Tensor,
    *,
    blocks: Sequence[nn.Module],
    connector: nn.Module,
    max_examples: int = 4,
) -> dict[str, Any]:
    """One forward of ``model`` on ``inputs`` (keyword inputs or positional ones) without gradients, measured by
    :class:`ModalitySplit` and :class:`VLMPath`; returns the record (``modality_split/.../L<i>``, ``vlm_path/...``).
    ``blocks``: the language model's layers in depth order; ``connector``: the connector module."""
    from .monitor import Monitor

    _mask(image_mask)
    metrics = [ModalitySplit(image_mask), VLMPath(connector, image_mask)]
    mon: Monitor = Monitor(
        model, every=1, metrics=metrics, blocks=list(blocks), alarms=[], print_alarms=False, max_examples=max_examples
    )
    try:
        with torch.no_grad():
            if isinstance(inputs, Mapping):
                model(**inputs)
            else:
                model(*inputs)
        mon.step()
    finally:
        mon.close()
    return dict(mon.last)
