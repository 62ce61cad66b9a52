"""``normatlas axes``: the essay's taxonomy table for the vision and sequence conventions."""

from __future__ import annotations

import argparse

from ..taxonomy import taxonomy_table
from ._format import Section, add_format_option, emit

AXES_TITLE = "x[n, c, s]: n = sample (N | B), c = feature (C | D), s = position (H,W | T)"


def configure_axes(p: argparse.ArgumentParser) -> None:
    add_format_option(p)


def axes(args: argparse.Namespace) -> int:
    emit([Section("layers", taxonomy_table(), AXES_TITLE)], args.format)
    return 0
