"""Function calling on chat completions: tools rendered by the model's chat template, the
model's tool-call markup parsed into OpenAI ``tool_calls`` (also when streamed), and, for
``tool_choice`` "required" or a named function, the calls constrained by a grammar to the
functions' JSON Schemas (``inferflow.engine.constrain``).

How a model writes calls is data: a ``CallFormat`` in ``CALL_FORMATS``, chosen by
``--tool-call-parser`` or recognised by the markers its chat template prints:

- ``hermes``: ``<tool_call>{"name": …, "arguments": …}</tool_call>`` per call (Qwen2.5, Hermes,
  SmolLM3 …);
- ``llama3_json``: ``{"name": …, "parameters": …}``, after ``<|python_tag|>`` or bare, several
  separated by ``;`` (Llama 3.1 – 3.3);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls;
- ``json``: no markup, the reply is a call object or a list of them (also in a ```json fence).

Whatever the format, with ``tool_choice`` auto a reply that is nothing but a call to a declared
function (a JSON object or list, bare or fenced; arguments under ``arguments`` or
``parameters``) is a call: small models often print one without their markup. A template that
prints none of the markers cannot take tools unless ``--tool-call-parser`` names a format."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from inferflow.errors import RequestError
from inferflow.registry import Registry
from inferflow.server.jsonvalue import check_value

ARGUMENT_KEYS = ("arguments", "parameters")  # where a call object holds its arguments
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_SEPARATORS = " \t\r\n;,"  # between calls of one block
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class CallFormat:
    """A model's tool-call markup: ``start`` (may be empty) + one or more call objects (a JSON
    list of them when ``listed``; else objects separated by ``between``, each followed by
    ``end`` when the format has one). A call object holds ``name`` and its arguments under
    ``key``. ``detect``: text of a chat template that prints this markup."""

    start: str = ""
    end: str = ""
    between: str = "\n"
    key: str = "arguments"
    listed: bool = False
    detect: tuple[str, ...] = ()

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with its ``%json`` schemas) for one call, or several
        with ``parallel``, of the ``functions`` (OpenAI function objects), arguments following
        each one's ``parameters`` schema. Formats with an end marker print their markers (plain
        text, as Hermes'); the others print the calls bare, which they read too (their start
        markers, ``<|python_tag|>`` and ``[TOOL_CALLS]``, are control tokens)."""
        one = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    self.key: f.get("parameters") or {"type": "object"},
                },
                "required": ["name", self.key],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = {"anyOf": one, "x-guidance": {"whitespace_flexible": False}}
        obj = f"obj: %json {json.dumps(schema)}\n"
        if self.listed:
            more = ' ("," obj)*' if parallel else ""
            return f'start: "[" obj{more} "]"\n{obj}'
        if not self.end:
            more = f" ({json.dumps(self.between)} obj)*" if parallel else ""
            return f"start: obj{more}\n{obj}"
        more = f" ({json.dumps(self.between)} call)*" if parallel else ""
        return (
            f"start: call{more}\ncall: {json.dumps(self.start)} obj {json.dumps(self.end)}\n{obj}"
        )

    def parse(self, text: str, names: frozenset[str]) -> tuple[str, list[dict[str, Any]]]:
        """(the text outside calls, the calls as OpenAI tool_calls). Markup whose JSON does not
        parse into calls stays in the text; with no markup, a reply that is only calls to
        ``names`` is calls."""
        content, calls, at = [], [], 0
        mark = self.start.strip()
        while mark and (i := text.find(mark, at)) >= 0:
            found = self._block(text, i + len(mark))
            if found is None:
                content.append(text[at : i + len(mark)])
                at = i + len(mark)
                continue
            content.append(text[at:i])
            calls += found[0]
            at = found[1]
        content.append(text[at:])
        if calls:
            return "".join(content).strip(), [_openai(c) for c in calls]
        bare = bare_calls(text, names)
        return ("", [_openai(c) for c in bare]) if bare else (text, [])

    def _block(self, text: str, pos: int) -> tuple[list[dict[str, Any]], int] | None:
        """The calls after a start marker at ``pos`` and where they end, or None."""
        end = self.end.strip()
        values, pos = _json_values(text, pos, one=bool(end) or self.listed)
        calls = [c for v in values for c in (v if isinstance(v, list) else [v])]
        if not calls or not all(_is_call(c) for c in calls):
            return None
        if end:
            pos = _skip(text, pos, " \t\r\n")
            if not text.startswith(end, pos):
                return None  # (cut off before its end marker: text)
            pos += len(end)
        return calls, pos


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _json_values(text: str, pos: int, one: bool) -> tuple[list[Any], int]:
    """JSON values from ``pos`` (whitespace first), separated by ``;`` or ``,`` unless ``one``;
    and the position after the last."""
    values: list[Any] = []
    while True:
        start = _skip(text, pos, " \t\r\n" if one or not values else _SEPARATORS)
        try:
            value, after = _DECODER.raw_decode(text, start)
            check_value(value, "a tool call")  # (the model's: nested too deep is not a call)
        except ValueError:
            return values, pos
        values.append(value)
        pos = after
        if one:
            return values, pos


def _is_call(obj: Any) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return False
    args: Any = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    if isinstance(args, str):  # (some models write the arguments as JSON text)
        try:
            args = json.loads(args)
        except ValueError:
            return False
    return isinstance(args, dict)


def bare_calls(text: str, names: frozenset[str]) -> list[dict[str, Any]]:
    """``text`` as nothing but calls to functions in ``names`` (an object, or a list of them,
    or several separated by ``;``; bare or in a ```json fence), else []."""
    body = text.strip()
    if (fenced := _FENCE.match(body)) is not None:
        body = fenced.group(1)
    values, end = _json_values(body, 0, one=False)
    if not values or _skip(body, end, _SEPARATORS) != len(body):
        return []
    calls = [c for v in values for c in (v if isinstance(v, list) else [v])]
    if calls and all(_is_call(c) and c["name"] in names for c in calls):
        return calls
    return []


def _openai(call: dict[str, Any]) -> dict[str, Any]:
    args: Any = next((call[k] for k in ARGUMENT_KEYS if k in call), {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args),
        },
    }


CALL_FORMATS: Registry[CallFormat] = Registry("tool-call format")
CALL_FORMATS.add("hermes", CallFormat("<tool_call>\n", "\n</tool_call>", detect=("<tool_call>",)))
CALL_FORMATS.add(
    "llama3_json",
    CallFormat("<|python_tag|>", between="; ", key="parameters", detect=("<|python_tag|>",)),
)
CALL_FORMATS.add("mistral", CallFormat("[TOOL_CALLS]", listed=True, detect=("[TOOL_CALLS]",)))
CALL_FORMATS.add("json", CallFormat(between="\n"))


def call_format(template: str | None) -> CallFormat | None:
    """The call format a chat template prints (the first whose marker it contains)."""
    for _, f in CALL_FORMATS.items():
        if template and any(d in template for d in f.detect):
            return f
    return None


@dataclass(frozen=True)
class CallParser:
    """How one request's replies are read: the model's markup and the functions it declared."""

    fmt: CallFormat
    names: frozenset[str]

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self.fmt.parse(text, self.names)


@dataclass
class ToolStream:
    """One streamed choice's text split into content (sent as it comes, except what may be
    a call: from a start marker on, or a reply that opens like a JSON call) and calls (sent
    once the choice ends)."""

    parser: CallParser
    held: str = ""  # text not yet sent: a possible call start, or everything after one
    calling: bool = False
    sent: bool = False  # some content went out (the reply is not a bare call)

    def push(self, text: str) -> str:
        """The part of ``text`` that can go out as content now."""
        self.held += text
        if self.calling:
            return ""
        if not self.sent and _may_be_bare(self.held):
            return ""
        marker = self.parser.fmt.start.strip()
        if marker and (i := self.held.find(marker)) >= 0:
            out, self.held, self.calling = self.held[:i], self.held[i:], True
            self.sent = self.sent or bool(out)
            return out
        keep = next(
            (k for k in range(min(len(marker) - 1, len(self.held)), 0, -1)
             if marker.startswith(self.held[-k:])),
            0,
        )  # fmt: skip
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent = self.sent or bool(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still held, the calls) once the choice has ended."""
        held, self.held = self.held, ""
        if not self.calling and self.sent:
            return held, []
        return self.parser.parse(held)


def _may_be_bare(text: str) -> bool:
    """The reply so far could still be a bare call (JSON or a fenced block)."""
    head = text.lstrip()
    return not head or head[0] in "{[" or "```".startswith(head[:3])


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools run: how replies are read (None: no tools offered), the tools as
    the chat template takes them, and the grammar that holds the reply to calls when one is
    required."""

    parser: CallParser | None = None
    listed: list[dict[str, Any]] | None = None
    forced: tuple[str, str, Any] | None = None


def plan_tools(
    template: str | None,
    tools: list[dict[str, Any]] | None,
    choice: str | None,
    named: str | None,
    parallel: bool,
    fmt_name: str | None = None,
) -> ToolPlan:
    """``tools``: OpenAI's chat tool objects (``{"type": "function", "function": {...}}``);
    ``choice``: none / auto / required (None: auto), or ``named``, one function the reply must
    call; ``fmt_name``: the server's ``--tool-call-parser`` (None: from the template).
    RequestError (naming the field) for a choice without tools, a function not among them, or
    a template that prints no tool-call markup."""
    if (choice not in (None, "none") or named) and not tools:
        raise RequestError("tool_choice: needs tools", "tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    fmt = CALL_FORMATS.get(fmt_name) if fmt_name else call_format(template)
    if fmt is None:
        raise RequestError(
            "tools: this model's chat template does not render tools (it prints no tool-call "
            f"markup of {', '.join(CALL_FORMATS.names())}; the server's --tool-call-parser "
            "names one)",
            "tools",
        )
    funcs = [t["function"] for t in tools]
    names = [f["name"] for f in funcs]
    if named is not None and named not in names:
        raise RequestError(
            f"tool_choice: function {named!r} is not among the tools ({', '.join(names)})",
            "tool_choice",
        )
    forced = None
    if choice == "required" or named is not None:  # the reply is calls, held to their schemas
        chosen = [f for f in funcs if named in (None, f["name"])]
        forced = ("tool_choice", "grammar", fmt.grammar(chosen, parallel and named is None))
    return ToolPlan(CallParser(fmt, frozenset(names)), tools, forced)
