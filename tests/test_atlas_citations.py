"""Every method the library implements names its paper, checked both ways: every registered object imports and
every key is a paper; every public method is registered or is an allowlisted utility with a reason."""

from __future__ import annotations

import pytest

from normatlas.atlas.citations import CITATIONS, METHOD_MODULES, UTILITIES, citations_for, public_methods, resolve
from normatlas.atlas.papers import paper, papers

KEYS = {r["key"] for r in papers()}
METHODS = public_methods()


@pytest.mark.parametrize("path", list(CITATIONS), ids=list(CITATIONS))
def test_registered_object_imports_and_cites_known_papers(path: str) -> None:
    assert resolve(path) is not None
    keys = CITATIONS[path]
    assert keys and len(set(keys)) == len(keys)
    assert set(keys) <= KEYS, f"{path} cites {sorted(set(keys) - KEYS)}, not in papers.json"


@pytest.mark.parametrize("path", METHODS, ids=METHODS)
def test_every_public_method_names_its_paper_or_is_a_utility(path: str) -> None:
    assert (path in CITATIONS) != (path in UTILITIES), f"{path}: registered in neither or both tables"


def test_no_stale_entries() -> None:
    assert set(CITATIONS) | set(UTILITIES) <= set(METHODS), "every entry is a public name of a method module"


@pytest.mark.parametrize("path", list(UTILITIES), ids=list(UTILITIES))
def test_utility_has_a_reason_and_imports(path: str) -> None:
    resolve(path)
    assert len(UTILITIES[path]) > 15


def test_the_method_modules_are_enumerated_from_the_library() -> None:
    import importlib

    assert len(METHODS) == sum(len(importlib.import_module(m).__all__) for m in METHOD_MODULES)
    assert {"normatlas.presets.RMSNorm", "normatlas.blocks.peri_ln", "normatlas.longtail.DyT"} <= set(METHODS)
    assert len(CITATIONS) > len(UTILITIES), "most public names are methods with a paper"


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("normatlas.presets.LayerNorm", "layernorm2016"),
        ("normatlas.presets.RMSNorm", "rmsnorm2019"),
        ("normatlas.presets.GroupNorm", "groupnorm2018"),
        ("normatlas.presets.InstanceNorm2d", "instancenorm2016"),
        ("normatlas.presets.GemmaRMSNorm", "gemma2024"),
        ("normatlas.blocks.post_ln", "vaswani2017"),
        ("normatlas.blocks.pre_ln", "xiong2020"),
        ("normatlas.blocks.peri_ln", "periln2025"),
        ("normatlas.blocks.mix_ln", "mixln2025"),
        ("normatlas.blocks.layernorm_scaling", "lns2025"),
        ("normatlas.blocks.depth_scaled_sandwich", "pangu_ultra2025"),
        ("normatlas.blocks.QKNorm", "henry2020"),
        ("normatlas.blocks.Rope", "roformer2021"),
        ("normatlas.blocks.MLP", "glu_variants2020"),
        ("normatlas.blocks.ModelConfig", "gpt2_2019"),
        ("normatlas.longtail.AdaLNZero", "dit2022"),
        ("normatlas.longtail.WSConv2d", "weight_standardization2019"),
        ("normatlas.longtail.adaptive_clip_grad_", "nfnets2021"),
        ("normatlas.longtail.ngpt_constraint", "ngpt2024"),
        ("normatlas.diagnostics.EntropyCollapseAlarm", "zhai2023"),
        ("normatlas.diagnostics.massive_activations", "massive_activations2024"),
        ("normatlas.diagnostics.attention_sinks", "attention_sinks2023"),
        ("normatlas.surgery.fold_gains", "flashnorm2024"),
        ("normatlas.surgery.ln_to_rms", "enjoy_layernorm"),
    ],
)
def test_known_citations(path: str, key: str) -> None:
    assert key in CITATIONS[path] and path in citations_for(key)
    assert paper(key)["key"] == key


def test_gpt2_scaled_init_is_a_config_flag_of_the_cited_object() -> None:
    import dataclasses

    cfg = resolve("normatlas.blocks.ModelConfig")
    assert "scaled_residual_init" in {f.name for f in dataclasses.fields(cfg)}  # type: ignore[arg-type]
