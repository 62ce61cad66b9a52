"""Fixing initialisation instead of normalizing: Fixup and Admin.

Essay section "Fixing initialisation and residual scale instead".

* **Fixup** (Zhang, Dauphin & Ma, "Fixup Initialization: Residual Learning Without
  Normalization", ICLR 2019): with L residual branches of m weight layers each, initialise the
  classification layer and the last layer of every branch at 0, the other branch layers with
  He init scaled by ``L^(-1/(2m-2))`` (:func:`fixup_scale`), and add scalar biases (init 0) and
  a scalar multiplier (init 1) per branch. Guarantee: every branch outputs exactly 0 at
  initialisation, so each residual block is the identity (:class:`FixupBasicBlock`).
* **Admin** (Liu, Liu, Gao, Chen & Han, "Understanding the Difficulty of Training
  Transformers", EMNLP 2020): deep Post-LN ``x_i = LN(omega_i * x_{i-1} + f_i(x_{i-1}))`` with
  ``omega_i`` set from one profiling forward pass: ``omega_i^2 = sum_{j < i} Var[f_j(x_{j-1})]``,
  where the j = 0 term is the variance of the block stack's input (the embedding output) so
  that ``omega_1`` is defined. :func:`admin_init_` measures and sets it. The authors' later
  closed forms (``admin_torch``; N = number of residual layers, 2 per Transformer layer) are
  :func:`admin_omega`: ``omega^2 = (N + 1) / ln(N + 1) - 1`` for an O(log N) output change
  (default), ``1`` for O(N) (plain Post-LN) and ``N`` for O(1).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "AdminOutputChange",
    "AdminResidual",
    "FixupBasicBlock",
    "ScalarBias",
    "ScalarScale",
    "admin_init_",
    "admin_omega",
    "fixup_init_",
    "fixup_scale",
]


def fixup_scale(num_branches: int, layers_per_branch: int) -> float:
    """Fixup's rescaling of the non-final branch layers: ``L ** (-1 / (2m - 2))``."""
    if isinstance(num_branches, bool) or not isinstance(num_branches, int) or num_branches < 1:
        raise ValueError(f"num_branches={num_branches!r} must be an integer >= 1")
    if isinstance(layers_per_branch, bool) or not isinstance(layers_per_branch, int) or layers_per_branch < 2:
        raise ValueError(f"layers_per_branch={layers_per_branch!r} must be an integer >= 2 (m = 1 has no rescaling)")
    return float(num_branches ** (-1.0 / (2 * layers_per_branch - 2)))


class ScalarBias(nn.Module):
    """One learnable scalar added to the input (Fixup's bias, init 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, input: Tensor) -> Tensor:
        return input + self.bias


class ScalarScale(nn.Module):
    """One learnable scalar multiplier (Fixup's scale, init 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, input: Tensor) -> Tensor:
        return input * self.scale


@torch.no_grad()
def fixup_init_(branches: Sequence[Sequence[nn.Module]], output_layer: nn.Module | None = None) -> float:
    """Fixup-initialise residual branches given as the ordered weight layers of each branch.

    Every branch must have the same number m >= 2 of layers with a ``weight``. All but the last
    get He (fan-in, ReLU) init times :func:`fixup_scale`; the last gets 0; ``output_layer``
    (the classifier) gets weight and bias 0. Returns the scale used.
    """
    if not branches:
        raise ValueError("branches must hold at least one branch")
    m = len(branches[0])
    if any(len(b) != m for b in branches):
        raise ValueError(f"every branch needs the same number of layers; got {[len(b) for b in branches]}")
    scale = fixup_scale(len(branches), m)
    for branch in branches:
        for layer in branch[:-1]:
            w = getattr(layer, "weight", None)
            if not isinstance(w, Tensor):
                raise TypeError(f"{type(layer).__name__} has no weight tensor to initialise")
            nn.init.kaiming_normal_(w, mode="fan_in", nonlinearity="relu")
            w.mul_(scale)
        last = branch[-1]
        nn.init.zeros_(last.weight)  # type: ignore[arg-type]
        if getattr(last, "bias", None) is not None:
            nn.init.zeros_(last.bias)  # type: ignore[arg-type]
    if output_layer is not None:
        nn.init.zeros_(output_layer.weight)  # type: ignore[arg-type]
        if getattr(output_layer, "bias", None) is not None:
            nn.init.zeros_(output_layer.bias)  # type: ignore[arg-type]
    return scale


class FixupBasicBlock(nn.Module):
    """The Fixup ResNet basic block (no normalization)::

        x ─┬─ +b1 ─ conv3x3 ─ +b2 ─ relu ─ +b3 ─ conv3x3 ─ *s ─ +b4 ─┐
           └──────────────────────────────────────────────────────── + ── relu

    Call :func:`fixup_init_` on ``[block.branch_layers() for block in blocks]``; the branch is
    then exactly 0 and the block computes ``relu(x)`` (the identity on non-negative inputs).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bias1a, self.bias1b, self.bias2a, self.bias2b = ScalarBias(), ScalarBias(), ScalarBias(), ScalarBias()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.scale = ScalarScale()

    def branch_layers(self) -> list[nn.Module]:
        return [self.conv1, self.conv2]

    def branch(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bias1b(self.conv1(self.bias1a(x))))
        return self.bias2b(self.scale(self.conv2(self.bias2a(out))))

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(x + self.branch(x))


class AdminOutputChange(enum.Enum):
    """How fast the model output may change with depth at initialisation (Admin's closed forms)."""

    LOG_N = "O(logN)"
    LINEAR = "O(N)"
    CONSTANT = "O(1)"


def admin_omega(num_res_layers: int, output_change: AdminOutputChange = AdminOutputChange.LOG_N) -> float:
    """Admin's closed-form ``omega`` for ``num_res_layers`` residual layers (2 per Transformer layer)."""
    if isinstance(num_res_layers, bool) or not isinstance(num_res_layers, int) or num_res_layers < 1:
        raise ValueError(f"num_res_layers={num_res_layers!r} must be an integer >= 1")
    if not isinstance(output_change, AdminOutputChange):
        raise TypeError(f"output_change={output_change!r} must be an AdminOutputChange (LOG_N, LINEAR, CONSTANT)")
    n = num_res_layers
    if output_change is AdminOutputChange.LOG_N:
        return math.sqrt((n + 1) / math.log(n + 1) - 1)
    if output_change is AdminOutputChange.LINEAR:
        return 1.0
    return math.sqrt(n)


class AdminResidual(nn.Module):
    """Admin's Post-LN residual: ``LN(omega * x + f(x))`` with ``omega`` per feature (init 1).

    ``forward(x, branch_out)``. While profiling (see :func:`admin_init_`) it records
    ``Var[branch_out]``. ``learnable=True`` makes ``omega`` a parameter (the paper's default).
    """

    def __init__(self, dim: int, norm: nn.Module | None = None, *, learnable: bool = True) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(dim)
        omega = torch.ones(dim)
        if learnable:
            self.omega = nn.Parameter(omega)
        else:
            self.register_buffer("omega", omega)
        self.profiling = False
        self.branch_var: float | None = None

    def forward(self, x: Tensor, branch_out: Tensor) -> Tensor:
        if self.profiling:
            self.branch_var = float(branch_out.detach().double().var(unbiased=False))
        return self.norm(x * self.omega + branch_out)


@torch.no_grad()
def admin_init_(
    residuals: Sequence[AdminResidual], profile: Callable[[], object], input_variance: float | None = None
) -> list[float]:
    """Set every ``omega_i = sqrt(sum_{j<i} Var[f_j])`` from one profiling forward pass (Admin).

    ``residuals`` in forward order; ``profile()`` runs the forward pass (omegas at 1). The
    j = 0 term is ``input_variance`` (the variance of the stack's input; default 1.0, what a
    unit-variance embedding gives). Returns the omegas set.
    """
    if not residuals:
        raise ValueError("residuals must hold at least one AdminResidual")
    base = 1.0 if input_variance is None else float(input_variance)
    if not base > 0:
        raise ValueError(f"input_variance={input_variance!r} must be > 0")
    for r in residuals:
        r.omega.fill_(1.0)
        r.profiling, r.branch_var = True, None
    try:
        profile()
    finally:
        for r in residuals:
            r.profiling = False
    omegas = []
    total = base
    for i, r in enumerate(residuals):
        if r.branch_var is None:
            raise ValueError(f"residual {i} was not called during profiling")
        omegas.append(math.sqrt(total))
        r.omega.fill_(omegas[-1])
        total += r.branch_var
    return omegas
