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

import enum
import json
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from importlib import resources
from typing import Any

from ..vocabulary import EmbeddingScale, Operator
from .design import DESIGN_FIELDS, SOFTCAP_FIELDS, UNCLEAR, VLM_TYPED, Unclear, allowed, parse_field, typed_design
from .papers import PAPER_FIELDS, filter_papers, papers

__all__ = [
    "CONNECTORS",
    "DESIGN_FIELDS",
    "MISSING",
    "MODEL_FIELDS",
    "OPERATORS",
    "PAPER_FIELDS",
    "PLACEMENTS",
    "QK_NORMS",
    "SOURCES",
    "STATUSES",
    "UNCLEAR",
    "VLM_FIELDS",
    "check",
    "essay_differences",
    "filter_models",
    "filter_papers",
    "inspected_value",
    "models",
    "papers",
    "typed_design",
    "validate_model",
]

MODEL_FIELDS = (
    "name",
    "family",
    "kind",
    "year",
    *DESIGN_FIELDS[: DESIGN_FIELDS.index("embedding_scale") + 1],  # the text stack's design, operator first
    "residual",
    "vision_tower",
    *VLM_TYPED,
    "hf_model_types",
    "papers",
    "status",
    "source",
    "essay_differs",
    "notes",
)
# The design fields speak the design vocabulary (normatlas.vocabulary), spelled by each enum's value, plus
# ``unclear`` (normatlas.atlas.design parses them); a model-level operator the vocabulary has no site operator for
# (BatchNorm, whose statistics span the batch; DiT's adaLN-Zero) is the only addition (design.RecordOperator).
# The operator is the norm on the activations: weights normalised in place (Weight Standardization in BiT and
# NFNets) are recorded under ``residual``, beside the activation norm (BiT: GroupNorm; NFNets: none).
OPERATORS = allowed("operator")
PLACEMENTS = allowed("placement")
QK_NORMS = allowed("qk_norm")
STATUSES = ("essay", "code", "paper", UNCLEAR)
_CORE = ("operator", "placement", "qk_norm")  # the fields ``status`` summarises
# A VLM row's connector: the kinds the inspector reads off the dataflow (normatlas.vocabulary.ConnectorKind's
# values), plus the gated cross-attention of Flamingo-style models (Injection.GATED_CROSS_ATTENTION).
CONNECTORS = tuple(a for a in allowed("connector") if a != UNCLEAR)
# The part fields and their allowed values (None: not a VLM); ``matrix --check`` compares them with the tower's
# operator, the connector's kind and its first norm.
VLM_FIELDS = {f: allowed(f) for f in VLM_TYPED}
SOURCES = ("essay", "code:", "paper:")


def _load(name: str) -> list[dict[str, Any]]:
    text = resources.files("normatlas").joinpath("data").joinpath(name).read_text(encoding="utf-8")
    return list(json.loads(text))


def validate_model(rec: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the record and field where a model record breaks the schema: every design field
    parses into its enum (the message names the field, the value and the allowed values)."""
    name = rec.get("name")
    if tuple(rec) != MODEL_FIELDS:
        raise ValueError(f"model {name!r}: fields are {tuple(rec)}, expected {MODEL_FIELDS}")
    design = typed_design(rec)
    if (design["connector"] is None) != (design["connector_norm"] is None):
        raise ValueError(f"model {name!r}: connector and connector_norm are both set (an image-text model) or null")
    if design["connector"] is not None and design["vision_tower_norm"] is None:
        raise ValueError(f"model {name!r}: an image-text model's vision_tower_norm is set (or 'unclear')")
    year = rec["year"]
    if year is not None and not (isinstance(year, int) and 1990 <= year <= 2026):
        raise ValueError(f"model {name!r}: year={year!r} must be an int between 1990 and 2026, or null")
    keys = rec["papers"]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"model {name!r}: papers={keys!r} must be a list of papers.json keys")
    source, differs = rec["source"], rec["essay_differs"]
    if not isinstance(source, str) or not source.startswith(SOURCES):
        raise ValueError(f"model {name!r}: source={source!r} must start with one of {', '.join(SOURCES)}")
    _check_paper_keys(name, source, keys)
    unclear = any(design[f] is Unclear.UNCLEAR for f in _CORE)
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


def _check_paper_keys(name: object, source: str, keys: list[str]) -> None:
    """Every ``paper:KEY`` in a source and every key of ``papers`` names a record of the bibliography."""
    import re

    known = {p["key"] for p in papers()}
    for key in re.findall(r"paper:\s*([a-z][a-z0-9_]*)", source):
        if key not in known:
            raise ValueError(f"model {name!r}: source cites paper:{key}, which is not a key of papers.json")
    for key in keys:
        if key not in known:
            raise ValueError(f"model {name!r}: papers lists {key!r}, which is not a key of papers.json")


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
        if operator and r["operator"].lower() != operator:
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
    keys = ("name", "hf_model_types", "operator", "placement", "qk_norm", "papers", "essay_differs", "source")
    return [{k: r[k] for k in keys} for r in models() if r["essay_differs"] is not None]


def inspected_value(field: str, row: Mapping[str, Any]) -> Any:
    """An inspected summary row's value for a record field, as the record's type: an enum member, a soft-cap as a
    float or None, the embedding scale as :class:`EmbeddingScale` of the scale and the row's hidden size; the
    ``MISSING`` sentinel where the row does not report the field."""
    if field not in row:
        return MISSING
    value = row[field]
    if field in SOFTCAP_FIELDS:
        return None if value is None else float(value)
    if field == "embedding_scale":
        return EmbeddingScale.of(value, row.get("hidden_size"))
    if value is None:
        return MISSING
    return parse_field(row.get("model"), field, value)


MISSING = object()


def _same(field: str, curated: Any, inspected: Any) -> bool:
    """Whether a record's typed value and an inspected one agree: a record's ``layernorm`` operator covers the
    non-parametric LayerNorm (OLMo's), a soft-cap agrees within 1e-6."""
    if field == "operator" and inspected is Operator.LAYERNORM_NONPARAM:
        inspected = Operator.LAYERNORM
    if isinstance(curated, float) and isinstance(inspected, float):
        return abs(curated - inspected) <= 1e-6 * max(1.0, abs(curated))
    return bool(curated == inspected)


def _word(value: Any) -> Any:
    """A typed value as the data file spells it."""
    if value is None:
        return "none"
    return value.value if isinstance(value, enum.Enum) else value


def check(
    inspected: Callable[[str], Mapping[str, Any]] | Mapping[str, Mapping[str, Any]], include_agreements: bool = False
) -> list[dict[str, Any]]:
    """Reconcile curated records with inspected dataflow summaries, field by typed field (:data:`DESIGN_FIELDS`).

    ``inspected`` maps a transformers model type to a summary row (as from
    :meth:`InspectionReport.summary_row` or the sweep), or is a function computing it.
    One row per (record, model type, field) that disagrees, or resolves an ``unclear``
    entry (plus agreements when asked); a model type that failed gives an ``error`` row.
    A field the row does not report (a text model's connector) is not compared.
    """
    get = inspected if callable(inspected) else lambda mt: inspected.get(mt, {"error": "not inspected"})
    rows = []
    for rec in models():
        design = typed_design(rec)
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
            for field in DESIGN_FIELDS:
                cur = design[field]
                if field in VLM_TYPED and cur is None:
                    continue
                got = inspected_value(field, summ)
                if got is MISSING:
                    continue
                if cur is Unclear.UNCLEAR:
                    verdict = "resolves unclear"
                elif _same(field, cur, got):
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
                        "curated": _word(cur),
                        "inspected": _word(got),
                        "verdict": verdict,
                        "source": rec["source"],
                    }
                )
    return rows
