"""vLLM's request fields and the openai SDK's round trips against `inferflow serve` (a real
process, SmolLM2 in float32 with a chat template written here), each checked against
transformers running the same GGUF and template: continue_final_message continues the given
text as transformers' greedy continuation of the same rendered prompt; chat_template_kwargs reach
the template; skip_special_tokens / include_stop_str_in_output / spaces_between_special_tokens
shape the text as the reference ids decode; guided_* hold the output; chat's prompt_logprobs;
the over-context error's code and wording on both routes and both streaming modes; several
served model names; an SDK conversation that appends ``model_dump()``ed replies with tool
calls."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conftest import smollm2_path
from tests.serving import greedy, run_server, smollm2_transformers

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
tf = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow

# ChatML with a template variable (greeting) and Hermes-style tool calls
TEMPLATE = (
    "{%- if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{%- if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{% endif %}"
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call one as <tool_call>\n"
    '{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NAMES = ("smol-first", "gpt-4o-mini")
MODEL = NAMES[0]
CONTEXT = re.compile(r"^This model's maximum context length is \d+ tokens")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    smollm2_path()  # skips when the model package is missing
    extra = f"tokenizer:\n  chat_template: {json.dumps(TEMPLATE)}\n"
    d = tmp_path_factory.mktemp("vllm")
    args = ("--quant", "none", "--served-model-name", *NAMES)
    with run_server(d, *args, spec_extra=extra) as (u, _):
        yield u


@pytest.fixture(scope="module")
def client(url: str):  # noqa: ANN201
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf():  # noqa: ANN201
    return smollm2_transformers()


def _render(hf: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    _, tok = hf
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kw)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _error(r: httpx.Response, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param is None or err["param"] == param, err
    return err


def test_served_model_names_and_integral_floats(client: Any, url: str) -> None:
    assert [m.id for m in client.models.list().data] == list(NAMES)
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "gpt-4o-mini", "prompt": "Hi", "max_tokens": 2.0, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL and r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-3.5-turbo", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert all(n in r.json()["error"]["message"] for n in NAMES)


def test_continue_final_message_matches_transformers(client: Any, url: str, hf: Any) -> None:
    _, tok = hf
    start = "The capital of France is"
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": start},
    ]
    ids = _render(hf, messages, continue_final_message=True)
    assert tok.decode(ids).endswith(start)  # (the premise: the turn is left open)
    want = tok.decode(greedy(hf, ids, 8), skip_special_tokens=True)
    switches = {"continue_final_message": True, "add_generation_prompt": False}
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    r = client.chat.completions.create(**kw, extra_body=switches)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    # add_generation_prompt left unset means false when continuing
    r = client.chat.completions.create(**kw, extra_body={"continue_final_message": True})
    assert r.choices[0].message.content == want
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages, **switches}).json()
    assert tokenized["tokens"] == ids
    # echo: the reply starts with the continued text, streamed or not
    echoed = {**switches, "echo": True}
    r = client.chat.completions.create(**kw, extra_body=echoed)
    assert r.choices[0].message.content == start + want
    chunks = list(client.chat.completions.create(**kw, extra_body=echoed, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == start + want
    # echo of a new assistant turn: the last message is the user's, nothing is echoed
    r = client.chat.completions.create(
        **{**kw, "messages": messages[:1]}, extra_body={"echo": True}
    )
    assert r.choices[0].message.content == tok.decode(
        greedy(hf, _render(hf, messages[:1], add_generation_prompt=True), 8),
        skip_special_tokens=True,
    )
    both = {"model": MODEL, "messages": messages, "continue_final_message": True,
            "add_generation_prompt": True}  # fmt: skip
    err = _error(httpx.post(f"{url}/v1/chat/completions", json=both), "continue_final_message")
    assert "add_generation_prompt" in err["message"]


def test_chat_template_kwargs_reach_the_template(client: Any, url: str, hf: Any) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    want = _render(hf, messages, add_generation_prompt=True, greeting="Ahoy there")
    assert want != _render(hf, messages, add_generation_prompt=True)
    body = {"messages": messages, "chat_template_kwargs": {"greeting": "Ahoy there"}}
    assert httpx.post(f"{url}/tokenize", json=body).json()["tokens"] == want
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body=body
    )
    assert r.usage.prompt_tokens == len(want)
    docs = [{"title": "Tide", "text": "The sea rises twice a day."}]
    want = _render(hf, messages, add_generation_prompt=True, documents=docs)
    assert "[Tide] The sea" in hf[1].decode(want)
    assert (
        httpx.post(f"{url}/tokenize", json={"messages": messages, "documents": docs}).json()[
            "tokens"
        ]
        == want
    )
    # vLLM's request_id names the response; fields at the value that asks for nothing special
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1, "request_id": "abc-1",
              "priority": 0, "use_beam_search": False, "bad_words": [], "best_of": 1},
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-abc-1", r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "priority": 1})
    assert _error(r, "priority")["message"].startswith("priority: not supported")
    bad = {"model": MODEL, "messages": messages, "chat_template_kwargs": {"messages": []}}
    err = _error(httpx.post(f"{url}/v1/chat/completions", json=bad), "chat_template_kwargs")
    assert "'messages'" in err["message"] and "reserved" in err["message"]


def test_special_tokens_and_stop_strings_shape_the_text(client: Any, url: str, hf: Any) -> None:
    _, tok = hf
    messages = [{"role": "user", "content": "Name an ocean."}]
    out = greedy(hf, _render(hf, messages, add_generation_prompt=True), 48)
    assert out[-1] == tok.eos_token_id and tok.eos_token_id not in out[:-1]  # (the premise)
    eos = tok.decode(out[-1:], skip_special_tokens=False)
    body = tok.decode(out[:-1], skip_special_tokens=True)
    kw = dict(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    cases = [
        ({}, body),
        ({"include_stop_str_in_output": True}, body),  # (the end token's text is skipped)
        ({"skip_special_tokens": False}, body),  # (the end token is not the text's)
        ({"skip_special_tokens": False, "include_stop_str_in_output": True}, body + eos),
        (
            {"skip_special_tokens": False, "include_stop_str_in_output": True,
             "spaces_between_special_tokens": True},
            body + " " + eos,
        ),
    ]  # fmt: skip
    for extra, want in cases:
        r = client.chat.completions.create(**kw, extra_body=extra)
        assert r.choices[0].message.content == want, extra
        chunks = list(client.chat.completions.create(**kw, extra_body=extra, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    kw = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    cut = free[: free.index(" 7") + 2]
    extra = {"include_stop_str_in_output": True}
    r = client.completions.create(**kw, stop=[" 7"], extra_body=extra)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = client.completions.create(**kw, stop=[" 7"], extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in s) == cut


def test_guided_fields_hold_the_output(client: Any, url: str) -> None:
    messages = [{"role": "user", "content": "Name an ocean and a number."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    choice = ["Atlantic", "Pacific"]
    r = client.chat.completions.create(**kw, extra_body={"guided_choice": choice})
    assert r.choices[0].message.content in choice
    r = client.chat.completions.create(**kw, extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", r.choices[0].message.content)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    for given in (schema, json.dumps(schema)):
        r = client.chat.completions.create(**kw, extra_body={"guided_json": given})
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"n"} and isinstance(value["n"], int)
    r = client.completions.create(
        model=MODEL, prompt="Ocean:", max_tokens=8, extra_body={"guided_choice": choice}
    )
    assert r.choices[0].text in choice
    # the alternatives the grammar rules out have no finite log-probability: -9999, as vLLM says
    # (a -inf was a 500: JSON has no infinity)
    r = client.completions.create(
        model=MODEL, prompt="Ocean:", max_tokens=4, logprobs=5, extra_body={"guided_choice": choice}
    )
    tops = [v for d in r.choices[0].logprobs.top_logprobs for v in d.values()]
    assert r.choices[0].text in choice and -9999.0 in tops and min(tops) == -9999.0
    two = {"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}
    err = _error(httpx.post(f"{url}/v1/completions", json=two), "guided_choice")
    assert "guided_regex and guided_choice" in err["message"]


def test_chat_prompt_logprobs_match_transformers(url: str, hf: Any) -> None:
    model, _ = hf
    messages = [{"role": "user", "content": "Hi there"}]
    ids = _render(hf, messages, add_generation_prompt=True)
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 2}
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            first = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
            got = first["prompt_logprobs"]
        else:
            got = r.json()["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for j in (1, len(ids) - 1):
            entry = got[j][str(ids[j])]
            assert entry["logprob"] == pytest.approx(float(lp[j - 1, ids[j]]), abs=1e-3)
            assert len(got[j]) in (2, 3)  # the 2 most likely, and the token itself


def test_over_context_errors_have_openai_code_and_vllm_wording(url: str) -> None:
    long_ids = [1] * 9000
    long_text = "hello " * 9000
    for stream in (False, True):
        for path, body, field in (
            ("/v1/completions", {"prompt": long_ids}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]},
             "messages"),
        ):  # fmt: skip
            r = httpx.post(f"{url}{path}", json={**body, "stream": stream, "max_tokens": 4})
            err = _error(r, field)
            assert err["code"] == "context_length_exceeded", err
            assert CONTEXT.match(err["message"]) and "input tokens" in err["message"], err
            assert f"length of the {field}" in err["message"]
            short = {"prompt": "Hi"} if field == "prompt" else {
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
            r = httpx.post(f"{url}{path}", json={**short, "stream": stream, "max_tokens": 9000})
            err = _error(r, "max_tokens")
            assert err["code"] == "context_length_exceeded" and CONTEXT.match(err["message"])
            assert "you requested" in err["message"] and "in the completion" in err["message"]
            assert "(max_tokens 9000: at most" in err["message"]


def test_sdk_conversation_appends_dumped_replies_with_tool_calls(
    client: Any, url: str, hf: Any
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=MODEL, tools=tools, temperature=0)
    r = client.chat.completions.create(
        **kw, messages=messages, tool_choice="required", parallel_tool_calls=False, max_tokens=64
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None, msg
    assert [c.function.name for c in msg.tool_calls or []] == ["get_weather"], msg
    dumped = msg.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    messages += [dumped, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sun"}]
    r = client.chat.completions.create(**kw, messages=messages, max_tokens=8)
    messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "Thanks"}]
    r = client.chat.completions.create(**kw, messages=messages, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt is what transformers renders (the arguments as an object, as it takes them)
    plain = []
    for m in copy.deepcopy(messages):
        m = {k: v for k, v in m.items() if v is not None and k in ("role", "content", "tool_calls")}
        for c in m.get("tool_calls") or []:  # (name first: the order the server passes)
            f = c["function"]
            c["function"] = {"name": f["name"], "arguments": json.loads(f["arguments"])}
        plain.append(m)
    got = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": tools}).json()
    want = _render(hf, plain, add_generation_prompt=True, tools=tools)
    assert got["tokens"] == want


def test_return_token_ids_are_transformers_greedy_ids(url: str, hf: Any) -> None:
    """vLLM's return_token_ids: each choice carries its prompt's ids and its output's ids (the
    end token included), non-streamed and streamed, on completions and chat."""
    _, tok = hf
    prompt = "The three primary colours are"
    ids = list(tok(prompt)["input_ids"])
    want = greedy(hf, ids, 12)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}).json()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want
    assert choice["text"] == tok.decode(want, skip_special_tokens=True)
    plain = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "return_token_ids": True, "stream": True}
    ) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == want
    messages = [{"role": "user", "content": "Name an ocean."}]
    chat_ids = _render(hf, messages, add_generation_prompt=True)
    chat = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    c = httpx.post(f"{url}/v1/chat/completions", json={**chat, "return_token_ids": True}).json()
    assert c["choices"][0]["prompt_token_ids"] == chat_ids
    assert c["choices"][0]["token_ids"] == greedy(hf, chat_ids, 8)
