"""Argument checks shared by the bench scripts."""

from __future__ import annotations

import argparse


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     *names: str) -> None:
    """argparse's usage error (exit 2) for the first of ``names`` (dests) that was given a
    value below 1; an option left at None is not checked."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be at least 1")
