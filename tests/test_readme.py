"""The README's and the docs' examples print what they say they print.

In each page (README.md, docs/*.md), every ```python block that is followed by an output block runs, in order, in
one namespace (as a reader pasting them into one session would), and its stdout must equal the documented output
exactly. The kernels example
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
EXAMPLE = re.compile(r"```python\n(.*?)```\n```\n(.*?)```", re.S)


def check_examples(text: str, where: Path = README) -> int:
    """Run every example of a README text; raise AssertionError at the first whose output differs. Returns how
    many were compared."""
    from normatlas.kernels import build_info

    avx512 = build_info().get("vector_isa") == "avx512"
    namespace: dict[str, object] = {"__name__": "readme"}
    compared = 0
    for code, want in EXAMPLE.findall(text):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(where), "exec"), namespace)
        if "build_info()" in code and not avx512:
            continue  # machine-specific figures (above)
        first = code.splitlines()[0]
        assert out.getvalue() == want, f"{where.name} example starting {first!r} printed:\n{out.getvalue()}"
        compared += 1
    return compared


def test_readme_examples_print_their_documented_output() -> None:
    assert check_examples(README.read_text()) >= 3


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_examples_print_their_documented_output(page: Path) -> None:
    check_examples("```python\nimport torch\n```\n```\n```\n" + page.read_text(), page)  # torch, as in the README


def test_a_changed_output_is_caught() -> None:
    text = README.read_text()
    changed = text.replace("4.8e-07  2.9e+00", "4.8e-07  3.0e+00", 1)
    assert changed != text
    with pytest.raises(AssertionError, match="import torch, normatlas"):
        check_examples(changed)
