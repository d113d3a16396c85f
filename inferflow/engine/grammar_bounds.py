"""Bounds on a structured-output constraint, checked before anything compiles it, and the
constraint turned into llguidance's grammar text and validated.

Compiling a grammar recurses per nesting level and per chained rule (a chain of 5,000 Lark
rules, or of 3,000 ``$ref``s, overflows an 8 MiB stack and kills the process), and some
schemas cost exponential time (``allOf`` of 14 distinct ``pattern``s: 7 s, 20: hours). So a
constraint is first measured here (size, rules, nesting, alternatives: ``GrammarLimits``, each
settable on ``inferflow serve``), and what passes is compiled and validated by
``grammar_text`` in a worker process that a crash or the time limit ends
(``inferflow.tokenizer.template_worker``), never in the server's own.

This module imports neither torch nor the rest of the engine: the worker loads it alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from inferflow.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it (", " and ": "), no other whitespace: a model cannot pad its
# output with newlines until max_tokens (llguidance's flexible whitespace allows that); a
# schema's "x-guidance" options may still change it
JSON_OPTIONS: Any = {"whitespace_flexible": False}
MAX_MESSAGE = 300  # characters of llguidance's message kept in an error (it may quote the grammar)


def _limit(default: float, flag: str, what: str) -> Any:
    """A GrammarLimits field: its default, its ``serve`` flag and what it counts (the help)."""
    return field(default=default, metadata={"flag": flag, "help": what})


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's constraint may hold (``inferflow serve --grammar-*``): each field
    declares its flag and help here, the CLI builds its options from them."""

    max_bytes: int = _limit(
        131072, "--grammar-max-bytes",
        "bytes of a structured-output constraint as sent (schema JSON, grammar, regex, choices)",
    )  # fmt: skip
    max_rules: int = _limit(
        1000, "--grammar-max-rules", "Lark rules and terminals, or a schema's $defs / definitions"
    )
    max_depth: int = _limit(
        64, "--grammar-max-depth", "levels a schema nests, or brackets of a grammar or regex"
    )
    max_alternatives: int = _limit(
        1024, "--grammar-max-alternatives",
        "anyOf / oneOf / allOf / enum members, choices, or a grammar's '|'",
    )  # fmt: skip
    seconds: float = _limit(
        5.0, "--grammar-timeout", "seconds to compile and validate one constraint (in a worker)"
    )

    @classmethod
    def flag(cls, name: str) -> str:
        return str(next(f.metadata["flag"] for f in fields(cls) if f.name == name))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise RequestError(f"{f.metadata['flag']}: must be > 0, got {value!r}")

    def over(self, name: str, what: str) -> RequestError:
        """The error for a constraint past the bound ``name``: ``what`` it has, the limit."""
        return RequestError(f"{what}; the limit is {getattr(self, name)} ({self.flag(name)})")


def short(message: str, most: int = MAX_MESSAGE) -> str:
    """``message`` cut to ``most`` characters (llguidance's errors may quote a whole grammar)."""
    message = message.replace("<non-verbose/>", "").strip()  # (llguidance's tail, said once)
    return message if len(message) <= most else f"{message[:most]}... ({len(message)} characters)"


def check_bounds(kind: str, value: Any, limits: GrammarLimits) -> None:
    """RequestError naming the bound when ``value`` (a constraint of ``kind``) exceeds one."""
    if kind == "json_object":
        return
    if kind == "json_schema":
        _check_schema(value, limits)  # (first: a schema too deep for json.dumps fails here)
        try:
            size = len(json.dumps(value))
        except RecursionError:
            raise RequestError("the schema nests too deeply to be measured") from None
    elif kind == "choice":
        size = sum(len(c.encode()) for c in value)
    else:
        size = len(value.encode())
    if size > limits.max_bytes:
        raise limits.over("max_bytes", f"the constraint has {size} bytes")
    if kind == "choice":
        if len(value) > limits.max_alternatives:
            raise limits.over("max_alternatives", f"{len(value)} choices")
    elif kind == "regex":
        _check_text(value, limits, lark=False)
    elif kind == "grammar":
        _check_text(value, limits, lark=True)
    elif kind != "json_schema":
        raise RequestError(f"unknown constraint {kind!r}; allowed: {', '.join(KINDS)}")


_ALTERNATIVES = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


def _check_schema(schema: Any, limits: GrammarLimits) -> None:
    """Walk the schema without recursion: its nesting, its members' lists, its definitions."""
    rules = 0
    stack: list[tuple[Any, int, str]] = [(schema, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > limits.max_depth:
            raise limits.over(
                "max_depth", f"the schema nests {depth} levels deep at {short(path, 120)}"
            )
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    rules += len(node[key])
            if rules > limits.max_rules:
                raise limits.over("max_rules", f"the schema has {rules} definitions")
            for key in _ALTERNATIVES:
                members = node.get(key)
                if isinstance(members, list) and len(members) > limits.max_alternatives:
                    raise limits.over(
                        "max_alternatives", f"{path}/{key} has {len(members)} members"
                    )
            stack.extend((v, depth + 1, f"{path}/{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}/{i}") for i, v in enumerate(node))


def _check_text(text: str, limits: GrammarLimits, lark: bool) -> None:
    """A Lark grammar's (``lark``) or a regex's rules, bracket nesting and alternatives, read
    past quoted strings, Lark's /regex/ literals and // comments."""
    depth = most = alternatives = 0
    rules = 0
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if lark and line_start:
            rules += _defines_rule(text, i)
        line_start = c == "\n"
        if lark and text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
            continue
        if lark and c in '"/':  # a string or a regex literal: skip to its unescaped end
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if not lark and c == "\\":
            i += 2
            continue
        if c in "([{":
            depth += 1
            most = max(most, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif c == "|":
            alternatives += 1
        i += 1
    what = "the grammar" if lark else "the regex"
    if most > limits.max_depth:
        raise limits.over("max_depth", f"{what} nests brackets {most} deep")
    if alternatives > limits.max_alternatives:
        raise limits.over("max_alternatives", f"{what} has {alternatives} alternatives ('|')")
    if rules > limits.max_rules:
        raise limits.over("max_rules", f"{what} defines {rules} rules")


def _defines_rule(text: str, at: int) -> int:
    """1 if the line starting at ``at`` defines a Lark rule or terminal (``name:``,
    ``?name:``, ``NAME.2:``), else 0."""
    j = at
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] in "?!":
        j += 1
    k = j
    while k < len(text) and (text[k].isalnum() or text[k] in "_."):
        k += 1
    while k < len(text) and text[k] in " \t":
        k += 1
    return int(k > j and k < len(text) and text[k] == ":" and (text[j].isalpha() or text[j] == "_"))


def parser_limits() -> Any:
    """llguidance's limits for every matcher: errors that never quote the grammar."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def grammar_text(kind: str, value: Any) -> str:
    """llguidance's grammar for a constraint (unchecked: see ``validated_text``)."""
    import llguidance

    m = llguidance.LLMatcher
    try:
        if kind in ("json_schema", "json_object"):
            schema = value if kind == "json_schema" else {"type": "object"}
            return str(m.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS))
        if kind == "regex":
            return str(m.grammar_from_regex(value))
        if kind == "choice":
            return str(m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value)))
        if kind == "grammar":
            return str(m.grammar_from_lark(value))
    except ValueError as e:
        raise RequestError(f"{kind}: {short(str(e))}") from None
    raise RequestError(f"unknown constraint {kind!r}; allowed: {', '.join(KINDS)}")


def validated_text(kind: str, value: Any, limits: GrammarLimits) -> str:
    """The constraint's grammar text, once it is within ``limits`` and llguidance validates
    it (without a tokenizer: what recurses deeply or runs long happens here too)."""
    import llguidance

    check_bounds(kind, value, limits)
    text = grammar_text(kind, value)
    error = llguidance.LLMatcher.validate_grammar(text, None, limits=parser_limits())
    if error:
        raise RequestError(f"{kind}: cannot be compiled: {short(error)}")
    return text
