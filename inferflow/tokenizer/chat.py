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

from typing import Any

from inferflow.errors import TokenizerError
from inferflow.tokenizer.jinja_env import (
    TemplateBudget,
    TemplateLimitError,
    _plain,
    compile_chat_template,
    render_here,
)
from inferflow.tokenizer.template_worker import render_in_worker

__all__ = [
    "CONTINUE_TAG",
    "TemplateBudget",
    "TemplateLimitError",
    "compile_chat_template",
    "cut_at_tag",
    "render_chat_template",
    "tag_final_message",
]


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
        return render_here(template, _plain(messages), add_generation_prompt, plain)
    return render_in_worker(template, _plain(messages), add_generation_prompt, plain, budget)


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
