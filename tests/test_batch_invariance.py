"""Batch invariance on the real models with their quantized blocks kept (the defaults): a
request's tokens and log-probabilities are the same bits whether it runs alone or among 16
others, arriving together, chunked differently, sharing a cached prompt prefix or not.

The references are the same requests run alone (a fresh engine each). What makes it hold:
QuantLinear's planes give each row the same operations whatever the rows beside it
(tests/test_fused.py checks the kernels bit for bit); every causal attention row runs in the
C decode kernel whatever the chunk; and decode rows always take the one-call C decode of the
stack where it has one, prompt rows always the modules (inferflow.model.stack). With the
decode rows of mixed steps sent through the modules instead, the log-probabilities of the
concurrent SmolLM2 requests differ from their runs alone.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator

import pytest

from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import SchedulerConfig
from inferflow.runtime import LanguageModel, load
from tests.conftest import gemma3_path, smollm2_path

WORDS = "sea river mountain city forest desert island winter summer music".split()
PROMPTS = [
    f"Write a short story about a {WORDS[i % 10]} and a {WORDS[(3 * i + 1) % 10]}, part {i}."
    for i in range(16)
]
PREFIX = "You are a helpful assistant. Answer briefly and clearly, in plain English. " * 3

Run = tuple[list[int], list[tuple[int, float, list[tuple[int, float]]]]]


@pytest.fixture(scope="module")
def smollm2() -> LanguageModel:
    smollm2_path()  # skips when the model package is missing
    return load("smollm2-135m-instruct")  # float32 activations, the file's Q4_1 blocks kept


def _run(
    lm: LanguageModel,
    prompts: list[str],
    params: Callable[[int], SamplingParams],
    prefix_caching: bool = False,
    first: int = 0,
) -> list[Run]:
    """Every prompt added at once (so prompts are chunked across steps by the token budget
    and decode rows share steps with prefill chunks); tokens and each token's logprobs."""
    sched = SchedulerConfig(max_batched_tokens=128, prefix_caching=prefix_caching)
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(scheduler=sched))
    ids = [eng.add_request(p, params(first + i)) for i, p in enumerate(prompts)]
    out: dict[str, Run] = {r: ([], []) for r in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.token_ids)
            for t in o.logprobs or []:
                out[o.request_id][1].append((t.token_id, t.logprob, t.top))
    return [out[r] for r in ids]


def _check(
    lm: LanguageModel, prompts: list[str], params: Callable[[int], SamplingParams], **kw
) -> None:  # noqa: ANN003
    together = _run(lm, prompts, params, **kw)
    alone = [_run(lm, [p], params, first=i, **kw)[0] for i, p in enumerate(prompts)]
    for i, (t, a) in enumerate(zip(together, alone, strict=True)):
        assert len(t[0]) == len(a[0]) > 0
        assert t == a, f"request {i}: {t[0]} vs alone {a[0]}"


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=16, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True, logprobs=2
    )


def test_greedy_requests_together_equal_alone_bit_for_bit(smollm2: LanguageModel) -> None:
    _check(smollm2, PROMPTS, _greedy)


def test_seeded_sampling_together_equals_alone(smollm2: LanguageModel) -> None:
    _check(smollm2, PROMPTS, _seeded)


def test_prefix_sharing_prompts_equal_alone(smollm2: LanguageModel) -> None:
    """A long shared prefix: together, later requests read the first one's cached blocks and
    compute only their own suffix; alone, each computes everything."""
    _check(smollm2, [PREFIX + p for p in PROMPTS], _greedy, prefix_caching=True)


def test_a_stack_without_the_c_decode_is_batch_invariant_too() -> None:
    """Gemma-3 (q/k-norm, sliding-window layers: the module path for every row), its Q4_K_M
    blocks kept: windowed attention rows in the C kernel too."""
    gemma3_path()  # skips when the model packages are missing
    lm = load("gemma-3-270m")
    assert lm.model.dec.fused_decode() is None
    _check(lm, PROMPTS[:8], _greedy)


# --- over HTTP, the default server ---------------------------------------------------------


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("fastapi")
    from tests.serving import run_server

    smollm2_path()
    with run_server(tmp_path_factory.mktemp("inv")) as (url, _):  # default settings
        yield url


def test_sixteen_concurrent_requests_to_the_server_equal_each_alone(default_server: str) -> None:
    httpx = pytest.importorskip("httpx")
    from tests.serving import NAME

    def complete(prompt: str) -> tuple[str, object]:
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        r = httpx.post(f"{default_server}/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return str(choice["message"]["content"]), choice["logprobs"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(complete, PROMPTS))
    alone = [complete(p) for p in PROMPTS]
    assert [t for t, _ in together] == [t for t, _ in alone]  # the texts
    assert together == alone  # and every token's log-probabilities, bit for bit
    assert len({t for t, _ in alone}) > 8  # (different requests, different texts)
