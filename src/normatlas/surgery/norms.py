"""Find a model's normalization layers and measure what each one computes.

Method: the shared behavioural probe (:func:`normatlas.analysis.probe`): a module is a norm
when, on inputs shaped like the ones it received in the recorded run, its output is
invariant to rescaling the input (the essay's defining property); centring, which 1-D
parameter is the gain and which the bias, the gain convention, eps and its placement and
the bf16 cast order are all measured, never read from names. Surgery accepts only last-dim
norms whose own parameters are at most a gain and a bias of shape ``(dim,)``.

Guaranteed property: every field of :class:`NormFacts` is a measurement of the module as it
runs; the module's parameters, buffers and training flags are restored afterwards.
"""

from __future__ import annotations

from torch import nn

from ..analysis.flow import Dataflow
from ..analysis.probe import NormFacts, probe

__all__ = ["NormFacts", "find_norms", "probe_norm"]


def _params_1d(module: nn.Module, dim: int) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == dim}


def probe_norm(module: nn.Module, name: str, dim: int) -> NormFacts | None:
    """Measure ``module`` as a last-dim norm of width ``dim``; None when it is not one surgery can handle."""
    params = _params_1d(module, dim)
    if len(params) > 2 or any(p.dim() != 1 for p in module.parameters(recurse=False)):
        return None
    facts = probe(module, dim, name=name)
    if facts is None or not facts.structured or facts.feature_axis != -1 or not set(facts.roles) <= set(params):
        return None
    return facts


def find_norms(flow: Dataflow) -> dict[str, NormFacts]:
    """Every module in the recorded run that behaves as a last-dim norm, with its measured facts."""
    found: dict[str, NormFacts] = {}
    for name in flow.modules():
        module = flow.submodule(name)
        calls = flow.module_calls(name)
        first = calls[0]
        if len(first.inputs) != 1 or len(first.outputs) != 1:
            continue
        tensor = flow.tensor(first.inputs[0])
        dim = tensor.shape[-1]
        if not _params_1d(module, dim) or not tensor.is_floating_point():
            continue
        facts = probe_norm(module, name, dim)
        if facts is not None:
            found[name] = facts
    return found
