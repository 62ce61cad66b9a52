"""The README's and the docs' examples run as written and print what they say they print.

In each page (README.md, docs/*.md), every ```python block runs, in order, in one namespace (as a reader pasting
them into one session would; nothing is imported for them), and where an output block follows, its stdout must
equal the documented output exactly. A block whose first line says ``# save as NAME.py and run: torchrun
--nproc-per-node N NAME.py`` is a script: it is saved and run that way, on gloo processes. The kernels example
prints figures of this machine's vector kernels (the instruction set and a rounding error), so it is compared
only where the C++ extension runs the AVX-512 kernels, as on the machine the README was written on.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
EXAMPLE = re.compile(r"```python\n(.*?)```(?:\n```\n(.*?)```)?", re.S)
SCRIPT = re.compile(r"# save as (\w+\.py) and run: torchrun --nproc-per-node (\d) \1")


def _run_script(code: str, name: str, nproc: int) -> str:
    """Save ``code`` as ``name`` in a fresh folder and run it as its first line says; its stdout."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_text(code)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), name]
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def check_examples(text: str, where: Path = README) -> int:
    """Run every example of a README text; raise AssertionError at the first whose output differs. Returns how
    many were compared."""
    from normatlas.kernels import build_info

    avx512 = build_info().get("vector_isa") == "avx512"
    namespace: dict[str, object] = {"__name__": "readme"}
    compared = 0
    for code, want in EXAMPLE.findall(text):
        script = SCRIPT.match(code)
        if script:
            printed = _run_script(code, script.group(1), int(script.group(2)))
        else:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, str(where), "exec"), namespace)
            printed = out.getvalue()
        if not want or ("build_info()" in code and not avx512):
            continue  # no documented output; machine-specific figures (above)
        first = code.splitlines()[0]
        assert printed == want, f"{where.name} example starting {first!r} printed:\n{printed}"
        compared += 1
    return compared


def test_readme_examples_print_their_documented_output() -> None:
    assert check_examples(README.read_text()) >= 3


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_examples_print_their_documented_output(page: Path) -> None:
    check_examples(page.read_text(), page)  # as written: each page imports what it uses


def test_a_changed_output_is_caught() -> None:
    text = README.read_text()
    changed = text.replace("4.8e-07  2.9e+00", "4.8e-07  3.0e+00", 1)
    assert changed != text
    with pytest.raises(AssertionError, match="import torch, normatlas"):
        check_examples(changed)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link of a page names a file that exists (anchors within a page: a heading of that page)."""
    text = page.read_text()
    headings = re.findall(r"^#+ (.*)$", text, re.M)
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        if target:
            assert (page.parent / target).exists(), f"{page.name}: broken link {target!r}"
        elif anchor:
            assert anchor in anchors, f"{page.name}: no heading for #{anchor}"
