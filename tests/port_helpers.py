"""What the port tests (tests/test_port*.py) share: the module-scoped ``ported`` fixture over a file's cases, seeded
token ids, and the checks every ported model goes through (the gradient on every parameter, the state dict loaded
back into the source class)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from normatlas import Norm
from normatlas.port import port, to_hf_state_dict


def ported_fixture(build: Callable[..., torch.nn.Module], params: Sequence[Any], ids: Any = None) -> Any:
    """A module-scoped fixture ``ported`` over ``params``: ``(name, hf, port result, our model)``, ``hf`` made by
    ``build(param)`` (a tuple param is ``build``'s arguments, its first the name) and ported on one thread."""

    @pytest.fixture(scope="module", params=params, ids=ids)
    def ported(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, Any, torch.nn.Module]:
        torch.set_num_threads(1)
        args = request.param if isinstance(request.param, tuple) else (request.param,)
        hf = build(*args)
        p, ours = port(hf)
        return args[0], hf, p, ours

    return ported


def token_ids(hf: torch.nn.Module, seed: int, shape: tuple[int, int] = (2, 9), low: int = 0) -> torch.Tensor:
    """Token ids in ``[low, vocab_size)`` of ``hf``'s config, drawn from a generator seeded with ``seed``."""
    return torch.randint(low, hf.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def logit_atol(ref: torch.Tensor) -> float:
    """The tests' fp32 logit tolerance: 1e-5 of (1 + the largest |logit|), the form of the port's own check (ten
    times tighter); an absolute 1e-5 fails on fp32 rounding alone where logits reach ~10 over a wide head (a
    rembert with a 1,664-wide output projection differs by 1.07e-5 on an AVX2 CPU, by less on others)."""
    return 1e-5 * (1 + float(ref.abs().max()))


def logits_of_both(hf: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The source's logits and ours on ``ids``, without gradients: ``(reference, got)``."""
    with torch.no_grad():
        return hf(input_ids=ids).logits, ours(ids)


@contextlib.contextmanager
def reference_backend(model: torch.nn.Module, types: tuple[type, ...] = (Norm,)) -> Iterator[None]:
    """The modules of ``types`` in ``model`` on the reference backend inside the block, ``auto`` after."""
    modules = [m for m in model.modules() if isinstance(m, types)]
    for m in modules:
        m.backend = "reference"
    try:
        yield
    finally:
        for m in modules:
            m.backend = "auto"


def backward_both(
    hf: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor, upstream: torch.Tensor | int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.nn.Parameter]]:
    """Backward from ``(logits * upstream).sum()`` through both models (their gradients cleared first): our
    gradients mapped back to the source's names by the port's links (fused and permuted rows re-assembled), and the
    source's parameters by name. ``upstream`` is a tensor, or a seed for one drawn in the logits' shape."""
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    out = hf(input_ids=ids).logits
    if isinstance(upstream, int):
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream))
    (out * upstream).sum().backward()
    (ours(ids) * upstream).sum().backward()
    grads = {n: q.grad for n, q in ours.named_parameters(remove_duplicate=False) if q.grad is not None}
    return to_hf_state_dict(ours, None, grads), dict(hf.named_parameters(remove_duplicate=False))


def assert_same_gradients(
    hf: torch.nn.Module,
    ours: torch.nn.Module,
    ids: torch.Tensor,
    upstream: torch.Tensor | int,
    name: str,
    *,
    atol: float = 1e-5,
    reference: tuple[type, ...] = (),
    unrouted_zero: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.nn.Parameter]]:
    """Every parameter's gradient of ours (:func:`backward_both`, with the modules of ``reference`` on the reference
    backend) equals the source's: ``atol`` times the larger of 1 and the gradient's largest magnitude (fp32 rounding
    grows with the gradient), ``rtol`` 1e-4. A source parameter without a gradient fails, except with
    ``unrouted_zero`` (an expert no token chose in the batch), where ours must be all zeros. Returns what
    :func:`backward_both` does."""
    with reference_backend(ours, reference):
        mapped, hf_params = backward_both(hf, ours, ids, upstream)
    for key, g in mapped.items():
        ref = hf_params[key].grad
        if ref is None and unrouted_zero:
            assert not bool(g.any()), key
            continue
        assert ref is not None, key
        tol = atol * max(1.0, float(ref.abs().max()))
        torch.testing.assert_close(g, ref, atol=tol, rtol=1e-4, msg=lambda m, k=key: f"{name} {k}: {m}")
    return mapped, hf_params


def assert_loads_back(fresh: torch.nn.Module, hf: torch.nn.Module, p: Any, ours: torch.nn.Module, ids: torch.Tensor):
    """Our weights under the source's names and layout (:func:`to_hf_state_dict`) load into ``fresh``, a new source
    model whose parameters are zeroed first: nothing unexpected, only buffers missing, and the same logits as ``hf``
    to the bit."""
    with torch.no_grad():
        for q in fresh.parameters():
            q.zero_()
    missing, unexpected = fresh.load_state_dict(to_hf_state_dict(ours), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= set(p.buffers), missing  # only buffers (RoPE tables, masks) are not ours
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, hf(input_ids=ids).logits, atol=0, rtol=0)
