"""A tokenizer described as data: normalizer -> pre-tokenizer -> model -> template -> decoder,
plus the special tokens' roles (the ``tokenizers`` library's pipeline, written in a spec)::

    tokenizer:
      normalizer: [{type: unicode, form: NFKC}, {type: lowercase}]
      pre_tokenizer: {type: split, pattern: '\\[[^\\]]*\\]|Br|Cl|.'}
      model: {type: wordpiece, vocab: {file: vocab.txt}}
      specials: {bos: '[CLS]', eos: '[SEP]', pad: '[PAD]', extra: ['[MASK]']}
      template: '[CLS] $A [SEP]'            # or {single: ..., pair: ...}
      decoder: {type: wordpiece}

With ``from:`` (a file kind or a preset) the file or preset gives the pipeline and these keys
replace its parts; without it, ``model`` is required. ``normalizer``, ``pre_tokenizer`` and
``decoder`` take one step or a list (``[]``: none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers

from inferflow.blocks.options import Options
from inferflow.errors import SpecError, TokenizerError
from inferflow.registry import Registry, RegistryError
from inferflow.tokenizer.base import Tokenizer, piece_style_of
from inferflow.tokenizer.components import (
    DECODERS,
    MODELS,
    NORMALIZERS,
    PRE_TOKENIZERS,
    SOURCE_FIELDS,
    BuiltModel,
    Component,
)
from inferflow.tokenizer.sources import SourceContext, parse_source

# role -> spellings looked up in the vocabulary when a spec names none (torchtext, fairseq, HF)
SPECIAL_ROLES: dict[str, tuple[str, ...]] = {
    "bos": ("<sos>", "<bos>", "<s>"),
    "eos": ("<eos>", "</s>"),
    "pad": ("<pad>",),
    "unk": ("<unk>",),
}


@dataclass(frozen=True)
class Step:
    """One component: a registered name and its options."""

    name: str
    options: Options


@dataclass(frozen=True)
class Specials:
    """The special tokens by role (texts of the vocabulary); ``extra`` are more atomic tokens
    (``[MASK]``, ``<|im_start|>``)."""

    bos: str | None = None
    eos: tuple[str, ...] = ()  # the first is the eos appended by add_eos
    pad: str | None = None
    unk: str | None = None
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Template:
    single: str
    pair: str | None = None


@dataclass(frozen=True)
class PipelineSpec:
    """The parts a spec gives; None keeps what the file or preset has."""

    normalizers: tuple[Step, ...] | None = None
    pre_tokenizers: tuple[Step, ...] | None = None
    model: Step | None = None
    decoders: tuple[Step, ...] | None = None
    specials: Specials | None = None
    template: Template | None = None

    def over(self, base: PipelineSpec) -> PipelineSpec:
        """These parts where given, ``base``'s elsewhere (a spec over its preset)."""
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out = dataclasses.replace(base, **{k: v for k, v in mine.items() if v is not None})
        if self.specials is not None and base.specials is not None:  # role by role
            given = {
                f.name: v
                for f in dataclasses.fields(Specials)
                if (v := getattr(self.specials, f.name)) not in (None, ())
            }
            out = dataclasses.replace(out, specials=dataclasses.replace(base.specials, **given))
        return out


PIPELINE_KEYS = ("normalizer", "pre_tokenizer", "model", "decoder", "specials", "template")


# -- schema and parsing (spec side) -----------------------------------------------------------


def _typed(registry: Registry[Component[Any]]) -> dict[str, Any]:
    return {
        "anyOf": [
            c.options.schema(type={"const": name}) | {"required": ["type"]}
            for name, c in registry.items()
        ]
    }


def _steps_schema(registry: Registry[Component[Any]]) -> dict[str, Any]:
    one = _typed(registry)
    return {"anyOf": [*one["anyOf"], {"type": "array", "items": one}]}


def pipeline_schema() -> dict[str, Any]:
    """The JSON Schema of the pipeline keys of a ``tokenizer`` section."""
    text = {"type": "string"}
    return {
        "normalizer": _steps_schema(NORMALIZERS),
        "pre_tokenizer": _steps_schema(PRE_TOKENIZERS),
        "model": _typed(MODELS),
        "decoder": _steps_schema(DECODERS),
        "specials": {
            "type": "object",
            "properties": {
                "bos": text,
                "eos": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1}]},
                "pad": text,
                "unk": text,
                "extra": {"type": "array", "items": text},
            },
            "additionalProperties": False,
        },
        "template": {
            "anyOf": [
                text,
                {
                    "type": "object",
                    "properties": {"single": text, "pair": text},
                    "required": ["single"],
                    "additionalProperties": False,
                },
            ]
        },
    }


def _step(registry: Registry[Component[Any]], doc: Mapping[str, Any], where: str) -> Step:
    try:
        comp = registry.get(doc["type"])
    except RegistryError as e:
        raise SpecError(f"{where}.type: {e}") from None
    return Step(doc["type"], comp.options.parse(dict(doc), where))


def _steps(registry: Registry[Component[Any]], doc: Any, where: str) -> tuple[Step, ...]:
    items = doc if isinstance(doc, list) else [doc]
    return tuple(_step(registry, d, f"{where}[{i}]") for i, d in enumerate(items))


def parse_pipeline(
    doc: Mapping[str, Any], where: str, resolve: Callable[[str], Path] | None = None
) -> PipelineSpec:
    """The pipeline keys of a schema-checked ``tokenizer`` section; ``resolve`` turns the
    vocabulary sources' file references into paths."""
    model = None
    if "model" in doc:
        model = _step(MODELS, doc["model"], f"{where}.model")
        sources = {
            f: parse_source(v, f"{where}.model.{f}", resolve)
            for f in SOURCE_FIELDS
            if isinstance(v := getattr(model.options, f, None), Mapping)
        }
        model = Step(model.name, dataclasses.replace(model.options, **sources))
    specials = None
    if "specials" in doc:
        s = doc["specials"]
        eos = s.get("eos", ())
        specials = Specials(
            s.get("bos"),
            (eos,) if isinstance(eos, str) else tuple(eos),
            s.get("pad"),
            s.get("unk"),
            tuple(s.get("extra", ())),
        )
    template = None
    if "template" in doc:
        t = doc["template"]
        template = Template(t) if isinstance(t, str) else Template(t["single"], t.get("pair"))
    return PipelineSpec(
        _steps(NORMALIZERS, doc["normalizer"], f"{where}.normalizer")
        if "normalizer" in doc
        else None,
        _steps(PRE_TOKENIZERS, doc["pre_tokenizer"], f"{where}.pre_tokenizer")
        if "pre_tokenizer" in doc
        else None,
        model,
        _steps(DECODERS, doc["decoder"], f"{where}.decoder") if "decoder" in doc else None,
        specials,
        template,
    )


# -- building ---------------------------------------------------------------------------------


def _build_steps(
    registry: Registry[Component[Any]], steps: Sequence[Step], where: str, sequence: Any
) -> Any:
    built = [registry.get(s.name).build(s.options, f"{where}[{i}]") for i, s in enumerate(steps)]
    if not built:
        return None
    return built[0] if len(built) == 1 else sequence(built)


def _lookup(tok: Tokenizer, text: str, where: str) -> int:
    tid = tok.backend.token_to_id(text)
    if tid is None:
        raise TokenizerError(f"{where}: {text!r} is not a token of the vocabulary")
    return int(tid)


def _template_specials(tok: Tokenizer, template: Template, where: str) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for text in (template.single, template.pair or ""):
        for item in text.split():
            name = item.rsplit(":", 1)[0] if ":" in item[1:] else item
            if not name.startswith("$"):
                out[name] = _lookup(tok, name, f"{where}.template")
    return list(out.items())


def apply_pipeline(tok: Tokenizer, p: PipelineSpec, where: str = "tokenizer") -> Tokenizer:
    """Replace the parts ``p`` gives on a built tokenizer (in place; returned for chaining)."""
    if p.model is not None:
        raise TokenizerError(
            f"{where}.model: this tokenizer's model comes from its file; drop model or from"
        )
    b = tok.backend
    if p.normalizers is not None:
        b.normalizer = _build_steps(
            NORMALIZERS, p.normalizers, f"{where}.normalizer", normalizers.Sequence
        )
    if p.pre_tokenizers is not None:
        b.pre_tokenizer = _build_steps(
            PRE_TOKENIZERS, p.pre_tokenizers, f"{where}.pre_tokenizer", pre_tokenizers.Sequence
        )
    if p.decoders is not None:
        b.decoder = _build_steps(DECODERS, p.decoders, f"{where}.decoder", decoders.Sequence)
        tok.piece_style = piece_style_of(b)
    if p.specials is not None:
        s = p.specials
        w = f"{where}.specials"

        def one(role: str, text: str | None, current: int | None) -> int | None:
            return current if text is None else _lookup(tok, text, f"{w}.{role}")

        eos_ids = [_lookup(tok, t, f"{w}.eos") for t in s.eos] if s.eos else tok.eos_ids
        for i, t in enumerate(s.extra):
            _lookup(tok, t, f"{w}.extra[{i}]")
        named = [t for t in (s.bos, *s.eos, s.pad, s.unk, *s.extra) if t is not None]
        tok.set_specials(
            named,
            bos_id=one("bos", s.bos, tok.bos_id),
            eos_ids=eos_ids,
            pad_id=one("pad", s.pad, tok.pad_id),
            unk_id=one("unk", s.unk, tok.unk_id),
        )
    if p.template is not None:
        specials = _template_specials(tok, p.template, where)
        tok.set_specials(
            [t for t, _ in specials],
            bos_id=tok.bos_id,
            eos_ids=tok.eos_ids,
            pad_id=tok.pad_id,
            unk_id=tok.unk_id,
        )
        tok.set_template(p.template.single, p.template.pair, specials)
    return tok


def build_pipeline(
    p: PipelineSpec, ctx: SourceContext | None = None, where: str = "tokenizer"
) -> Tokenizer:
    """A tokenizer from its parts alone (``model`` is required)."""
    if p.model is None:
        raise TokenizerError(
            f"{where}: give from: (a file kind or preset) or model: (one of "
            f"{', '.join(MODELS.names())})"
        )
    options = p.model.options
    # the unk a spec names among the specials is the model's unk, unless the model names one
    if p.specials and p.specials.unk and getattr(options, "unk", "x") is None:
        options = dataclasses.replace(options, unk=p.specials.unk)  # type: ignore[call-arg]
    built: BuiltModel = MODELS.get(p.model.name).build(
        options, f"{where}.model", ctx or SourceContext()
    )
    tok = Tokenizer(BackendTokenizer(built.model), keep_post_processor=True)
    # the usual spellings play their roles unless the spec names them
    found = {
        role: next((t for t in spellings if t in built.vocab), None)
        for role, spellings in SPECIAL_ROLES.items()
    }
    unk = getattr(options, "unk", None) or found["unk"]
    tok.set_specials(
        [t for t in (*found.values(), unk) if t is not None],
        bos_id=built.vocab.get(found["bos"] or ""),
        eos_ids=[built.vocab[found["eos"]]] if found["eos"] else [],
        pad_id=built.vocab.get(found["pad"] or ""),
        unk_id=built.vocab.get(unk or ""),
    )
    tok.set_template("$A", "$A $B:1", [])  # no wrapping unless the spec asks
    return apply_pipeline(tok, dataclasses.replace(p, model=None), where)
