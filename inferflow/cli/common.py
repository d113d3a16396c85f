"""Flags and input reading that several subcommands share."""

from __future__ import annotations

import argparse
import sys

from inferflow.errors import RequestError

DTYPE_CHOICES = ("float32", "bfloat16")


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype", default="float32", choices=DTYPE_CHOICES, help="activation and weight dtype"
    )


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 file, or of stdin for ``-``, without their line ends."""
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"--input: cannot read {path}: {e}") from None
