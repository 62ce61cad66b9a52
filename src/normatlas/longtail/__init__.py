"""The long tail of the essay: batch-statistics norms and converters, pointwise norm
replacements (DyT, Derf), initialisation fixes (Fixup, Admin), weight-side methods (WS,
scaled WS, AGC, spectral / weight norm), nGPT, conditioning norms (AdaIN, adaLN-Zero) and
the VLM connectors (ConnectorNorm, the Perceiver resampler, Flamingo's gated cross-attention, norms split by
modality) with tiny VLMs built from them. Residual scalars (ReZero, LayerScale, DeepNorm) and QK-Norm live in
``normatlas.blocks``.
"""

from ._report import Change, ConversionReport
from .batchnorm import (
    PAPER_D_MAX,
    PAPER_R_MAX,
    BatchNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    BatchNormState,
    BatchRenorm,
    FrozenBatchNorm,
    GhostBatchNorm,
    Ramp,
    batch_moments,
    batch_norm_spec,
    read_batchnorm,
)
from .conditioning import AdaIN, AdaLNZero, adain, modulate
from .connector import ConnectorNorm, grad_scale, text_embedding_norm
from .convert import BatchNormTarget, convert_batchnorm
from .init import (
    AdminOutputChange,
    AdminResidual,
    FixupBasicBlock,
    ScalarBias,
    ScalarScale,
    admin_init_,
    admin_omega,
    fixup_init_,
    fixup_scale,
)
from .ngpt import HypersphereConstraint, SphericalUpdate, ngpt_constraint, sphere
from .pointwise import Derf, DyT, Pointwise, convert_norms_to_pointwise, derf, dyt
from .powernorm import PowerNorm, power_norm
from .syncbn import SyncBatchNorm, merge_moments
from .tiny_vlm import Connector, TinyVLM, TinyVLMConfig, VisionTower
from .vlm_connectors import (
    CrossAttention,
    GatedCrossAttentionBlock,
    ModalityBlock,
    ModalitySplitNorm,
    PerceiverLayer,
    PerceiverResampler,
    TanhGate,
)
from .weight import (
    ScaledWSConv2d,
    WSConv2d,
    adaptive_clip_grad_,
    apply_parametrization,
    remove_parametrization,
    spectral_norm,
    standardize_weight,
    unitwise_norm,
    weight_norm,
)

__all__ = [
    "PAPER_D_MAX",
    "PAPER_R_MAX",
    "AdaIN",
    "AdaLNZero",
    "AdminOutputChange",
    "AdminResidual",
    "BatchNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "BatchNormState",
    "BatchNormTarget",
    "BatchRenorm",
    "Change",
    "Connector",
    "ConnectorNorm",
    "ConversionReport",
    "CrossAttention",
    "Derf",
    "DyT",
    "FixupBasicBlock",
    "FrozenBatchNorm",
    "GatedCrossAttentionBlock",
    "GhostBatchNorm",
    "HypersphereConstraint",
    "ModalityBlock",
    "ModalitySplitNorm",
    "PerceiverLayer",
    "PerceiverResampler",
    "Pointwise",
    "PowerNorm",
    "Ramp",
    "ScalarBias",
    "ScalarScale",
    "ScaledWSConv2d",
    "SphericalUpdate",
    "SyncBatchNorm",
    "TanhGate",
    "TinyVLM",
    "TinyVLMConfig",
    "VisionTower",
    "WSConv2d",
    "adain",
    "adaptive_clip_grad_",
    "admin_init_",
    "admin_omega",
    "apply_parametrization",
    "batch_moments",
    "batch_norm_spec",
    "convert_batchnorm",
    "convert_norms_to_pointwise",
    "derf",
    "dyt",
    "fixup_init_",
    "fixup_scale",
    "grad_scale",
    "merge_moments",
    "modulate",
    "ngpt_constraint",
    "power_norm",
    "read_batchnorm",
    "remove_parametrization",
    "spectral_norm",
    "sphere",
    "standardize_weight",
    "text_embedding_norm",
    "unitwise_norm",
    "weight_norm",
]
