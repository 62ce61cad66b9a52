"""The essay's bibliography as data (``normatlas/data/papers.json``), grouped by the question each paper answers.

A record is one paper, method or model report. ``title`` and ``arxiv`` are set only where a public
page showed them together: ``verified`` is that page's address and ``verification`` says what the
page shows. A record whose title and id could not be confirmed has ``verified = None``, no title
and no id, and ``verification`` says what could not be confirmed (``first_author`` / ``year`` then
come from the essay's own wording, if at all). ``url`` / ``doi`` locate a paper that is not on arXiv.
``named_as`` quotes the essay verbatim where the essay names the paper; ``source`` says where the
record comes from (``essay ...``, ``library: ...`` for a method the library implements, or
``related: ...`` for a paper the issue asked for that neither names). ``essay_differs`` says, with
its source, where the essay is wrong or unsourced about the paper.

:func:`paper_link` is the paper's own link (``https://arxiv.org/abs/<id>``, else ``url``, else the DOI);
:func:`title_search_url` is the fallback that finds it by title if an id is ever stale.
``verified`` covers the title and the id; ``first_author``, ``venue`` and the year of a confirmed
record are curated alongside it. Import from this module by name (``from normatlas.atlas.papers
import paper_link``): the package attribute ``normatlas.atlas.papers`` is the function :func:`papers`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import quote_plus

__all__ = [
    "PAPER_FIELDS",
    "PAPER_GROUPS",
    "filter_papers",
    "paper",
    "paper_link",
    "paper_row",
    "papers",
    "title_search_url",
    "validate_paper",
]

PAPER_FIELDS = (
    "key",
    "title",
    "first_author",
    "year",
    "venue",
    "arxiv",
    "url",
    "doi",
    "group",
    "question",
    "named_as",
    "source",
    "verified",
    "verification",
    "essay_differs",
)
PAPER_GROUPS = (
    "Why does normalization help?",
    "Which operator: BatchNorm, LayerNorm, RMSNorm and the long tail?",
    "Where does the norm sit relative to the residual?",
    "Why do deep Pre-LN layers do so little?",
    "How are attention logits kept bounded?",
    "Can normalization be removed?",
    "What happens at the vision-language interface?",
    "What matters when you ship it?",
    "Which design did each model family ship?",
)
ARXIV_ID = re.compile(r"(\d{2})(\d{2})\.(\d{4,5})|[a-z-]+(\.[A-Z]{2})?/\d{7}")
_KEY = re.compile(r"[a-z][a-z0-9_]*")
_URL = re.compile(r"https?://[^\s/]+\.[^\s/]+(/\S*)?")
_SOURCES = ("essay", "library:", "related:")


def _fail(key: object, message: str) -> None:
    raise ValueError(f"paper {key!r}: {message}")


def validate_paper(rec: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the record and field where a paper record breaks the schema."""
    key = rec.get("key")
    if tuple(rec) != PAPER_FIELDS:
        _fail(key, f"fields are {tuple(rec)}, expected {PAPER_FIELDS}")
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        _fail(key, "key must be lower-case letters, digits and '_', starting with a letter")
    if rec["group"] not in PAPER_GROUPS:
        _fail(key, f"group={rec['group']!r} is not one of {', '.join(PAPER_GROUPS)}")
    if not isinstance(rec["question"], str) or len(rec["question"]) < 10:
        _fail(key, f"question={rec['question']!r} must say what the paper answers")
    if not isinstance(rec["source"], str) or not rec["source"].startswith(_SOURCES):
        _fail(key, f"source={rec['source']!r} must start with one of {', '.join(_SOURCES)}")
    year = rec["year"]
    if year is not None and not (isinstance(year, int) and 1950 <= year <= 2026):
        _fail(key, f"year={year!r} must be an int between 1950 and 2026, or None")
    arxiv = rec["arxiv"]
    if arxiv is not None:
        match = ARXIV_ID.fullmatch(arxiv) if isinstance(arxiv, str) else None
        if match is None:
            _fail(key, f"arxiv={arxiv!r} is not an arXiv id like 1910.07467 (or hep-th/9901001)")
        elif match.group(1) is not None:
            yy, mm = int(match.group(1)), int(match.group(2))
            if not 1 <= mm <= 12:
                _fail(key, f"arxiv={arxiv!r}: month {mm:02d} is not 01-12")
            if len(match.group(3)) != (5 if yy * 100 + mm >= 1501 else 4):
                _fail(key, f"arxiv={arxiv!r}: ids from 2015 on have 5 digits after the dot, earlier ones 4")
            if year is not None and abs(2000 + yy - year) > 1:
                _fail(key, f"arxiv={arxiv!r} was posted in 20{yy:02d}, more than a year from year={year}")
    for field in ("url", "verified"):
        if rec[field] is not None and not (isinstance(rec[field], str) and _URL.fullmatch(rec[field])):
            _fail(key, f"{field}={rec[field]!r} is not an http(s) URL")
    if rec["doi"] is not None and not (isinstance(rec["doi"], str) and rec["doi"].startswith("10.")):
        _fail(key, f"doi={rec['doi']!r} must start with '10.'")
    if not isinstance(rec["verification"], str) or not rec["verification"]:
        _fail(key, "verification must say what the verified page shows, or what could not be confirmed")
    if rec["verified"] is None:
        if rec["title"] is not None or arxiv is not None:
            _fail(key, "title and arxiv are set only where a page confirmed them (verified is None)")
    elif not rec["title"] or (arxiv is None and rec["url"] is None and rec["doi"] is None):
        _fail(key, "a verified paper has a title and an arXiv id, a URL or a DOI")
    if rec["named_as"] is None and rec["source"].startswith("essay"):
        _fail(key, "source cites the essay, so named_as must quote how the essay names it")
    differs = rec["essay_differs"]
    if differs is not None and not (isinstance(differs, str) and differs.startswith("essay") and "http" in differs):
        _fail(key, "essay_differs must start with 'essay' (what it says) and give a source URL")


def _load() -> list[dict[str, Any]]:
    text = resources.files("normatlas").joinpath("data").joinpath("papers.json").read_text(encoding="utf-8")
    return list(json.loads(text))


@cache
def _papers() -> tuple[dict[str, Any], ...]:
    records = _load()
    seen: set[str] = set()
    for rec in records:
        validate_paper(rec)
        if rec["key"] in seen:
            _fail(rec["key"], "the key is used twice")
        seen.add(rec["key"])
    return tuple(records)


def papers() -> list[dict[str, Any]]:
    """Every paper record (copies), in the essay's grouping order."""
    return [dict(r) for r in _papers()]


def paper(key: str) -> dict[str, Any]:
    """The record with this key; ``KeyError`` naming the key otherwise."""
    for rec in _papers():
        if rec["key"] == key:
            return dict(rec)
    raise KeyError(f"no paper with key {key!r}")


def paper_link(rec: Mapping[str, Any]) -> str | None:
    """The paper's own link: its arXiv abstract page, else its URL, else its DOI; None when unconfirmed."""
    if rec.get("arxiv"):
        return f"https://arxiv.org/abs/{rec['arxiv']}"
    if rec.get("url"):
        return str(rec["url"])
    if rec.get("doi"):
        return f"https://doi.org/{rec['doi']}"
    return None


def title_search_url(rec: Mapping[str, Any]) -> str | None:
    """An arXiv title search for the paper (the fallback if an id is stale); None without a title."""
    title = rec.get("title")
    if not title:
        return None
    return f"https://arxiv.org/search/?query={quote_plus(str(title))}&searchtype=title"


def paper_row(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A record plus its derived ``link``, ``search`` and the library objects that cite it (``implemented_by``)."""
    from .citations import citations_for

    return {
        **rec,
        "link": paper_link(rec),
        "search": title_search_url(rec),
        "implemented_by": citations_for(rec["key"]),
    }


def _matches(rec: Mapping[str, Any], query: str | None) -> bool:
    return query is None or query.lower() in json.dumps(rec, ensure_ascii=False).lower()


def filter_papers(
    *, group: str | None = None, query: str | None = None, verified: bool | None = None
) -> list[dict[str, Any]]:
    """Paper records whose group/question contains ``group``, any field contains ``query`` (case-insensitive),
    and (when given) whose title and id were confirmed (``verified=True``) or not (``False``)."""
    return [
        r
        for r in papers()
        if (group is None or group.lower() in (r["group"] + " " + r["question"]).lower())
        and _matches(r, query)
        and (verified is None or (r["verified"] is not None) == verified)
    ]
