"""Surgery: fold, convert and port normalization in real checkpoints, proving every result.

Owns the transforms (:mod:`.fold`, :mod:`.convert`, :mod:`.absorb`), their proof (:mod:`.verify`) and the safe
checkpoint write (:mod:`.io`, :mod:`.output`). Every transformation reads the model's recorded dataflow
(:func:`normatlas.analysis.record_flow`) and measured norm behaviour (:func:`normatlas.analysis.probe`,
through :mod:`.norms`), never parameter names; returns a
:class:`Surgery` (the transformed model, runtime swaps, changes and refusals with
reasons); is proven by :func:`run_checks` (before vs after on probes, float64 and the
working dtype); and is written only when the proof passes (:func:`save_surgery`).

>>> s = fold_gains(model, inputs); run_checks(model, s, inputs); save_surgery(s, "out/", inputs=inputs, source="ckpt/")
"""

from .absorb import Absorption, FrozenStatNorm, PostNormStat, absorb_post_norms, approximation
from .convert import (
    change_eps,
    convert_gain_convention,
    fold_batchnorm,
    freeze_batchnorm,
    gain_offset_warnings,
    ln_foldability,
    ln_to_rms,
)
from .fold import DeferredNormLinear, cancel_pre_attention_norms, deferred_runtime, fold_gains, linear_consumers
from .io import MANIFEST, load_checkpoint, load_transformed, save_surgery
from .norms import find_norms, probe_norm
from .output import OutputPlan, check_output
from .report import Change, Check, NothingToChange, Refusal, Surgery, Swap, SwapKind, apply_swaps
from .verify import (
    DEFAULT_TOLERANCE,
    Tolerance,
    analysis_copy,
    compare,
    model_dtype,
    model_output,
    probe_inputs,
    run_checks,
)

__all__ = [
    "DEFAULT_TOLERANCE",
    "MANIFEST",
    "Absorption",
    "Change",
    "Check",
    "DeferredNormLinear",
    "FrozenStatNorm",
    "NothingToChange",
    "OutputPlan",
    "PostNormStat",
    "Refusal",
    "Surgery",
    "Swap",
    "SwapKind",
    "Tolerance",
    "absorb_post_norms",
    "analysis_copy",
    "apply_swaps",
    "approximation",
    "cancel_pre_attention_norms",
    "change_eps",
    "check_output",
    "compare",
    "convert_gain_convention",
    "deferred_runtime",
    "find_norms",
    "fold_batchnorm",
    "fold_gains",
    "freeze_batchnorm",
    "gain_offset_warnings",
    "linear_consumers",
    "ln_foldability",
    "ln_to_rms",
    "load_checkpoint",
    "load_transformed",
    "model_dtype",
    "model_output",
    "probe_inputs",
    "probe_norm",
    "run_checks",
    "save_surgery",
]
