"""argparse types shared by the commands: each refuses a value out of its range, and argparse then
names the option ("argument --reps: expected a positive integer, got 0"). No torch here: the
`magicube` command's parser is built without it."""

from __future__ import annotations

import argparse
from pathlib import Path

from magicube.train.files import check_writable


def positive_int(text: str) -> int:
    """A count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def fraction(text: str) -> float:
    """A fraction in [0, 1): a mask's sparsity."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value}")
    return value


def output_folder(text: str) -> Path:
    """A folder to write into (`check_writable`)."""
    try:
        return check_writable(text)
    except OSError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def output_prefix(text: str) -> Path:
    """A path without suffix (.md and .json are written beside it) in a folder to write into."""
    output_folder(str(Path(text).parent))
    return Path(text)
