"""Diagnostics: watch the geometry of normalization during training (hooks only), and group
parameters for the optimizer by the role each one plays.

Owns: the training-time :class:`Monitor` and its metrics as objects (:class:`MonitorMetric`:
each declares its hooks and columns; :mod:`.monitor_metrics` holds the built-in ones), alarms and
sinks, :func:`param_groups` (optimizer groups by what each parameter does, found by behaviour
through :mod:`normatlas.analysis`), :func:`cross_example_dependence`, and the pure metric functions
in :mod:`normatlas.diagnostics.metrics`.
"""

from __future__ import annotations

from .alarms import (
    AlarmEvent,
    EntropyCollapseAlarm,
    NonFiniteAlarm,
    SpikeDetector,
    ThresholdAlarm,
    TrendAlarm,
    default_alarms,
)
from .attention import AttentionCapture, sdpa_probs
from .discarded import DiscardedDirections, discarded_hf, measure_site
from .groups import ParamInfo, Role, format_report, param_groups, param_roles
from .metric_base import Column, Hook, MonitorMetric, Scope
from .metrics import (
    attention_sinks,
    attention_stats,
    headroom,
    massive_activations,
    modality_norm_gap,
    repeated_ngrams,
    residual_stats,
)
from .modality import (
    ModalitySplit,
    PartUpdates,
    VLMPart,
    VLMPath,
    image_attention_share,
    modality_norms,
    modality_report,
    modality_updates,
    update_ratio,
)
from .monitor import DEFAULT_METRICS, Metric, Monitor
from .roles import Kind, find_blocks, gain_convention, module_kind, trace_linear_to_norm
from .sinks import CSVSink, JSONLSink, MemorySink, Sink, TensorBoardSink
from .vlm import check_image_processor

__all__ = [
    "DEFAULT_METRICS",
    "AlarmEvent",
    "AttentionCapture",
    "CSVSink",
    "Column",
    "DiscardedDirections",
    "EntropyCollapseAlarm",
    "Hook",
    "JSONLSink",
    "Kind",
    "MemorySink",
    "Metric",
    "ModalitySplit",
    "Monitor",
    "MonitorMetric",
    "NonFiniteAlarm",
    "ParamInfo",
    "PartUpdates",
    "Role",
    "Scope",
    "Sink",
    "SpikeDetector",
    "TensorBoardSink",
    "ThresholdAlarm",
    "TrendAlarm",
    "VLMPart",
    "VLMPath",
    "attention_sinks",
    "attention_stats",
    "check_image_processor",
    "default_alarms",
    "discarded_hf",
    "find_blocks",
    "format_report",
    "gain_convention",
    "headroom",
    "image_attention_share",
    "massive_activations",
    "measure_site",
    "modality_norm_gap",
    "modality_norms",
    "modality_report",
    "modality_updates",
    "module_kind",
    "param_groups",
    "param_roles",
    "repeated_ngrams",
    "residual_stats",
    "sdpa_probs",
    "trace_linear_to_norm",
    "update_ratio",
]
