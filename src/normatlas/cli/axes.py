"""``normatlas axes``: the essay's taxonomy table for the vision and sequence conventions."""

from __future__ import annotations

import argparse

from ..taxonomy import taxonomy_table
from . import command
from ._format import add_format_option, format_rows


def _configure(p: argparse.ArgumentParser) -> None:
    add_format_option(p)


@command("axes", "print which reduced axes name which normalization layer (vision and sequence)", _configure)
def axes(args: argparse.Namespace) -> int:
    title = "x[n, c, s]: n = sample (N | B), c = feature (C | D), s = position (H,W | T)"
    print(format_rows(taxonomy_table(), args.format, title=title))
    return 0
