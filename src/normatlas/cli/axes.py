"""``normatlas axes``: the essay's taxonomy table for the vision and sequence conventions."""

from __future__ import annotations

import argparse

from ..taxonomy import taxonomy_table
from . import command
from ._format import Section, add_format_option, emit

AXES_TITLE = "x[n, c, s]: n = sample (N | B), c = feature (C | D), s = position (H,W | T)"


def _configure(p: argparse.ArgumentParser) -> None:
    add_format_option(p)


@command("axes", "print which reduced axes name which normalization layer (vision and sequence)", _configure)
def axes(args: argparse.Namespace) -> int:
    emit([Section("layers", taxonomy_table(), AXES_TITLE)], args.format)
    return 0
