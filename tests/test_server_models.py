"""`inferflow serve` for the networks the continuous-batching engine does not run, as real
processes driven by the official `openai` client and raw HTTP:

- an encoder-only model (all-MiniLM-L6-v2) on /v1/embeddings: vectors against transformers
  (mean over the attention mask, L2), batched requests equal single ones, completions refused;
- an encoder-decoder model (annalog's SMILES seq2seq) on /v1/completions: greedy targets against
  the package's own PyTorch model, beam search (n best) against the in-process search (itself
  checked against transformers in tests/test_seq2seq_parity.py), streaming, stop strings,
  sampling fields refused naming the field, a source longer than the positions refused naming
  both numbers.

Plus ``Batcher`` (the server's batching of embedding / search jobs) in-process: one call per key
over all queued inputs, the bound in inputs (429), abandoned jobs leaving the bound at once,
cancelled jobs dropped, a failing group (a 500 with OpenAI's error body through the server).
"""

from __future__ import annotations

import base64
import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from inferflow.engine.scheduler import QueueFull
from inferflow.errors import Stopped
from inferflow.server.batcher import Batcher
from tests.serving import check_error, run_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


# --- Batcher, in-process ------------------------------------------------------------------------


def test_batcher_groups_by_key_and_keeps_order() -> None:
    calls: list[tuple[str, list[list[int]]]] = []

    def call(tag: str):  # noqa: ANN202
        def run(inputs: list[list[int]], stop: object) -> list[int]:
            calls.append((tag, inputs))
            return [sum(x) for x in inputs]

        return run

    b = Batcher(max_waiting=100)
    f1 = b.submit("a", [[1], [2, 3]], call("a"))
    f2 = b.submit("b", [[10]], call("b"))
    f3 = b.submit("a", [[4, 4]], call("a"))
    assert b.pending()
    b.run_pending()
    assert not b.pending()
    assert calls == [("a", [[1], [2, 3], [4, 4]]), ("b", [[10]])]  # one call per key
    assert (f1.result(), f2.result(), f3.result()) == ([1, 5], [10], [8])


def test_batcher_bound_cancel_and_failure() -> None:
    woken = []
    b = Batcher(max_waiting=3, wake=lambda: woken.append(1))
    ok = b.submit("k", [[1], [2]], lambda xs, stop: [len(x) for x in xs])
    with pytest.raises(QueueFull, match="2 of 3 inputs"):
        b.submit("k", [[1], [2]], lambda xs, stop: xs)
    gone = b.submit("k", [[3]], lambda xs, stop: [len(x) for x in xs])
    with pytest.raises(QueueFull, match="3 of 3 inputs"):
        b.submit("k", [[4]], lambda xs, stop: xs)
    b.abandon(gone)  # its client went away before the model thread took it: its input leaves
    assert gone.cancelled() and b.waiting == 2 and len(b.jobs) == 1
    late = b.submit("k", [[4]], lambda xs, stop: [len(x) for x in xs])  # fits again
    b.run_pending()
    assert ok.result() == [1, 1] and late.result() == [1] and b.waiting == 0 and len(woken) == 3
    # a request larger than the bound still runs when nothing else waits
    big = b.submit("k", [[1]] * 5, lambda xs, stop: [0] * len(xs))
    b.run_pending()
    assert big.result() == [0] * 5
    dropped = b.submit("k", [[5]], lambda xs, stop: [len(x) for x in xs])
    assert dropped.cancel()  # a future cancelled directly (not abandoned): dropped unrun
    b.run_pending()
    assert dropped.cancelled()

    def boom(xs: list[list[int]], stop: object) -> list[int]:
        raise ValueError("bad group")

    bad = b.submit("x", [[1]], boom)
    fine = b.submit("y", [[1]], lambda xs, stop: [7])
    b.run_pending()
    with pytest.raises(ValueError, match="bad group"):
        bad.result()
    assert fine.result() == [7]  # another key's group is not affected


def test_batcher_stops_a_running_call_once_every_client_left() -> None:
    """A running call's stop check turns True only when every job it serves is abandoned; the
    call then ends with Stopped and the futures carry it."""
    b = Batcher(max_waiting=100)
    seen: list[bool] = []
    futures: list = []

    def call(xs: list[list[int]], stop) -> list[int]:  # noqa: ANN001
        seen.append(stop())
        b.abandon(futures[0])  # the first client leaves while its job runs
        seen.append(stop())
        b.abandon(futures[1])  # and the second
        seen.append(stop())
        if stop():
            raise Stopped("stopped")
        return [0] * len(xs)

    futures += [b.submit("s", [[1]], call), b.submit("s", [[2]], call)]
    b.run_pending()
    assert seen == [False, False, True]
    for f in futures:
        with pytest.raises(Stopped):
            f.result()
    assert not b.abandoned  # nothing kept for finished jobs
    kept = b.submit("s", [[3]], lambda xs, stop: [int(stop())])
    b.run_pending()
    b.abandon(kept)  # after it finished: no effect
    assert kept.result() == [0] and not b.abandoned


def test_runner_stops_a_running_batch_when_its_client_disconnects() -> None:
    """The server path: a batched call already running on the model thread sees its stop check
    turn True once the request's client is gone (until_disconnect cancels the request, and
    EngineRunner.batch abandons the job), so it ends early instead of running on."""
    import asyncio
    import threading

    from inferflow.server.metrics import Metrics
    from inferflow.server.runner import ClientGone, EngineRunner, until_disconnect

    started, stopped = threading.Event(), threading.Event()

    def long_call(xs: list[list[int]], stop) -> list[int]:  # noqa: ANN001
        started.set()
        for _ in range(500):  # at most 10 s
            if stop():
                stopped.set()
                raise Stopped("stopped")
            threading.Event().wait(0.02)
        return [0] * len(xs)

    async def scenario() -> None:
        runner = EngineRunner(None, Metrics(), max_waiting=8)
        runner.start(asyncio.get_running_loop())

        async def gone() -> bool:
            return started.is_set()  # the client leaves once its call runs

        with pytest.raises(ClientGone):
            await until_disconnect(runner.batch("k", [[1]], long_call), gone)
        await asyncio.get_running_loop().run_in_executor(None, stopped.wait, 5)
        runner.stop()

    asyncio.run(scenario())
    assert stopped.is_set()


def test_the_loaded_model_is_out_of_the_collectors_way_while_serving(tmp_path) -> None:  # noqa: ANN001
    """What the server loads lives as long as it does: frozen out of the garbage collector's
    generations once loaded (a full collection while serving walked SmolLM2's ~230k objects, ~130
    ms holding the GIL), back in them after shutdown (a process that serves again, or a test
    process, frees what it no longer uses)."""
    import gc
    import time

    from fastapi.testclient import TestClient

    from inferflow.server.app import ServerConfig, create_app
    from inferflow.spec import load_spec
    from tests.conftest import tiny_llama

    tiny_llama(tmp_path)
    app = create_app(ServerConfig(load_spec(tmp_path / "spec.yaml")))
    assert gc.get_freeze_count() == 0
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        model = app.state.inferflow.lm.model
        assert gc.get_freeze_count() > 0
        assert not any(o is model for o in gc.get_objects())  # (the generations only)
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert gc.get_freeze_count() == 0
    assert any(o is model for o in gc.get_objects())


def test_a_load_that_ends_after_shutdown_starts_nothing_and_freezes_nothing(tmp_path) -> None:  # noqa: ANN001
    """The load runs in a thread of its own: where the server stopped before it ended (a quick
    Ctrl-C, a test's client closed early), it neither starts an engine thread nor freezes what
    it made (nothing would ever unfreeze it)."""
    import asyncio
    import gc

    from inferflow.server.state import ServerConfig, ServerState
    from inferflow.spec import load_spec
    from tests.conftest import tiny_llama

    tiny_llama(tmp_path)
    state = ServerState(ServerConfig(load_spec(tmp_path / "spec.yaml")))
    state.close()  # (before the load ends)
    loop = asyncio.new_event_loop()
    try:
        state.load(loop)
    finally:
        loop.close()
    assert state.runner is None and state.lm is None and state.load_error is None
    assert gc.get_freeze_count() == 0


def test_a_failed_batched_call_answers_openai_500_and_a_bad_request_400() -> None:
    """A batched call that fails with anything but an InferflowError is a 500 with OpenAI's
    error body (EngineRunner.batch turns it into ModelFailed; it was a plain-text 500 with the
    exception unhandled); an InferflowError (a bad request found by the call) stays a 400."""
    import asyncio
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from inferflow.errors import RequestError
    from inferflow.server.guard import install_error_handlers
    from inferflow.server.metrics import Metrics
    from inferflow.server.runner import EngineRunner

    runner = EngineRunner(None, Metrics(), max_waiting=8)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        runner.start(asyncio.get_running_loop())
        yield
        runner.stop()

    def broken(xs: list[list[int]], stop: object) -> list[int]:
        raise RuntimeError("CUDA error: an internal detail")

    def refused(xs: list[list[int]], stop: object) -> list[int]:
        raise RequestError("input 0: too long")

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/broken")
    async def run_broken() -> list[int]:
        return await runner.batch("b", [[1]], broken)

    @app.post("/refused")
    async def run_refused() -> list[int]:
        return await runner.batch("r", [[1]], refused)

    @app.post("/fine")
    async def run_fine() -> list[int]:
        return await runner.batch("f", [[1], [2, 3]], lambda xs, stop: [len(x) for x in xs])

    with TestClient(app) as client:
        r = client.post("/broken")
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and set(err) == {"message", "type", "param", "code"}
        assert "RuntimeError" in err["message"] and "internal detail" not in err["message"]
        r = client.post("/refused")
        assert r.status_code == 400 and r.json()["error"]["message"] == "input 0: too long"
        assert client.post("/fine").json() == [1, 2]  # the runner goes on serving


# --- an encoder-only model ----------------------------------------------------------------------

MINILM = "all-minilm-l6-v2"
SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the stage while the crowd sings along.",
    "¿Dónde está la biblioteca? 東京は日本の首都です。",
]


@pytest.fixture(scope="module")
def minilm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.test_embed import minilm_dir

    minilm_dir()  # skips when the model package is missing
    with run_server(tmp_path_factory.mktemp("minilm"), spec=MINILM) as (url, _):
        yield url


def _minilm_reference(texts: list[str]) -> np.ndarray:
    """sentence-transformers' pipeline in transformers: mean over the mask, L2."""
    tf = pytest.importorskip("transformers")
    from tests.test_embed import minilm_dir

    d = minilm_dir()
    tok = tf.AutoTokenizer.from_pretrained(d)
    model = tf.AutoModel.from_pretrained(d).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    mask = enc["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1).numpy()


@pytest.mark.slow
def test_encoder_only_embeddings_match_transformers(minilm_url: str) -> None:
    client = openai.OpenAI(base_url=f"{minilm_url}/v1", api_key="unused", max_retries=0)
    r = client.embeddings.create(model=MINILM, input=SENTENCES)
    got = np.array([d.embedding for d in r.data])
    want = _minilm_reference(SENTENCES)
    assert got.shape == (len(SENTENCES), 384) and [d.index for d in r.data] == [0, 1, 2, 3]
    cos = (got * want).sum(-1)  # both unit vectors: the spec's normalize (on by default)
    assert cos.min() >= 0.9999, cos
    assert np.allclose(np.linalg.norm(got, axis=-1), 1, atol=1e-5)
    tokens = httpx.post(f"{minilm_url}/tokenize", json={"prompt": SENTENCES[1]}).json()
    assert r.usage.prompt_tokens == sum(
        httpx.post(f"{minilm_url}/tokenize", json={"prompt": s}).json()["count"] for s in SENTENCES
    )
    assert tokens["max_model_len"] == 512  # the network's positions (no engine, no KV cache)
    # token ids and base64 give the same vectors
    raw = httpx.post(
        f"{minilm_url}/v1/embeddings",
        json={"input": [tokens["tokens"]], "encoding_format": "base64"},
    ).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, got[1], atol=1e-6)
    models = httpx.get(f"{minilm_url}/v1/models").json()["data"]
    assert models[0]["id"] == MINILM and models[0]["max_model_len"] == 512


@pytest.mark.slow
def test_encoder_only_concurrent_requests_equal_single(minilm_url: str) -> None:
    """Requests that arrive together share forward passes (Batcher); each still gets exactly
    its own inputs' vectors, in order."""

    def one(i: int) -> list[list[float]]:
        texts = [SENTENCES[(i + k) % len(SENTENCES)] for k in range(1 + i % 3)]
        r = httpx.post(f"{minilm_url}/v1/embeddings", json={"input": texts}, timeout=60)
        assert r.status_code == 200, r.text
        return [d["embedding"] for d in r.json()["data"]]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(24)))
    single = np.array(
        [
            httpx.post(f"{minilm_url}/v1/embeddings", json={"input": s}).json()["data"][0][
                "embedding"
            ]
            for s in SENTENCES
        ]
    )
    for i, vecs in enumerate(results):
        for k, v in enumerate(vecs):
            assert np.allclose(v, single[(i + k) % len(SENTENCES)], atol=1e-5)


@pytest.mark.slow
def test_encoder_only_refuses_generation(minilm_url: str) -> None:
    r = httpx.post(f"{minilm_url}/v1/completions", json={"prompt": "hi"})
    check_error(r, 400, "encoder_only", "/v1/embeddings")
    assert r.json()["error"]["param"] == "model"
    r = httpx.post(
        f"{minilm_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    check_error(r, 400, "encoder_only", "not chat completions")
    long = " ".join(["word"] * 600)
    check_error(
        httpx.post(f"{minilm_url}/v1/embeddings", json={"input": ["ok", long]}),
        400,
        "input 1 has",
        "at most 512",
    )
    check_error(
        httpx.post(f"{minilm_url}/v1/embeddings", json={"input": "x", "dimensions": 10}),
        400,
        "384",
    )


# --- an encoder-decoder model -------------------------------------------------------------------

ANNALOG = "annalog-smiles"
SMILES = ["CCO", "c1ccccc1O", "CC(=O)Nc1ccc(O)cc1", "Clc1ccc(Br)cc1"]


def _need_annalog() -> None:
    # (found, not imported: the package's modules import rdkit and partialsmiles)
    if importlib.util.find_spec("annalog") is None:
        pytest.skip("annalog is not installed (python tools/fetch_models.py annalog)")


@pytest.fixture(scope="module")
def annalog_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _need_annalog()
    with run_server(tmp_path_factory.mktemp("annalog"), spec=ANNALOG) as (url, _):
        yield url


@pytest.fixture(scope="module")
def annalog_lm():  # noqa: ANN201
    _need_annalog()
    from inferflow.runtime import load

    return load(ANNALOG)


@pytest.mark.slow
def test_encoder_decoder_greedy_matches_package(annalog_url: str) -> None:
    """The package's own model, greedy (tests/test_annalog.py's reference): each source's target
    text, finish reason "stop" at its <eos>."""
    from tests.test_annalog import load_package, package_greedy, package_source_ids

    package = load_package()
    client = openai.OpenAI(base_url=f"{annalog_url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=ANNALOG, prompt=SMILES, max_tokens=101)
    assert r.object == "text_completion" and len(r.choices) == len(SMILES)
    itos = package["trg"].vocab.itos
    generated = 0
    for i, (smiles, c) in enumerate(zip(SMILES, r.choices, strict=True)):
        src = package_source_ids(package, smiles)
        ys, _ = package_greedy(package, src)
        assert c.index == i
        assert c.text == "".join(itos[t] for t in ys[1:] if t > 3), smiles
        assert c.finish_reason == ("stop" if ys[-1] == 3 else "length")
        generated += len(ys) - 1
    assert r.usage.completion_tokens == generated
    assert r.usage.total_tokens == r.usage.prompt_tokens + generated


@pytest.mark.slow
def test_encoder_decoder_beams_stream_and_stop(annalog_url: str, annalog_lm) -> None:  # noqa: ANN001
    from inferflow.engine.search import SearchParams

    client = openai.OpenAI(base_url=f"{annalog_url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model=ANNALOG, prompt=SMILES[:2], n=2, max_tokens=60, extra_body={"beam_width": 4}
    )
    sources = [annalog_lm.encode_source(s) for s in SMILES[:2]]
    want = annalog_lm.search(sources, SearchParams(beam_width=4, num_return=2, max_new_tokens=60))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, hs in enumerate(want):
        for j, h in enumerate(hs):
            tokens = h.tokens[:-1] if h.ended else h.tokens
            assert r.choices[2 * i + j].text == annalog_lm.decode_target(tokens)
    assert r.choices[0].text != r.choices[1].text  # two different beams
    # streaming: the same texts, then the usage, then [DONE]
    body = {
        "prompt": SMILES[:2],
        "n": 2,
        "max_tokens": 60,
        "beam_width": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{annalog_url}/v1/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in chunks if c["choices"]}
    assert texts == {c.index: c.text for c in r.choices}
    assert chunks[-1]["usage"] == r.usage.model_dump(exclude_none=True)
    # a stop string cuts the text before it, finish reason "stop"
    full = client.completions.create(model=ANNALOG, prompt="CC(=O)Nc1ccc(O)cc1", max_tokens=60)
    text = full.choices[0].text
    assert "(" in text
    cut = client.completions.create(
        model=ANNALOG, prompt="CC(=O)Nc1ccc(O)cc1", max_tokens=60, stop="("
    )
    assert cut.choices[0].text == text[: text.index("(")]
    assert cut.choices[0].finish_reason == "stop"
    # max_tokens cuts the search: finish reason "length"
    short = client.completions.create(model=ANNALOG, prompt="CC(=O)Nc1ccc(O)cc1", max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


@pytest.mark.slow
def test_encoder_decoder_concurrent_requests_equal_single(annalog_url: str) -> None:
    def one(smiles: str) -> str:
        r = httpx.post(
            f"{annalog_url}/v1/completions",
            json={"prompt": smiles, "max_tokens": 60},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    single = [one(s) for s in SMILES]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, SMILES * 4))
    assert together == single * 4


@pytest.mark.slow
def test_encoder_decoder_errors(annalog_url: str) -> None:
    url = f"{annalog_url}/v1/completions"
    for field, value in (
        ("temperature", 0.7),
        ("top_p", 0.5),
        ("presence_penalty", 0.5),
        ("logprobs", 1),
        ("logit_bias", {"5": 1.0}),
    ):
        r = httpx.post(url, json={"prompt": "CCO", field: value})
        check_error(r, 400, field, "encoder_decoder", "beam_width")
    # neutral values and seed / user are accepted (the search is deterministic)
    r = httpx.post(url, json={"prompt": "CCO", "temperature": 0, "top_p": 1, "seed": 3})
    assert r.status_code == 200, r.text
    check_error(
        httpx.post(url, json={"prompt": "C" * 150}), 400, "prompt 0 has 152 tokens", "at most 102"
    )
    check_error(httpx.post(url, json={"prompt": [[2, 99, 3]]}), 400, "99", "0..58")
    r = httpx.post(
        f"{annalog_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "C"}]}
    )
    check_error(r, 400, "encoder_decoder", "no chat template", "/v1/completions")
    check_error(httpx.post(f"{annalog_url}/v1/embeddings", json={"input": "CCO"}), 400, "pooling")
    assert httpx.get(f"{annalog_url}/health").status_code == 200


@pytest.mark.slow
def test_encoder_decoder_disconnect_stops_the_search(annalog_url: str) -> None:
    """A client that gives up before its search returns: the search stops (or never starts),
    so the next request is answered long before the abandoned one would have finished. That
    search (64 sources x 32 beams, min_tokens forcing all 100 steps) takes over 3 minutes on a
    2-core CPU; stopped, the next answer comes in seconds (1.5-4 s on a loaded 2-core machine)."""
    sources = ["CC(C)Cc1ccc(cc1)[C@@H](C)C(=O)O"] * 64
    body = {"prompt": sources, "max_tokens": 100, "min_tokens": 100, "n": 8, "beam_width": 32}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{annalog_url}/v1/completions", json=body, timeout=0.05)
    r = httpx.post(f"{annalog_url}/v1/completions", json={"prompt": "CCO"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
