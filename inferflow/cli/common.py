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
    """The lines of a UTF-8 file, or of stdin for ``-``, without their line ends ("\n" or
    "\r\n"). Only those end a line: not str.splitlines' others (form feed, U+2028, ...), which
    may sit inside a source text and would give more outputs than input lines."""
    if path == "-":
        return [line.rstrip("\r\n") for line in sys.stdin]
    try:
        with open(path, encoding="utf-8", newline="\n") as f:  # (a lone "\r" ends no line)
            return [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"--input: cannot read {path}: {e}") from None
