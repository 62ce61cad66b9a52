"""``normatlas kernels build | info``: compile the C++ CPU kernels once into the shared cache, or say how they stand."""

from __future__ import annotations

import argparse

from . import CliError
from ._format import Section, add_format_option, emit


def configure_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=("build", "info"),
        help="build: compile the kernels now unless the cache has them (about 35 s on 2 cores, once per machine); "
        "info: how this process would get them, without compiling",
    )
    add_format_option(p)


def kernels(args: argparse.Namespace) -> int:
    from ..kernels import dispatch

    if args.action == "build":
        try:
            info = dispatch.ensure_built()
        except RuntimeError as exc:
            raise CliError(str(exc)) from None
    else:
        info = dispatch.build_info()
    rows = [{"field": k, "value": v} for k, v in info.items()]
    emit([Section("kernels", rows, title=f"C++ CPU kernels ({args.action})")], args.format, meta=None)
    return 0
