"""Continuous batching: outputs with many concurrent requests (mixed lengths, arriving at
different steps, chunked prefill, preemption) equal each request run alone; no block leaks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import fields

import pytest
import torch

from inferflow.engine.engine import WARM_AHEAD, Engine, EngineConfig
from inferflow.engine.generate import generate_tokens
from inferflow.engine.kv_cache import PagedKVCache, SeqBlocks
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import QueueFull, SchedulerConfig
from inferflow.errors import RequestError
from inferflow.model.build import load_model
from inferflow.server.metrics import Metrics
from inferflow.server.runner import EngineRunner
from inferflow.spec import load_spec
from tests.conftest import needs_proc, rss

tf = pytest.importorskip("transformers")
VOCAB = 128


@pytest.fixture(scope="module")
def model(tiny_model):  # noqa: ANN001  (conftest: a tiny random llama, GQA, sharp logits)
    return tiny_model


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            0, VOCAB, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def _alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return [s.token_id for s in generate_tokens(model, prompt, params)]


def _engine(model, **kw) -> Engine:
    sched = SchedulerConfig(
        **{k: kw.pop(k) for k in list(kw) if k in {f.name for f in fields(SchedulerConfig)}}
    )
    return Engine(model, None, EngineConfig(scheduler=sched, **kw))


@pytest.mark.parametrize("n", [1, 8, 32])
def test_greedy_batched_equals_alone(model, n: int) -> None:
    prompts = _prompts(n, seed=n)
    params = [SamplingParams(max_new_tokens=int(5 + i % 13), ignore_eos=True) for i in range(n)]
    eng = _engine(model, max_batched_tokens=64)
    free0 = eng.cache.alloc.num_free
    ids, pending = [], list(zip(prompts, params, strict=True))
    results: dict[str, list[int]] = {}
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % 2 == 0:  # arrivals spread over steps, joining a running batch
            for _ in range(min(3, len(pending))):
                p, sp = pending.pop(0)
                ids.append(eng.add_request(p, sp))
        for out in eng.step():
            results.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        assert results[rid] == _alone(model, p, sp), rid
    assert eng.cache.alloc.num_free == free0


def test_prefill_budget_caps_prompt_positions_not_decode_rows(model) -> None:
    """max_prefill_tokens: a step computes at most that many prompt positions (the prompt that
    crosses it is chunked, the rest wait), while every running sequence still gets its decode
    token each step; outputs equal each request run alone."""
    eng = _engine(model, max_batched_tokens=512, max_prefill_tokens=100)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    steps: list[list[tuple[str, int, int]]] = []
    schedule = eng.scheduler.schedule

    def record():  # noqa: ANN202
        batch = schedule()
        steps.append([(s.req.id, s.start, s.length) for s in batch])
        return batch

    eng.scheduler.schedule = record  # type: ignore[method-assign]
    early = [[3 + i] * 10 for i in range(2)]
    late = [[20 + i, 21, 22] * 15 for i in range(5)]  # 45 tokens each
    rids = [eng.add_request(p, params) for p in early]
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        if len(rids) == 2:  # (the late ones arrive while the early ones decode)
            rids += [eng.add_request(p, params) for p in late]
    prompt_len = dict(zip(rids, [len(p) for p in early + late], strict=True))
    prompt = [[n for rid, start, n in st if start < prompt_len[rid]] for st in steps]
    assert prompt[0] == [10, 10]
    assert prompt[1:4] == [[45, 45, 10], [35, 45, 20], [25]]  # a chunk, then the rest
    assert all(sum(p) <= 100 for p in prompt)
    for st in steps[1:5]:  # the early two decode in every one of those steps
        assert {rid for rid, start, n in st if start >= prompt_len[rid]} >= set(rids[:2])
    for rid, p in zip(rids, early + late, strict=True):
        assert out[rid] == _alone(model, p, params), rid


def test_seeded_sampling_batch_invariant(model) -> None:
    prompts = _prompts(6, seed=7)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_new_tokens=12, ignore_eos=True)
        for i in range(6)
    ]
    eng = _engine(model)
    reqs = [eng.requests[eng.add_request(p, sp)][0] for p, sp in zip(prompts, params, strict=True)]
    while eng.has_unfinished():
        eng.step()
    for r, p, sp in zip(reqs, prompts, params, strict=True):
        assert r.output_ids == _alone(model, p, sp)


def test_preemption_when_kv_cache_is_small(model) -> None:
    """6 requests x ~70 tokens do not fit in 12 blocks of 16: the newest are preempted and
    recomputed, outputs unchanged, and every block comes back."""
    prompts = _prompts(6, seed=3)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    h = model.spec.hparams
    per_block = 2 * h.n_layers * 16 * h.n_kv_heads * h.head_dim * 4
    eng = _engine(model, kv_cache_bytes=12 * per_block, max_batched_tokens=128)
    free0 = eng.cache.alloc.num_free
    assert free0 == 12
    reqs = eng.generate(prompts, params)
    assert eng.scheduler.preemptions > 0
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_ids == _alone(model, p, params)
    assert eng.cache.alloc.num_free == free0


def test_preempted_requests_do_not_fill_the_waiting_bound(model) -> None:
    """--max-waiting bounds requests not yet started: a running request preempted back into
    the queue was admitted already, so a new one is still accepted (the server's admission
    check counts the same way; before, such a request failed after a 200 with "engine
    failed")."""
    h = model.spec.hparams
    per_block = 2 * h.n_layers * 16 * h.n_kv_heads * h.head_dim * 4
    eng = _engine(model, kv_cache_bytes=4 * per_block, max_batched_tokens=128, max_waiting=1)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)  # 60 tokens: 4 blocks each
    prompts = [[7] * 30, [9] * 30, [5] * 3]
    reqs = []
    for p in prompts[:2]:
        reqs.append(eng.requests[eng.add_request(p, params)][0])
        eng.step()  # (it starts: the queue has room for the next)
    while not eng.scheduler.preemptions:
        eng.step()
    assert len(eng.scheduler.waiting) == 1 and eng.scheduler.queued == 0
    reqs.append(eng.requests[eng.add_request(prompts[2], params)][0])
    with pytest.raises(QueueFull):  # the bound still holds for new requests
        eng.add_request([6], params)
    while eng.has_unfinished():
        eng.step()
    for r, p in zip(reqs, prompts, strict=True):
        assert r.finish_reason == "length" and r.output_ids == _alone(model, p, params)
    assert eng.scheduler.queued == 0 and eng.cache.alloc.num_free == 4


def test_prefix_caching_shares_blocks_and_keeps_outputs(model) -> None:
    shared = _prompts(1, seed=11)[0] * 3  # > 2 blocks of common prefix
    prompts = [shared + [1, 2], shared + [3]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    eng = _engine(model)
    eng.add_request(prompts[0], params)
    eng.step()  # first request's prompt is computed and published
    second = eng.add_request(prompts[1], params)
    req = eng.requests[second][0]
    eng.step()
    assert len(req.kv.hashes) >= (len(shared) // 16)  # shared blocks were reused
    while eng.has_unfinished():
        eng.step()
    assert req.output_ids == _alone(model, prompts[1], params)


def test_abort_frees_blocks(model) -> None:
    eng = _engine(model)
    free0 = eng.cache.alloc.num_free
    rid = eng.add_request(
        _prompts(1, seed=5)[0] * 2, SamplingParams(max_new_tokens=50, ignore_eos=True)
    )
    eng.step()
    assert eng.cache.alloc.num_free < free0
    assert eng.abort(rid)
    assert eng.cache.alloc.num_free == free0
    outs = eng.step()
    assert any(o.request_id == rid and o.finished and o.finish_reason == "abort" for o in outs)
    assert not eng.abort(rid)


def test_bad_requests(model) -> None:
    eng = _engine(model, max_waiting=2)
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request([1, VOCAB + 5])
    with pytest.raises(RequestError, match="maximum context length is 256 tokens") as e:
        eng.add_request([1] * 300)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    for tok in (VOCAB, -1):  # refused up front, not when a step samples
        with pytest.raises(
            RequestError, match=rf"logit_bias: token id {tok} is outside .*{VOCAB - 1}"
        ):
            eng.add_request([1], SamplingParams(logit_bias={5: 1.0, tok: 2.0}))
    eng.add_request([1])
    eng.add_request([2])
    with pytest.raises(QueueFull):
        eng.add_request([3])


def test_context_limit_finishes_with_length(model) -> None:
    eng = _engine(model)
    (r,) = eng.generate([[5] * 250], SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.tokens) == 256


def test_sliding_window_and_softcap_model_batched_equals_alone(tmp_path) -> None:
    """Grouped decode attention with a window (and the soft-capped path) equals one-at-a-time."""
    torch.manual_seed(1)
    cfg = tf.MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        num_hidden_layers=2,
        max_position_embeddings=256,
        sliding_window=5,
    )
    ref = tf.MistralForCausalLM(cfg)
    with torch.no_grad():
        ref.lm_head.weight.mul_(8)
    ref.save_pretrained(tmp_path)
    for extra in ("", "  attention: {softcap: 20.0}\n"):
        (tmp_path / "spec.yaml").write_text(
            f"name: w\nbase: arch/mistral\nsource: {{format: hf, files: ['{tmp_path}']}}\n"
            + (f"network:\n{extra}" if extra else "")
        )
        model = load_model(load_spec(tmp_path / "spec.yaml"))
        prompts = _prompts(8, seed=21)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        reqs = _engine(model).generate(prompts, params)
        for r, p in zip(reqs, prompts, strict=True):
            assert r.output_ids == _alone(model, p, params)


def test_n_samples_fork_the_prompt_blocks(model) -> None:
    """n = 3 seeded samples: sample i equals seed + i run alone; the prompt is computed once and
    its blocks are shared (copy-on-write for the partial last block); all blocks come back."""
    prompt = _prompts(1, seed=13)[0] * 2 + [7] * 40  # several full blocks and a partial one
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_new_tokens=10, ignore_eos=True)
    eng = _engine(model)
    free0 = eng.cache.alloc.num_free
    rid = eng.add_request(prompt, params)
    outs = eng.step()  # prefill of sample 0, then every sample draws its first token
    assert sorted(o.index for o in outs) == [0, 1, 2] and {o.request_id for o in outs} == {rid}
    group = eng.requests[rid]
    full = len(prompt) // 16
    assert all(r.kv.blocks[:full] == group[0].kv.blocks[:full] for r in group)
    assert eng.cache.alloc.num_free == free0 - len(group[0].kv.blocks)  # nothing copied yet
    while eng.has_unfinished():
        eng.step()
    blocks = [set(r.kv.blocks) for r in group]
    assert not blocks[0] and rid not in eng.requests  # released and forgotten
    for i, r in enumerate(group):
        alone = _alone(model, prompt, SamplingParams(**{**params.__dict__, "n": 1, "seed": 5 + i}))
        assert r.output_ids == alone
    assert len({tuple(r.output_ids) for r in group}) > 1
    assert eng.cache.alloc.num_free == free0


def test_n_samples_abort_and_limits(model) -> None:
    eng = _engine(model, max_running=4)
    free0 = eng.cache.alloc.num_free
    with pytest.raises(RequestError, match="exceed max_running"):
        eng.add_request([1, 2], SamplingParams(n=5))
    with pytest.raises(RequestError, match=r"n: must be in \[1, 64\]"):
        SamplingParams(n=0)
    rid = eng.add_request([1, 2, 3], SamplingParams(n=3, temperature=1.0, max_new_tokens=50))
    eng.step()
    eng.step()
    assert eng.abort(rid)
    outs = eng.step()
    assert sorted(o.index for o in outs if o.finish_reason == "abort") == [0, 1, 2]
    assert eng.cache.alloc.num_free == free0 and not eng.has_unfinished()


def _bf16_run(model, prompts, deterministic: bool, alone: bool):  # noqa: ANN001, ANN202
    """Greedy outputs and per-step top-2 logprobs of each prompt, all at once or one by one."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2)
    cfg = EngineConfig(SchedulerConfig(max_batched_tokens=64), deterministic=deterministic)
    groups = [[p] for p in prompts] if alone else [prompts]
    toks, tops = [], []
    for g in groups:
        eng = Engine(model, None, cfg)
        rids = [eng.add_request(p, params) for p in g]
        seen: dict[str, list] = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                seen[o.request_id] += o.logprobs or []
        toks += [[lp.token_id for lp in seen[r]] for r in rids]
        tops += [[lp.top for lp in seen[r]] for r in rids]
    return toks, tops


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):  # noqa: ANN001, ANN201
    from conftest import tiny_llama

    d = tmp_path_factory.mktemp("bf16")
    tiny_llama(d, sharpen=1.0, eos_token_id=None, bos_token_id=None)  # unsharpened: near-ties
    return load_model(load_spec(d / "spec.yaml"), torch.bfloat16)


def test_deterministic_mode_is_batch_invariant_in_bf16(bf16_model) -> None:
    prompts = _prompts(32, seed=0)
    batched, _ = _bf16_run(bf16_model, prompts, deterministic=True, alone=False)
    alone, _ = _bf16_run(bf16_model, prompts, deterministic=True, alone=True)
    assert batched == alone


def test_bf16_batched_divergence_starts_at_a_near_tie(bf16_model) -> None:
    """Without deterministic mode, bf16 batching may change a greedy choice only where the
    top-1 / top-2 gap (in the run alone) is below bf16's resolution at that logit size."""
    prompts = _prompts(32, seed=0)
    batched, _ = _bf16_run(bf16_model, prompts, deterministic=False, alone=False)
    alone, tops = _bf16_run(bf16_model, prompts, deterministic=False, alone=True)
    gaps = []
    for b, a, t in zip(batched, alone, tops, strict=True):
        if b != a:
            i = next(i for i, (x, y) in enumerate(zip(b, a, strict=True)) if x != y)
            gaps.append(t[i][0][1] - t[i][1][1])
    print(f"bf16: {len(gaps)}/32 requests diverged; top-1/top-2 gaps at divergence: {gaps}")
    assert all(g < 0.01 for g in gaps), gaps


@needs_proc
def test_warm_ahead_maps_never_used_blocks_and_nothing_else() -> None:
    """An idle engine writes the pool's next never-used blocks (their pages get mapped then,
    not by a step's keys and values): the resident memory grows by those blocks, the blocks of
    running requests and of cached prefixes keep their values, and allocation goes on in
    order past the warmed blocks."""
    cache = PagedKVCache(4, 2, 64, 16, 1024, torch.float32)  # 64 KiB a block, 64 MiB in all
    per_block = 64 << 10
    a, b = SeqBlocks(), SeqBlocks()
    cache.reserve(a, 5 * 16)
    cache.reserve(b, 3 * 16)
    g = torch.Generator().manual_seed(0)
    for seq in (a, b):
        slots = torch.tensor([blk * 16 + i for blk in seq.blocks for i in range(16)])
        for layer in range(4):
            k = torch.randn(len(slots), 2, 64, generator=g)
            cache.write(layer, slots, k, -k)
    tokens = list(range(3 * 16))
    b.num_computed = len(tokens)
    cache.register_full_blocks(b, tokens)
    cache.release(b)  # (its blocks stay cached: a later prompt may match them)
    assert cache.alloc.fresh == 8
    used = torch.tensor([blk * 16 + i for blk in a.blocks + b.blocks for i in range(16)])
    before = cache.k[:, used].clone(), cache.v[:, used].clone()
    r0 = rss()
    calls = 0
    while cache.warm_ahead(256 * per_block, 64 * per_block):  # 16 MiB ahead, 4 MiB a call
        calls += 1
    assert calls == 4 and cache.written == 8 + 256
    assert rss() - r0 >= 0.9 * 256 * per_block  # the pages are mapped now
    assert torch.equal(cache.k[:, used], before[0]) and torch.equal(cache.v[:, used], before[1])
    assert cache.match_prefix(SeqBlocks(), [*tokens, 7]) == 3 * 16  # the cached prefix is kept
    c = SeqBlocks()
    cache.reserve(c, 10 * 16)
    assert c.blocks == list(range(8, 18))  # never-used blocks first, in order
    assert cache.warm_ahead(256 * per_block, 1) and cache.written == 8 + 256 + 1
    while cache.warm_ahead(1 << 30, 1 << 30):  # never past the pool's end
        pass
    assert cache.written == 1024


def test_an_idle_server_warms_its_kv_pool(model) -> None:
    """The server's engine thread warms the pool while it has no request (Engine.warm_cache)."""
    eng = _engine(model)
    cache = eng.cache
    per_block = 2 * cache.k.element_size() * cache.k[0, 0].numel() * len(cache.k) * cache.block_size
    want = min(cache.alloc.num_blocks, WARM_AHEAD // per_block)
    runner = EngineRunner(eng, Metrics(), 4)
    loop = asyncio.new_event_loop()
    runner.start(loop)
    try:
        deadline = time.monotonic() + 30
        while eng.cache.written < want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.cache.written == want
    finally:
        runner.stop()
        loop.close()


def test_a_failing_warm_up_leaves_the_server_serving(
    model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mapping the pool ahead is idle work: if it raises, the engine thread logs it, stops
    warming and still serves requests (their tokens are the module path's, alone)."""
    eng = _engine(model)
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise OSError("no memory to map")

    monkeypatch.setattr(eng, "warm_cache", broken)
    runner = EngineRunner(eng, Metrics(), 4)
    loop = asyncio.new_event_loop()
    runner.start(loop)
    try:
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls and runner.thread.is_alive()
        prompt, params = _prompts(1, seed=3)[0], SamplingParams(max_new_tokens=5, ignore_eos=True)
        out: asyncio.Queue = asyncio.Queue()
        runner.submit([prompt], params, out)
        got: list[int] = []
        while len(got) < 5 and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.01))  # (deliveries come by the loop)
            while not out.empty():
                got += out.get_nowait().token_ids
        assert got == _alone(model, prompt, params) and len(calls) == 1
    finally:
        runner.stop()
        loop.close()
