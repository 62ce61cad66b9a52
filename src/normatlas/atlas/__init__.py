"""The essay's model matrix and bibliography, as data (``normatlas/data/*.json``).

Every record carries its ``source`` (essay section, paper or reference code). A model
record states what the model does: ``status`` says where its design fields come from
(``"essay"``: as the essay states them; ``"code"``: read off the reference code, the
``source`` then starting ``"code:"`` with the file and class; ``"unclear"``: some field
is not known). Where the essay says otherwise, ``essay_differs`` quotes the essay's claim
(else ``None``); :func:`essay_differences` lists those records. The bibliography lives in
:mod:`normatlas.atlas.papers` (re-exported here) and the method-to-paper registry in
:mod:`normatlas.atlas.citations`. :func:`check` reconciles the matrix with the design
:func:`normatlas.inspect.inspect_model` reads off transformers' reference code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from importlib import resources
from typing import Any

from ..vocabulary import Operator, PlacementKind, QKNormKind
from .papers import PAPER_FIELDS, filter_papers, papers

__all__ = [
    "CONNECTORS",
    "MODEL_FIELDS",
    "OPERATORS",
    "PAPER_FIELDS",
    "PLACEMENTS",
    "QK_NORMS",
    "SOURCES",
    "STATUSES",
    "VLM_FIELDS",
    "check",
    "essay_differences",
    "filter_models",
    "filter_papers",
    "models",
    "papers",
    "validate_model",
]

MODEL_FIELDS = (
    "name",
    "family",
    "kind",
    "year",
    "operator",
    "placement",
    "qk_norm",
    "gain_convention",
    "residual",
    "vision_tower",
    "vision_tower_norm",
    "connector",
    "connector_norm",
    "hf_model_types",
    "status",
    "source",
    "essay_differs",
    "notes",
)
UNCLEAR = "unclear"  # neither code nor paper within reach says
# The design fields speak the design vocabulary (normatlas.vocabulary), spelled by each enum's value, plus
# ``unclear``; a model-level operator the vocabulary has no site operator for (BatchNorm, whose statistics span
# the batch; DiT's adaLN-Zero) and ``yes`` (a QK-norm whose kind the source does not give) are the only additions.
# The operator is the norm on the activations: weights normalised in place (Weight Standardization in BiT and
# NFNets) are recorded under ``residual``, beside the activation norm (BiT: GroupNorm; NFNets: none).
_RECORD_OPERATORS = (Operator.LAYERNORM, Operator.RMSNORM, Operator.NONE, Operator.L2, Operator.GROUPNORM)
OPERATORS = (*(o.value for o in _RECORD_OPERATORS), "batchnorm", "adaLN-Zero", UNCLEAR)
PLACEMENTS = (*(p.value for p in PlacementKind if p not in (PlacementKind.UNKNOWN, PlacementKind.PRE_POST)), UNCLEAR)
QK_NORMS = (*(q.value for q in QKNormKind if q is not QKNormKind.MIXED), "yes", UNCLEAR)
STATUSES = ("essay", "code", "paper", UNCLEAR)
_DESIGN = {"operator": OPERATORS, "placement": PLACEMENTS, "qk_norm": QK_NORMS}
# A VLM row's connector: the kinds the inspector reads off the dataflow (normatlas.inspect.vlm.ConnectorKind's
# values; tests/test_atlas_vlm.py keeps the two equal), plus the gated cross-attention of Flamingo-style models.
CONNECTORS = (
    "linear", "mlp", "patch-merger", "pooling", "resampler", "soft-tokens", "vq-tokens", "none",
    "gated-cross-attention",
)  # fmt: skip
# The part fields, their allowed values (None: not a VLM / not applicable) and the inspected summary key
# ``matrix --check`` compares them with (the tower's operator, the connector's kind and its first norm).
VLM_FIELDS = {"vision_tower_norm": OPERATORS, "connector": CONNECTORS, "connector_norm": OPERATORS}
SOURCES = ("essay", "code:", "paper:")


def _load(name: str) -> list[dict[str, Any]]:
    text = resources.files("normatlas").joinpath("data").joinpath(name).read_text(encoding="utf-8")
    return list(json.loads(text))


def validate_model(rec: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the record and field where a model record breaks the schema."""
    name = rec.get("name")
    if tuple(rec) != MODEL_FIELDS:
        raise ValueError(f"model {name!r}: fields are {tuple(rec)}, expected {MODEL_FIELDS}")
    for field, allowed in _DESIGN.items():
        if rec[field] not in allowed:
            raise ValueError(f"model {name!r}: {field}={rec[field]!r} is not one of {', '.join(allowed)}")
    for field, allowed in VLM_FIELDS.items():
        if rec[field] is not None and rec[field] not in allowed:
            raise ValueError(f"model {name!r}: {field}={rec[field]!r} is not None or one of {', '.join(allowed)}")
    source, differs = rec["source"], rec["essay_differs"]
    if not isinstance(source, str) or not source.startswith(SOURCES):
        raise ValueError(f"model {name!r}: source={source!r} must start with one of {', '.join(SOURCES)}")
    _check_paper_keys(name, source)
    unclear = UNCLEAR in (rec["operator"], rec["placement"], rec["qk_norm"])
    want = (
        "unclear"
        if unclear
        else next(st for st, pre in zip(("essay", "code", "paper"), SOURCES, strict=True) if source.startswith(pre))
    )
    if rec["status"] != want:
        raise ValueError(f"model {name!r}: status={rec['status']!r}, expected {want!r} (from its fields and source)")
    if differs is not None and not (isinstance(differs, str) and differs.startswith("essay")):
        raise ValueError(f"model {name!r}: essay_differs={differs!r} must be None or quote the essay ('essay ...')")
    if differs is not None and not source.startswith(("code:", "paper:")):
        raise ValueError(f"model {name!r}: essay_differs is set, so source must name the code or the paper")


def _check_paper_keys(name: object, source: str) -> None:
    """Every ``paper:KEY`` in a source names a record of the bibliography."""
    import re

    known = {p["key"] for p in papers()}
    for key in re.findall(r"paper:\s*([a-z][a-z0-9_]*)", source):
        if key not in known:
            raise ValueError(f"model {name!r}: source cites paper:{key}, which is not a key of papers.json")


@cache
def _models() -> tuple[dict[str, Any], ...]:
    records = _load("models.json")
    for rec in records:
        validate_model(rec)
    return tuple(records)


def models() -> list[dict[str, Any]]:
    """Every model / family record (copies)."""
    return [dict(r) for r in _models()]


def _choice(name: str, value: str | None, allowed: Iterable[str]) -> str | None:
    if value is None:
        return None
    allowed = tuple(allowed)
    if value.lower() not in {a.lower() for a in allowed}:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value.lower()


def _matches(rec: Mapping[str, Any], query: str | None) -> bool:
    return query is None or query.lower() in json.dumps(rec, ensure_ascii=False).lower()


def filter_models(
    *,
    family: str | None = None,
    operator: str | None = None,
    placement: str | None = None,
    qk_norm: str | None = None,
    query: str | None = None,
) -> list[dict[str, Any]]:
    """Model records matching every given filter (case-insensitive; ``query`` searches all fields)."""
    operator = _choice("operator", operator, OPERATORS)
    placement = _choice("placement", placement, PLACEMENTS)
    qk_norm = _choice("qk_norm", qk_norm, QK_NORMS)
    out = []
    for r in models():
        if family and family.lower() not in (r["family"] or "").lower():
            continue
        if operator and (r["operator"] or "").lower() != operator:
            continue
        if placement and r["placement"] != placement:
            continue
        if qk_norm and r["qk_norm"] != qk_norm:
            continue
        if _matches(r, query):
            out.append(r)
    return out


def essay_differences() -> list[dict[str, Any]]:
    """Records whose design differs from what the essay says: name, the design, and the essay's claim."""
    keys = ("name", "hf_model_types", "operator", "placement", "qk_norm", "essay_differs", "source")
    return [{k: r[k] for k in keys} for r in models() if r["essay_differs"] is not None]


def _same(field: str, curated: str, inspected: str) -> bool:
    """Whether a record's value and an inspected summary's agree, compared as vocabulary members: a record's
    ``layernorm`` covers the non-parametric LayerNorm, its ``yes`` any QK-norm kind."""
    if field == "operator" and inspected == Operator.LAYERNORM_NONPARAM.value:
        inspected = Operator.LAYERNORM.value
    if field == "qk_norm" and curated == "yes":
        return inspected not in (QKNormKind.NONE.value, UNCLEAR)
    return curated == inspected


def check(
    inspected: Callable[[str], Mapping[str, Any]] | Mapping[str, Mapping[str, Any]], include_agreements: bool = False
) -> list[dict[str, Any]]:
    """Reconcile curated records with inspected dataflow summaries.

    ``inspected`` maps a transformers model type to a summary row (as from
    :meth:`InspectionReport.summary_row` or the sweep), or is a function computing it.
    One row per (record, model type, field) that disagrees, or resolves an ``unclear``
    entry (plus agreements when asked); a model type that failed gives an ``error`` row.
    """
    get = inspected if callable(inspected) else lambda mt: inspected.get(mt, {"error": "not inspected"})
    rows = []
    for rec in models():
        for mt in rec["hf_model_types"]:
            try:
                summ = dict(get(mt))
            except Exception as exc:  # a model type that cannot be built is reported, not raised
                summ = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"}
            if summ.get("error"):
                rows.append(
                    {
                        "model": rec["name"],
                        "hf_model_type": mt,
                        "field": "-",
                        "curated": "-",
                        "inspected": "-",
                        "verdict": "error: " + str(summ["error"])[:90],
                        "source": rec["source"],
                    }
                )
                continue
            for field in ("operator", "placement", "qk_norm", "gain_convention", *VLM_FIELDS):
                cur, got = rec.get(field), summ.get(field)
                if cur is None or got is None:
                    continue
                if cur == "unclear":
                    verdict = "resolves unclear"
                elif _same(field, str(cur), str(got)):
                    if not include_agreements:
                        continue
                    verdict = "agrees"
                else:
                    verdict = "DISAGREES"
                rows.append(
                    {
                        "model": rec["name"],
                        "hf_model_type": mt,
                        "field": field,
                        "curated": cur,
                        "inspected": got,
                        "verdict": verdict,
                        "source": rec["source"],
                    }
                )
    return rows
