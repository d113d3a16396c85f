"""Hostile shapes for what a request can nest or chain (issue 48's probe): Lark grammars of
chained rules, JSON Schemas of chained ``$ref``s, nested lists and objects, intersections of
patterns, and JSON text nested past any sane depth. Each builder takes its size; the tests and
the HTTP fuzzer's hooks draw sizes from small to far past the server's limits."""

from __future__ import annotations

from typing import Any


def lark_chain(n: int) -> str:
    """``n`` rules, each calling the next: the compiler recurses once per rule."""
    rules = "".join(f'r{k}: "a" r{k + 1} | "b"\n' for k in range(n))
    return f'start: r0\n{rules}r{n}: "c"\n'


def lark_nested(n: int) -> str:
    """One rule of ``n`` nested groups."""
    return "start: " + "(" * n + '"a"' + ")" * n + "\n"


def ref_chain(n: int) -> dict[str, Any]:
    """A schema whose ``$defs`` chain ``n`` references, each to the next."""
    defs: dict[str, Any] = {f"d{k}": {"$ref": f"#/$defs/d{k + 1}"} for k in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_schema(n: int) -> dict[str, Any]:
    """An object property nested ``n`` levels deep (a tool's parameters)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_json(n: int) -> str:
    """JSON text of ``n`` nested lists (a tool call's arguments)."""
    return "[" * n + "]" * n


def nested_object_json(n: int) -> str:
    """JSON text of ``n`` nested objects."""
    return '{"a": ' * n + "1" + "}" * n


def pattern_intersection(n: int) -> dict[str, Any]:
    """``allOf`` of ``n`` distinct patterns: deciding whether their intersection is empty costs
    time exponential in ``n`` (14: 7 s, 20: hours)."""
    return {"allOf": [{"pattern": f".*x{i}.*"} for i in range(n)]}


def any_of_objects(n: int) -> dict[str, Any]:
    return {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(n)
        ]
    }


def self_reference() -> dict[str, Any]:
    """A required property that is the schema itself: no finite value matches it."""
    return {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def long_choices(n: int, size: int) -> list[str]:
    return [f"{i:05d}" + "y" * size for i in range(n)]


# (kind, builder of a constraint of size n) for the fuzzers: the request field is the kind's
CONSTRAINTS = {
    "grammar chain": ("grammar", lark_chain),
    "grammar nested": ("grammar", lark_nested),
    "schema ref chain": ("json_schema", ref_chain),
    "schema nested": ("json_schema", nested_schema),
    "schema allOf patterns": ("json_schema", lambda n: pattern_intersection(min(n, 30))),
    "schema anyOf": ("json_schema", any_of_objects),
    "regex nested": ("regex", lambda n: "(" * n + "a" + ")" * n),
    "choice": ("choice", lambda n: long_choices(max(1, n), 8)),
}


def structured_outputs(kind: str, value: Any) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` field for a constraint of ``kind``."""
    field = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
    return {field[kind]: value}
