"""Tool-call formats (``inferflow.server.tools``): each format's markup, written here as a
model prints it, parsed into OpenAI tool_calls, whole and streamed in small pieces (the
streamed content and calls equal the whole ones); the format chosen from a chat template's
text or by name; a reply that is only a call to a declared function, without markup, is a call
under every format; what is not a complete call stays text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inferflow.engine.constrain import grammar_text
from inferflow.errors import RequestError
from inferflow.server.tools import CALL_FORMATS, CallParser, ToolStream, call_format, plan_tools

NAMES = frozenset({"get_weather", "add"})
PARIS = ("get_weather", {"city": "Paris"})
SUM = ("add", {"a": 1, "b": 2.5})

# (format, what the model printed, the content, the calls)
CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [PARIS]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>\n<tool_call>{"name":"add","arguments":{"a":1,"b":2.5}}</tool_call>',
     "Let me check.", [PARIS, SUM]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [PARIS]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "add", "parameters": {"a": 1, "b": 2.5}}', "", [PARIS, SUM]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', "", [PARIS, SUM]),
    ("mistral", '[{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', "", [SUM]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
    ("json", '```json\n[{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2.5}"}]\n```', "",
     [SUM]),
    # a Hermes model printing a bare or fenced call, as small models do
    ("hermes", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "",
     [PARIS]),
    ("hermes", ' {"name": "add", "parameters": {"a": 1, "b": 2.5}}\n', "", [SUM]),
    # not calls: text
    ("hermes", "The weather is fine.", "The weather is fine.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>',
     '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("json", '{"name": "delete_all", "arguments": {}}',
     '{"name": "delete_all", "arguments": {}}', []),  # (not a declared function)
    ("json", '{"name": "add", "arguments": {"a": 1}} and some words',
     '{"name": "add", "arguments": {"a": 1}} and some words', []),
    ("json", '{"a": 1}', '{"a": 1}', []),
]  # fmt: skip


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("fmt", "printed", "content", "calls"), CASES)
def test_each_format_parses_whole_and_streamed(
    fmt: str, printed: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    parser = CallParser(CALL_FORMATS.get(fmt), NAMES)
    got_content, got = parser.parse(printed)
    assert (got_content, _calls(got)) == (content, calls)
    for size in (1, 3, 7):
        stream = ToolStream(parser)
        sent = "".join(stream.push(printed[i : i + size]) for i in range(0, len(printed), size))
        rest, found = stream.finish()
        if calls:  # (content around calls goes out stripped once the reply ends)
            assert (sent + rest).strip() == content and _calls(found) == calls
        else:
            assert sent + rest == content and not found


def test_streamed_text_goes_out_before_the_reply_ends() -> None:
    """Plain text is not held to the end: only what may start a call waits."""
    stream = ToolStream(CallParser(CALL_FORMATS.get("hermes"), NAMES))
    assert stream.push("The weather ") == "The weather "
    assert stream.push("is fine <tool") == "is fine "  # (may be a marker's start)
    assert stream.push("kit>.") == "<toolkit>."
    assert stream.finish() == ("", [])
    stream = ToolStream(CallParser(CALL_FORMATS.get("hermes"), NAMES))
    assert stream.push('{"na') == ""  # (may be a bare call)
    assert stream.push('me": "add", "arguments": {}}') == ""
    assert _calls(stream.finish()[1]) == [("add", {})]


def test_the_format_comes_from_the_template_or_the_flag() -> None:
    qwen = "{% for tool in tools %}...{% endfor %} <tool_call>\n{{ call | tojson }}\n</tool_call>"
    llama = '{{- "<|python_tag|>" + tool_call.name }} {"name": ..., "parameters": ...}'
    mistral = "{{- '[TOOL_CALLS] [' }}{% for tc in tool_calls %}...{% endfor %}"
    assert call_format(qwen) is CALL_FORMATS.get("hermes")
    assert call_format(llama) is CALL_FORMATS.get("llama3_json")
    assert call_format(mistral) is CALL_FORMATS.get("mistral")
    assert call_format("{{ messages }}") is None
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    with pytest.raises(RequestError, match="does not render tools.*--tool-call-parser"):
        plan_tools("{{ messages }}", tools, None, None, True)
    plan = plan_tools("{{ messages }}", tools, None, None, True, "json")
    assert plan.parser is not None and plan.parser.fmt is CALL_FORMATS.get("json")
    assert plan.parser.names == {"add"}


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "json"])
def test_forced_grammars_print_what_the_format_reads(fmt: str) -> None:
    """A required call's grammar (llguidance) accepts the format's own printing of calls and
    the parser reads that printing back: checked with llguidance's matcher on the text."""
    llguidance = pytest.importorskip("llguidance")
    f = CALL_FORMATS.get(fmt)
    funcs = [
        {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    ]
    grammar = f.grammar(funcs, parallel=True)
    one = json.dumps({"name": "add", f.key: {"a": 1}}, separators=(",", ":"))
    if f.listed:
        text = f"[{one},{one}]"
    elif f.end:
        text = f"{f.start}{one}{f.end}{f.between}{f.start}{one}{f.end}"
    else:
        text = f"{one}{f.between}{one}"
    m = llguidance.LLMatcher(_byte_tokenizer(llguidance), grammar_text("grammar", grammar))
    assert not m.is_error(), m.get_error()
    for b in text.encode():
        assert m.consume_token(b), (fmt, text, m.get_error())
    assert m.is_accepting()
    assert _calls(CallParser(f, frozenset({"add"})).parse(text)[1]) == [("add", {"a": 1})] * 2


def _byte_tokenizer(llguidance: Any) -> Any:
    """A tokenizer of 256 one-byte tokens and an end token: a grammar's matcher then reads
    text byte by byte."""

    class View:
        eos_token_id = 256
        bos_token_id = None
        tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
        special_token_ids = [256]

        def __call__(self, text: str | bytes) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(View()), n_vocab=257)
