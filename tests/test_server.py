"""`inferflow serve` as a real process on a free localhost port, driven by the official `openai`
client and by raw HTTP for every error path. Outputs are checked against transformers running
the same GGUF (greedy text, logprobs, embeddings, chat template) — not against the server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import smollm2_path
from tests.serving import NAME, greedy, smollm2_transformers
from tests.serving import check_error as _err
from tests.serving import metric as _metric
from tests.serving import run_server as _server
from tests.serving import wait_for as _wait_for

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
tf = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def served_from(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("srv")  # (the server's log is written here)


@pytest.fixture(scope="module")
def url(served_from: Path) -> Iterator[str]:
    smollm2_path()  # skips when the model package is missing
    with _server(served_from, "--quant", "none") as (u, _):
        yield u


@pytest.fixture(scope="module")
def client(url: str):  # noqa: ANN201
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf():  # noqa: ANN201
    return smollm2_transformers()


def test_completion_greedy_text_and_logprobs_match_transformers(client, hf) -> None:  # noqa: ANN001
    model, tok = hf
    prompt = "The capital of France is"
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3
    )
    ids = tok(prompt)["input_ids"]
    want = greedy(hf, ids, 12)
    c = r.choices[0]
    assert c.text == tok.decode(want, skip_special_tokens=True)
    assert c.finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(ids) and r.object == "text_completion" and r.id
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    top = torch.topk(lp, 3)
    got = c.logprobs.top_logprobs[0]
    assert len(got) == 3 and c.logprobs.token_logprobs[0] == pytest.approx(
        float(top.values[0]), abs=1e-3
    )
    for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert got[tok.decode([t])] == pytest.approx(v, abs=1e-3)


def test_chat_stream_equals_non_stream_and_template_matches(client, hf, url) -> None:  # noqa: ANN001
    _, tok = hf
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name an ocean."},
        {"role": "assistant", "content": "The Pacific."},
        {"role": "user", "content": "Another one?"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want_ids = tok(text, add_special_tokens=False)["input_ids"]
    got = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert got["tokens"] == list(want_ids)
    kw = dict(model=NAME, messages=messages, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    want = tok.decode(greedy(hf, list(want_ids), 16), skip_special_tokens=True)
    assert full.choices[0].message.content == want
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_sequence_cuts_the_greedy_text(client) -> None:  # noqa: ANN001
    kw = dict(model=NAME, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert " 7" in free
    r = client.completions.create(**kw, stop=[" 7", "never"])
    assert r.choices[0].text == free[: free.index(" 7")] and r.choices[0].finish_reason == "stop"
    s = client.completions.create(**kw, stop=" 7", stream=True)
    assert "".join(ch.choices[0].text for ch in s) == r.choices[0].text


def test_n2_and_seed_reproducibility(client) -> None:  # noqa: ANN001
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=1.0, n=2, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # sample i draws with seed + i
    c = client.completions.create(**{**kw, "seed": 8})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    assert a.usage.completion_tokens == 32
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=8,
        seed=1,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices) == 2
    entries = chat.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in entries)


def test_embeddings_match_transformers_mean_pooling(client, hf) -> None:  # noqa: ANN001
    model, tok = hf
    texts = ["The sea is calm tonight.", "def add(a, b): return a + b"]
    r = client.embeddings.create(model=NAME, input=texts)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
    for text, d in zip(texts, r.data, strict=True):
        with torch.no_grad():
            h = model.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0]
        want = torch.nn.functional.normalize(h.mean(0), dim=0)
        got = torch.tensor(d.embedding)
        assert got.shape == want.shape
        assert float(got @ want) > 0.9999


def test_models_tokenize_detokenize_metrics(client, hf, url) -> None:  # noqa: ANN001
    _, tok = hf
    (card,) = client.models.list().data
    assert card.id == NAME and card.owned_by == "inferflow"
    text = "Hello, world! Ünïcödé"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]
    assert ids == tok(text)["input_ids"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"] == text
    client.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0)
    m = httpx.get(f"{url}/metrics").text
    for name in (
        "inferflow_requests_running",
        "inferflow_requests_waiting",
        "inferflow_kv_cache_usage_ratio",
        "inferflow_prompt_tokens_total",
        "inferflow_generation_tokens_total",
        "inferflow_time_to_first_token_seconds_bucket",
        "inferflow_inter_token_latency_seconds_bucket",
    ):
        assert name in m, name
    gen = [ln for ln in m.splitlines() if ln.startswith("inferflow_generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0


def test_error_paths(url) -> None:
    post = lambda path, **kw: httpx.post(f"{url}{path}", timeout=30, **kw)  # noqa: E731
    base = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    _err(
        post("/v1/completions", json={**base, "frobnicate": 1}), 400, "frobnicate", "unknown field"
    )
    _err(post("/v1/completions", json={**base, "max_tokens": "many"}), 400, "max_tokens")
    _err(post("/v1/completions", json={**base, "top_p": 0}), 400, "top_p")
    _err(post("/v1/completions", json={**base, "model": "gpt-4"}), 404, "gpt-4", NAME)
    _err(post("/v1/completions", json={**base, "prompt": [5] * 9000}), 400, "9000", "8192")
    _err(post("/v1/completions", json={**base, "prompt": []}), 400, "prompt", "at least 1")
    _err(post("/v1/completions", json={**base, "prompt": [10**7]}), 400, "outside the vocabulary")
    _err(post("/v1/completions", json={**base, "logit_bias": {"abc": 1}}), 400, "logit_bias")
    _err(
        post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
        400,
    )
    _err(post("/v1/completions", json={"model": NAME}), 400, "prompt")
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}]}
    _err(post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400, "logprobs")
    _err(
        post(
            "/v1/chat/completions", json={**chat, "messages": [{"role": "wizard", "content": "x"}]}
        ),
        400,
        "role",
    )
    _err(post("/v1/chat/completions", json={**chat, "messages": []}), 400, "messages")
    _err(post("/detokenize", json={"tokens": [-1]}), 400, "outside the vocabulary")
    _err(httpx.get(f"{url}/v1/nothing"), 404)


def test_limits_auth_queue_and_disconnects(tmp_path: Path) -> None:
    smollm2_path()
    args = (
        "--api-key",
        KEY,
        "--max-running",
        "1",
        "--max-waiting",
        "1",
        "--max-body-bytes",
        "4096",
    )
    with _server(tmp_path, *args) as (url, proc):
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{url}/health").status_code == 200  # open without the key
        _err(httpx.get(f"{url}/v1/models"), 401, "API key")
        _err(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200
        big = {"model": NAME, "prompt": "x " * 4000}
        _err(httpx.post(f"{url}/v1/completions", json=big, headers=auth), 413, "limit")

        def chunked():  # noqa: ANN202  (no Content-Length: the limit applies while reading)
            yield json.dumps(big).encode()

        _err(
            httpx.post(
                f"{url}/v1/completions",
                content=chunked(),
                headers={**auth, "content-type": "application/json"},
            ),
            413,
        )

        free0 = _metric(url, "inferflow_kv_cache_free_blocks", auth)
        long = {
            "model": NAME,
            "prompt": "Tell me a story.",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(headers=auth, timeout=60) as c1,
            httpx.Client(headers=auth, timeout=60) as c2,
        ):
            with c1.stream("POST", f"{url}/v1/completions", json=long) as s1:
                lines1 = s1.iter_lines()  # (held: a dropped iterator closes the connection)
                next(lines1)  # the first request is running
                with c2.stream("POST", f"{url}/v1/completions", json=long) as s2:
                    assert s2.status_code == 200  # waiting (max_running 1)
                    r = httpx.post(f"{url}/v1/completions", json=long, headers=auth)
                    _err(r, 429, "queue is full")
                    assert r.headers["retry-after"] == "1"
                    assert _metric(url, "inferflow_kv_cache_free_blocks", auth) < free0
            # both streams closed by the client mid-generation: aborted, blocks back
        assert _wait_for(lambda: _metric(url, "inferflow_kv_cache_free_blocks", auth) == free0)
        assert _metric(url, "inferflow_requests_running", auth) == 0
        # a non-streaming request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/completions", json={**long, "stream": False}, headers=auth, timeout=1.0
            )
        assert _wait_for(lambda: _metric(url, "inferflow_kv_cache_free_blocks", auth) == free0)
        assert _wait_for(lambda: _metric(url, "inferflow_requests_running", auth) == 0)
        aborts = 'inferflow_request_finished_total{finish_reason="abort"}'
        # (waited for: the free-block and running gauges were already back before the plain
        # request reached the engine, on a loaded machine)
        assert _wait_for(lambda: _metric(url, aborts, auth) == 3)  # two streams, one plain
        # graceful shutdown with a request in flight: it ends, the process exits cleanly
        with httpx.Client(headers=auth, timeout=60) as c:
            with c.stream("POST", f"{url}/v1/completions", json={**long, "max_tokens": 60}) as s:
                lines = s.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGINT)
                rest = list(lines)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert proc.wait(30) == 0


def test_beam_search_extra_field_matches_transformers(client, hf) -> None:  # noqa: ANN001
    model, tok = hf
    prompt = "The best way to learn a language is"
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=8, n=2, extra_body={"beam_width": 3}
    )
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=8,
            early_stopping=True,
            top_p=None,
            top_k=None,
        )
    want = [tok.decode(s[len(ids) :], skip_special_tokens=True) for s in out]
    assert [c.text for c in r.choices] == want


def test_every_sampling_field_reaches_sampling_params() -> None:
    """The body -> SamplingParams table misses no field and names only real parameters."""
    import dataclasses

    from inferflow.engine.sampling import SamplingParams
    from inferflow.server.protocol import SAME_NAME, SPEC_DEFAULTED, SamplingBody

    by_hand = {"model", "max_tokens", "stream", "stream_options", "user", "stop", "logit_bias"}
    by_hand |= {"min_tokens", "stop_token_ids", "n", "response_format", "structured_outputs"}
    by_hand |= {"cache_salt"}  # (with the API key, to SamplingParams.cache_salt: ServerState.start)
    by_hand |= {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}  # (constraint)
    by_hand |= {"request_id", "return_token_ids"}  # (the response's id, its token ids: Generation)
    assert set(SamplingBody.model_fields) - by_hand == {*SAME_NAME, *SPEC_DEFAULTED}
    assert {*SAME_NAME, *SPEC_DEFAULTED} <= {f.name for f in dataclasses.fields(SamplingParams)}


def test_startup_says_what_loads_and_when_it_is_ready(url: str, served_from: Path) -> None:
    """At the default log level: the file, its format and size as loading starts, then one line
    with the load time, the peak RSS and the URL once requests can be served (issue 28)."""
    text = next(served_from.glob("server-*.log")).read_text()
    loading = re.search(r"loading \S+: (\S+) \(gguf, (\d+) MiB\)", text)
    assert loading and loading.group(1).endswith(".gguf")
    assert int(loading.group(2)) == round(Path(loading.group(1)).stat().st_size / 2**20)
    ready = re.findall(r"loaded in [\d.]+ s \(peak RSS \d+ MiB\); ready on (\S+)", text)
    assert ready == [url]
    assert text.index("loading") < text.index("ready on")


# --- the Responses API ---------------------------------------------------------------------


def _templated(hf, messages: list[dict]) -> list[int]:  # noqa: ANN001
    _, tok = hf
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _reply(hf, messages: list[dict], n: int) -> str:  # noqa: ANN001
    """transformers' greedy reply to ``messages`` (at most ``n`` tokens, EOS cut)."""
    _, tok = hf
    return tok.decode(greedy(hf, _templated(hf, messages), n), skip_special_tokens=True)


def test_responses_create_and_multi_turn_match_transformers(client, hf) -> None:  # noqa: ANN001
    """``client.responses.create``: instructions as the system message, the text is
    transformers' greedy reply through the chat template; ``previous_response_id`` continues
    the stored conversation (the earlier instructions are not carried, as OpenAI does);
    retrieve / delete; an unknown id is a 400 naming the field."""
    first = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi."}]
    r = client.responses.create(
        model=NAME, input="Say hi.", instructions="Be terse.", max_output_tokens=40, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == _reply(hf, first, 40)
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.instructions == "Be terse." and r.max_output_tokens == 40
    assert r.usage.input_tokens == len(_templated(hf, first))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the second turn: the stored user message and reply, then the new input (a message item)
    r2 = client.responses.create(
        model=NAME,
        input=[{"role": "user", "content": "And in French?"}],
        previous_response_id=r.id,
        max_output_tokens=24,
        temperature=0,
    )
    turns = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "And in French?"},
    ]
    assert r2.previous_response_id == r.id and r2.instructions is None
    assert r2.output_text == _reply(hf, turns, 24)
    assert r2.usage.input_tokens == len(_templated(hf, turns))
    # the same turns sent as chat completions give the same text (one engine path)
    chat = client.chat.completions.create(model=NAME, messages=turns, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == r2.output_text
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="x", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and r.id in e.value.body["message"]
    # per-token logprobs on request, as transformers computes them for the first token
    model, tok = hf
    lp = (
        client.responses.create(
            model=NAME,
            input="Say hi.",
            max_output_tokens=4,
            temperature=0,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
        )
        .output[0]
        .content[0]
        .logprobs
    )
    ids = _templated(hf, [{"role": "user", "content": "Say hi."}])
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1).topk(2)
    assert len(lp) == 4 and [len(x.top_logprobs) for x in lp] == [2] * 4
    assert lp[0].token == tok.decode([int(want.indices[0])])
    assert [t.logprob for t in lp[0].top_logprobs] == pytest.approx(want.values.tolist(), abs=1e-3)
    unstored = client.responses.create(model=NAME, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_stream_events_and_final_object(client, hf) -> None:  # noqa: ANN001
    """``client.responses.stream``: the event sequence OpenAI sends (created, in_progress, the
    item and its part added, text deltas, then done events and completed), sequence numbers
    0, 1, 2, ...; the deltas add up to the final object's text, which equals the non-streamed
    one; a reply cut by max_output_tokens ends with response.incomplete."""
    kw = dict(model=NAME, input="What is 2+2? Answer with one number.", temperature=0)
    with client.responses.stream(**kw, max_output_tokens=40) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    text = "".join(e.delta for e in deltas)
    messages = [{"role": "user", "content": kw["input"]}]
    assert text == final.output_text == _reply(hf, messages, 40)
    assert final.status == "completed" and final.usage.output_tokens > 0
    again = client.responses.create(**kw, max_output_tokens=40)
    assert again.output_text == text
    # the same prompt again: all its full KV blocks (16 tokens each) come from the prefix cache
    # (the first time, only those of the template's system prompt that earlier tests sent)
    full = again.usage.input_tokens // 16 * 16
    assert final.usage.input_tokens_details.cached_tokens < full
    assert again.usage.input_tokens_details.cached_tokens == full
    # cut short: incomplete, with the reason
    with client.responses.stream(**kw, max_output_tokens=3) as s:
        events = list(s)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 3
    assert last.response.output[0].content[0].text == _reply(hf, messages, 3)


def test_echo_logprobs_score_the_prompt_as_transformers(client, hf, url) -> None:  # noqa: ANN001
    """``echo`` + ``logprobs`` (what lm-evaluation-harness's local-completions scores): the
    choice holds the prompt's tokens and their teacher-forced log-probabilities, equal to
    transformers' fp32 log-softmax within 1e-4, then the generated token's; ``max_tokens: 0``
    scores the prompt alone; vLLM's ``prompt_logprobs`` gives ranks; streamed, the prompt part
    comes first."""
    model, tok = hf
    prompt = "The capital of France is Paris, and the capital of Spain is"
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.logprobs.tokens) == len(ids) + 1
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    got = torch.tensor(c.logprobs.token_logprobs[1 : len(ids)])
    assert (got - want).abs().max() < 1e-4
    assert c.logprobs.token_logprobs[-1] == pytest.approx(float(lp[-1].max()), abs=1e-3)
    for j in range(1, len(ids)):  # the 2 most likely, the prompt's own token added
        top = c.logprobs.top_logprobs[j]
        best = [tok.decode([int(t)]) for t in lp[j - 1].topk(2).indices]
        assert set(best) <= set(top) and tok.decode([ids[j]]) in top
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    # max_tokens 0: the prompt scored, nothing generated; prompt_logprobs with ranks
    raw = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs": 1},
    ).json()
    zero = raw["choices"][0]
    assert zero["text"] == tok.decode(ids) and raw["usage"]["completion_tokens"] == 0
    assert torch.tensor(zero["logprobs"]["token_logprobs"][1:]).sub(want).abs().max() < 1e-4
    ranks = [e[str(t)]["rank"] for e, t in zip(zero["prompt_logprobs"][1:], ids[1:], strict=True)]
    assert ranks == [int((row > row[t]).sum()) + 1 for row, t in zip(lp[:-1], ids[1:], strict=True)]
    _err(httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "echo")
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=2, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == prompt
    two = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert "".join(ch.choices[0].text for ch in chunks) == prompt + two.choices[0].text


def test_lm_evaluation_harness_scores_a_local_task(url, hf, tmp_path: Path) -> None:  # noqa: ANN001
    """lm-evaluation-harness's ``local-completions`` (tokenizer_backend=remote: /tokenizer_info,
    /tokenize, /detokenize) runs a multiple-choice task written here (a task YAML over a JSON
    file; no hub access) against the server: every choice's log-likelihood equals transformers'
    teacher-forced sum within 1e-3, and the reported accuracy is transformers' argmax's."""
    pytest.importorskip("lm_eval")
    model, tok = hf
    docs = [
        ("The capital of France is", ["Paris", "Rome", "Berlin"], 0),
        ("The capital of Italy is", ["Madrid", "Rome", "Paris"], 1),
        ("Two plus two equals", ["seven", "four", "ten"], 1),
        ("The sun rises in the", ["west", "north", "east"], 2),
        ("Water freezes at zero degrees", ["Celsius", "Kelvin"], 0),
        ("The opposite of hot is", ["cold", "warm", "loud"], 0),
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in docs)
    )
    (tmp_path / "task.yaml").write_text(
        "task: inferflow_local\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: '{data}'}}}}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list: [{metric: acc}]\n"
    )
    args = f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1"
    out = tmp_path / "out"
    cache = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [
            *(sys.executable, "-m", "lm_eval", "--model", "local-completions"),
            *("--model_args", args, "--tasks", "inferflow_local"),
            *("--include_path", str(tmp_path), "--output_path", str(out), "--log_samples"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **cache},
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_inferflow_local_*.jsonl")
    right = 0
    for line, (q, choices, answer) in zip(samples.read_text().splitlines(), docs, strict=True):
        got = [float(resp[0][0]) for resp in json.loads(line)["resps"]]
        want = []
        for choice in choices:  # lm-eval's split: context tokens, then the rest
            ctx = tok(q, add_special_tokens=False)["input_ids"]
            whole = tok(q + " " + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            cont = torch.tensor(whole[len(ctx) :])
            want.append(float(lp[len(ctx) - 1 : -1].gather(1, cont[:, None]).sum()))
        assert got == pytest.approx(want, abs=1e-3), (q, got, want)
        right += max(range(len(want)), key=want.__getitem__) == answer
    acc = json.loads(results.read_text())["results"]["inferflow_local"]["acc,none"]
    assert acc == pytest.approx(right / len(docs))
