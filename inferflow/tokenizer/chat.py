"""Chat templates: the jinja2 programs checkpoints ship to turn messages into a prompt.

Templates come from downloaded files, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` and see only plain JSON-like copies of the messages. The
environment mirrors the one transformers' ``apply_chat_template`` uses (``trim_blocks``,
``lstrip_blocks``, loop controls, a non-escaping ``tojson``, ``raise_exception``,
``strftime_now``), so a template renders here exactly as on the Hub.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inferflow.errors import TokenizerError


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
    **variables: Any,
) -> str:
    """Render ``messages`` with ``template``; ``variables`` are ``bos_token``, ``eos_token``,
    ``tools`` and whatever else the template reads."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenizerError(f"chat message {i} is a {type(message).__name__}, expected a dict")
    compiled = compile_chat_template(template)
    # transformers always passes these, and templates test them with `is none`
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return compiled.render(
            messages=_plain(messages),
            add_generation_prompt=add_generation_prompt,
            **{k: _plain(v) for k, v in variables.items()},
        )
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template failed: {e}") from e
