"""Structured output through `inferflow serve` with the official `openai` client: every reply
to a JSON Schema request validates against that schema (checked by the `jsonschema` package, not
by the server's grammar engine), streamed or not, on the default model and on Qwen2.5; JSON
object mode parses; vLLM's regex / choice / grammar extras hold; the Responses API's
``text.format`` and the SDK's ``parse`` helpers get objects back; a schema the engine cannot
compile is a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import qwen_coder_path, smollm2_path
from tests.serving import NAME, run_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow

S = {"type": "string", "maxLength": 24}
I = {"type": "integer", "minimum": 0, "maximum": 10000}  # noqa: E741


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def arr(items: dict[str, Any], most: int = 3) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


# (prompt, schema): nested objects, arrays, enums, required and optional fields, numbers,
# booleans, nulls; every string and array bounded so that a reply fits in max_tokens
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person.", obj({"name": S, "age": I})),
    ("A city and its country.", obj({"city": S, "country": S, "capital": {"type": "boolean"}})),
    ("Three colors.", obj({"colors": arr({"enum": ["red", "green", "blue", "yellow"]})})),
    ("A book.", obj({"title": S, "author": obj({"first": S, "last": S}), "year": I})),
    ("Rate a movie.", obj({"movie": S, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("A shopping list.", obj({"items": arr(obj({"name": S, "qty": I}), 3)})),
    ("Is water wet?", obj({"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}})),
    ("A point in 2D.", obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    ("A user profile.", obj({"user": S, "email": S, "admin": {"type": "boolean"}}, ["user"])),
    ("Weather today.", obj({"temp": I, "sky": {"enum": ["sunny", "cloudy", "rainy"]}})),
    ("A pet.", obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": S, "age": I})),
    ("Two friends.", obj({"friends": arr(obj({"name": S}), 2)})),
    ("A recipe.", obj({"dish": S, "steps": arr(S, 3), "minutes": I})),
    ("A car.", obj({"make": S, "model": S, "electric": {"type": "boolean"}})),
    ("A date.", obj({"year": I, "month": {"type": "integer", "minimum": 1, "maximum": 12}})),
    ("A tiny tree.", obj({"root": obj({"value": I, "children": arr(obj({"value": I}), 2)})})),
    ("An answer or nothing.", obj({"value": {"anyOf": [I, {"type": "null"}]}})),
    ("A team.", obj({"team": S, "members": arr(S, 3), "lead": S})),
    ("A song.", obj({"title": S, "genre": {"enum": ["pop", "rock", "jazz"]}, "length": I})),
    ("Planet facts.", obj({"planet": S, "moons": I, "rings": {"type": "boolean"}})),
    ("A list of numbers.", obj({"numbers": arr(I, 4)})),
]


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    smollm2_path()
    with run_server(tmp_path_factory.mktemp("so-smol")) as (url, _):
        yield _client(url), NAME, url


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    qwen_coder_path()
    name = "qwen2.5-coder-0.5b-instruct"
    with run_server(tmp_path_factory.mktemp("so-qwen"), spec=name) as (url, _):
        yield _client(url), name, url


def _ask(client: Any, model: str, prompt: str, schema: dict[str, Any], stream: bool) -> Any:
    """One JSON Schema request: (text, finish reason)."""
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": f"{prompt} Reply in JSON."}],
        max_tokens=200,
        temperature=0.8,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": schema, "strict": True},
        },
    )
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.finish_reason
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    return text, reasons[-1]


def _all_validate(client: Any, model: str, cases: list[tuple[str, dict[str, Any]]]) -> None:
    """Every case, concurrently (the engine batches them), odd ones streamed: each reply ends
    by itself ("stop") and validates against its schema."""
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(_ask, client, model, p, s, i % 2 == 1) for i, (p, s) in enumerate(cases)
        ]
        replies = [f.result() for f in futures]
    for (prompt, schema), (text, reason) in zip(cases, replies, strict=True):
        assert reason == "stop", (prompt, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_schema_replies_validate_on_the_default_model(smol: Any) -> None:
    client, model, _ = smol
    _all_validate(client, model, CASES)


def test_json_schema_replies_validate_on_qwen(qwen: Any) -> None:
    """The same 21 cases on Qwen2.5, and JSON object mode ending by itself with a JSON object,
    streamed and not."""
    client, model, _ = qwen
    _all_validate(client, model, CASES)
    for stream in (False, True):
        kw = dict(
            model=model,
            messages=[{"role": "user", "content": "Describe a cat in JSON."}],
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_object"},
        )
        if stream:
            chunks = [ch for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            c = client.chat.completions.create(**kw).choices[0]
            text, reason = c.message.content, c.finish_reason
        assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_json_object_regex_choice_and_grammar(smol: Any) -> None:
    client, model, url = smol
    msg = [{"role": "user", "content": "Tell me about cats in JSON."}]
    for stream in (False, True):
        kw = dict(model=model, messages=msg, max_tokens=120, temperature=0.8, seed=3)
        if stream:
            chunks = client.chat.completions.create(
                **kw, stream=True, response_format={"type": "json_object"}
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            r = client.chat.completions.create(**kw, response_format={"type": "json_object"})
            text = r.choices[0].message.content
        assert text.startswith("{")  # (SmolLM2 may nest until max_tokens: Qwen's test parses)
    prompt = dict(model=model, prompt="My phone number is", max_tokens=20, temperature=1.0)
    for seed in range(4):
        r = client.completions.create(
            **prompt, seed=seed, extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}}
        )
        assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        r = client.completions.create(
            **prompt, seed=seed, extra_body={"structured_outputs": {"choice": [" yes", " no"]}}
        )
        assert r.choices[0].text in (" yes", " no")
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
    r = client.completions.create(
        **prompt, seed=0, extra_body={"structured_outputs": {"grammar": lark}}
    )
    assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", r.choices[0].text), r.choices[0].text


def test_parse_helpers_and_the_responses_api(smol: Any) -> None:
    """The SDK's ``chat.completions.parse`` and ``responses.parse`` send a strict JSON Schema
    built from a pydantic model and parse the reply into it."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**9)

    client, model, _ = smol
    msg = [{"role": "user", "content": "A big city, as JSON."}]
    got = client.chat.completions.parse(
        model=model, messages=msg, response_format=City, max_tokens=80, temperature=0.5, seed=2
    )
    assert isinstance(got.choices[0].message.parsed, City)
    r = client.responses.parse(
        model=model, input="A big city, as JSON.", text_format=City, max_output_tokens=80
    )
    assert isinstance(r.output_parsed, City) and r.text.format.type == "json_schema"


def test_bad_constraints_are_400_naming_the_field(smol: Any) -> None:
    client, model, _ = smol
    msg = [{"role": "user", "content": "x"}]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msg, response_format=bad)
    assert e.value.body["param"] == "response_format" and "frob" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt="x", extra_body={"structured_outputs": {"regex": "((("}}
        )
    assert e.value.body["param"] == "structured_outputs" and "regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model,
            prompt="x",
            extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}},
        )
    assert "exactly one" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model,
            prompt="x",
            extra_body={"beam_width": 2, "structured_outputs": {"choice": ["a"]}},
        )
    assert e.value.body["param"] == "beam_width"


# --- tools (Qwen2.5's chat template renders them; its replies use <tool_call> markup) -------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": obj({"a": {"type": "number"}, "b": {"type": "number"}}),
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _calls_validate(message: Any, names: set[str]) -> list[Any]:
    calls = message.tool_calls
    assert calls, message
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def test_tool_calls_required_named_auto_and_streamed(qwen: Any) -> None:
    """tool_choice "required" and a named function give tool_calls whose arguments validate
    against the function's schema (finish reason "tool_calls"); "auto" gives text or a
    well-formed call; streamed, the call deltas reassemble to the same call."""
    client, model, _ = qwen
    asks = ["What's the weather in Paris?", "What is 17 plus 25?", "Weather in Oslo, Fahrenheit?"]
    for ask in asks:
        kw = dict(model=model, messages=[{"role": "user", "content": ask}], tools=TOOLS)
        r = client.chat.completions.create(**kw, tool_choice="required", max_tokens=80, seed=1)
        assert r.choices[0].finish_reason == "tool_calls"
        _calls_validate(r.choices[0].message, set(SCHEMAS))
        named = {"type": "function", "function": {"name": "add"}}
        r = client.chat.completions.create(**kw, tool_choice=named, max_tokens=80, seed=2)
        (call,) = _calls_validate(r.choices[0].message, {"add"})
        r = client.chat.completions.create(**kw, tool_choice="auto", max_tokens=80, seed=3)
        m = r.choices[0].message
        if m.tool_calls:
            _calls_validate(m, set(SCHEMAS))
        else:
            assert m.content and "<tool_call>" not in m.content
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": asks[0]}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    full = _calls_validate(client.chat.completions.create(**kw).choices[0].message, set(SCHEMAS))
    chunks = [ch for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    parts: dict[int, dict[str, str]] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            p = parts.setdefault(d.index, {"name": "", "arguments": ""})
            p["name"] += d.function.name or ""
            p["arguments"] += d.function.arguments or ""
    assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in full
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_history_renders_as_transformers_and_errors(qwen: Any) -> None:
    """A history with an assistant tool call and a tool result renders (tools included) as
    transformers' chat-template renderer renders it; tools on a template without tool markup,
    tool_choice without tools or naming an unknown function are 400s naming the field."""
    transformers = pytest.importorskip("transformers")
    import httpx

    from inferflow.runtime import tokenizer_for
    from inferflow.spec import load_spec

    client, model, url = qwen
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    ours = tokenizer_for(load_spec(model))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, chat_template=ours.chat_template
    )
    as_hf = [
        {
            **m,
            "tool_calls": [
                {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        }
        if m.get("tool_calls")
        else m
        for m in history
    ]
    text = hf.apply_chat_template(as_hf, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n18 C, sunny" in text and '"name": "get_weather"' in text
    got = httpx.post(f"{url}/tokenize", json={"messages": history, "tools": TOOLS}).json()
    assert got["tokens"] == ours.encode(text, add_special_tokens=False)
    r = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=24, temperature=0
    )
    assert r.usage.prompt_tokens == len(got["tokens"])
    msg = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msg, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    unknown = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msg, tools=TOOLS, tool_choice=unknown)
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]


def test_tools_on_a_template_without_tool_markup_are_refused(smol: Any) -> None:
    client, model, _ = smol
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], tools=TOOLS
        )
    assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]


def test_responses_api_function_calls(qwen: Any) -> None:
    """/v1/responses with function tools: a required call comes back as a ``function_call``
    item whose arguments validate (streamed: the item added, its arguments, done, in order);
    its output sent back with ``previous_response_id`` continues the conversation as the chat
    template renders [user, assistant call, tool result]."""
    import httpx

    client, model, url = qwen
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = dict(model=model, input="Weather in Paris?", tools=flat, tool_choice="required")
    r = client.responses.create(**kw, max_output_tokens=60, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name in SCHEMAS and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(**kw, max_output_tokens=60, temperature=0) as s:
        events = [e.type for e in s]
        final = s.get_final_response()
    assert events == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (streamed,) = final.output
    assert (streamed.name, json.loads(streamed.arguments)) == (
        call.name,
        json.loads(call.arguments),
    )
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    r2 = client.responses.create(
        model=model, input=[result], previous_response_id=r.id, tools=flat, max_output_tokens=8
    )
    as_chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
    ]
    want = httpx.post(f"{url}/tokenize", json={"messages": as_chat, "tools": TOOLS}).json()
    assert r2.usage.input_tokens == want["count"]


def test_a_failing_grammar_mask_ends_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the engine: when the batched mask call fails, each constrained sample is masked
    alone, and only the one whose mask fails ends with "error"; the other constrained sample
    still follows its grammar and the free one runs on."""
    import inferflow.engine.engine as engine_module
    from inferflow.engine.constrain import compile_grammar, lltokenizer, mask_rows
    from inferflow.engine.engine import Engine
    from inferflow.engine.sampling import SamplingParams
    from inferflow.runtime import load

    smollm2_path()
    lm = load("smollm2-135m-instruct")
    ll = lltokenizer(lm.tokenizer, lm.spec.hparams.vocab_size)
    bad = compile_grammar("choice", [" yes", " no"], ll)
    good = compile_grammar("regex", r" \d{3}", ll)
    broken: list[Any] = []

    def flaky(x: Any, rows: list[int], constraints: list[Any]) -> None:
        if any(c in broken for c in constraints):
            raise RuntimeError("mask failed")
        mask_rows(x, rows, constraints)

    monkeypatch.setattr(engine_module, "mask_rows", flaky)
    eng = Engine(lm.model, lm.tokenizer)
    prompt = lm.encode_prompt("My lucky number is")
    ids = [
        eng.add_request(prompt, SamplingParams(max_new_tokens=8, grammar=g))
        for g in (bad, good, None)
    ]
    reqs = [eng.requests[i][0] for i in ids]
    broken.append(reqs[0].constraint)
    while eng.has_unfinished():
        eng.step()
    assert [r.finish_reason for r in reqs] == ["error", "stop", "length"]
    assert re.fullmatch(r" \d{3}", reqs[1].text) and len(reqs[2].output_ids) == 8
