"""The spec's ``tokenizer`` section -> ``TokenizerSpec`` (checked before any weight is read):
``from`` (a file kind or preset of ``TOKENIZER_KINDS``, or ``none``) and/or the pipeline's own
parts (``inferflow.tokenizer.pipeline``); file references resolved and checked to exist.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from inferflow.errors import SpecError, TokenizerError
from inferflow.paths import resolve_ref
from inferflow.spec.types import SourceSpec, TokenizerSpec
from inferflow.tokenizer import TOKENIZER_KINDS
from inferflow.tokenizer.kinds import NONE, PIPELINE, check_kind
from inferflow.tokenizer.pipeline import PIPELINE_KEYS, parse_pipeline


def default_tokenizer(source: SourceSpec) -> dict[str, Any]:
    """A spec without a tokenizer section: a GGUF's own vocabulary, else token ids only."""
    return {"from": "gguf" if source.format == "gguf" else NONE}


def parse_tokenizer(doc: dict[str, Any], base_dir: Path, where: str = "tokenizer") -> TokenizerSpec:
    def resolve(ref: str, what: str) -> Path:
        path = resolve_ref(ref, base_dir, what=what)
        if not os.path.exists(path):
            raise SpecError(f"{what}: {ref!r} resolves to {path}, which does not exist")
        return path

    files = tuple(resolve(f, f"{where}.files[{i}]") for i, f in enumerate(doc.get("files", ())))
    parts = [k for k in PIPELINE_KEYS if k in doc]
    kind = doc.get("from")
    if kind is None:
        if "model" not in doc:
            raise SpecError(
                f"{where}: give from: (one of {', '.join([*TOKENIZER_KINDS.names(), NONE])}) "
                "or model: (a pipeline of your own)"
            )
        kind = PIPELINE
    elif kind == NONE:
        extra = sorted(set(doc) - {"from"})
        if extra:
            raise SpecError(f"{where}: from: none takes no other keys; got {extra}")
    else:
        try:
            check_kind(kind, "model" in doc, "pattern" in doc, where)
        except TokenizerError as e:
            raise SpecError(str(e)) from None
    if kind == PIPELINE and "pattern" in doc:
        raise SpecError(f"{where}.pattern: without from:, use pre_tokenizer: {{type: split}}")
    if "template" in doc and ("add_bos" in doc or "add_eos" in doc):
        raise SpecError(
            f"{where}: template and add_bos / add_eos both say what wraps the text; give one"
        )
    try:
        pipeline = parse_pipeline(
            {k: doc[k] for k in parts},
            where,
            lambda ref: resolve(ref, f"{where}.model"),
        )
    except TokenizerError as e:
        raise SpecError(str(e)) from None
    return TokenizerSpec(
        kind,
        files,
        doc.get("chat_template"),
        doc.get("add_bos"),
        doc.get("add_eos"),
        doc.get("pattern"),
        pipeline,
    )
