"""Argument types of the command line: numbers refused by argparse (one usage line, exit 2) when out of range, instead
of failing later with a traceback or silently meaning something else."""

from __future__ import annotations

import argparse
import math


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def finite_float(text: str) -> float:
    """A finite number (not nan or inf: a size, rate or fraction computed with one would be nan)."""
    v = float(text)
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (a duration or size of zero, or a negative one, means nothing)."""
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return v
