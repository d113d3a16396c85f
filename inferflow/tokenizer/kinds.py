"""What ``tokenizer.from`` names: a file kind (the file holds the whole pipeline: GGUF metadata,
``tokenizer.json``, tiktoken) or a preset (a pipeline over a vocabulary file: ``vocab_txt``,
``pickle_vocab``); ``load_tokenizer`` builds either and lays the spec's own parts over it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferflow.errors import TokenizerError
from inferflow.registry import Registry, RegistryError
from inferflow.tokenizer.base import Tokenizer
from inferflow.tokenizer.pipeline import PipelineSpec, Specials, apply_pipeline, build_pipeline
from inferflow.tokenizer.sources import SourceContext


@dataclass(frozen=True)
class KindSettings:
    """What a kind reads besides its files."""

    metadata: dict[str, Any] | None = None  # gguf: the file's key/values, when already read
    pattern: str | None = None  # the regex a kind that takes one cuts text with
    sources: SourceContext = field(default_factory=SourceContext)


@dataclass(frozen=True)
class Kind:
    """A file kind builds a ``Tokenizer``; a preset returns the pipeline it stands for."""

    build: Callable[[Sequence[Path], KindSettings], Tokenizer | PipelineSpec]
    preset: bool = False
    takes_pattern: bool = False  # tokenizer.pattern is read by this kind


TOKENIZER_KINDS: Registry[Kind] = Registry("tokenizer kind")
PIPELINE = "pipeline"  # no from: the spec's own parts, model included
NONE = "none"  # token ids only


def register_kind(
    name: str, *, preset: bool = False, takes_pattern: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        TOKENIZER_KINDS.add(name, Kind(fn, preset, takes_pattern))
        return fn

    return deco


def check_kind(kind: str, has_model: bool, has_pattern: bool, where: str = "tokenizer") -> Kind:
    """The kind ``from:`` names, with what a spec may add to it: no model (the kind gives it),
    a pattern only where the kind reads one. Needs no file: a spec checks it before loading."""
    try:
        entry = TOKENIZER_KINDS.get(kind)
    except RegistryError as e:
        raise TokenizerError(f"{where}.from: {e}") from None
    if has_model:
        raise TokenizerError(f"{where}.model: from: {kind} gives the model; drop model or from")
    if has_pattern and not entry.takes_pattern:
        takes = [n for n, k in TOKENIZER_KINDS.items() if k.takes_pattern]
        raise TokenizerError(
            f"{where}.pattern is read by from: {' / '.join(takes)}, not {kind!r}; cut text "
            "with pre_tokenizer: {type: split, pattern: ...}"
        )
    return entry


# override key -> what it sets (checked strictly: the spec's YAML is the user interface)
OVERRIDE_KEYS = {
    "chat_template": "jinja2 chat template source",
    "add_bos": "prepend bos when encoding with special tokens",
    "add_eos": "append eos when encoding with special tokens",
    "bos": "bos token text",
    "eos": "eos token text, or a list of texts (the first is the eos appended by add_eos)",
}


def apply_overrides(tok: Tokenizer, overrides: dict[str, Any]) -> Tokenizer:
    """Set what a spec overrides on a freshly built tokenizer (in place; returned for chaining)."""
    unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
    if unknown:
        raise TokenizerError(
            f"unknown tokenizer override(s) {unknown}; allowed: {', '.join(OVERRIDE_KEYS)}"
        )

    if "chat_template" in overrides:
        tok.chat_template = overrides["chat_template"]
    if "bos" in overrides or "eos" in overrides:  # (the roles, as tokenizer.specials sets them)
        eos = overrides.get("eos", ())
        roles = Specials(
            bos=overrides.get("bos"), eos=(eos,) if isinstance(eos, str) else tuple(eos)
        )
        apply_pipeline(tok, PipelineSpec(specials=roles), "tokenizer override")
    # setting either flag rebuilds the post-processor with the (possibly new) bos/eos
    if "bos" in overrides or "eos" in overrides or "add_bos" in overrides or "add_eos" in overrides:
        tok.add_eos = bool(overrides.get("add_eos", tok.add_eos))
        tok.add_bos = bool(overrides.get("add_bos", tok.add_bos))
    return tok


def load_tokenizer(
    kind: str,
    files: Sequence[str | Path],
    metadata: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    pattern: str | None = None,
    pipeline: PipelineSpec | None = None,
    sources: SourceContext | None = None,
    where: str = "tokenizer",
) -> Tokenizer:
    """Build the tokenizer a spec describes: ``kind`` is one of ``TOKENIZER_KINDS`` or
    ``'pipeline'``; ``pipeline`` holds the spec's own parts, laid over the kind's."""
    parts = pipeline or PipelineSpec()
    if kind == PIPELINE:
        tok = build_pipeline(parts, sources, where)
    else:
        entry = check_kind(kind, parts.model is not None, pattern is not None, where)
        paths = [Path(f) for f in files]
        for p in paths:
            if not p.is_file():
                raise TokenizerError(f"tokenizer file not found: {p}")
        built = entry.build(paths, KindSettings(metadata, pattern, sources or SourceContext()))
        if isinstance(built, PipelineSpec):
            tok = build_pipeline(parts.over(built), sources, where)
        else:
            tok = apply_pipeline(built, parts, where)
    return apply_overrides(tok, overrides) if overrides else tok
