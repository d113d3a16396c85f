"""The sandboxed jinja2 environment chat templates run in, and one render in this process
(``inferflow.tokenizer.chat`` decides where a render runs; ``template_worker`` runs it in a worker
process under a budget).
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


def render_here(
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
