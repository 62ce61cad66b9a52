"""Rename invariance: renaming every module, parameter and buffer of a model changes nothing the library reports.

The essay's porting bug is reading names as semantics (HF's ``post_attention_layernorm`` is the pre-FFN norm
in Llama and the post-branch norm in OLMo 2). Every reader here (inspect, surgery, the Monitor, param_groups,
module_kind, trace_linear_to_norm) is run on a model and on its renamed twin (:mod:`.renamer`: same modules,
same tensors, names replaced by meaningless or *lying* ones: an RMSNorm's gain registered as ``bias``, a norm
called ``q_proj``, a child called ``variance_epsilon``); the results must agree once the labels are mapped back.

Models: tiny HF families built offline from their configs (random weights; original sizes in tests/tiny_hf.py),
our ``TransformerLM`` with four placements, a ``ViTEncoder`` and a small CNN with BatchNorm.
"""

from __future__ import annotations

import copy
import math
import random
import re
import string
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import normatlas
from normatlas import blocks, surgery
from normatlas.analysis import probe
from normatlas.diagnostics import Monitor, module_kind, param_groups, trace_linear_to_norm
from normatlas.inspect import inspect_model, inspect_vision

from .renamer import ALIAS, Scheme, counter_scheme, old_names, renamed
from .tiny_hf import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore")

HF = ("llama", "gemma2", "olmo2", "qwen3", "gpt2", "bert")
OURS = ("pre_ln", "post_ln", "peri_ln", "hybridnorm")
MODELS = (*HF, *OURS, "vit", "cnn")
VOCAB = 64

# Names that mean something to a reader that reads names: each may be given to anything that does not own it.
LIES = (
    "weight", "bias", "norm", "proj", "q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "up_proj", "gate_proj",
    "input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm", "ln_f", "ln_1", "ln_2", "LayerNorm",
    "final_norm", "norm_f", "q_norm", "k_norm", "layers", "h", "mlp", "attn", "self_attn", "embed_tokens", "wte",
    "lm_head", "gamma", "beta", "gain", "scale", "running_mean", "running_var", "variance_epsilon", "eps", "spec",
    "normalized_shape", "num_features", "hidden_size", "conv", "bn", "batchnorm", "embeddings", "classifier",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- schemes


def lying_scheme(rng: random.Random, lie: float = 0.5, root: nn.Module | None = None) -> Scheme:
    """With probability ``lie`` a name from :data:`LIES` the module does not own, else a random identifier.

    The entries of ``root`` get no plain English word (``bias``, ``norm``, ...): a top-level name is a whole
    label, and the test could not tell it from the same word in a message when mapping labels back."""

    def scheme(module: nn.Module, kind: str, old: str, forbidden: set[str]) -> str:
        lies = [n for n in LIES if "_" in n or not n.islower()] if module is root else LIES
        free = [n for n in lies if n not in forbidden and n != old]
        if free and rng.random() < lie:
            return rng.choice(free)
        while True:
            name = rng.choice(string.ascii_letters) + "".join(rng.choices(string.ascii_letters + string.digits, k=5))
            if name not in forbidden:
                return name

    return scheme


# --------------------------------------------------------------------------- models


class CNN(nn.Module):
    """Conv-BN-ReLU x 3 (two repeated blocks, so the Monitor finds a stack) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(2)
        ])  # fmt: skip
        self.head = nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _ours(kind: str) -> nn.Module:
    placement = getattr(blocks, kind)()
    cfg = blocks.ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        norm=normatlas.RMSNorm,
        placement=placement,
        tie_embeddings=False,  # a tied one trips fold_gains on the frozen config: see test_fold_gains_on_a_tied_lm
    )
    return blocks.TransformerLM(cfg)


def _warm_bn(model: nn.Module, x: Tensor) -> nn.Module:
    """A few train-mode forwards so the running statistics are not at their init."""
    model.train()
    with torch.no_grad():
        for i in range(3):
            model(x * (1 + i) + i)
    return model.eval()


@cache
def _built(kind: str) -> tuple[nn.Module, Any]:
    """``(model in eval mode with non-trivial weights, example inputs)``; cached, never mutated by the tests."""
    gen = torch.Generator().manual_seed(0)
    if kind in HF:
        model = tiny_model(kind, "BertModel" if kind == "bert" else None, vocab_size=VOCAB)
        with torch.no_grad():  # gains and biases off their init, so a wrong gain convention shows
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        return model, {"input_ids": torch.randint(0, VOCAB, (2, 8), generator=gen)}
    if kind in OURS:
        torch.manual_seed(0)
        return _ours(kind).eval(), torch.randint(0, VOCAB, (2, 8), generator=gen)
    if kind == "vit":
        torch.manual_seed(0)
        cfg = blocks.ViTConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, norm=normatlas.LayerNorm, image_size=16)
        return blocks.ViTEncoder(cfg).eval(), torch.randn(2, 3, 16, 16, generator=gen)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=gen)
    return _warm_bn(CNN(), torch.randn(4, 3, 8, 8, generator=gen)), x


@cache
def _pair(kind: str) -> tuple[nn.Module, nn.Module, Any, dict[str, str]]:
    """``(model, renamed twin sharing its tensors, inputs, {new name: old name})``; one seeded lying scheme."""
    model, x = _built(kind)
    twin = renamed(model, lying_scheme(random.Random(f"rename-{kind}"), root=model))
    return model, twin, x, old_names(model, twin)


def _fresh(kind: str) -> tuple[nn.Module, nn.Module, Any, dict[str, str]]:
    """As :func:`_pair` but with tensors of their own (for readers that train or transform in place)."""
    model, x = _built(kind)
    model = copy.deepcopy(model)
    twin = renamed(model, lying_scheme(random.Random(f"rename-{kind}"), root=model), share=False)
    return model, twin, x, old_names(model, twin)


def _run(model: nn.Module, x: Any) -> Tensor:
    with torch.no_grad():
        out = model(**x) if isinstance(x, dict) else model(x)
    if isinstance(out, Tensor):
        return out
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


# --------------------------------------------------------------------------- mapping labels back


_TOKEN = re.compile(r"[A-Za-z_][\w.]*")


def _map_name(name: str, back: dict[str, str]) -> str:
    """A (dotted) name of the twin in the original's names: the longest known prefix is mapped."""
    if name in back:
        return back[name]
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in back:
            return ".".join([back[head], *parts[i:]])
    return name


def relabel(text: str, back: dict[str, str]) -> str:
    """A label or a message of the twin with every module / parameter name in it replaced by the original's."""
    return _TOKEN.sub(lambda m: _map_name(m.group(0), back), text)


def _nan_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_nan_equal(u, v) for u, v in zip(a, b, strict=True))
    return bool(a == b)


def assert_same(original: Any, mapped: Any) -> None:
    """``mapped`` (the twin's result, labels mapped back) equals ``original``; NaN equals NaN. The first
    differing key of a dict is named."""
    if _nan_equal(original, mapped):
        return
    if isinstance(original, dict) and isinstance(mapped, dict):
        for k in sorted(set(original) | set(mapped), key=str):
            if not _nan_equal(original.get(k), mapped.get(k)):
                raise AssertionError(f"{k!r}: original {original.get(k)!r} != renamed {mapped.get(k)!r}")
    if isinstance(original, list) and isinstance(mapped, list):
        for i, (u, v) in enumerate(zip(original, mapped, strict=False)):
            if not _nan_equal(u, v):
                raise AssertionError(f"[{i}]: original {u!r} != renamed {v!r}")
    assert original == mapped


# --------------------------------------------------------------------------- the renamer itself


def _check_renamer(model: nn.Module, twin: nn.Module, x: Any, *, shared: bool = True) -> None:
    back = old_names(model, twin)
    old = {n for n, _ in model.named_modules()} | set(model.state_dict())
    new_modules = [n for n, _ in twin.named_modules() if n]
    new = set(new_modules) | set(twin.state_dict())
    assert new_modules and not (new - {""}) & old, "some name was kept"
    assert {back[n] for n in new} == old - {""} | ({""} & new)
    for (na, a), (nb, b) in zip(
        model.named_parameters(remove_duplicate=False), twin.named_parameters(remove_duplicate=False), strict=True
    ):
        assert back[nb] == na
        assert (a is b) == shared and torch.equal(a, b)
    for (na, a), (nb, b) in zip(model.named_modules(), twin.named_modules(), strict=True):
        assert back[nb] == na and type(b).__name__ == type(a).__name__ and isinstance(b, type(a))
    for na, nb in zip(model.state_dict(), twin.state_dict(), strict=True):
        assert back[nb] == na
    torch.testing.assert_close(_run(twin, x), _run(model, x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", MODELS)
def test_renamer_changes_every_name_and_nothing_else(kind: str) -> None:
    model, twin, x, _ = _pair(kind)
    _check_renamer(model, twin, x)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lie=st.sampled_from([0.0, 0.5, 1.0]), kind=st.sampled_from(["pre_ln", "cnn"]))
def test_renamer_property_random_schemes(seed: int, lie: float, kind: str) -> None:
    model, x = _built(kind)
    _check_renamer(model, renamed(model, lying_scheme(random.Random(seed), lie, root=model)), x)


def test_renamer_counter_scheme_and_deep_copy() -> None:
    model, x = _built("llama")
    twin = renamed(model, counter_scheme(), share=False)
    _check_renamer(model, twin, x, shared=False)
    assert all(re.fullmatch(r"[mpb]\d+", n.rsplit(".", 1)[-1]) for n in twin.state_dict())
    again = copy.deepcopy(twin)  # the twin survives deepcopy (surgery copies models)
    torch.testing.assert_close(_run(again, x), _run(model, x), rtol=0, atol=0)


def test_renamer_follows_a_module_replaced_under_its_new_name() -> None:
    model, twin, x, back = _fresh("pre_ln")
    new = {v: k for k, v in back.items()}
    path = new["layers.0.mlp"]
    twin.set_submodule(path, nn.Identity())  # what a surgery does: the forward code must see the replacement
    model.set_submodule("layers.0.mlp", nn.Identity())
    torch.testing.assert_close(_run(twin, x), _run(model, x), rtol=0, atol=0)
    assert isinstance(twin.get_submodule(path.rsplit(".", 1)[0]).mlp, nn.Identity)
    assert ALIAS in vars(twin)


# --------------------------------------------------------------------------- inspect


def _report(model: nn.Module, x: Any, kind: str, back: dict[str, str] | None = None) -> dict[str, Any]:
    """The report as a dict, without its timing; with ``back``, the twin's labels (each norm's module and
    the notes) mapped back to the original's names."""
    inspect = inspect_vision if kind == "vit" else inspect_model
    d = inspect(model, x, name=kind).to_dict()
    d.pop("seconds", None)
    if back is not None:
        for norm in d.get("norms", []):
            norm["module"] = relabel(norm["module"], back)
        d["notes"] = [relabel(n, back) for n in d["notes"]]
    return d


@pytest.mark.parametrize("kind", [k for k in MODELS if k != "cnn"])
def test_inspect_is_rename_invariant(kind: str) -> None:
    model, twin, x, back = _pair(kind)
    assert_same(_report(model, x, kind), _report(twin, x, kind, back))


# --------------------------------------------------------------------------- surgery


def _surgery_view(s: surgery.Surgery, back: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest (changes, refusals, swaps, notes, the checks); with ``back``, the twin's labels mapped back."""
    m = s.manifest()
    if back is None:
        return m
    for swap in m["swaps"]:
        module = swap["module"]
        if swap["params"] is not None:  # parameter names local to the swapped module: map their full paths back
            full = {ours: relabel(f"{module}.{theirs}", back) for ours, theirs in swap["params"].items()}
            swap["params"] = {ours: path.rpartition(".")[2] for ours, path in full.items()}
        swap["module"] = relabel(module, back)
        swap["source"] = relabel(swap["source"], back) if swap["source"] is not None else None
    for c in m["changes"]:
        c["target"], c["detail"] = relabel(c["target"], back), relabel(c["detail"], back)
    for r in m["refusals"]:
        r["target"], r["reason"] = relabel(r["target"], back), relabel(r["reason"], back)
    m["notes"] = [relabel(n, back) for n in m["notes"]]
    return m


def _surgery(transform: Callable[[nn.Module, Any], surgery.Surgery], kind: str) -> None:
    model, twin, x, back = _fresh(kind)
    views, runtimes = [], []
    for m in (model, twin):
        try:
            s = transform(m, x)
        except surgery.NothingToChange as err:
            views.append({"nothing": str(err)})
            continue
        surgery.run_checks(m, s, x)
        views.append(_surgery_view(s, back if m is twin else None))
        runtimes.append(_run(s.runtime(), x))
    assert_same(views[0], views[1])
    if runtimes:  # the transformed twin computes what the transformed original does
        torch.testing.assert_close(runtimes[1], runtimes[0], rtol=1e-5, atol=1e-6)
        assert views[0]["checks"], views[0]


SURGERIES: dict[str, tuple[Callable[[nn.Module, Any], surgery.Surgery], tuple[str, ...]]] = {
    "fold_gains": (surgery.fold_gains, ("llama", "gemma2", "olmo2", "gpt2", "pre_ln", "peri_ln")),
    "ln_to_rms": (surgery.ln_to_rms, ("gpt2", "bert", "vit")),
    "to_w": (lambda m, x: surgery.convert_gain_convention(m, x, "w"), ("gemma2",)),
    "to_1pw": (lambda m, x: surgery.convert_gain_convention(m, x, "1+w"), ("qwen3",)),
    "fold_batchnorm": (surgery.fold_batchnorm, ("cnn",)),
    "freeze_batchnorm": (surgery.freeze_batchnorm, ("cnn",)),
}


@pytest.mark.parametrize(
    ("name", "kind"),
    [pytest.param(name, kind, id=f"{name}-{kind}") for name, (_, kinds) in SURGERIES.items() for kind in kinds],
)
def test_surgery_is_rename_invariant(name: str, kind: str) -> None:
    _surgery(SURGERIES[name][0], kind)


def test_fold_batchnorm_ignores_a_tensor_registered_as_spec() -> None:
    """A BatchNorm's layout was read from ``getattr(bn, "spec", None)`` (fixed on main: the typed read_batchnorm);
    a torch BatchNorm2d whose weight is registered as ``spec`` must fold as before."""
    torch.manual_seed(0)
    model, x = (
        _warm_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), torch.randn(4, 3, 8, 8)),
        torch.randn(2, 3, 8, 8),
    )
    count = counter_scheme()

    def scheme(module: nn.Module, kind: str, old: str, forbidden: set[str]) -> str:
        lie = isinstance(module, nn.BatchNorm2d) and old == "weight"
        return "spec" if lie and "spec" not in forbidden else count(module, kind, old, forbidden)

    twin = renamed(model, scheme)
    assert any(n.endswith(".spec") for n, _ in twin.named_parameters())
    a, b = surgery.fold_batchnorm(model, x), surgery.fold_batchnorm(twin, x)
    assert_same(
        _surgery_view(surgery.run_checks(model, a, x)),
        _surgery_view(surgery.run_checks(twin, b, x), old_names(model, twin)),
    )
    assert a.passed and a.changes


def test_apply_swaps_carries_a_renamed_gain_and_bias() -> None:
    """A LayerNorm swapped for the same Norm, gain and bias renamed: the swap carries the parameters the probe
    measured as gain and bias (``NormFacts.params``), not the ones called weight and bias (it once did)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8))
    with torch.no_grad():
        model[0].weight.normal_()
        model[0].bias.normal_()
    twin = renamed(model, counter_scheme())
    (path,) = [n for n, _ in twin.named_children()]
    facts = probe(twin.get_submodule(path), 8)
    assert facts is not None and set(facts.params().values()) == {
        n for n, _ in twin.get_submodule(path).named_parameters()
    }
    swap = surgery.Swap(path, surgery.SwapKind.NORM, normatlas.LayerNorm(8).spec, [8], params=facts.params())
    x = torch.randn(3, 8)
    torch.testing.assert_close(surgery.apply_swaps(twin, [swap])(x), model(x))


def test_fold_gains_on_a_tied_lm() -> None:
    """A tied TransformerLM: untying writes tie_embeddings=False into its (frozen) ModelConfig (it once raised)."""
    torch.manual_seed(0)
    cfg = blocks.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=64, norm=normatlas.RMSNorm)
    model, x = blocks.TransformerLM(cfg).eval(), torch.randint(0, VOCAB, (2, 8))
    done = surgery.run_checks(model, surgery.fold_gains(model, x), x)
    assert done.passed and done.stock.config.tie_embeddings is False


# --------------------------------------------------------------------------- diagnostics


def _param_groups(model: nn.Module, back: dict[str, str] | None = None) -> list[tuple[Any, ...]]:
    """(name, aliases, owning classes, role, decay) per parameter, and the two groups' names."""
    groups, infos = param_groups(model, report=True)  # type: ignore[misc]
    name: Callable[[str], str] = (lambda n: relabel(n, back)) if back is not None else (lambda n: n)
    rows = [(name(i.name), tuple(map(name, i.aliases)), i.module, i.role.value, i.decay) for i in infos]
    return rows + [(g["weight_decay"], [name(n) for n in g["names"]]) for g in groups]


@pytest.mark.parametrize("kind", MODELS)
def test_param_groups_and_module_kind_are_rename_invariant(kind: str) -> None:
    model, twin, _, back = _pair(kind)
    assert_same(_param_groups(model), _param_groups(twin, back))
    kinds_a = [(n, module_kind(m).value) for n, m in model.named_modules()]
    kinds_b = [(relabel(n, back), module_kind(m).value) for n, m in twin.named_modules()]
    assert_same(kinds_a, kinds_b)


@pytest.mark.parametrize("kind", MODELS)
def test_trace_linear_to_norm_is_rename_invariant(kind: str) -> None:
    model, twin, x, back = _pair(kind)
    names_a = {m: n for n, m in model.named_modules()}
    names_b = {m: n for n, m in twin.named_modules()}
    args, kwargs = ((), x) if isinstance(x, dict) else ((x,), {})
    pairs_a = [(names_a[lin], names_a[norm]) for lin, norm in trace_linear_to_norm(model, *args, **kwargs)]
    pairs_b = [
        (relabel(names_b[lin], back), relabel(names_b[norm], back))
        for lin, norm in trace_linear_to_norm(twin, *args, **kwargs)
    ]
    assert_same(pairs_a, pairs_b)


def _monitored(model: nn.Module, kind: str, steps: int = 2) -> list[dict[str, Any]]:
    """A few seeded SGD steps under a Monitor measuring every step; its records."""
    model.train()
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, every=1, optimizer=opt, print_alarms=False, channels_first=kind in ("cnn",))
    _, x = _built(kind)
    for _ in range(steps):
        if isinstance(x, dict):
            out = model(**x)
            logits = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
            loss = logits.float().pow(2).mean()
        else:
            out = model(x)
            loss = F.cross_entropy(
                out.reshape(-1, out.shape[-1]), torch.zeros(out.shape[:-1], dtype=torch.long).flatten()
            )
        loss.backward()
        mon.step(loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    return mon.history.records


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert", "pre_ln", "hybridnorm", "vit", "cnn"])
def test_monitor_records_are_rename_invariant(kind: str) -> None:
    model, twin, _, back = _fresh(kind)
    records = [{relabel(k, back): v for k, v in rec.items()} for rec in _monitored(twin, kind)]
    assert_same(_monitored(model, kind), records)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["pre_ln", "cnn"]))
def test_param_groups_property_random_schemes(seed: int, kind: str) -> None:
    model, _ = _built(kind)
    twin = renamed(model, lying_scheme(random.Random(seed), 0.7, root=model))
    assert_same(_param_groups(model), _param_groups(twin, old_names(model, twin)))


# --------------------------------------------------------------------------- long tail converters


def _conversion(report: Any, back: dict[str, str] | None = None) -> list[tuple[Any, ...]]:
    name: Callable[[str], str] = (lambda n: relabel(n, back)) if back is not None else (lambda n: n)
    return [(name(c.path), c.old, c.new, c.kept, c.note) for c in report.changes]


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt2", "pre_ln", "vit"])
def test_convert_norms_to_pointwise_is_rename_invariant(kind: str) -> None:
    from normatlas.longtail import convert_norms_to_pointwise

    model, twin, x, back = _fresh(kind)
    a = convert_norms_to_pointwise(model, copy_affine=True)
    b = convert_norms_to_pointwise(twin, copy_affine=True)
    assert a.changes and _conversion(a) == _conversion(b, back)
    torch.testing.assert_close(_run(twin, x), _run(model, x), rtol=0, atol=0)


@pytest.mark.parametrize("target", ["frozen", "group", "ghost"])
def test_convert_batchnorm_is_rename_invariant(target: str) -> None:
    from normatlas.longtail import BatchNormTarget, convert_batchnorm

    model, twin, x, back = _fresh("cnn")
    to = BatchNormTarget(target)
    a, b = convert_batchnorm(model, to, num_groups=4), convert_batchnorm(twin, to, num_groups=4)
    assert a.changes and _conversion(a) == _conversion(b, back)
    model.eval(), twin.eval()
    torch.testing.assert_close(_run(twin, x), _run(model, x), rtol=0, atol=0)
    # converting again leaves every converted module alone, also in the twin, whose classes are renamed subclasses
    assert not convert_batchnorm(renamed(model), to, num_groups=4).changes or to is BatchNormTarget.GROUP


# --------------------------------------------------------------------------- the name readings fixed here


def test_pointwise_converter_finds_a_norm_by_behaviour_not_by_variance_epsilon() -> None:
    """longtail/pointwise.py ``_describe`` recognised a foreign RMSNorm by ``hasattr(m, "variance_epsilon")``: Gemma's
    RMSNorm (which calls it ``eps``) was missed, and anything carrying that name with a 1-D weight was taken."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from normatlas.longtail import DyT, convert_norms_to_pointwise

    class Gate(nn.Module):  # not a norm, whatever its attributes say
        def __init__(self, d: int) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.full((d,), 0.5)), 1e-6

        def forward(self, x: Tensor) -> Tensor:
            return x * self.weight

    gemma = GemmaRMSNorm(8)
    with torch.no_grad():
        gemma.weight.fill_(0.5)  # multiplies by 1.5
    model = nn.Sequential(gemma, Gate(8))
    report = convert_norms_to_pointwise(model, copy_affine=True)
    assert [(c.path, c.kept) for c in report.changes] == [("0", ("weight",))]
    assert isinstance(model[0], DyT) and isinstance(model[1], Gate)
    torch.testing.assert_close(model[0].weight.detach(), torch.full((8,), 1.5))  # the (1 + w) gain, measured


def test_post_gain_init_measures_a_foreign_one_plus_w_norm() -> None:
    """blocks/block.py chose the (1 + w) init by ``getattr(norm, "spec")``: HF's GemmaRMSNorm (no ``spec``) got
    ``w = g``, i.e. an effective gain of 1 + g. Now the convention is measured: every operator starts at ``g``."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    for norm in (normatlas.RMSNorm, normatlas.GemmaRMSNorm, lambda d: GemmaRMSNorm(d)):
        cfg = blocks.ModelConfig(
            vocab_size=VOCAB, d_model=32, n_layers=4, d_ff=64, norm=norm, placement=blocks.depth_scaled_sandwich(0.5)
        )
        post = blocks.TransformerLM(cfg).layers[0].attn_post_norm
        with torch.no_grad():
            torch.testing.assert_close(post(x), 0.25 * unit, rtol=1e-4, atol=1e-5)  # c / sqrt(depth) = 0.5 / 2
    from normatlas.longtail import DyT  # a pointwise stand-in: its per-feature gain, found by the zeroing test

    cfg = blocks.ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=4, d_ff=64, norm=DyT, placement=blocks.depth_scaled_sandwich(0.5)
    )
    post = blocks.TransformerLM(cfg).layers[0].attn_post_norm
    assert torch.equal(post.weight.detach(), torch.full((32,), 0.25)) and post.alpha.item() == 0.5


def test_demo_peers_state_their_gain_convention() -> None:
    """cli/demo.py chose the random gains' centre by ``"Gemma" in name``; each peer now states its convention,
    and it is the preset's own (typed ``spec``), so a row named anything gets the right one."""
    from normatlas.cli.demo import _peers

    rows = _peers()
    assert any(r.gain_convention is normatlas.GainConvention.ONE_PLUS_W for r in rows)
    for row in rows:
        ours = row.ours()
        assert isinstance(ours, normatlas.Norm) and ours.spec.gain_convention is row.gain_convention, row.name


def test_batchnorm_converter_eps_none_is_the_machine_epsilon() -> None:
    """longtail/convert.py read a normatlas BatchNorm's eps as ``spec.eps or 1e-5``: ``eps=None`` (the machine
    epsilon of the compute dtype) became 1e-5, and so would ``eps=0.0``."""
    from normatlas.longtail import BatchNorm2d, BatchNormTarget, FrozenBatchNorm, convert_batchnorm

    bn = BatchNorm2d(4, eps=None)
    model = nn.Sequential(bn)
    convert_batchnorm(model, BatchNormTarget.FROZEN)
    assert isinstance(model[0], FrozenBatchNorm) and model[0].eps == torch.finfo(torch.float32).eps
