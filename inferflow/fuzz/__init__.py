"""Fuzzing of every parser of untrusted input: pickle, GGUF, safetensors, spec YAML.

``Campaign(targets).run(target, count)`` mutates real seed files and runs each input through the
target's full load path in a worker process with a memory bound, a time limit and a guard against
writes; ``tools/fuzz.py`` is its command line.
"""

from __future__ import annotations

from inferflow.fuzz.harness import (
    MEMORY_BOUND,
    TIME_LIMIT,
    Bug,
    Campaign,
    TargetReport,
    write_report,
)
from inferflow.fuzz.targets import PUBLIC_TARGETS, TARGETS

__all__ = [
    "MEMORY_BOUND",
    "PUBLIC_TARGETS",
    "TARGETS",
    "TIME_LIMIT",
    "Bug",
    "Campaign",
    "TargetReport",
    "write_report",
]
