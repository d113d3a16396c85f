"""Chat templates: the jinja2 programs checkpoints ship to turn messages into a prompt.

Templates come from downloaded files, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` and see only plain JSON-like copies of the messages. The
environment mirrors the one transformers' ``apply_chat_template`` uses (``trim_blocks``,
``lstrip_blocks``, loop controls, a non-escaping ``tojson``, ``raise_exception``,
``strftime_now``), so a template renders here exactly as on the Hub.

The sandbox does not stop a template from looping for hours or building gigabyte strings, so a
server passes a ``TemplateBudget``: the render then runs in a worker process that is killed past
the budget (``inferflow.tokenizer.template_worker``).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inferflow.errors import TokenizerError

_MAX_DETAIL_CHARS = 2000


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (transformers marks assistant spans with
    it) and render the body unchanged: we never need the span indices."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt tool schemas in prompts
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class TemplateBudget:
    """Limits on one render of an untrusted chat template."""

    seconds: float = 2.0  # wall clock, from sending the request to the reply
    max_output_chars: int = 1 << 22
    max_memory_bytes: int = 512 << 20  # address space the render may add to the worker's

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise TokenizerError(f"template budget {f.name}: must be > 0, got {value!r}")


class TemplateLimitError(TokenizerError):
    """A chat template went past its ``TemplateBudget``; the message names the limit."""


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not parse (line {e.lineno}): {e.message}") from e
    except Exception as e:  # deep nesting (RecursionError), constant folding (`(10**5000)|string`)
        raise TokenizerError(f"chat template failed to compile: {type(e).__name__}: {e}") from e


def _plain(value: Any) -> Any:
    """A JSON-types copy: a template must not reach methods of the caller's objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    # subclasses (str enums, IntEnum) come back as the base type, without their methods
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return f"<{type(value).__name__}>"


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    budget: TemplateBudget | None = None,
    **variables: Any,
) -> str:
    """Render ``messages`` with ``template``; ``variables`` are ``bos_token``, ``eos_token``,
    ``tools`` and whatever else the template reads.

    Without a ``budget`` the template runs in this thread, unbounded (the CLI's own model);
    with one it runs in a worker process, and going past a limit raises ``TemplateLimitError``.
    Any failure of the template itself raises ``TokenizerError``.
    """
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenizerError(f"chat message {i} is a {type(message).__name__}, expected a dict")
    # transformers always passes these, and templates test them with `is none`
    plain = {"tools": None, "documents": None, **{k: _plain(v) for k, v in variables.items()}}
    if budget is None:
        return _render(template, _plain(messages), add_generation_prompt, plain)
    # imported here: template_worker imports this module
    from inferflow.tokenizer.template_worker import render_in_worker

    return render_in_worker(template, _plain(messages), add_generation_prompt, plain, budget)


def _render(
    template: str,
    messages: list[Any],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    max_output_chars: int = sys.maxsize,
) -> str:
    """Render plain (JSON-types) inputs in this process; every failure of the template, a
    MemoryError included, becomes a ``TokenizerError`` chained to it."""
    compiled = compile_chat_template(template)
    pieces: list[str] = []
    size = 0
    try:
        for piece in compiled.generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        ):
            size += len(piece)
            if size > max_output_chars:
                break
            pieces.append(piece)
    except Exception as e:  # untrusted code: range(10**9), deep recursion, a MemoryError...
        detail = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
        # raise_exception() can pass a message of any size
        raise TokenizerError(f"chat template failed: {detail[:_MAX_DETAIL_CHARS]}") from e
    if size > max_output_chars:
        raise TemplateLimitError(
            f"chat template: output of at least {size} characters exceeds the limit of "
            f"{max_output_chars}"
        )
    return "".join(pieces)


# continue_final_message: a marker appended to the last message's text, cut off the render with
# whatever the template printed after it (transformers' own way: it finds the end of the text
# even where a template strips or repeats it)
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of ``messages`` whose last text (its content, or its last text part) ends with
    ``CONTINUE_TAG``."""
    if not messages:
        raise TokenizerError("continue_final_message: there are no messages to continue")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        at = next(
            (
                i
                for i in reversed(range(len(parts)))
                if isinstance(parts[i], dict) and "text" in parts[i]
            ),
            None,
        )
        if at is None:
            raise TokenizerError("continue_final_message: the last message has no text part")
        parts[at]["text"] = str(parts[at]["text"]) + CONTINUE_TAG
        last["content"] = parts
    elif isinstance(content, str):
        last["content"] = content + CONTINUE_TAG
    else:
        raise TokenizerError("continue_final_message: the last message has no text to continue")
    return [*messages[:-1], last]


def cut_at_tag(rendered: str) -> str:
    """``rendered`` (of ``tag_final_message``'s messages) ended where the last text ends."""
    at = rendered.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise TokenizerError(
            "continue_final_message: the chat template does not print the last message's text, "
            "so the prompt cannot end inside it"
        )
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # (the template stripped the text's trailing space)
