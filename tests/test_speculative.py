"""Speculative decoding in the engine (inferflow.engine.speculative): the exact rule preserves
the target's distribution (on known distributions, and through the engine against the exact
marginals of transformers' model), greedy speculative output is plain greedy output token for
token and logprob for logprob (tiny models, SmolLM2 with its quantized blocks), the relaxed
rule keeps to the target's support, and the server and CLI reach it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.scheduler import SchedulerConfig
from inferflow.engine.speculative import NgramProposer, SpecConfig, distribution, verify
from inferflow.errors import InferflowError
from inferflow.model.network import Network
from tests.conftest import smollm2_path, tiny_llama

V, K, TRIALS = 6, 3, 20000


def _dists(seed: int, rows: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * sharp, dim=-1)


def test_exact_rule_emits_the_target_distribution() -> None:
    p, q = _dists(1, K + 1), _dists(2, K)  # q is a poor draft of p
    gen = torch.Generator().manual_seed(0)
    first = torch.zeros(V)
    first_accepted = 0
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(K)]
        out, n = verify(p, q, drafts, gen, "exact")
        first[out[0]] += 1
        first_accepted += n >= 1
    freq = first / TRIALS
    sd = (p[0] * (1 - p[0]) / TRIALS).sqrt()
    assert ((freq - p[0]).abs() <= 4.5 * sd + 1e-9).all(), (freq, p[0])
    # the draft's own distribution differs enough that the test could fail
    assert (q[0] - p[0]).abs().max() > 0.1
    # the first draft is accepted with probability sum_x min(p(x), q(x))
    want = float(torch.minimum(p[0], q[0]).sum())
    assert abs(first_accepted / TRIALS - want) <= 4.5 * (want * (1 - want) / TRIALS) ** 0.5


def test_relaxed_rule_keeps_to_the_target_support() -> None:
    p = _dists(3, K + 1)
    p[:, :2] = 0  # the target's filters dropped tokens 0 and 1
    p = p / p.sum(-1, keepdim=True)
    q = torch.full((K, V), 1 / V)
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(K)]
        out, _ = verify(p, q, drafts, gen, "relaxed")
        assert all(t >= 2 for t in out)


def test_a_draft_the_target_gives_no_mass_is_never_accepted() -> None:
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert verify(p, torch.tensor([[1.0, 0.0]]), [0], gen) == ([1], 0)


def test_distribution_applies_filters() -> None:
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert distribution(x, SamplingParams()).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    pk = distribution(x, SamplingParams(temperature=1.0, top_k=2))
    assert pk[0, 2:].sum() == 0 and pk.sum() == pytest.approx(1.0)


def test_prompt_lookup_takes_the_latest_longest_match() -> None:
    look = NgramProposer(SpecConfig(ngram_max=3, ngram_min=1)).lookup
    assert look([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # "2 3": the later one
    assert look([1, 2, 3, 9, 4, 2, 3, 1, 2, 3], 2) == [9, 4]  # "1 2 3" beats "2 3"
    assert look([4, 5, 6], 3) == []
    assert look([7, 8, 7], 4) == [8, 7]  # (fewer than k at the end)


def test_config_errors_name_the_allowed_values() -> None:
    with pytest.raises(InferflowError, match="unknown; known: ngram, draft"):
        SpecConfig("medusa")
    with pytest.raises(InferflowError, match="unknown; known: exact, relaxed"):
        SpecConfig(rule="fast")
    with pytest.raises(InferflowError, match="lookahead: must be >= 1"):
        SpecConfig(lookahead=0)


# --- through the engine, tiny models -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Network, Network]:
    def make(seed: int) -> Network:
        d = tmp_path_factory.mktemp(f"m{seed}")
        return tiny_llama(d, sharpen=4.0, seed=seed, eos_token_id=None, bos_token_id=None)[1]

    return make(0), make(1)


Out = tuple[list[int], list[tuple[int, float, list[tuple[int, float]]]]]


def _run(
    target: Network,
    prompts: list[list[int]],
    params: Callable[[int], SamplingParams],
    spec: SpecConfig | None = None,
    draft: Network | None = None,
    max_running: int = 64,
) -> tuple[list[Out], Engine]:
    """All prompts at once; each request's tokens and its tokens' logprobs."""
    sched = SchedulerConfig(max_running=max_running, max_waiting=len(prompts))
    eng = Engine(target, None, EngineConfig(scheduler=sched, speculative=spec), draft)
    ids = [eng.add_request(p, params(i)) for i, p in enumerate(prompts)]
    out: dict[str, Out] = {r: ([], []) for r in ids}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.finish_reason != "error"
            out[o.request_id][0].extend(o.token_ids)
            for t in o.logprobs or []:
                out[o.request_id][1].append((t.token_id, t.logprob, t.top))
    return [out[r] for r in ids], eng


PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(20, 60)), [7, 8, 7, 8, 7, 8, 7]]


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
@pytest.mark.parametrize("lookahead", [1, 3, 5])
def test_greedy_speculation_is_plain_greedy(tiny, method: str, lookahead: int) -> None:  # noqa: ANN001
    """Token for token (these tiny models run float layers, whose products may round a row
    differently in a batch of another size: logprobs agree to 1e-5 here, bit for bit with
    quantized blocks, see the SmolLM2 test)."""
    target, other = tiny
    draft = {"ngram": None, "draft": other, "self": target}[method]
    # (drafting never paused: the other model's drafts are rarely accepted, and both outcomes
    # of the check are wanted here)
    spec = SpecConfig(
        "ngram" if draft is None else "draft", lookahead, max_rows=None, min_acceptance=0
    )

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=24 + i, ignore_eos=True, logprobs=2)

    want, _ = _run(target, PROMPTS, params)
    got, eng = _run(target, PROMPTS, params, spec, draft)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert [x[0] for x in a] == [x[0] for x in b]
        assert torch.allclose(torch.tensor([x[1] for x in a]), torch.tensor([x[1] for x in b]))
    st = eng.spec_stats
    assert st.proposed > 0
    if method == "self":  # a draft equal to the target: every drafted token is accepted
        assert st.accepted == st.proposed
        assert st.steps < sum(len(t) for t, _ in want) / (lookahead + 1) + 2 * len(PROMPTS)
    if method == "draft":  # a different model: both outcomes occur
        assert 0 < st.accepted < st.proposed


def test_speculation_through_preemption_is_plain_greedy(tiny) -> None:  # noqa: ANN001
    """A KV cache of 8 blocks for 4 requests: requests holding drafts are preempted and
    recomputed; the tokens stay plain greedy's."""
    target, other = tiny

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=40, ignore_eos=True)

    def run(spec: SpecConfig | None) -> tuple[list[list[int]], Engine]:
        cfg = EngineConfig(kv_cache_bytes=8 * 8192, speculative=spec)
        eng = Engine(target, None, cfg, other if spec else None)
        done = eng.generate(PROMPTS, params(0))
        return [r.output_ids for r in done], eng

    want, plain = run(None)
    got, eng = run(SpecConfig("draft", 3, max_rows=None))
    assert plain.scheduler.preemptions > 0 and eng.scheduler.preemptions > 0
    assert eng.spec_stats.proposed > 0
    assert got == want


def test_a_draft_model_equal_to_the_target_accepts_all_sampled_tokens(tiny) -> None:  # noqa: ANN001
    target, _ = tiny

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=i)

    _, eng = _run(target, PROMPTS, params, SpecConfig("draft", 4, max_rows=None), target)
    assert eng.spec_stats.proposed > 40
    assert eng.spec_stats.acceptance_rate == 1.0


def test_requests_that_cannot_speculate_decode_plainly(tiny) -> None:  # noqa: ANN001
    """Penalties make the next token depend on more than its logits: no drafts, same tokens."""
    target, other = tiny

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3)

    want, _ = _run(target, PROMPTS, params)
    got, eng = _run(target, PROMPTS, params, SpecConfig("draft", 3, max_rows=None), other)
    assert got == want and eng.spec_stats.proposed == 0


def test_drafts_fill_a_step_up_to_max_rows(tiny) -> None:  # noqa: ANN001
    """Two decoding requests and max_rows 4: one draft each per step; four: none until some
    have finished."""
    target, _ = tiny

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=10 + 6 * i, ignore_eos=True)

    spec = SpecConfig("draft", 3, max_rows=4)
    same = SamplingParams(max_new_tokens=16, ignore_eos=True)
    _, eng = _run(target, PROMPTS[:2], lambda i: same, spec, target)
    st = eng.spec_stats
    assert st.proposed == st.steps > 0  # (one draft a check)
    want, _ = _run(target, PROMPTS, params)
    got, eng = _run(target, PROMPTS, params, spec, target)
    assert got == want
    # the longest request alone for its last 6 tokens: 3 drafts, all accepted (4 a step)
    assert eng.spec_stats.proposed > eng.spec_stats.steps


def test_a_request_pauses_drafting_while_its_drafts_fail(tiny) -> None:  # noqa: ANN001
    """A draft model that rarely agrees with the target: with min_acceptance, each request
    stops drafting after a trial of 16 drafts with too few accepted (16 tokens, then 32, ...),
    so it drafts far fewer tokens, and its tokens stay plain greedy's; with a draft model
    equal to the target no request ever pauses."""
    target, other = tiny

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=120, ignore_eos=True)

    want, _ = _run(target, PROMPTS, params)
    runs = {}
    for least in (0.0, 0.2):
        spec = SpecConfig("draft", 3, max_rows=None, min_acceptance=least)
        got, eng = _run(target, PROMPTS, params, spec, other)
        assert got == want
        runs[least] = eng.spec_stats
    always, paused = runs[0.0], runs[0.2]  # (measured: 1401 drafts, 1 accepted; 216, 12 pauses)
    assert always.pauses == 0 and always.acceptance_rate < 0.2
    assert paused.pauses > 0 and paused.proposed < always.proposed / 2
    _, same = _run(target, PROMPTS, params, SpecConfig("draft", 3, max_rows=None), target)
    assert same.spec_stats.pauses == 0 and same.spec_stats.acceptance_rate == 1.0


def test_a_draft_model_must_share_the_vocabulary(tmp_path: Path, tiny) -> None:  # noqa: ANN001
    small = tiny_llama(tmp_path, vocab_size=96, eos_token_id=None)[1]
    with pytest.raises(InferflowError, match=r"vocabulary \(96\) differs from the target's"):
        Engine(tiny[0], None, EngineConfig(speculative=SpecConfig("draft")), small)
    with pytest.raises(InferflowError, match="needs a draft model"):
        Engine(tiny[0], None, EngineConfig(speculative=SpecConfig("draft")))


@pytest.fixture(scope="module")
def sharp(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Two tiny llamas over 8 tokens with peaked, different next-token distributions:
    (transformers' target, ours; transformers' draft, ours)."""
    cfg = dict(vocab_size=8, eos_token_id=None, bos_token_id=None, sharpen=8.0)
    ref, target = tiny_llama(tmp_path_factory.mktemp("t8"), seed=3, **cfg)  # type: ignore[arg-type]
    ref_d, draft = tiny_llama(tmp_path_factory.mktemp("d8"), seed=4, **cfg)  # type: ignore[arg-type]
    return ref, target, ref_d, draft


def _marginals(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of the 2nd and 3rd sampled tokens (temperature 1)."""
    with torch.no_grad():

        def nxt(seqs: list[list[int]]) -> torch.Tensor:
            out = model(torch.tensor(seqs)).logits[:, -1].double()
            return torch.softmax(out, -1)

        p1 = nxt([prompt])[0]
        seq1 = [[*prompt, a] for a in range(8)]
        p2 = nxt(seq1)  # (a, b)
        seq2 = [[*prompt, a, b] for a in range(8) for b in range(8)]
        p3 = nxt(seq2).reshape(8, 8, 8)  # (a, b, c)
    m2 = (p1[:, None] * p2).sum(0)
    m3 = (p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1))
    return m2, m3


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_sampling_keeps_the_target_distribution(sharp, method: str) -> None:  # noqa: ANN001
    """4000 seeded requests through the engine; tokens 2 and 3 come from checks of drafts
    (the first is sampled from the prompt's logits). Their frequencies match the exact
    marginals of transformers' model of the target, not the draft's."""
    ref, target, ref_d, draft = sharp
    prompt = [1, 2, 5, 1, 2, 5, 1, 2]
    n = 4000

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=i)

    spec = SpecConfig(method, 2, ngram_min=1, max_rows=None)  # (1: lookups hit often on 8 tokens)
    got, eng = _run(target, [prompt] * n, params, spec, draft if method == "draft" else None)
    st = eng.spec_stats
    # a draft model drafts for every request (once, or twice after a rejection); prompt
    # lookup where the tail occurred before
    assert st.steps >= (n if method == "draft" else n // 4)
    assert 0.02 < st.acceptance_rate < 0.98  # both outcomes occur
    m2, m3 = _marginals(ref, prompt)
    for j, m in ((1, m2), (2, m3)):
        freq = torch.bincount(torch.tensor([t[j] for t, _ in got]), minlength=8).double() / n
        sd = (m * (1 - m) / n).sqrt()
        assert ((freq - m).abs() <= 4.5 * sd + 1e-3).all(), (j, freq, m)
    if method == "draft":  # the draft's own marginals are far enough that the test could fail
        assert (_marginals(ref_d, prompt)[0] - m2).abs().max() > 0.1


# --- SmolLM2, its quantized blocks kept ------------------------------------------------------

REPEAT = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew.",
    "Copy the code: def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Say 'the quick brown fox jumps over the lazy dog' three times.",
    "Count from one to twenty in words: one, two, three, four, five, six, seven, eight.",
]


@pytest.fixture(scope="module")
def smollm2():  # noqa: ANN201
    from inferflow.runtime import load

    smollm2_path()  # skips when the model package is missing
    return load("smollm2-135m-instruct")


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_smollm2_greedy_speculation_is_plain_greedy_bit_for_bit(smollm2, method: str) -> None:  # noqa: ANN001
    tok = smollm2.tokenizer
    prompts = [tok.encode(p) for p in REPEAT]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)

    draft = smollm2.model if method == "self" else None
    spec = SpecConfig("ngram" if draft is None else "draft", 4, max_rows=None)
    want, _ = _run(smollm2.model, prompts, params)
    got, eng = _run(smollm2.model, prompts, params, spec, draft)
    assert got == want
    assert eng.spec_stats.accepted > 20


def test_cli_generate_with_prompt_lookup() -> None:
    smollm2_path()
    cmd = [sys.executable, "-m", "inferflow.cli.main", "generate", "smollm2-135m-instruct"]
    cmd += ["--prompt", REPEAT[1], "--max-tokens", "24", "--temperature", "0", "--json"]
    plain = json.loads(subprocess.run(cmd, capture_output=True, check=True).stdout)
    spec = subprocess.run([*cmd, "--prompt-lookup"], capture_output=True, check=True)
    out = json.loads(spec.stdout)
    assert out["token_ids"] == plain["token_ids"]
    assert out["drafted"] > 0 and 0 < out["acceptance_rate"] <= 1
    bad = subprocess.run([*cmd, "--prompt-lookup", "--draft", "x"], capture_output=True)
    assert bad.returncode != 0 and b"choose one" in bad.stderr
    # a draft model (here the model itself: every drafted token accepted)
    drafted = subprocess.run([*cmd, "--draft", "smollm2-135m-instruct"], capture_output=True)
    out = json.loads(drafted.stdout)
    assert out["token_ids"] == plain["token_ids"]
    assert out["drafted"] > 0 and out["acceptance_rate"] == 1.0


def test_server_speculates_and_reports_acceptance(tmp_path: Path) -> None:
    httpx = pytest.importorskip("httpx")
    from tests.serving import NAME, metric, run_server

    smollm2_path()
    body = {"model": NAME, "prompt": REPEAT[1], "max_tokens": 32, "temperature": 0}
    texts, ratios = [], []
    for args in ((), ("--prompt-lookup", "--lookahead", "5"), ("--draft", "smollm2-135m-instruct")):
        with run_server(tmp_path, *args) as (url, _):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
            drafted = metric(url, "inferflow_spec_decode_draft_tokens")
            accepted = metric(url, "inferflow_spec_decode_accepted_tokens")
            ratio = metric(url, "inferflow_spec_decode_acceptance_ratio")
            if args:
                assert drafted > 0 and 0 < accepted <= drafted
                assert ratio == pytest.approx(accepted / drafted)
                ratios.append(ratio)
    assert texts[0] == texts[1] == texts[2]
    assert ratios[1] == 1.0  # (the draft model is the model itself)
