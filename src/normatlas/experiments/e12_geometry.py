"""Experiment 12: the geometry of LayerNorm and RMSNorm, measured on the library's own functional core.

LayerNorm's image is the sphere of radius sqrt(D) inside the hyperplane ``1^T y = 0``; RMSNorm's is the
whole sphere of radius sqrt(D). Their input gradient is the upstream gradient projected off the
directions the forward ignores: off ``1`` and ``x_hat`` for LayerNorm, off ``x_hat`` only for RMSNorm.

Everything runs through :func:`normatlas.functional.normalize` with a :class:`~normatlas.spec.NormSpec`
(no gain, no bias) in float64, with ``eps = 1e-12`` so the invariances hold to rounding: a 3-D picture at
D = 3, then the radius, the hyperplane residual and the gradient's angles at large D.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..functional import normalize
from ..spec import Gain, NormSpec
from .base import Experiment, Outcome, RunContext, Series, estimates
from .runner import use_agg
from .verdict import Clause, Direction, VerdictRule

EPS = 1e-12
SPECS = {
    "LayerNorm": NormSpec(center=True, gain=Gain.NONE, bias=False, eps=EPS),
    "RMSNorm": NormSpec(center=False, gain=Gain.NONE, bias=False, eps=EPS),
}
# fixed before the run: the relations the verdict checks
RADIUS_TOL = 1e-9  # max | ||y|| / sqrt(D) - 1 |, both norms
PLANE_TOL = 1e-9  # max |1^T y| / (sqrt(D) ||y||) for LayerNorm (cosine between y and 1)
ANGLE_TOL_DEG = 1e-6  # max |angle - 90 deg| where the projection removes a direction
RMS_ONES_MIN_SHARE = 0.1  # RMSNorm keeps the ones-direction: mean |cos(grad, 1)| > this share of the upstream's
PAPER_S = 30.0  # paper scale: widths to 16384 (exact identities: the same verdict at any scale)
RULE = VerdictRule((
    Clause("max_radius_rel_error", Direction.BELOW, RADIUS_TOL, "both images lie on the sphere of radius sqrt(D)"),
    Clause("ln_max_cos_y_ones", Direction.BELOW, PLANE_TOL, "LayerNorm's image lies in the hyperplane 1^T y = 0"),
    Clause("ln_max_dev_deg_grad_vs_ones", Direction.BELOW, ANGLE_TOL_DEG,
           "LayerNorm's input gradient is orthogonal to 1 (max |angle - 90 deg|)"),
    Clause("ln_max_dev_deg_grad_vs_xhat", Direction.BELOW, ANGLE_TOL_DEG,
           "LayerNorm's input gradient is orthogonal to x-hat"),
    Clause("rms_max_dev_deg_grad_vs_xhat", Direction.BELOW, ANGLE_TOL_DEG,
           "RMSNorm's input gradient is orthogonal to x-hat"),
    Clause("rms_mean_abs_cos_grad_ones_over_upstream", Direction.ABOVE, RMS_ONES_MIN_SHARE,
           "RMSNorm's gradient keeps the ones direction (its mean |cos(g, 1)| over the upstream's)"),
))  # fmt: skip


def _inputs(n: int, d: int, gen: torch.Generator) -> Tensor:
    """Gaussian tokens with a per-token mean offset and scale, so centring and scaling both matter."""
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    offset = 2.0 * torch.randn(n, 1, generator=gen, dtype=torch.float64)
    scale = torch.exp(torch.randn(n, 1, generator=gen, dtype=torch.float64))
    return scale * (x + offset)


def _cos(a: Tensor, b: Tensor) -> Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def _dev_deg(cos: Tensor) -> Tensor:
    """|angle - 90 degrees| from a cosine (arcsin keeps the precision that arccos loses near 90)."""
    return torch.rad2deg(torch.arcsin(cos.abs().clamp(max=1)))


def _image_stats(x: Tensor) -> dict[str, dict[str, float]]:
    """Radius and hyperplane residual of each norm's image of ``x`` (tokens x D)."""
    d = x.shape[-1]
    out = {}
    for name, spec in SPECS.items():
        y = normalize(x, spec, backend="reference")
        out[name] = {
            "radius_err": float((y.norm(dim=-1) / math.sqrt(d) - 1).abs().max()),
            "plane_cos": float(_cos(y, torch.ones_like(y)).abs().max()),
        }
    return out


def _grad_cosines(x: Tensor, gen: torch.Generator) -> dict[str, dict[str, Tensor]]:
    """Cosines between the input gradient and ``1`` / ``x_hat`` under a random upstream gradient (per token)."""
    upstream = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    ones = torch.ones_like(x)
    out = {"upstream": {"ones": _cos(upstream, ones), "xhat": _cos(upstream, x)}}
    for name, spec in SPECS.items():
        xi = x.clone().requires_grad_(True)
        y = normalize(xi, spec, backend="reference")
        (grad,) = torch.autograd.grad(y, xi, upstream)
        out[name] = {"ones": _cos(grad, ones), "xhat": _cos(grad, y.detach())}
    return out


def _figure(x3: Tensor, angles: dict[str, dict[str, Tensor]], d: int) -> object:
    plt = use_agg()
    fig = plt.figure(figsize=(14, 4.6))
    fig.suptitle("LayerNorm maps onto a sphere inside the plane 1ᵀy = 0, RMSNorm onto the full sphere; "
                 "the gradient is projected off 1 and x̂")  # fmt: skip
    colors = {"LayerNorm": "tab:blue", "RMSNorm": "tab:orange"}
    for i, (name, spec) in enumerate(SPECS.items()):
        ax = fig.add_subplot(1, 3, i + 1, projection="3d")
        y = normalize(x3, spec, backend="reference")
        ax.scatter(*y.T.numpy(), s=4, alpha=0.6, color=colors[name], label=f"{name}(x), {len(y)} random x")
        ax.quiver(0, 0, 0, 1, 1, 1, color="k", linewidth=1.5, label="the ones vector 1")
        ax.set(xlabel="y₁", ylabel="y₂", zlabel="y₃", title=f"{name} at D = 3 (radius √3)")
        ax.set_box_aspect((1, 1, 1))
        ax.legend(loc="upper left", fontsize=7)
    ax = fig.add_subplot(1, 3, 3)
    bins = torch.linspace(-17, 0, 69).numpy()
    for (src, key), style in zip(
        [("upstream", "ones"), ("LayerNorm", "ones"), ("LayerNorm", "xhat"), ("RMSNorm", "ones"), ("RMSNorm", "xhat")],
        ["k:", "b-", "b--", "r-", "r--"], strict=True,
    ):  # fmt: skip
        target = "1" if key == "ones" else "x̂"
        label = f"{'upstream g' if src == 'upstream' else src + ' ∂L/∂x'} vs {target}"
        logcos = angles[src][key].abs().clamp(min=1e-17).log10().numpy()
        ax.hist(logcos, bins=bins, histtype="step", linestyle=style[1:], color=style[0], label=label)
    ax.set(xlabel="log10 |cos(angle)|  (0 = parallel, -16 = orthogonal to float64 rounding)", ylabel="tokens",
           title=f"input gradient vs 1 and x̂ at D = {d} (float64 autograd)")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def run(ctx: RunContext) -> Outcome:
    gen = ctx.generator()
    widths = ctx.pick((64, 256, 1024, 4096), (64, 256), paper=(64, 256, 1024, 4096, 16384))
    n = ctx.size(512, 64)
    images = {d: _image_stats(_inputs(n, d, gen)) for d in widths}
    d_grad = widths[-1]
    angles = _grad_cosines(_inputs(n, d_grad, gen), gen)
    dev = {f"{k}_{t}": float(_dev_deg(angles[k][t]).max()) for k in SPECS for t in ("ones", "xhat")}
    cos_ones = {k: float(angles[k]["ones"].abs().mean()) for k in ("upstream", "RMSNorm")}
    rms_ones_share = cos_ones["RMSNorm"] / cos_ones["upstream"]
    radius = max(s[k]["radius_err"] for s in images.values() for k in SPECS)
    plane_ln = max(s["LayerNorm"]["plane_cos"] for s in images.values())
    plane_rms = min(s["RMSNorm"]["plane_cos"] for s in images.values())
    measured = {
        "max_radius_rel_error": radius, "ln_max_cos_y_ones": plane_ln, "rms_min_over_D_of_max_cos_y_ones": plane_rms,
        "ln_max_dev_deg_grad_vs_ones": dev["LayerNorm_ones"], "ln_max_dev_deg_grad_vs_xhat": dev["LayerNorm_xhat"],
        "rms_max_dev_deg_grad_vs_xhat": dev["RMSNorm_xhat"], "rms_mean_abs_cos_grad_ones_over_upstream": rms_ones_share,
        "widths": list(widths), "tokens": n, "grad_width": d_grad,
    }  # fmt: skip
    statistics = {
        "max_radius_rel_error": radius, "ln_max_cos_y_ones": plane_ln,
        "ln_max_dev_deg_grad_vs_ones": dev["LayerNorm_ones"], "ln_max_dev_deg_grad_vs_xhat": dev["LayerNorm_xhat"],
        "rms_max_dev_deg_grad_vs_xhat": dev["RMSNorm_xhat"], "rms_mean_abs_cos_grad_ones_over_upstream": rms_ones_share,
    }  # fmt: skip
    rows = [(d, k, s[k]["radius_err"], s[k]["plane_cos"]) for d, s in images.items() for k in SPECS]
    grad_rows = [(k, t, float(v)) for k in angles for t in ("ones", "xhat") for v in angles[k][t]]
    x3 = _inputs(ctx.size(600, 200), 3, gen)
    return Outcome(
        statistics=statistics, measured=measured,
        series={"image": Series(("D", "norm", "max_radius_rel_error", "max_cos_y_ones"), rows),
                "grad_angles": Series(("source", "direction", "cosine"), grad_rows)},
        figure=_figure(x3, angles, d_grad),
        notes=f"float64, eps={EPS}, no gain or bias (the learned affine moves the image off the sphere); inputs "
              f"are Gaussian tokens with random per-token offsets and scales; {n} tokens per width.",
    )  # fmt: skip


EXPERIMENT = Experiment.declare(
    "geometry", rule=RULE, estimates_s=estimates(default=5.0, quick=0.5, paper=PAPER_S), run=run
)
