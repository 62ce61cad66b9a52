"""Every method the library implements, with the paper(s) that define it (keys of ``papers.json``).

:data:`CITATIONS` maps an importable object path (``"normatlas.longtail.DyT"``) to paper keys;
:data:`UTILITIES` lists the public names that are the library's own machinery (sinks, reports,
config types, I/O), each with the reason it cites no paper. :func:`public_methods` enumerates the
public names the library exports for methods (``normatlas.presets``, ``normatlas.blocks``,
``normatlas.longtail``, ``normatlas.diagnostics``, ``normatlas.surgery``; the design vocabulary and the
analysis substrate are no methods); the tests check that each
is in exactly one of the two tables, that every path imports and that every key is a paper.
Paths are strings, so importing this module imports no torch code; :func:`resolve` does.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

__all__ = ["CITATIONS", "METHOD_MODULES", "UTILITIES", "citations_for", "public_methods", "resolve"]

METHOD_MODULES = (
    "normatlas.presets",
    "normatlas.blocks",
    "normatlas.longtail",
    "normatlas.diagnostics",
    "normatlas.surgery",
)


def _table(groups: Iterable[tuple[tuple[str, ...], str, tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for keys, module, names in groups:
        for name in names:
            path = f"{module}.{name}"
            if path in out:
                raise ValueError(f"{path} is cited twice")
            out[path] = keys
    return out


_P, _B, _L, _D, _S = METHOD_MODULES

CITATIONS: dict[str, tuple[str, ...]] = _table(
    [
        # operator presets
        (("layernorm2016",), _P, ("LayerNorm",)),
        (("rmsnorm2019",), _P, ("RMSNorm",)),
        (("gemma2024", "rmsnorm2019"), _P, ("GemmaRMSNorm",)),
        (("groupnorm2018",), _P, ("GroupNorm",)),
        (("instancenorm2016",), _P, ("InstanceNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d")),
        (("convnext2022", "layernorm2016"), _P, ("LayerNorm2d",)),
        (("scalenorm2019",), _P, ("ScaleNorm",)),
        (("fixnorm2018", "ngpt2024"), _P, ("L2Norm",)),
        # placements, residual scalars, attention
        (("vaswani2017",), _B, ("post_ln", "Attention", "Block", "TransformerLM")),
        (("baevski2019", "xiong2020"), _B, ("pre_ln",)),
        (("cogview2021",), _B, ("sandwich_ln",)),
        (("periln2025", "gemma2_2024"), _B, ("peri_ln",)),
        (("swinv2_2022",), _B, ("res_post_norm",)),
        (("chameleon2024", "olmo2_2024"), _B, ("reordered_norm",)),
        (("deepnet2022",), _B, ("deepnorm", "deepnorm_constants", "DeepNormArch", "DeepNormConstants")),
        (("hybridnorm2025",), _B, ("hybridnorm", "hybridnorm_star")),
        (("lns2025",), _B, ("layernorm_scaling",)),
        (("pangu_ultra2025",), _B, ("depth_scaled_sandwich",)),
        (("lns2025", "pangu_ultra2025"), _B, ("DepthScale",)),
        (("palm2022",), _B, ("parallel",)),
        (("mixln2025",), _B, ("mix_ln",)),
        (("rezero2020",), _B, ("rezero", "ReZero")),
        (("skipinit2020",), _B, ("skipinit", "SkipInit")),
        (("cait2021",), _B, ("layerscale", "LayerScale")),
        (("rezero2020", "skipinit2020", "cait2021"), _B, ("Gate",)),
        (("fixup2019", "rezero2020"), _B, ("norm_free",)),
        (("deepnet2022",), _B, ("scaled_residual",)),
        (("henry2020", "vit22b2023"), _B, ("QKNorm", "QKNormConfig", "QK_OPERATORS", "QKScope", "QKGain")),
        (("roformer2021",), _B, ("Rope", "RopeStyle", "apply_rope", "rope_tables")),
        (("glu_variants2020",), _B, ("MLP",)),
        (("vit2020",), _B, ("ViTConfig", "ViTEncoder", "ViTPool")),
        (("gpt2_2019", "vaswani2017"), _B, ("ModelConfig",)),
        # the long tail
        (
            ("ioffe2015",),
            _L,
            ("BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "batch_moments", "batch_norm_spec"),
        ),
        (("ioffe2015",), _L, ("FrozenBatchNorm", "BatchNormState", "read_batchnorm")),
        (("batchrenorm2017",), _L, ("BatchRenorm", "Ramp", "PAPER_R_MAX", "PAPER_D_MAX")),
        (("ghostbn2017",), _L, ("GhostBatchNorm",)),
        (("megdet2018", "ioffe2015"), _L, ("SyncBatchNorm",)),
        (("groupnorm2018", "ioffe2015"), _L, ("convert_batchnorm", "BatchNormTarget")),
        (("powernorm2020",), _L, ("PowerNorm", "power_norm")),
        (("adain2017", "instancenorm2016"), _L, ("AdaIN", "adain")),
        (("dit2022",), _L, ("AdaLNZero",)),
        (("film2018", "dit2022"), _L, ("modulate",)),
        (("vlm_norm_gap2025",), _L, ("ConnectorNorm", "grad_scale", "text_embedding_norm")),
        (("flamingo2022",), _L, ("PerceiverResampler", "PerceiverLayer", "GatedCrossAttentionBlock", "TanhGate")),
        # one norm per modality in a shared block: BEiT-3's Multiway Transformer (torchscale's MultiwayWrapper splits
        # its LayerNorms at a position; here the caller's mask splits them)
        (("beit3_2022",), _L, ("ModalitySplitNorm", "ModalityBlock")),
        (("dyt2025",), _L, ("DyT", "dyt", "Pointwise", "convert_norms_to_pointwise")),
        (("derf2025",), _L, ("Derf", "derf")),
        (("fixup2019",), _L, ("FixupBasicBlock", "ScalarBias", "ScalarScale", "fixup_init_", "fixup_scale")),
        (("admin2020",), _L, ("AdminResidual", "AdminOutputChange", "admin_init_", "admin_omega")),
        (("ngpt2024",), _L, ("HypersphereConstraint", "SphericalUpdate", "ngpt_constraint", "sphere")),
        (("weight_standardization2019",), _L, ("WSConv2d", "standardize_weight")),
        (("nfresnet2021",), _L, ("ScaledWSConv2d",)),
        (("nfnets2021",), _L, ("adaptive_clip_grad_", "unitwise_norm")),
        (("spectralnorm2018",), _L, ("spectral_norm",)),
        (("weightnorm2016",), _L, ("weight_norm",)),
        # diagnostics
        (("zhai2023",), _D, ("EntropyCollapseAlarm", "attention_stats")),
        (("attention_sinks2023",), _D, ("attention_sinks",)),
        (("massive_activations2024",), _D, ("massive_activations",)),
        (("vlm_norm_gap2025",), _D, ("modality_norm_gap", "VLMPath", "ModalitySplit", "PartUpdates")),
        (("vlm_norm_gap2025",), _D, ("modality_norms", "modality_updates", "image_attention_share")),
        (("clip2021", "siglip2023"), _D, ("check_image_processor",)),
        (("lns2025",), _D, ("residual_stats",)),
        (("olmo2_2024",), _D, ("repeated_ngrams", "param_groups")),
        (("gemma2024",), _D, ("gain_convention",)),
        (("chameleon2024", "olmo2_2024"), _D, ("TrendAlarm", "SpikeDetector")),
        # surgery transforms
        (
            ("flashnorm2024",),
            _S,
            ("fold_gains", "DeferredNormLinear", "deferred_runtime", "cancel_pre_attention_norms"),
        ),
        (("enjoy_layernorm", "pre_rmsnorm2023"), _S, ("ln_to_rms", "ln_foldability")),
        (("ioffe2015",), _S, ("fold_batchnorm", "freeze_batchnorm")),
        (("gemma2024",), _S, ("convert_gain_convention", "gain_offset_warnings")),
        (("pangu_light2025",), _S, ("absorb_post_norms", "FrozenStatNorm")),
    ]
)


def _reasons(groups: Iterable[tuple[str, str, tuple[str, ...]]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for reason, module, names in groups:
        for name in names:
            out[f"{module}.{name}"] = reason
    return out


UTILITIES: dict[str, str] = _reasons(
    [
        (
            "the absorption's report and its measurement against the original model, not a method",
            _S,
            ("Absorption", "PostNormStat", "approximation"),
        ),
        (
            "block configuration plumbing (norm factories), not a method",
            _B,
            ("NormFactory", "as_factory"),
        ),
        (
            "the typed placement vocabulary the presets are values of",
            _B,
            ("PRESETS", "Placement", "Sublayer", "LayerPlan", "Schedule"),
        ),
        (
            "the residual add as a module, the hook point for the cited scalars (ReZero, DeepNorm, LNS)",
            _B,
            ("ResidualAdd",),
        ),
        ("an activation enum (SiLU / GELU / ReLU) for the MLP", _B, ("Activation",)),
        (
            "the MLP slot's routed mixture-of-experts value, so that routed decoders port (not a normalization method)",
            _B,
            ("MoE", "MoEConfig", "RouterScore"),
        ),
        (
            "a position bias on the attention scores, so that ALiBi decoders port (not a normalization method)",
            _B,
            ("Alibi", "geometric_slopes"),
        ),
        ("reports of what a conversion changed", _L, ("Change", "ConversionReport")),
        (
            "torch.nn.utils.parametrize plumbing shared by weight_norm and spectral_norm",
            _L,
            ("apply_parametrization", "remove_parametrization"),
        ),
        ("Chan et al.'s parallel-variance merge, a numerical utility of SyncBatchNorm", _L, ("merge_moments",)),
        (
            "the multi-head cross-attention the resampler and the gated block share, not a normalization method",
            _L,
            ("CrossAttention",),
        ),
        (
            "tiny image-text models assembled from the connectors for tests and diagnostics, not a method",
            _L,
            ("TinyVLM", "TinyVLMConfig", "VisionTower", "Connector"),
        ),
        (
            "plumbing of the per-modality diagnostics: the parts enum, a one-forward report, the ratio arithmetic",
            _D,
            ("VLMPart", "modality_report", "update_ratio"),
        ),
        (
            "monitoring machinery: record sinks, metric registry and the Monitor that runs them",
            _D,
            (
                "Monitor",
                "Metric",
                "DEFAULT_METRICS",
                "Kind",
                "Sink",
                "CSVSink",
                "JSONLSink",
                "MemorySink",
                "TensorBoardSink",
            ),
        ),
        (
            "alarm plumbing (events, generic thresholds, defaults, non-finite guard)",
            _D,
            ("AlarmEvent", "ThresholdAlarm", "NonFiniteAlarm", "default_alarms"),
        ),
        (
            "introspection helpers that find blocks, roles and attention probabilities",
            _D,
            (
                "AttentionCapture",
                "sdpa_probs",
                "find_blocks",
                "module_kind",
                "ParamInfo",
                "Role",
                "param_roles",
                "trace_linear_to_norm",
            ),
        ),
        ("the essay's bf16-range argument measured directly (§01), no paper", _D, ("headroom",)),
        (
            "the essay's rank-deficiency argument (§03: a norm's backward discards 1 and x-hat) measured directly, "
            "no paper",
            _D,
            ("DiscardedDirections", "discarded_hf", "measure_site"),
        ),
        (
            "the Monitor's metric protocol (hooks and columns a metric declares)",
            _D,
            ("Column", "Hook", "MonitorMetric", "Scope"),
        ),
        ("text rendering of a diagnostics report", _D, ("format_report",)),
        (
            "the proof a surgery carries: probe inputs, the before / after comparison and its tolerances",
            _S,
            (
                "run_checks",
                "compare",
                "Check",
                "Tolerance",
                "DEFAULT_TOLERANCE",
                "probe_inputs",
                "model_output",
                "model_dtype",
                "analysis_copy",
            ),
        ),
        (
            "what a surgery reports: its changes, refusals and runtime swaps",
            _S,
            ("Surgery", "Change", "Refusal", "Swap", "SwapKind", "NothingToChange", "apply_swaps"),
        ),
        (
            "checkpoint I/O: the safe, verified write and the loaders",
            _S,
            ("save_surgery", "load_checkpoint", "load_transformed", "check_output", "OutputPlan", "MANIFEST"),
        ),
        (
            "the analysis a surgery reads (norms found by behaviour, their linear consumers)",
            _S,
            ("find_norms", "probe_norm", "linear_consumers"),
        ),
        ("moves eps and its placement (the essay's §12.2 porting detail), not a published method", _S, ("change_eps",)),
    ]
)


def public_methods() -> list[str]:
    """Every public name the method modules export (``module.name``), from their ``__all__``."""
    out = []
    for module in METHOD_MODULES:
        out += [f"{module}.{name}" for name in importlib.import_module(module).__all__]
    return out


def resolve(path: str) -> object:
    """The object at ``"package.module.name"``; ``ImportError`` / ``AttributeError`` when it is gone."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def citations_for(key: str) -> list[str]:
    """The registered library objects that cite paper ``key``, in registry order."""
    return [path for path, keys in CITATIONS.items() if key in keys]
