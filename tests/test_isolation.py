"""A bad request fails alone (issue 24): a failure while stepping ends only the request that
caused it, and the others' tokens are those of a run without it; the server's admission takes a
multi-prompt request whole or not at all; a failing batched call (embeddings, searches) fails
only the job that caused it."""

from __future__ import annotations

import asyncio
import random

import pytest

from inferflow.engine.beam import BeamState
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import QueueFull, SchedulerConfig
from inferflow.errors import RequestError
from inferflow.server.batcher import Batcher
from inferflow.server.metrics import Metrics
from inferflow.server.runner import EngineRunner

pytest.importorskip("transformers")
POISON = 127  # a token id the model wrapper below refuses to run


@pytest.fixture(scope="module")
def model(tiny_model):  # noqa: ANN001, ANN201  (conftest: a tiny random llama, vocab 128)
    return tiny_model


@pytest.fixture
def poisoned(model, monkeypatch):  # noqa: ANN001, ANN201
    """The model fails every forward pass that contains the token POISON (as a bug in one
    request's input would), whatever else is in the batch."""
    forward = model.forward

    def failing(flat):  # noqa: ANN001, ANN202
        if (flat.token_ids == POISON).any():
            raise RuntimeError("poisoned input")
        return forward(flat)

    monkeypatch.setattr(model, "forward", failing)
    return model


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 100) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def _run(eng: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """Every request's (tokens, finish reason), all added before the first step."""
    ids = [eng.add_request(p, sp) for p, sp in requests]
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            toks[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (toks[rid], reasons.get(rid)) for rid in ids}


def _engine(model, deterministic: bool = False) -> Engine:  # noqa: ANN001
    return Engine(
        model,
        None,
        EngineConfig(SchedulerConfig(max_batched_tokens=64), deterministic=deterministic),
    )


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_failing_forward_pass_ends_only_its_request(
    model,
    poisoned,
    when: str,
    deterministic: bool,  # noqa: ANN001
) -> None:
    """One request's input makes the forward pass fail, at its prefill or (its first sampled
    token forced to POISON) at its first decode step, while four others run: it alone ends with
    "error", the others end as they would without it, and every KV block comes back."""
    good = [(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in _prompts(4)]
    bad = (
        ([5, POISON, 9], SamplingParams(max_new_tokens=8))
        if when == "prefill"
        else ([5, 6, 9], SamplingParams(max_new_tokens=8, logit_bias={POISON: 100.0}))
    )
    alone = _run(_engine(model, deterministic), good)
    eng = _engine(model, deterministic)
    free = eng.cache.alloc.num_free
    got = _run(eng, [good[0], good[1], bad, good[2], good[3]])
    results = list(got.values())
    assert results[2] == ([] if when == "prefill" else [POISON], "error")
    assert [results[i] for i in (0, 1, 3, 4)] == list(alone.values())
    assert all(reason == "length" for _, reason in alone.values())
    assert eng.cache.alloc.num_free == free and not eng.requests


def test_a_failing_beam_step_ends_only_its_search(model, monkeypatch) -> None:  # noqa: ANN001
    """A beam search whose step raises (as an overflowing length penalty did) ends alone with
    "error"; another search and plain requests in the same steps are unaffected."""
    select = BeamState.select

    def failing(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self.width == 3:
            raise OverflowError("(34, 'Numerical result out of range')")
        return select(self, *args, **kwargs)

    monkeypatch.setattr(BeamState, "select", failing)
    p = _prompts(3)
    others = [
        (p[0], SamplingParams(max_new_tokens=6, ignore_eos=True)),
        (p[1], SamplingParams(max_new_tokens=6, beam_width=2, n=2, ignore_eos=True)),
    ]
    alone = _run(_engine(model), others)
    got = list(
        _run(_engine(model), [others[0], (p[2], SamplingParams(beam_width=3)), others[1]]).values()
    )
    assert got[1] == ([], "error")
    assert [got[0], got[2]] == list(alone.values())


def test_a_step_failing_outside_any_request_still_ends_all(model, monkeypatch) -> None:  # noqa: ANN001
    """fail_all stays the last resort of the server's loop (a scheduler bug): every request in
    flight ends with "error" and frees its blocks."""
    eng = _engine(model)
    free = eng.cache.alloc.num_free
    for p in _prompts(3):
        eng.add_request(p, SamplingParams(max_new_tokens=4))
    eng.step()
    outs = eng.fail_all()
    assert len(outs) == 3 and {o.finish_reason for o in outs} == {"error"}
    assert eng.cache.alloc.num_free == free and not eng.requests


def test_admission_takes_a_multi_prompt_request_whole_or_not_at_all(model) -> None:  # noqa: ANN001
    """The waiting bound counts requests waiting (queued in the engine or posted to it), and a
    request of several prompts is queued whole or refused whole: it used to queue its first
    prompts, hit the bound, then abort them (locking other clients out meanwhile)."""
    eng = Engine(model, None, EngineConfig(SchedulerConfig(max_waiting=4)))
    runner = EngineRunner(eng, Metrics(), 4)  # (not started: nothing leaves the inbox)
    runner.loop = asyncio.new_event_loop()
    out: asyncio.Queue = asyncio.Queue()
    params = SamplingParams(max_new_tokens=2)
    assert len(runner.submit([[1, 2], [3, 4], [5, 6]], params, out)) == 3
    with pytest.raises(QueueFull, match="3 of 4 requests waiting, 2 more asked"):
        runner.submit([[1], [2]], params, out)
    assert len(runner.streams) == 3 and runner.inbox.qsize() == 3  # nothing of it queued
    with pytest.raises(RequestError, match="5 prompts exceed the waiting queue's bound"):
        runner.submit([[1]] * 5, params, out)
    with pytest.raises(RequestError, match="outside the vocabulary"):  # (validated first)
        runner.submit([[1], [999]], params, out)
    assert len(runner.streams) == 3 and runner.inbox.qsize() == 3
    runner._drain()  # the engine thread takes them: the bound counts them once
    assert runner.posted == runner.taken == 3 and len(eng.scheduler.waiting) == 3
    assert len(runner.submit([[7]], params, out)) == 1
    runner.loop.close()


def test_a_failing_batched_call_fails_only_the_job_that_caused_it() -> None:
    """Jobs of one key share a call; when it fails, each job runs alone, so only the job whose
    input breaks the call gets the exception."""

    def call(xs: list[list[int]], stop) -> list[int]:  # noqa: ANN001
        if any(POISON in x for x in xs):
            raise ValueError("poisoned input")
        return [sum(x) for x in xs]

    b = Batcher(max_waiting=16)
    ok1 = b.submit("k", [[1, 2], [3]], call)
    bad = b.submit("k", [[POISON]], call)
    ok2 = b.submit("k", [[4]], call)
    b.run_pending()
    assert ok1.result() == [3, 3] and ok2.result() == [4]
    with pytest.raises(ValueError, match="poisoned"):
        bad.result()
    assert not b.jobs and not b.running


def test_request_fields_are_bounded() -> None:
    """Each field that sizes a step's work has a bound (README "Security model")."""
    for field, value in [
        ("fsd_n", 2**62),
        ("fsd_k", 10**6),
        ("length_penalty", 1e308),
        ("repetition_penalty", 1e300),
        ("mirostat_tau", 1e300),
        ("stop", tuple("abcdefghijklmnopq")),
        ("stop", ("x" * 1001,)),
        ("stop_token_ids", tuple(range(2000))),
        ("logit_bias", {i: 1.0 for i in range(301)}),
    ]:
        with pytest.raises(RequestError, match=field):
            SamplingParams(**{field: value})
