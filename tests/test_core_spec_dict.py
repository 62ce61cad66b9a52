"""``NormSpec.to_dict`` / ``from_dict``: the one data-file form of a spec (surgery manifests, reports)."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from normatlas.spec import Axis, CastOrder, EpsPlacement, Gain, GainConvention, Layout, NormSpec, Scale


@st.composite
def specs(draw: st.DrawFn) -> NormSpec:
    """Any valid spec: draw fields, keep the combinations the constructor accepts."""
    layout = draw(st.sampled_from([Layout.BTD, Layout.NCHW, Layout.N_ANY_C, Layout.NC_ANY, Layout.NLC]))
    reduce = draw(st.sets(st.sampled_from(list(Axis)), min_size=1))
    gain = draw(st.sampled_from(list(Gain)))
    kw = dict(
        layout=layout, reduce=frozenset(reduce), center=draw(st.booleans()), scale=draw(st.sampled_from(list(Scale))),
        eps=draw(st.one_of(st.none(), st.floats(1e-12, 1e-1))), eps_placement=draw(st.sampled_from(list(EpsPlacement))),
        cast_order=draw(st.sampled_from(list(CastOrder))), gain=gain, bias=draw(st.booleans()),
        gain_convention=draw(st.sampled_from(list(GainConvention))) if gain is not Gain.NONE else GainConvention.W,
        groups=draw(st.sampled_from([1, 2, 4])) if Axis.FEATURE in reduce else 1,
    )  # fmt: skip
    try:
        return NormSpec(**kw)
    except ValueError:
        assume(False)
        raise


@given(specs())
def test_round_trip_through_json(spec: NormSpec) -> None:
    d = spec.to_dict()
    back = NormSpec.from_dict(json.loads(json.dumps(d)))
    assert back == spec and hash(back) == hash(spec)
    assert all(isinstance(v, (str, int, float, bool, list, type(None))) for v in d.values())


def test_from_dict_takes_defaults_and_names_and_parses_members() -> None:
    assert NormSpec.from_dict({}) == NormSpec()
    assert NormSpec.from_dict({"center": False, "cast_order": "BEFORE_GAIN"}) == NormSpec(
        center=False, cast_order=CastOrder.BEFORE_GAIN
    )


@pytest.mark.parametrize(
    ("d", "exc", "match"),
    [
        ({"centre": True}, ValueError, r"unknown NormSpec field\(s\) \['centre'\]"),
        ({"scale": "std"}, ValueError, r"scale='std' is not a valid Scale; allowed: 'rms', 'l2', 'none'"),
        ({"reduce": ["feature", "time"]}, ValueError, r"reduce='time' is not a valid Axis"),
        ({"eps": -1.0}, ValueError, r"eps=-1.0 must be a finite float > 0"),
        ([("center", True)], TypeError, r"must be a mapping"),
    ],
)
def test_from_dict_refuses_bad_input_by_name(d: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        NormSpec.from_dict(d)  # type: ignore[arg-type]
