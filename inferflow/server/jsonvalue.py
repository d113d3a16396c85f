"""JSON values in requests, bounded: every list or object nests at most MAX_JSON_DEPTH levels,
holds only valid Unicode text, and JSON text inside a field (a tool call's arguments) is parsed
under the same bound. Everything downstream that walks a value (the chat template, a schema
compiler, json.dumps) recurses per level, so a value nested a few hundred levels deep would
end in a RecursionError instead of a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64


def check_value(value: Any, where: str) -> None:
    """ValueError when ``value`` nests deeper than MAX_JSON_DEPTH or holds a lone UTF-16
    surrogate (JSON's "\\udfff", which no UTF-8 text can hold); walked without recursion."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"a lone surrogate ({v[e.start]!r}) in {where} is not valid Unicode text"
                ) from None
        elif isinstance(v, (list, dict)):
            if depth == MAX_JSON_DEPTH:
                raise ValueError(
                    f"{where} nests lists or objects deeper than {MAX_JSON_DEPTH} levels"
                )
            items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


def loads(text: str, where: str) -> Any:
    """``text`` parsed as JSON and checked by ``check_value``; ValueError naming ``where`` when
    it is not JSON or nests too deep."""
    try:
        value = json.loads(text)
    except RecursionError:  # (deeper than the interpreter's limit: far past ours)
        raise ValueError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        raise ValueError(f"{where} is not JSON: {text[:60]!r}") from None
    check_value(value, where)
    return value
