"""Chat templates under a budget: a template that loops or grows without end is stopped in its
worker process, and the parent process (the server) keeps its time and memory."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel

from inferflow.errors import TokenizerError
from inferflow.tokenizer import Tokenizer
from inferflow.tokenizer.chat import TemplateBudget, TemplateLimitError, render_chat_template
from inferflow.tokenizer.template_worker import _POOL

NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING = (
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}"
)
# Qwen2.5's template (ChatML with tools), shortened only in its system prompt
CHATML = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse. <b>&</b>"},
    {"role": "user", "content": "Weather in 東京? \x00 \ud800"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "東京"}}}],
    },
    {"role": "tool", "content": '{"temp": 21.5}'},
    {"role": "user", "content": "Thanks 😀"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmRSS:"))
    return int(kib) << 10


def test_time_limit_kills_the_worker_and_the_pool_recovers() -> None:
    budget = TemplateBudget(seconds=1.0)
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"exceeded the time limit of 1\.0 s"):
        render_chat_template(NESTED_RANGE, [], budget=budget)
    assert time.monotonic() - start < budget.seconds + 1.0
    assert render_chat_template(CHATML, CHAT, budget=budget) == render_chat_template(CHATML, CHAT)


def test_runaway_string_stops_at_the_memory_limit_outside_this_process() -> None:
    before = _rss_bytes()
    with pytest.raises(TemplateLimitError, match=r"memory limit of 128 MiB"):
        render_chat_template(DOUBLING, [], budget=TemplateBudget(max_memory_bytes=128 << 20))
    assert _rss_bytes() - before < 50 << 20
    assert render_chat_template("{{ 'ok' }}", [], budget=TemplateBudget()) == "ok"


def test_output_limit() -> None:
    many = "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"
    with pytest.raises(TemplateLimitError, match=r"characters exceeds the limit of 1000$"):
        render_chat_template(many, [], budget=TemplateBudget(max_output_chars=1000))
    assert render_chat_template(
        "{{ 'x' * 1000 }}", [], budget=TemplateBudget(max_output_chars=1000)
    )


@pytest.mark.parametrize("budget", [None, TemplateBudget()], ids=["in_process", "worker"])
@pytest.mark.parametrize(
    ("template", "cause"),
    [
        ("{{ range(10**9) | list }}", "OverflowError"),
        ("{{ (10**5000) | string }}", "ValueError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError|unsafe"),
        ("{{ raise_exception('no system' * 10**6) }}", "no system"),
    ],
    ids=["range", "int_to_str", "recursion", "sandbox", "raise"],
)
def test_template_exceptions_become_tokenizer_errors(
    template: str, cause: str, budget: TemplateBudget | None
) -> None:
    with pytest.raises(TokenizerError, match=f"chat template failed.*({cause})") as info:
        render_chat_template(template, [], budget=budget)
    assert type(info.value) is TokenizerError
    assert len(str(info.value)) < 10_000


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_template_renders_the_same_in_a_worker(add_generation_prompt: bool) -> None:
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tools": TOOLS}
    expect = render_chat_template(CHATML, CHAT, **kwargs)
    assert (
        "<tool_call>" in expect
        and "東京" in expect
        and expect.count("<|im_start|>") == 5 + add_generation_prompt
    )
    assert render_chat_template(CHATML, CHAT, budget=TemplateBudget(), **kwargs) == expect
    assert render_chat_template(CHATML, CHAT[1:2], budget=TemplateBudget()) == (
        render_chat_template(CHATML, CHAT[1:2])
    )


def test_tokenizer_passes_the_budget() -> None:
    backend = BackendTokenizer(WordLevel({"<s>": 0, "</s>": 1, "x": 2}, unk_token="x"))
    template = "{{ bos_token }}{{ messages[0].content * 2000 }}{{ eos_token }}"
    tok = Tokenizer(backend, bos_id=0, eos_ids=[1], chat_template=template)
    msgs = [{"role": "user", "content": "hi"}]
    expect = "<s>" + "hi" * 2000 + "</s>"
    assert tok.apply_chat_template(msgs) == expect
    assert tok.apply_chat_template(msgs, budget=TemplateBudget()) == expect
    with pytest.raises(TemplateLimitError, match="exceeds the limit of 1000$"):
        tok.apply_chat_template(msgs, budget=TemplateBudget(max_output_chars=1000))


def test_concurrent_renders_from_threads() -> None:
    chats = [CHAT[: i + 1] for i in range(1, len(CHAT))]
    expect = [render_chat_template(CHATML, chat, tools=TOOLS) for chat in chats]
    results: dict[int, list[str]] = {}

    def run(thread: int) -> None:
        results[thread] = [
            render_chat_template(CHATML, chat, budget=TemplateBudget(), tools=TOOLS)
            for _ in range(5)
            for chat in chats
        ]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: expect * 5 for i in range(4)}


def test_a_slow_render_does_not_block_another_thread() -> None:
    assert _POOL.size == 2
    slow_error: list[Exception] = []

    def slow() -> None:
        try:
            render_chat_template(NESTED_RANGE, [], budget=TemplateBudget(seconds=3.0))
        except TemplateLimitError as e:
            slow_error.append(e)

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)  # the slow render is in its worker by now
    start = time.monotonic()
    assert render_chat_template("{{ 'fast' }}", [], budget=TemplateBudget()) == "fast"
    assert time.monotonic() - start < 1.5
    assert thread.is_alive()
    thread.join()
    assert slow_error and "time limit of 3.0 s" in str(slow_error[0])


def test_worker_loads_no_heavy_libraries() -> None:
    render_chat_template("x", [], budget=TemplateBudget())
    assert _POOL._workers
    for worker in list(_POOL._workers):
        with open(f"/proc/{worker.proc.pid}/maps") as f:
            maps = f.read()
        assert "torch" not in maps and "numpy" not in maps and "tokenizers" not in maps


@pytest.mark.parametrize("field", ["seconds", "max_output_chars", "max_memory_bytes"])
def test_budget_must_be_positive(field: str) -> None:
    with pytest.raises(TokenizerError, match=f"{field}: must be > 0, got 0"):
        TemplateBudget(**{field: 0})
