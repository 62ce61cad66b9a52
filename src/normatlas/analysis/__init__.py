"""The analysis substrate: everything that reads a model shares this one recorder, op table, walker and probe.

* :mod:`.graph`: the recorder (:func:`record`): one eager forward under a ``TorchFunctionMode``,
  one :class:`Node` per torch call, module invocations as :class:`Span` labels;
* :mod:`.flow`: the coarse view (:func:`collapse`, :func:`record_flow`): one :class:`Call` per
  parameter-owning module, and the who-reads-who-writes queries of :class:`Dataflow`;
* :mod:`.ops`: the one op table (what counts as a cast, a view, a split, a projection);
* :mod:`.walk`: the one walker over the fine graph (value-preserving chains, constant and learned scalings);
* :mod:`.probe`: the behavioural probe that decides, from behaviour alone, whether a module is a norm
  and measures its :class:`~normatlas.spec.NormSpec` (:class:`NormFacts`).

The words these readers report in are the design vocabulary, :mod:`normatlas.vocabulary` (placement
kind, operator, QK-norm kind, RoPE order) and :mod:`normatlas.spec` (eps placement, cast order, gain
convention), shared with the blocks that write designs. The readers built on this package are
:mod:`normatlas.inspect`, :mod:`normatlas.surgery` and :mod:`normatlas.diagnostics`; none of them
keeps a recorder, op set or norm recogniser of its own.
"""

from __future__ import annotations

from .flow import Call, Dataflow, collapse, linear_kind, owns_parameters, record_flow
from .graph import Graph, Node, Ref, Span, record
from .ops import op_name
from .probe import NormFacts, ParamRole, param_roles, probe, randomized, respond, restoring

__all__ = [
    "Call",
    "Dataflow",
    "Graph",
    "Node",
    "NormFacts",
    "ParamRole",
    "Ref",
    "Span",
    "collapse",
    "linear_kind",
    "op_name",
    "owns_parameters",
    "param_roles",
    "probe",
    "randomized",
    "record",
    "record_flow",
    "respond",
    "restoring",
]
