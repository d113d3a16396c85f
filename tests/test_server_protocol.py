"""Request validation and the OpenAPI schema, in process (no model is loaded: a valid body
reaches the route and gets 503 "loading"). Regression tests for what the schemathesis run
(tests/test_server_fuzz.py) found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_llama

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from inferflow.server.app import ServerConfig, create_app  # noqa: E402
from inferflow.spec import load_spec  # noqa: E402


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    d: Path = tmp_path_factory.mktemp("tiny-serve")
    tiny_llama(d)
    return TestClient(create_app(ServerConfig(load_spec(d / "spec.yaml"), api_keys=("k",))))


AUTH = {"Authorization": "Bearer k"}


def _bad(client: TestClient, path: str, body: object, param: str | None, *needles: str) -> None:
    r = client.post(path, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for n in needles:
        assert n in err["message"], err


def test_types_are_strict(client: TestClient) -> None:
    """Pydantic's lax mode took "3" for max_tokens, "yes" for stream, false for mirostat 0 and
    "2" for a logit bias: schema-violating requests that ran."""
    base = {"prompt": "hi"}
    _bad(client, "/v1/completions", {**base, "max_tokens": "3"}, "max_tokens", "integer")
    _bad(client, "/v1/completions", {**base, "stream": "yes"}, "stream", "boolean")
    _bad(client, "/v1/completions", {**base, "mirostat": False}, "mirostat", "integer")
    _bad(client, "/v1/completions", {**base, "logit_bias": {"5": "2"}}, "logit_bias", "number")
    _bad(client, "/v1/completions", {**base, "n": 2.5}, "n", "integer")
    ok = client.post("/v1/completions", json={**base, "temperature": 1}, headers=AUTH)
    assert ok.status_code == 503  # (an integer is a number: valid, and the model is loading)


def test_non_finite_numbers_are_refused(client: TestClient) -> None:
    """Python's JSON parser reads NaN / Infinity; unconstrained floats (length_penalty,
    mirostat_tau) took them."""
    for field in ("length_penalty", "mirostat_tau", "temperature"):
        r = client.post(
            "/v1/completions",
            content=f'{{"prompt": "hi", "{field}": NaN}}'.encode(),
            headers={**AUTH, "content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "finite" in r.json()["error"]["message"]


def test_unknown_fields_are_named(client: TestClient) -> None:
    _bad(client, "/v1/completions", {"prompt": "a", "frobnicate": 1}, "frobnicate", "unknown")
    chat = {"messages": [{"role": "user", "content": "x", "frobnicate": "no"}]}
    _bad(client, "/v1/chat/completions", chat, "messages.0.frobnicate", "unknown field")


def test_malformed_json_names_no_field(client: TestClient) -> None:
    """The character position of a JSON syntax error came back as the param ("1")."""
    r = client.post(
        "/v1/completions",
        content=b"{not json",
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert "not valid JSON" in r.json()["error"]["message"] and "character 1" in r.text


def test_seed_range(client: TestClient) -> None:
    """A seed past int64 used to fail inside torch.Generator.manual_seed: a 500."""
    _bad(client, "/v1/completions", {"prompt": "hi", "seed": 10**26}, "seed", "less than")
    _bad(client, "/v1/completions", {"prompt": "hi", "seed": -(10**26)}, "seed", "greater than")


def test_union_errors_name_the_field_not_the_member(client: TestClient) -> None:
    """Errors in a union field were reported as param "prompt.str" with the first member's
    message, whatever the value's shape."""
    _bad(client, "/v1/completions", {"prompt": 5}, "prompt", "expected one of str, list[str]")
    _bad(
        client, "/v1/completions", {"prompt": [-1]}, "prompt.0", "greater than or equal to 0", "-1"
    )
    _bad(client, "/v1/completions", {"prompt": ""}, "prompt", "at least 1 character")
    _bad(client, "/v1/completions", {"prompt": [[]]}, "prompt.0", "at least 1 item")
    _bad(client, "/v1/completions", {"prompt": "a", "stop": [1]}, "stop", "expected one of")
    _bad(client, "/v1/embeddings", {"input": []}, "input", "at least 1 item")
    chat = {"messages": [{"role": "user", "content": 5}]}
    _bad(client, "/v1/chat/completions", chat, "messages.0.content", "expected one of")


def test_tokenize_takes_exactly_one_of_prompt_and_messages(client: TestClient) -> None:
    """The schema said neither was required, so an empty body was schema-valid and refused."""
    _bad(client, "/tokenize", {}, "prompt", "Field required")
    both = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    _bad(client, "/tokenize", both, "prompt", "unknown field")
    msgs = {"messages": [{"role": "user", "content": "b"}]}
    assert client.post("/tokenize", json=msgs, headers=AUTH).status_code == 503


def test_openapi_schema_is_what_the_server_answers(client: TestClient) -> None:
    s = client.get("/openapi.json", headers=AUTH).json()
    assert "HTTPValidationError" not in s["components"]["schemas"]
    for path, ops in s["paths"].items():
        shape = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        for op in ops.values():
            codes = op["responses"]
            assert "422" not in codes, path
            for code, resp in codes.items():
                if code != "200" and path != "/health":
                    want = {"$ref": f"#/components/schemas/{shape}"}
                    assert resp["content"]["application/json"]["schema"] == want
    comp = s["paths"]["/v1/completions"]["post"]
    assert set(comp["responses"]) == {"200", "400", "401", "404", "413", "429", "500", "503"}
    assert set(comp["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    # embeddings queue too (the Batcher's bound: 429), but never stream
    emb = s["paths"]["/v1/embeddings"]["post"]["responses"]
    assert set(emb) == {"200", "400", "401", "404", "413", "429", "500", "503"}
    assert set(emb["200"]["content"]) == {"application/json"}
    assert "Retry-After" in emb["429"]["headers"]
    assert "429" not in s["paths"]["/tokenize"]["post"]["responses"]
    assert comp["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionBody"
    }
    assert set(s["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    body = s["components"]["schemas"]["CompletionBody"]
    assert body["additionalProperties"] is False and body["required"] == ["prompt"]
    # and the Messages API answers its errors in that shape (the model is loading: 503)
    r = client.post(
        "/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        headers=AUTH,
    )
    assert r.status_code == 503 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "overloaded_error" and r.json()["error"]["message"]


def _valid(client: TestClient, path: str, body: object) -> None:
    r = client.post(path, json=body, headers=AUTH)
    assert r.status_code == 503, r.text  # valid: it reached the route (the model is loading)


def test_null_means_not_set_for_every_optional_field(client: TestClient) -> None:
    """Many SDKs send explicit nulls for unset options: every optional field of each route
    takes null (its default applies), OpenAI fields not implemented here take null only, and
    unknown fields are still refused by name. The schema says so."""
    s = client.get("/openapi.json", headers=AUTH).json()["components"]["schemas"]
    routes = {
        "/v1/completions": ("CompletionBody", {"prompt": "hi"}),
        "/v1/chat/completions": ("ChatBody", {"messages": [{"role": "user", "content": "x"}]}),
        "/v1/embeddings": ("EmbeddingBody", {"input": "hi"}),
        "/v1/classify": ("ClassifyBody", {"input": "hi"}),
        "/v1/rerank": ("RerankBody", {"query": "q", "documents": ["d"]}),
        "/v1/responses": ("ResponsesBody", {"input": "hi"}),
    }
    for path, (name, base) in routes.items():
        optional = set(s[name]["properties"]) - set(s[name].get("required", []))
        assert optional, name
        for field in optional:
            assert "null" in str(s[name]["properties"][field]), (name, field)
        _valid(client, path, {**base, **dict.fromkeys(optional)})
    _valid(client, "/v1/chat/completions", {**routes["/v1/chat/completions"][1], "functions": None})
    _bad(
        client,
        "/v1/chat/completions",
        {**routes["/v1/chat/completions"][1], "functions": []},
        "functions",
        "deprecated form: use tools",
    )
    _valid(client, "/v1/responses", {"input": "hi", "reasoning": None, "tools": None})
    _valid(client, "/v1/responses", {"input": "hi", "tools": [], "tool_choice": "auto"})
    _bad(client, "/v1/responses", {"input": "hi", "reasoning": {}}, "reasoning", "unknown")
    _bad(client, "/v1/completions", {"prompt": "a", "frobnicate": None}, "frobnicate", "unknown")
    _bad(client, "/v1/completions", {"prompt": None}, "prompt")  # a required field stays required


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d: Path = tmp_path_factory.mktemp("tiny-loaded")
    tiny_llama(d)
    with TestClient(create_app(ServerConfig(load_spec(d / "spec.yaml")))) as c:
        for _ in range(600):
            if c.get("/health").status_code == 200:
                break
            import time

            time.sleep(0.05)
        yield c


def test_routes_without_v1_and_system_fingerprint(loaded: TestClient) -> None:
    """A client whose base URL lacks /v1 reaches the same routes (as llama-server serves
    them); responses carry a system_fingerprint that stays the same across requests."""
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    a = loaded.post("/v1/completions", json=body).json()
    b = loaded.post("/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    fp = a["system_fingerprint"]
    assert fp.startswith("fp_") and b["system_fingerprint"] == fp
    assert loaded.get("/models").json() == loaded.get("/v1/models").json()
    stream = loaded.post("/completions", json={**body, "stream": True}).text
    chunks = [line[6:] for line in stream.splitlines() if line.startswith("data: {")]
    assert chunks and all(f'"system_fingerprint":"{fp}"' in c.replace(" ", "") for c in chunks)
    paths = loaded.get("/openapi.json").json()["paths"]
    assert "/v1/completions" in paths and "/completions" not in paths  # listed once


def test_cached_tokens_report_prefix_cache_hits(loaded: TestClient) -> None:
    """``usage.prompt_tokens_details.cached_tokens``: 0 for a prompt never seen, then the
    shared full blocks' tokens for prompts that start the same way (completions and chat
    share the engine's prefix cache); /metrics counts the same tokens."""
    import re

    def cached_total() -> float:
        text = loaded.get("/metrics").text
        return float(re.search(r"^inferflow_prompt_tokens_cached_total (\S+)", text, re.M)[1])

    block = loaded.app.state.inferflow.runner.engine.cache.block_size  # type: ignore[attr-defined]
    shared = [(7 * i) % 100 + 3 for i in range(3 * block)]  # three full blocks
    before = cached_total()
    first = {"prompt": shared + [11, 12], "max_tokens": 2, "temperature": 0}
    u = loaded.post("/v1/completions", json=first).json()["usage"]
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}
    again = {**first, "prompt": shared + [13, 14, 15]}
    u = loaded.post("/v1/completions", json=again).json()["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] == 3 * block
    assert cached_total() - before == 3 * block
    # two prompts in one request: each prompt's own hits, summed
    both = {**first, "prompt": [shared + [20], [1, 2, 3]]}
    u = loaded.post("/v1/completions", json=both).json()["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] == 3 * block


def test_responses_body_names_what_it_takes(client: TestClient) -> None:
    """/v1/responses: input as text or message items (an output message passed back as input
    included); what it does not do yet is refused naming the field and the allowed values."""
    item = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant"}
    item["content"] = [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}]
    user = {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}
    _valid(client, "/v1/responses", {"input": [user, item], "metadata": {"k": "v"}})
    _valid(client, "/v1/responses", {"input": "x", "text": {"format": {"type": "text"}}})
    schema = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    _valid(client, "/v1/responses", {"input": "x", "text": schema})
    xml = {"format": {"type": "xml"}}
    _bad(client, "/v1/responses", {"input": "x", "text": xml}, "text.format.type", "json_schema")
    _bad(client, "/v1/responses", {"input": "x", "truncation": "auto"}, "truncation", "disabled")
    _bad(client, "/v1/responses", {"input": "x", "include": ["file"]}, "include.0", "logprobs")
    _bad(client, "/v1/responses", {"input": []}, "input", "at least 1")
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    done = {"type": "function_call_output", "call_id": "c", "output": "42"}
    _valid(client, "/v1/responses", {"input": [user, call, done], "tools": None})
    search = {"type": "web_search_call", "id": "w", "status": "completed"}
    _bad(client, "/v1/responses", {"input": [search]}, "input.0.type", "'message'")
    _bad(client, "/v1/responses", {"input": "x", "n": 2}, "n", "unknown")
    _bad(client, "/v1/responses", {"input": "x", "max_tokens": 5}, "max_tokens", "unknown")


def test_response_store_is_bounded_by_count_size_and_age(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store behind previous_response_id: the oldest go first past the count or the total
    size, and a response older than the age limit is gone."""
    import json

    from inferflow.server import store as store_module
    from inferflow.server.store import ResponseStore, StoreLimits

    now = [1000.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: now[0])
    msg = [{"role": "user", "content": "x" * 100}]
    one = 100 + len(json.dumps({"id": 0}))
    s = ResponseStore(StoreLimits(items=3, chars=10 * one, seconds=60))
    for i in range(5):
        s.put(f"r{i}", msg, {"id": i})
    assert [k for k in ("r0", "r1", "r2", "r3", "r4") if s.get(k)] == ["r2", "r3", "r4"]
    assert s.size == 3 * one
    s = ResponseStore(StoreLimits(items=100, chars=2 * one, seconds=60))
    for i in range(3):
        s.put(f"r{i}", msg, {"id": i})
    assert s.get("r0") is None and s.get("r1") and s.get("r2")
    s.put("big", [{"role": "user", "content": "x" * (3 * one)}], {})
    assert s.get("big") is None and s.get("r2")  # (larger than the store: not kept)
    now[0] += 61
    assert s.get("r2") is None and s.size == 0
    s.put("a", msg, {"id": 0})
    assert s.delete("a") and not s.delete("a") and s.size == 0


def test_serve_checks_the_response_store_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """``--responses-store -1`` / ``--responses-ttl 0`` fail before loading or opening a port."""
    from inferflow.cli.main import main
    from tests.conftest import smollm2_path

    smollm2_path()  # (the built-in spec names the model package's file)
    assert main(["serve", "smollm2-135m-instruct", "--responses-store", "-1"]) == 2
    assert "--responses-store: must be >= 0, got -1" in capsys.readouterr().err
    assert main(["serve", "smollm2-135m-instruct", "--responses-ttl", "0"]) == 2
    assert "--responses-ttl: seconds in (0, 86400), got 0" in capsys.readouterr().err


def test_method_not_allowed_lists_every_method_of_the_path(client: TestClient) -> None:
    """A path served by a route per method (GET and DELETE /v1/responses/{id}): a 405 names
    all of them in Allow, not only the first route's (schemathesis' Allow check)."""
    for path in ("/v1/responses/x", "/responses/x"):
        r = client.request("PUT", path, headers=AUTH)
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers
    assert client.get("/v1/completions", headers=AUTH).headers["allow"] == "POST"


def test_bad_requests_name_their_param_and_a_body_without_content_type_is_json(
    loaded: TestClient,
) -> None:
    """Every 400 caused by one field names it in ``param``; max_tokens past what the context
    leaves after the prompt is refused naming both numbers (as vLLM does), not clamped; a body
    sent without a Content-Type is read as JSON, one sent as text/plain gets a message saying
    what to send."""
    most = loaded.app.state.inferflow.max_len()  # type: ignore[attr-defined]

    def bad(body: dict, param: str, *needles: str) -> None:
        r = loaded.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        for n in needles:
            assert n in r.json()["error"]["message"], r.text

    bad({"prompt": [5] * (most - 10), "max_tokens": 20}, "max_tokens", "20", str(most - 10))
    bad({"prompt": [5] * (most + 1)}, "prompt", str(most + 1))
    bad({"prompt": [5], "top_k": 10**6}, "top_k", "vocabulary")
    bad({"prompt": [5], "max_tokens": 2**64}, "max_tokens", str(2**64))
    bad({"prompt": [5], "logit_bias": {"x": 1}}, "logit_bias")
    ok = loaded.post("/v1/completions", json={"prompt": [5] * (most - 10), "max_tokens": 10})
    assert ok.status_code == 200, ok.text
    raw = json.dumps({"prompt": [5, 6], "max_tokens": 2})
    for r in (
        loaded.post("/v1/completions", content=raw),  # (httpx sends no Content-Type for bytes)
        loaded.post("/v1/completions", content=raw, headers={"content-type": ""}),
    ):
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = loaded.post("/v1/completions", content=raw, headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.text, r.text


def test_vllm_extras_sdk_messages_and_integral_floats_are_accepted(client: TestClient) -> None:
    """vLLM's chat and completion extras are known fields (their effects: tests/test_server_vllm
    .py); an assistant message as the openai SDK dumps it (refusal, annotations, audio,
    function_call: null) goes back as it is; 2.0 is an integer, as OpenAI reads it; fields of
    OpenAI's or vLLM's APIs not served here say why, not "unknown field"."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    extras = {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "echo": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": True,
        "prompt_logprobs": 2,
        "add_special_tokens": True,
    }
    _valid(client, "/v1/chat/completions", {**chat, **extras})
    for guided in (
        {"guided_json": {"type": "object"}},
        {"guided_json": '{"type": "object"}'},
        {"guided_regex": "[ab]+"},
        {"guided_choice": ["yes", "no"]},
        {"guided_grammar": 'start: "a"'},
    ):
        _valid(client, "/v1/chat/completions", {**chat, **guided})
        _valid(client, "/v1/completions", {"prompt": "x", **guided})
    for name in ("skip_special_tokens", "include_stop_str_in_output", "add_special_tokens"):
        _valid(client, "/v1/completions", {"prompt": "x", name: False})
    dumped = {  # (openai SDK: resp.choices[0].message.model_dump())
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    _valid(client, "/v1/chat/completions", {"messages": [*chat["messages"], dumped, tool]})
    plain = {**dumped, "content": "hi", "tool_calls": None, "annotations": []}
    _valid(client, "/v1/chat/completions", {"messages": [*chat["messages"], plain]})
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
    _valid(client, "/v1/chat/completions", {"messages": [*chat["messages"], refused]})
    for field, value in (("max_tokens", 3.0), ("n", 2.0), ("top_k", 5.0), ("seed", 7.0)):
        _valid(client, "/v1/completions", {"prompt": "x", field: value})
    _valid(client, "/v1/chat/completions", {**chat, "max_completion_tokens": 4.0})
    _bad(client, "/v1/completions", {"prompt": "x", "max_tokens": 3.5}, "max_tokens", "integer")
    _bad(client, "/v1/completions", {"prompt": "x", "echo": 1.0}, "echo", "boolean")
    _bad(client, "/v1/chat/completions", {**chat, "priority": 1}, "priority", "first come")
    _bad(client, "/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "beam_width")
    _valid(client, "/v1/completions", {"prompt": "x", "best_of": None, "priority": None})
    audio = {"role": "assistant", "content": "a", "audio": {"id": "x"}}
    _bad(client, "/v1/chat/completions", {"messages": [audio]}, "messages.0.audio", "text only")


def test_cors_preflight_is_refused_by_name_unless_an_origin_is_allowed(
    client: TestClient, tmp_path: Path
) -> None:
    """CORS stays off by default; a browser's preflight gets 403 naming the flag (it was 405
    "method not allowed"), and with --cors-origin the origin is allowed."""
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    r = client.options("/v1/chat/completions", headers=pre)
    assert r.status_code == 403, r.text
    assert "--cors-origin" in r.json()["error"]["message"] and "app.example" in r.text
    tiny_llama(tmp_path)
    cfg = ServerConfig(load_spec(tmp_path / "spec.yaml"), cors_origins=("http://app.example",))
    r = TestClient(create_app(cfg)).options("/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"


def test_anthropic_messages_become_the_chat_messages_they_mean() -> None:
    """system, text, tool_use and tool_result blocks (results before the user's text, a failed
    call's marked) as chat messages; blocks in the wrong role's message are refused by name."""
    from inferflow.errors import RequestError
    from inferflow.server.anthropic import Conversation

    conv = Conversation.model_validate(
        {
            "model": "m",
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "Oslo"}},
                        {"type": "tool_use", "id": "t2", "name": "w", "input": {"c": "Rome"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "5 C"},
                        {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                         "content": [{"type": "text", "text": "timeout"}]},
                        {"type": "text", "text": "And?"},
                    ],
                },
            ],
        }
    )  # fmt: skip
    call = [
        {
            "id": f"t{i}",
            "type": "function",
            "function": {"name": "w", "arguments": f'{{"c": "{c}"}}'},
        }
        for i, c in ((1, "Oslo"), (2, "Rome"))
    ]
    assert conv.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": call,
        },
        {"role": "tool", "tool_call_id": "t1", "content": "5 C"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: timeout"},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
    ]
    wrong = {"model": "m", "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]}  # fmt: skip
    with pytest.raises(
        RequestError, match=r"messages.0.content: tool_result blocks are the user's"
    ):
        Conversation.model_validate(wrong).chat_messages()
