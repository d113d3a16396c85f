"""``inferflow inspect FILE [--spec SPEC]``: list a checkpoint's tensors (name, shape, type) and
metadata. With ``--spec``, the spec's ``source.keys`` pick a pickle's state dicts, and each
tensor also shows where that spec's tensor map puts it: the
canonical name(s) it fills, ``(ignored)`` for a name the spec's ``ignore`` lists, or
``(unmapped)`` (which ``validate`` reports as unused)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferflow.loaders import detect_format, open_files
from inferflow.paths import resolve_ref
from inferflow.spec.types import TensorsSpec

_MAX_LIST = 8  # long arrays (vocabularies) are summarised


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="list tensors and metadata of a checkpoint file", description=__doc__
    )
    p.add_argument(
        "file",
        help="GGUF, safetensors, pickle (.bin/.pt) file or HF model directory (package://... too)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-metadata", action="store_true", help="tensors only")
    p.add_argument("--spec", default=None, help="show where this spec's tensor map puts each")
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
    spec = None
    if args.spec:
        from inferflow.spec import load_spec

        spec = load_spec(args.spec)
    where = _placement(spec.network.tensors) if spec else None
    # a path as a spec writes one: package://<package>/<path>, ~/..., relative to here
    path = resolve_ref(args.file, Path.cwd(), what="FILE")
    fmt = detect_format(path)
    # (the spec's choice of a pickle's state dicts applies to its own format)
    keys = spec.source.keys if spec and fmt == spec.source.format else ()
    src = open_files(fmt, [path], keys)
    try:
        tensors = [
            {"name": n, "shape": list(src.shape(n)), "type": src.dtype_name(n)}
            | ({"to": where(n)} if where else {})
            for n in src.names()
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
        to = f"  -> {t['to']}" if "to" in t else ""
        print(f"  {t['name']:<{width}}  {t['type']:<6}  {t['shape']}{to}")
    return 0


def _placement(tensors: TensorsSpec) -> Callable[[str], str]:
    """Checkpoint name -> where a spec's map puts it (canonical names, or why none)."""
    from inferflow.model.names import NameMap

    names = NameMap(tensors)

    def where(name: str) -> str:
        uses = names(name)
        if uses is not None:
            return ", ".join(u.target for u in uses)
        return "(ignored)" if names.ignored(name) else "(unmapped)"

    return where
