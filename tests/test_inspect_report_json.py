"""The inspection report's JSON and summary rows are what they were when the placement and branch-scale fields
were strings: the web page and the data files read them. tests/data/inspect_reports.json holds the documents the
string-typed reports gave for the toy designs (every placement mix, learned scalar, LayerScale and constant branch
scale they show) and a DINOv2 tower (its stages' LayerScale); regenerate it only on purpose, with
``NORMATLAS_WRITE_REPORTS=1``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from normatlas.vocabulary import BranchScale, BranchScaling, PlacementKind, PlacementMix, branch_scale_word

from .test_inspect_designs import report

GOLDEN = Path(__file__).parent / "data" / "inspect_reports.json"
DESIGNS = ("deepnorm", "lns", "mixln", "hybridnorm", "rezero", "layerscale_peri", "parallel_gptj", "l2_qk_after_rope",
           "flat_ln_qk_softcap", "eps_outside")  # fmt: skip


def _clean(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without its timing (and JSON-round-tripped, as the page and the files see it)."""
    doc = {k: v for k, v in doc.items() if k != "seconds"}
    return json.loads(json.dumps(doc, default=str))


def documents() -> dict[str, Any]:
    from normatlas.inspect import inspect_vision_target

    out: dict[str, Any] = {}
    for name in DESIGNS:
        r = report(name)
        out[name] = {"detail": _clean(r.to_dict()), "row": _clean(r.summary_row())}
    v = inspect_vision_target("dinov2", probe=False)
    out["vision:dinov2"] = {
        "detail": _clean(v.to_dict()),
        "brief": _clean(v.to_dict(detail=False)),
        "row": _clean(v.summary_row()),
    }
    return out


def test_reports_serialise_as_before() -> None:
    got = documents()
    if os.environ.get("NORMATLAS_WRITE_REPORTS") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert set(got) == set(want)
    for name in want:
        for view in want[name]:
            assert got[name][view] == want[name][view], (name, view)
    # the typed fields this file pins are all there, with values of each kind
    words = {want[n]["row"]["branch_scale"] for n in want}
    assert {"learned scalar", "per-channel", None} <= words and any(w and w[0].isdigit() for w in words), words
    mixes = {want[n]["row"][k] for n in want for k in ("placement_attention", "placement_mlp", "placement_mixer")}
    assert {"n/a", "pre", "none"} <= mixes and any(m.startswith("mix(") for m in mixes), mixes


def test_branch_scale_and_placement_mix_spell_as_the_reports_did() -> None:
    """The spellings, against the string code they replace: parts sorted and joined; a summary joins the distinct
    sublayer spellings; ``mix(...)`` names the sequence, with counts past 8 sublayers."""
    a = BranchScale.of([0.5, BranchScaling.LEARNED_SCALAR, 0.50000001])
    b = BranchScale.of([0.5])
    assert a.value == ", ".join(sorted({f"{0.5:.6g}", "learned scalar", f"{0.50000001:.6g}"})) == "0.5, learned scalar"
    assert branch_scale_word(frozenset({a, b})) == ", ".join(sorted({a.value, b.value})) == "0.5, 0.5, learned scalar"
    assert branch_scale_word(BranchScale()) is None and branch_scale_word(frozenset()) is None and not BranchScale()
    assert (
        a | BranchScale.of([BranchScaling.PER_CHANNEL, 1 / 3])
    ).value == "0.333333, 0.5, learned scalar, per-channel"
    assert BranchScale.parse(a.value) == a and BranchScale.parse("") == BranchScale()
    pre, post = PlacementKind.PRE, PlacementKind.POST
    assert PlacementMix().value == "n/a" and PlacementMix((pre, pre)).value == "pre"
    assert PlacementMix((post, pre, pre)).value == "mix(post,pre,pre)"
    assert PlacementMix((post,) * 2 + (pre,) * 10).value == "mix(post x2, pre x10)"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: BranchScale.parse("0.5, learned"), ValueError,
         r"branch_scale='0.5, learned': part 'learned' is neither a finite number nor one of 'learned scalar', "
         r"'per-channel'"),
        (lambda: BranchScale.parse("nan"), ValueError,
         r"branch_scale='nan': part 'nan' is neither a finite number"),
        (lambda: BranchScale(frozenset({"0.5"})), TypeError,
         r"constants=frozenset\(\{'0.5'\}\) must be a frozenset of floats"),
        (lambda: BranchScale(learned=frozenset({"per-channel"})),
         TypeError, r"learned=frozenset\(\{'per-channel'\}\) must be a frozenset of BranchScaling.LEARNED_SCALAR, "
         r"BranchScaling.PER_CHANNEL"),
        (lambda: PlacementMix(("pre",)), TypeError,
         r"kinds=\('pre',\) must be a tuple of PlacementKind.PRE, "),
    ],
)  # fmt: skip
def test_bad_values_name_the_parameter_and_what_is_allowed(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()
