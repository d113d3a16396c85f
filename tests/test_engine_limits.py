"""The engine at its limits (bugs the HTTP fuzzer found): under a KV cache smaller than the work
nothing waits forever and what can never fit is refused up front; extreme but valid sampling
parameters still sample; out-of-range ones are refused."""

from __future__ import annotations

import math

import pytest
import torch

from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.request import RequestOutput
from inferflow.engine.sampling import SEED_RANGE, SamplingParams, make_sampler
from inferflow.engine.scheduler import SchedulerConfig
from inferflow.errors import RequestError

pytest.importorskip("transformers")
STEPS = 2000  # far more than any of these needs: reaching it means the engine is stuck


@pytest.fixture(scope="module")
def model(tiny_model):  # noqa: ANN001, ANN201  (conftest: a tiny random llama, 256 positions)
    return tiny_model


def _engine(model, blocks: int, **sched) -> Engine:  # noqa: ANN001
    h = model.spec.hparams
    per_block = 2 * h.n_layers * 16 * h.n_kv_heads * h.head_dim * 4  # float32, 16 tokens
    return Engine(
        model, None, EngineConfig(SchedulerConfig(**sched), kv_cache_bytes=blocks * per_block)
    )


def _run(eng: Engine) -> list[RequestOutput]:
    outs = []
    for _ in range(STEPS):
        if not eng.has_unfinished():
            return outs
        outs += eng.step()
    raise AssertionError(f"stuck: {len(eng.scheduler.waiting)} waiting, nothing can run")


def test_a_sequence_longer_than_the_kv_cache_ends_with_length(model) -> None:  # noqa: ANN001
    """It used to be preempted by itself and then wait forever (its tokens never fit again)."""
    eng = _engine(model, blocks=4)  # 64 tokens in all, the model's context is 256
    assert eng.max_len == 64
    rid = eng.add_request([7] * 40, SamplingParams(max_new_tokens=100, ignore_eos=True))
    req = eng.requests[rid][0]
    _run(eng)
    assert req.finish_reason == "length" and len(req.tokens) == 64
    assert eng.cache.alloc.num_free == 4
    with pytest.raises(
        RequestError, match=r"length is 64 tokens here \(what the KV cache holds\).*has 64 input"
    ):
        eng.add_request([7] * 64)


def test_beams_that_cannot_fit_together_are_refused(model) -> None:  # noqa: ANN001
    """A beam search waits for all its beams: if they cannot all be resident, it used to wait
    forever once one was preempted."""
    eng = _engine(model, blocks=8, max_running=16)
    with pytest.raises(RequestError, match=r"beam_width: 5 beams of up to 40 tokens need 15"):
        eng.add_request([3] * 20, SamplingParams(beam_width=5, max_new_tokens=20))
    eng.add_request([3] * 20, SamplingParams(beam_width=4, max_new_tokens=12))  # 4 x 2 blocks
    _run(eng)
    assert eng.cache.alloc.num_free == 8


def test_beam_searches_that_fit_alone_but_not_together_finish(model) -> None:  # noqa: ANN001
    """Three beam searches, each fitting the cache alone, not together: beams are preempted
    and recomputed (a beam waits for its siblings, holding its blocks) and all finish."""
    eng = _engine(model, blocks=14, max_running=16)  # one search needs 12 at most
    params = SamplingParams(beam_width=4, n=2, max_new_tokens=20, ignore_eos=True)
    rids = [eng.add_request([i + 1] * 18, params) for i in range(3)]
    outs = _run(eng)
    for rid in rids:
        done = [o for o in outs if o.request_id == rid and o.finished]
        assert [(o.finish_reason, len(o.token_ids)) for o in done] == [("length", 20)] * 2
    assert eng.scheduler.preemptions > 0
    assert eng.cache.alloc.num_free == 14 and not eng.beams and not eng.requests


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=5e-324),  # repeated tokens' logits / 5e-324 = +inf
        dict(temperature=1e-300),  # x / T overflows (and T underflows float32 to 0)
        dict(temperature=1e-300, mirostat=2, mirostat_tau=5e-324),
        dict(temperature=1e-300, mirostat=1),
        dict(temperature=1e-30, typical_p=5e-324, tfs_z=5e-324, min_p=0.5, top_k=3),
        dict(temperature=1.5, repetition_penalty=5e-324, frequency_penalty=-2),
    ],
)
def test_extreme_valid_parameters_still_sample(kw: dict) -> None:
    """torch.multinomial failed on NaN probabilities ("the engine failed": a 500)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 5
    prompt = list(range(0, 1000, 3))
    tok = make_sampler(SamplingParams(seed=0, **kw))(logits, prompt, [1, 2])
    assert 0 <= tok < 1000
    if kw.get("temperature", 1) < 1e-20 and "mirostat" not in kw and "top_k" not in kw:
        assert tok == int(torch.argmax(logits))  # a vanishing temperature is greedy
    if "repetition_penalty" in kw:
        assert tok in prompt  # a penalty below 1 favours the prompt's tokens, without bound


def test_seed_and_non_finite_parameters_are_refused() -> None:
    """A seed past int64 reached torch.Generator.manual_seed and failed the request with a
    500; non-finite mirostat / length penalty values passed."""
    with pytest.raises(RequestError, match="seed"):
        SamplingParams(seed=SEED_RANGE[1] + 1)
    SamplingParams(seed=SEED_RANGE[0])
    for name in ("mirostat_tau", "mirostat_eta", "length_penalty"):
        with pytest.raises(RequestError, match=name):
            SamplingParams(**{name: math.inf})
        with pytest.raises(RequestError, match=name):
            SamplingParams(**{name: math.nan})


def test_memory_bound_terms_match_the_engine(model) -> None:  # noqa: ANN001
    """inferflow.server.memory's KV term is what the engine allocates (both plan the cache with
    kv_cache.plan_cache: the spec's geometry there, the model's here), and its weights term
    covers every parameter the model holds."""
    from inferflow.server.memory import kv_plan, memory_bound

    eng = _engine(model, blocks=7)
    cfg = eng.config
    bound = memory_bound(model.spec, cfg, runtime=0)
    assert bound.kv_cache == eng.cache.k.nbytes + eng.cache.v.nbytes
    plan = kv_plan(model.spec, cfg, torch.float32)
    assert (plan.num_blocks, plan.max_len) == (7, eng.max_len)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held <= bound.weights


def test_memory_bound_counts_a_draft_model(model) -> None:  # noqa: ANN001
    """With ``--draft`` the bound adds the draft's weights, files and the KV cache its
    proposer allocates (the model as its own draft here)."""
    from inferflow.engine.speculative import SpecConfig
    from inferflow.server.memory import memory_bound

    h = model.spec.hparams
    per_block = 2 * h.n_layers * 16 * h.n_kv_heads * h.head_dim * 4
    cfg = EngineConfig(kv_cache_bytes=7 * per_block, speculative=SpecConfig("draft"))
    eng = Engine(model, None, cfg, model)
    alone = memory_bound(model.spec, cfg, runtime=0)
    both = memory_bound(model.spec, cfg, runtime=0, draft=model.spec)
    drafted = eng.spec.proposer.cache
    assert both.kv_cache - alone.kv_cache == drafted.k.nbytes + drafted.v.nbytes
    assert both.weights == 2 * alone.weights
    assert both.checkpoint_files == 2 * alone.checkpoint_files > 0
