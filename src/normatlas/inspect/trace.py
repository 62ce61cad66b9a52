"""The fine recorded dataflow that :mod:`normatlas.inspect` reads (a view of :mod:`normatlas.dataflow`).

Method: :func:`normatlas.dataflow.record` runs the model once under a
:class:`torch.overrides.TorchFunctionMode` and records every torch call at the level the
model's own code wrote it (``x.pow(2).mean(-1)``, ``F.layer_norm``, ``a + b``) as a
:class:`Node`; module paths are kept only as *labels* in reports, never to decide what a
node is.

Guaranteed property: the graph is the dataflow of the run that happened (like
``torch.jit.trace``). It needs no symbolic tracing, so it works on every model that runs
eagerly; when even this fails, :mod:`.probe` falls back to module hooks.
"""

from __future__ import annotations

from ..dataflow import Graph, Node, Ref, record

__all__ = ["Graph", "Node", "Ref", "record"]
