"""Anthropic's Messages API on `inferflow serve qwen2.5-coder-0.5b-instruct`, driven by the
official `anthropic` SDK: the same text as the chat route on the same conversation (create and
stream), the event sequence, stop sequences, a tool round trip (tool_use out, tool_result
back, equal to the chat route's reply to the same history), count_tokens against /tokenize,
errors in Anthropic's shape, the key sent as x-api-key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import qwen_coder_path
from tests.serving import run_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b-instruct"
# (the SDK of 2026 has no sampling arguments; the API, vLLM's and ours take them in the body)
GREEDY = {"temperature": 0}
KEY = "sk-anthropic-test"
SYSTEM = "You are a terse assistant."
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
AS_CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    qwen_coder_path()  # skips when the model is not assembled
    with run_server(tmp_path_factory.mktemp("anthropic"), "--api-key", KEY, spec=MODEL) as (u, _):
        yield u


@pytest.fixture(scope="module")
def claude(url: str) -> Any:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def _chat_text(oai: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *messages],
        temperature=0,
        **kw,
    )
    return r.choices[0]


def test_create_and_stream_equal_the_chat_route(claude: Any, oai: Any, url: str) -> None:
    messages = [
        {"role": "user", "content": "Name a large ocean."},
        {"role": "assistant", "content": "The Pacific."},
        {"role": "user", "content": [{"type": "text", "text": "And a small sea?"}]},
    ]
    want = _chat_text(oai, messages, max_tokens=24)
    kw = dict(model=MODEL, system=SYSTEM, messages=messages, max_tokens=24, extra_body=GREEDY)
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.finish_reason]
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.content[0].text == want.message.content and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    events = _events(url, {**kw, **GREEDY, "extra_body": None})
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert all(d["type"] == k for k, d in events)
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == (
        want.message.content
    )
    assert events[0][1]["message"]["usage"]["input_tokens"] == m.usage.input_tokens
    assert events[-2][1]["delta"]["stop_reason"] == m.stop_reason


def _events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The raw server-sent events of a streamed request: (event name, data)."""
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(
        f"{url}/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}, timeout=60
    )
    assert r.status_code == 200, r.text
    out = []
    for chunk in r.text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stop_sequences_say_which_one_ended(claude: Any, oai: Any) -> None:
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    free = _chat_text(oai, messages, max_tokens=40).message.content
    assert "5" in free  # (the premise)
    want = _chat_text(oai, messages, max_tokens=40, stop=["5", "never"]).message.content
    kw = dict(model=MODEL, system=SYSTEM, messages=messages, max_tokens=40, extra_body=GREEDY)
    m = claude.messages.create(**kw, stop_sequences=["5", "never"])
    assert m.content[0].text == want == free[: free.index("5")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "5"
    with claude.messages.stream(**kw, stop_sequences=["5", "never"]) as s:
        final = s.get_final_message()
    assert final.content[0].text == want and final.stop_sequence == "5"


def test_tool_round_trip(claude: Any, oai: Any, url: str) -> None:
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    kw = dict(model=MODEL, system=SYSTEM, max_tokens=60, extra_body=GREEDY, tools=[WEATHER])
    m = claude.messages.create(**kw, messages=ask, tool_choice={"type": "any"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with claude.messages.stream(**kw, messages=ask, tool_choice={"type": "any"}) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("tool_use", u.name, u.input) for u in uses
    ]
    assert streamed.stop_reason == "tool_use"
    events = _events(url, {**kw, **GREEDY, "extra_body": None, "messages": ask,
                           "tool_choice": {"type": "any"}})  # fmt: skip
    starts = [d["content_block"] for k, d in events if k == "content_block_start"]
    assert [b["type"] for b in starts][-1:] == ["tool_use"] and starts[-1]["input"] == {}
    deltas = [d["delta"] for k, d in events if k == "content_block_delta"]
    assert deltas[-1]["type"] == "input_json_delta"
    assert json.loads(deltas[-1]["partial_json"]) == uses[0].input
    # the call's result goes back; the reply equals the chat route's on the same history
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C, sun"}],
        },
    ]
    r = claude.messages.create(**{**kw, "max_tokens": 32}, messages=history)
    call = {"id": uses[0].id, "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": json.dumps(uses[0].input)}
    text = next((b.text for b in m.content if b.type == "text"), None)
    as_chat = [
        *ask,
        {"role": "assistant", "content": text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "18 C, sun"},
    ]
    want = _chat_text(oai, as_chat, max_tokens=32, tools=[AS_CHAT_TOOL])
    got_text = "".join(b.text for b in r.content if b.type == "text")
    assert got_text == (want.message.content or "")
    # count_tokens is the chat prompt's length
    n = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history, tools=[WEATHER])
    tokens = httpx.post(
        f"{url}/tokenize",
        json={
            "messages": [{"role": "system", "content": SYSTEM}, *as_chat],
            "tools": [AS_CHAT_TOOL],
        },
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()["tokens"]
    assert n.input_tokens == len(tokens)


def test_errors_in_anthropic_shape(claude: Any, url: str) -> None:
    msg = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-3-5-sonnet", messages=msg, max_tokens=4)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert MODEL in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=MODEL, messages=msg, max_tokens=4, extra_body={"temperature": 1.5}
        )
    assert "temperature" in e.value.body["error"]["message"]
    long = [{"role": "user", "content": "hello " * 40000}]
    for stream in (False, True):
        r = httpx.post(
            f"{url}/v1/messages",
            json={"model": MODEL, "messages": long, "max_tokens": 4, "stream": stream},
            headers={"x-api-key": KEY},
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["message"].startswith("This model's maximum context length")
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "messages": msg})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}],
           "max_tokens": 4}  # fmt: skip
    r = httpx.post(f"{url}/v1/messages", json=bad, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_output_config_format_holds_the_reply_to_a_schema(claude: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"ocean": {"type": "string", "maxLength": 20}, "deep": {"type": "boolean"}},
        "required": ["ocean", "deep"],
        "additionalProperties": False,
    }
    m = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name an ocean. Is it deep?"}],
        max_tokens=60,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            output_config={"effort": "high"},
        )
    assert "effort" in e.value.body["error"]["message"]
