"""``inferflow inspect FILE``: list a checkpoint's tensors (name, shape, type) and metadata."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from inferflow.loaders import detect_format, open_files

_MAX_LIST = 8  # long arrays (vocabularies) are summarised


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="list tensors and metadata of a checkpoint file", description=__doc__
    )
    p.add_argument(
        "file", type=Path, help="GGUF, safetensors, pickle (.bin/.pt) file or HF model directory"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-metadata", action="store_true", help="tensors only")
    p.set_defaults(run=run)


def _short(v: Any) -> Any:
    if isinstance(v, list) and len(v) > _MAX_LIST:
        return [_short(x) for x in v[:_MAX_LIST]] + [f"... ({len(v)} items)"]
    if isinstance(v, str) and len(v) > 200:
        return v[:200] + f"... ({len(v)} chars)"
    if isinstance(v, dict):
        return {k: _short(x) for k, x in v.items()}
    return v


def run(args: argparse.Namespace) -> int:
    fmt = detect_format(args.file)
    src = open_files(fmt, [args.file])
    try:
        tensors = [
            {"name": n, "shape": list(src.shape(n)), "type": src.dtype_name(n)} for n in src.names()
        ]
        meta = {} if args.no_metadata else {k: _short(v) for k, v in src.metadata.items()}
    finally:
        src.close()
    if args.json:
        print(
            json.dumps({"format": fmt, "metadata": meta, "tensors": tensors}, indent=2, default=str)
        )
        return 0
    print(f"format: {fmt}")
    if meta:
        print("metadata:")
        for k, v in meta.items():
            print(f"  {k}: {v}")
    print(f"tensors ({len(tensors)}):")
    width = max((len(t["name"]) for t in tensors), default=0)
    for t in tensors:
        print(f"  {t['name']:<{width}}  {t['type']:<6}  {t['shape']}")
    return 0
