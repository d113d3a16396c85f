"""Speculative decoding: the exact rule preserves the target distribution (statistical test on
known distributions), greedy speculative output equals greedy target output, and the relaxed
rule only emits tokens the target would keep."""

from __future__ import annotations

import pytest
import torch

from inferflow.engine.generate import generate_tokens
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.speculative import distribution, speculative_generate, verify
from inferflow.errors import RequestError
from tests.conftest import tiny_llama

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


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    target = tiny_llama(tmp_path_factory.mktemp("target"), sharpen=4.0, seed=0, eos_token_id=None)[
        1
    ]
    draft = tiny_llama(tmp_path_factory.mktemp("draft"), sharpen=4.0, seed=1, eos_token_id=None)[1]
    return target, draft


@pytest.mark.parametrize("lookahead", [1, 3, 5])
def test_greedy_speculative_equals_greedy_target(models, lookahead: int) -> None:  # noqa: ANN001
    target, draft = models
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6], list(range(20, 60))):
        want = [s.token_id for s in generate_tokens(target, prompt, params)]
        res = speculative_generate(target, draft, prompt, params, lookahead)
        assert res.token_ids == want
        assert res.finish_reason == "length"
        assert res.target_passes < len(want) or lookahead == 1 or res.accepted == 0


def test_draft_equal_to_target_accepts_everything(models) -> None:  # noqa: ANN001
    target, _ = models
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=20, ignore_eos=True, seed=3)
        res = speculative_generate(target, target, [3, 1, 4], params, lookahead=4)
        assert res.acceptance_rate == 1.0
        assert len(res.token_ids) == 20 and res.target_passes == 4


def test_distribution_applies_filters() -> None:
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert distribution(x, SamplingParams()).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    pk = distribution(x, SamplingParams(temperature=1.0, top_k=2))
    assert pk[0, 2:].sum() == 0 and pk.sum() == pytest.approx(1.0)


def test_errors(models) -> None:  # noqa: ANN001
    target, draft = models
    with pytest.raises(RequestError, match="unknown speculative rule"):
        speculative_generate(target, draft, [1], SamplingParams(), rule="fast")
    with pytest.raises(RequestError, match="repetition_penalty"):
        speculative_generate(target, draft, [1], SamplingParams(repetition_penalty=1.2))
    with pytest.raises(RequestError, match="unsupported here: stop, logprobs"):
        speculative_generate(target, draft, [1], SamplingParams(stop=("x",), logprobs=1))
    with pytest.raises(RequestError, match="empty"):
        speculative_generate(target, draft, [], SamplingParams())
