"""Typed block options declared once: a frozen dataclass whose fields (type hint, default, and
``doc`` in the field's metadata) give the JSON Schema, the YAML parsing and the documented
defaults of the spec section that configures the block.

    @dataclass(frozen=True)
    class MoEOptions(Options):
        routing: Literal["softmax_topk", "topk_softmax"] = field(
            default="softmax_topk", metadata={"doc": "..."}
        )

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]`` of strings, and
unions of those (``X | None``, ``bool | int``). A ``str`` field whose allowed values live in a
registry names them with ``metadata={"choices": callable returning the names}``; a field of
another shape (a nested mapping) gives its JSON Schema in ``metadata={"schema": ...}``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Self, get_args, get_origin

from inferflow.errors import SpecError


def _json_type(hint: Any) -> dict[str, Any]:
    if get_origin(hint) is Literal:
        return {"enum": sorted(get_args(hint))}
    if get_origin(hint) in (typing.Union, types.UnionType):
        return {"anyOf": [_json_type(a) for a in get_args(hint)]}
    if hint is type(None):
        return {"type": "null"}
    named = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if hint in named:
        return {"type": named[hint]}
    raise TypeError(f"option type {hint} is not supported")


@dataclass(frozen=True)
class Options:
    """Base of a block's options (see the module's docstring)."""

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        return typing.get_type_hints(cls, include_extras=False)

    @classmethod
    def schema(cls, **extra: dict[str, Any]) -> dict[str, Any]:
        """The JSON Schema of the section: an object of these fields (plus ``extra``
        properties, e.g. the ``type`` that picks the block), nothing else."""
        hints = cls._hints()
        props = {}
        for f in dataclasses.fields(cls):
            choices, given = f.metadata.get("choices"), f.metadata.get("schema")
            if given is not None:  # (a callable: made when asked, after registries fill)
                props[f.name] = given() if callable(given) else given
            elif choices:
                props[f.name] = {"enum": sorted(choices())}
            else:
                props[f.name] = _json_type(hints[f.name])
        return {"type": "object", "properties": {**extra, **props}, "additionalProperties": False}

    @classmethod
    def parse(cls, doc: dict[str, Any], where: str) -> Self:
        """The options of a schema-checked section (keys outside the fields are ignored: the
        schema has refused unknown ones, and ``type`` picks the block)."""
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in doc.items() if k in names})
        except (TypeError, ValueError) as e:
            raise SpecError(f"{where}: {e}") from None

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's default (what ``inferflow validate`` shows for an unset option)."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def docs(cls) -> dict[str, str]:
        return {f.name: str(f.metadata.get("doc", "")) for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class NoOptions(Options):
    """A block without options."""
