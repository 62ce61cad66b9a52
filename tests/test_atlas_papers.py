"""The bibliography: every record is well-formed, confirmed or says why not, and named by the essay or cited by the
library."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from normatlas import atlas
from normatlas.atlas.citations import CITATIONS, citations_for
from normatlas.atlas.papers import (
    PAPER_FIELDS,
    PAPER_GROUPS,
    filter_papers,
    paper,
    paper_link,
    paper_row,
    papers,
    title_search_url,
    validate_paper,
)

PAPERS = papers()
ESSAY = Path("/work/shared/essay/the-geometry-of-normalization.txt")
CITED = {key for keys in CITATIONS.values() for key in keys}
NEW_STYLE = re.compile(r"(\d{2})(\d{2})\.(\d{4,5})")


def _essay() -> str:
    return ESSAY.read_text(encoding="utf-8") if ESSAY.exists() else ""


@pytest.mark.parametrize("rec", PAPERS, ids=[r["key"] for r in PAPERS])
def test_paper_record(rec: dict) -> None:
    validate_paper(rec)
    assert tuple(rec) == PAPER_FIELDS and rec["group"] in PAPER_GROUPS and rec["group"].endswith("?")
    assert rec["year"] is None or 1950 <= rec["year"] <= 2026
    if rec["arxiv"] is not None:
        yy, mm, _ = NEW_STYLE.fullmatch(rec["arxiv"]).groups()  # every id here is new-style
        assert 1 <= int(mm) <= 12 and rec["year"] is not None and abs(2000 + int(yy) - rec["year"]) <= 1
        assert paper_link(rec) == f"https://arxiv.org/abs/{rec['arxiv']}"
    if rec["verified"] is None:  # nothing recalled from memory: no title, no id, and the reason
        assert rec["title"] is None and rec["arxiv"] is None and paper_link(rec) is None
        assert len(rec["verification"]) > 30
    else:
        page = urlparse(rec["verified"])
        assert page.scheme == "https" and "." in page.netloc and " " not in rec["verified"]
        assert rec["title"] and rec["verification"]
        assert paper_link(rec) is not None
        assert rec["verified"] != paper_link(rec), "the confirming page is a page other than the link it confirms"


@pytest.mark.parametrize("rec", PAPERS, ids=[r["key"] for r in PAPERS])
def test_paper_is_named_by_the_essay_or_cited_by_the_library(rec: dict) -> None:
    if rec["named_as"] is not None and ESSAY.exists():
        assert rec["named_as"] in _essay(), "named_as quotes the essay verbatim"
    if rec["source"].startswith("library:") or "; library:" in rec["source"]:
        assert rec["key"] in CITED, "a record whose source is the library is cited by the registry"
    if rec["named_as"] is None:
        assert rec["key"] in CITED or rec["source"].startswith("related:")


@pytest.mark.parametrize("rec", [r for r in PAPERS if r["title"]], ids=[r["key"] for r in PAPERS if r["title"]])
def test_title_search_fallback(rec: dict) -> None:
    url = urlparse(title_search_url(rec))
    assert (url.scheme, url.netloc, url.path) == ("https", "arxiv.org", "/search/")
    assert parse_qs(url.query) == {"query": [rec["title"]], "searchtype": ["title"]}


def test_counts() -> None:
    verified = [r for r in PAPERS if r["verified"]]
    assert len(PAPERS) >= 80 and len(verified) >= 80
    assert len({r["key"] for r in PAPERS}) == len(PAPERS)
    assert sum(r["arxiv"] is not None for r in PAPERS) >= 80
    assert all(r["verification"] for r in PAPERS if r["verified"] is None)


def test_groups_are_contiguous_in_the_essays_order() -> None:
    order = list(dict.fromkeys(r["group"] for r in PAPERS))
    assert order == [g for g in PAPER_GROUPS if g in order]
    assert [r["group"] for r in PAPERS] == sorted((r["group"] for r in PAPERS), key=PAPER_GROUPS.index)


@pytest.mark.parametrize(
    "key",
    [
        "layernorm2016",
        "ioffe2015",
        "instancenorm2016",
        "groupnorm2018",
        "rmsnorm2019",
        "weight_standardization2019",
        "weightnorm2016",
        "spectralnorm2018",
        "adain2017",
        "dit2022",
        "film2018",
        "roformer2021",
        "glu_variants2020",
        "gpt2_2019",
        "logit_lens2020",
        "flashnorm2024",
        "enjoy_layernorm",
        "massive_activations2024",
        "attention_sinks2023",
        "navit2023",
        "flamingo2022",
        "blip2_2023",
        "matformer2023",
        "altup2023",
        "laurel2024",
        "santurkar2018",
        "fixup2019",
        "rezero2020",
        "skipinit2020",
        "nfnets2021",
        "ngpt2024",
        "deepnet2022",
        "mixln2025",
        "lns2025",
        "periln2025",
        "hybridnorm2025",
        "xiong2020",
        "vaswani2017",
        "vit22b2023",
        "zhai2023",
        "henry2020",
        "olmo2_2024",
        "gemma2024",
        "gemma2_2024",
        "gemma3_2025",
        "llama2023",
        "palm2022",
        "t5_2019",
        "bert2018",
        "dinov2_2023",
        "clip2021",
        "siglip2023",
        "llava2023",
        "qwen2vl2024",
        "paligemma2024",
        "chameleon2024",
        "cait2021",
        "convnext2022",
        "resnet2015",
        "vit2020",
        "efficientnet2019",
        "mae2021",
        "wav2vec2_2020",
        "simclr2020",
        "moco2019",
        "byol2020",
        "scalenorm2019",
        "fixnorm2018",
        "powernorm2020",
        "batchrenorm2017",
        "ghostbn2017",
        "frn2019",
        "evonorm2020",
        "dyt2025",
        "magneto2022",
        "normformer2021",
        "cogview2021",
        "pangu_ultra2025",
    ],
)
def test_every_paper_the_issue_lists_has_a_record(key: str) -> None:
    assert paper(key)["key"] == key


def test_unknown_key() -> None:
    with pytest.raises(KeyError, match="no paper with key 'nope'"):
        paper("nope")


# Where the essay is wrong or unsourced, the record says so with its source.
def test_entropy_collapse_is_zhai_et_al_not_vit22b() -> None:
    zhai, vit22b = paper("zhai2023"), paper("vit22b2023")
    assert zhai["arxiv"] == "2303.06296" and zhai["first_author"] == "Shuangfei Zhai"
    assert vit22b["arxiv"] == "2302.05442" and vit22b["first_author"] == "Mostafa Dehghani"
    for rec in (zhai, vit22b):
        assert "ViT-22B" in rec["essay_differs"] and "2303.06296" in rec["essay_differs"]


def test_depth_scaled_sandwich_describes_a_135b_dense_model() -> None:
    rec = paper("pangu_ultra2025")
    assert "38B" in rec["essay_differs"] and "135 billion" in rec["essay_differs"]
    assert rec["arxiv"] == "2504.07866" and rec["verified"] in rec["essay_differs"]


def test_rmsnorm_speedup_is_whole_model_running_time() -> None:
    rec = paper("rmsnorm2019")
    assert "norm op" in rec["essay_differs"] and "running time by 7%~64% on different models" in rec["essay_differs"]


def test_vlm_norm_gap_study_is_found_and_says_the_mmlu_row_is_unchecked() -> None:
    """The study is found (arXiv 2512.08374, the LayerNorm after the projector on LLaVA-1.5); the essay's '+8 MMLU'
    row is not on any page in reach, so the record says it could not be checked rather than confirming it."""
    rec = paper("vlm_norm_gap2025")
    assert rec["verified"] and rec["arxiv"] == "2512.08374"
    assert "+8 MMLU" in rec["verification"] and "could not be checked" in rec["verification"]
    # The guide's specifics are flagged as unsourced (the abstract names no number and no Llama-3.2-3B row).
    assert "+8 points with Llama-3.2-3B" in rec["essay_differs"] and "unsourced" in rec["essay_differs"]


def test_essay_differs_always_gives_a_source() -> None:
    differing = [r for r in PAPERS if r["essay_differs"]]
    assert len(differing) >= 5
    assert all(r["essay_differs"].startswith("essay") and "https://" in r["essay_differs"] for r in differing)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("group", "Is this a group?", "group="),
        ("arxiv", "1910.7467", "5 digits"),
        ("arxiv", "19107467", "not an arXiv id"),
        ("arxiv", "1913.07467", "month 13"),
        ("year", 2030, "year="),
        ("verified", "not a url", "verified="),
        ("source", "memory", "source="),
        ("essay_differs", "the essay is wrong", "essay_differs"),
        ("verification", "", "verification"),
    ],
)
def test_validate_names_the_field(field: str, value: object, message: str) -> None:
    rec = dict(paper("rmsnorm2019"), **{field: value})
    with pytest.raises(ValueError, match=rf"paper 'rmsnorm2019': .*{re.escape(message)}"):
        validate_paper(rec)


def test_unverified_records_may_not_carry_a_recalled_title_or_id() -> None:
    """Every record is confirmed now; one whose page is taken away must drop its title and id too."""
    unconfirmed = dict(paper("enjoy_layernorm"), verified=None)
    with pytest.raises(ValueError, match="only where a page confirmed them"):
        validate_paper(unconfirmed)
    validate_paper(dict(unconfirmed, title=None, arxiv=None))  # no title, no id, the reason kept: well-formed
    with pytest.raises(ValueError, match="fields are"):
        validate_paper({k: v for k, v in paper("enjoy_layernorm").items() if k != "verification"})


def test_arxiv_id_year_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="more than a year"):
        validate_paper(dict(paper("rmsnorm2019"), year=2015))


def test_filters() -> None:
    assert all("attention" in (r["group"] + r["question"]).lower() for r in filter_papers(group="attention"))
    assert {r["key"] for r in filter_papers(query="Peri-LN")} >= {"periln2025"}
    confirmed, open_ = filter_papers(verified=True), filter_papers(verified=False)
    assert len(confirmed) + len(open_) == len(PAPERS) and all(r["verified"] for r in confirmed)
    assert all(r["verified"] is None for r in open_)


def test_paper_row_links_and_implementers() -> None:
    row = paper_row(paper("dyt2025"))
    assert row["link"] == "https://arxiv.org/abs/2503.10622" and "searchtype=title" in row["search"]
    assert "normatlas.longtail.DyT" in row["implemented_by"] == citations_for("dyt2025")
    gpt2 = paper_row(paper("gpt2_2019"))
    assert gpt2["arxiv"] is None and gpt2["link"] == gpt2["url"] and gpt2["link"].startswith("https://cdn.openai.com/")


def test_atlas_reexports_the_same_names() -> None:
    import sys

    module = sys.modules["normatlas.atlas.papers"]
    assert atlas.papers is module.papers and atlas.filter_papers is module.filter_papers
    assert atlas.PAPER_FIELDS is module.PAPER_FIELDS and {"papers", "filter_papers", "PAPER_FIELDS"} <= set(
        atlas.__all__
    )
