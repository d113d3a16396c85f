"""Function calling on chat completions: tools rendered by the model's chat template, the
model's tool-call markup parsed into OpenAI ``tool_calls`` (also when streamed), and, for
``tool_choice`` "required" or a named function, the calls constrained by a grammar to the
functions' JSON Schemas (``inferflow.engine.constrain``).

How a model writes a call is data: a ``CallFormat`` in ``CALL_FORMATS``, recognised by the
markers its chat template prints (Hermes-style ``<tool_call>{"name": …, "arguments": …}
</tool_call>``: Qwen2.5, Hermes, SmolLM3 …). A template that prints none of them cannot take
tools: a 400 says so."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from inferflow.errors import RequestError
from inferflow.registry import Registry
from inferflow.server.jsonvalue import loads


@dataclass(frozen=True)
class CallFormat:
    """A model's tool-call markup: each call is ``start`` + a JSON object holding ``name`` and
    ``arguments`` + ``end``; calls follow one another separated by ``between``."""

    start: str
    end: str
    between: str = "\n"

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with its ``%json`` schemas) for one call, or several
        with ``parallel``, of the ``functions`` (OpenAI function objects), arguments following
        each one's ``parameters`` schema."""
        one = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = {"anyOf": one, "x-guidance": {"whitespace_flexible": False}}
        more = f" ({json.dumps(self.between)} call)*" if parallel else ""
        return (
            f"start: call{more}\n"
            f"call: {json.dumps(self.start)} obj {json.dumps(self.end)}\n"
            f"obj: %json {json.dumps(schema)}\n"
        )

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(the text outside calls, the calls as OpenAI tool_calls). A call whose JSON does not
        parse, or has no name, stays in the text."""
        content, calls, at = [], [], 0
        while (i := text.find(self.start, at)) >= 0:
            j = text.find(self.end, i + len(self.start))
            if j < 0:
                break
            body = text[i + len(self.start) : j].strip()
            try:
                obj = loads(body, "a tool call")  # (the model's: nested too deep stays text)
                name, args = obj["name"], obj.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError(name)
            except (ValueError, KeyError, TypeError):
                content.append(text[at : j + len(self.end)])
            else:
                content.append(text[at:i])
                calls.append(
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                )
            at = j + len(self.end)
        content.append(text[at:])
        return "".join(content).strip() if calls else text, calls


CALL_FORMATS: Registry[CallFormat] = Registry("tool-call format")
CALL_FORMATS.add("hermes", CallFormat("<tool_call>\n", "\n</tool_call>"))


def call_format(template: str | None) -> CallFormat | None:
    """The call format a chat template prints (the first whose start marker it contains)."""
    for _, f in CALL_FORMATS.items():
        if template and f.start.strip() in template:
            return f
    return None


@dataclass
class ToolStream:
    """One streamed choice's text split into content (sent as it comes, except what may be
    the start of a call) and calls (sent once the choice ends)."""

    fmt: CallFormat
    held: str = ""  # text not yet sent: a possible call start, or everything after one
    calling: bool = False

    def push(self, text: str) -> str:
        """The part of ``text`` that can go out as content now."""
        self.held += text
        marker = self.fmt.start.strip()
        if self.calling:
            return ""
        if (i := self.held.find(marker)) >= 0:
            out, self.held, self.calling = self.held[:i], self.held[i:], True
            return out
        keep = next(
            (k for k in range(min(len(marker) - 1, len(self.held)), 0, -1)
             if marker.startswith(self.held[-k:])),
            0,
        )  # fmt: skip
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still held, the calls) once the choice has ended."""
        if not self.calling:
            out, self.held = self.held, ""
            return out, []
        return self.fmt.parse(self.held)


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools run: the call markup to parse replies with (None: no tools
    offered), the tools as the chat template takes them, and the grammar that holds the reply
    to calls when one is required."""

    fmt: CallFormat | None = None
    listed: list[dict[str, Any]] | None = None
    forced: tuple[str, str, Any] | None = None


def plan_tools(
    template: str | None,
    tools: list[dict[str, Any]] | None,
    choice: str | None,
    named: str | None,
    parallel: bool,
) -> ToolPlan:
    """``tools``: OpenAI's chat tool objects (``{"type": "function", "function": {...}}``);
    ``choice``: none / auto / required (None: auto), or ``named``, one function the reply must
    call. RequestError (naming the field) for a choice without tools, a function not among
    them, or a template that prints no tool-call markup."""
    if (choice not in (None, "none") or named) and not tools:
        raise RequestError("tool_choice: needs tools", "tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    fmt = call_format(template)
    if fmt is None:
        raise RequestError(
            "tools: this model's chat template does not render tools (it prints no tool-call "
            f"markup; known: {', '.join(CALL_FORMATS.names())})",
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
    return ToolPlan(fmt, tools, forced)
