"""``inferflow validate SPEC``: check a spec, bind its checkpoint by name and shape (on the meta
device: no tensor data is read) and print the spec resolved against the checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from inferflow.model.build import check_binding
from inferflow.spec import load_spec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="validate a spec and print it resolved", description=__doc__
    )
    p.add_argument("spec", help="spec file path or built-in spec name")
    p.set_defaults(run=run)


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {
            f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x) if f.name != "raw"
        }
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, Path):
        return str(x)
    return x


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    plan = check_binding(spec)  # a WeightBindingError names every tensor that does not bind
    out = _plain(spec)
    out["hparams"]["attention_kind"] = spec.hparams.attention_kind
    out["binding"] = {"checkpoint_tensors": len(plan.consumed), "parameters": len(plan.parts)}
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0
