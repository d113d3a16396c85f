"""Every sampling strategy against an independent statement of its definition: plain-Python
reference filters, empirical distributions, mirostat's surprise tracking, FSD's n-gram penalty,
penalties by hand, stop strings and logprobs through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from inferflow.engine import logits as L
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.fsd import NGramAntiLM
from inferflow.engine.sampling import SamplingParams, make_sampler
from inferflow.errors import RequestError


def _logits(v: int = 50, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * scale


def _kept(x: torch.Tensor) -> set[int]:
    return {i for i, val in enumerate(x.tolist()) if val != float("-inf")}


def _probs(x: torch.Tensor) -> list[float]:
    m = max(x.tolist())
    e = [math.exp(v - m) for v in x.tolist()]
    return [v / sum(e) for v in e]


# --- plain-Python references of each filter's definition ---------------------------------------


def ref_min_p(x: torch.Tensor, m: float) -> set[int]:
    p = _probs(x)
    return {i for i, q in enumerate(p) if q >= m * max(p)}


def ref_typical(x: torch.Tensor, mass: float) -> set[int]:
    p = _probs(x)
    h = -sum(q * math.log(q) for q in p if q > 0)
    order = sorted(range(len(p)), key=lambda i: abs(-math.log(p[i]) - h))
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += p[i]
        if total >= mass:
            break
    return kept


def ref_tail_free(x: torch.Tensor, z: float) -> set[int]:
    p = _probs(x)
    order = sorted(range(len(p)), key=lambda i: -p[i])
    s = [p[i] for i in order]
    d1 = [s[i] - s[i + 1] for i in range(len(s) - 1)]
    d2 = [abs(d1[i] - d1[i + 1]) for i in range(len(d1) - 1)]
    tot = sum(d2)
    cum, last = 0.0, len(s)
    for i, d in enumerate(d2):
        cum += d / tot
        if cum > z:
            last = i
            break
    return set(order[: max(last, 1)])


@pytest.mark.parametrize("seed", range(5))
def test_filters_match_reference_definitions(seed: int) -> None:
    x = _logits(seed=seed)
    for m in (0.05, 0.2, 0.6):
        assert _kept(L.min_p(x, m)) == ref_min_p(x, m)
    for mass in (0.2, 0.5, 0.9):
        assert _kept(L.typical(x, mass)) == ref_typical(x, mass)
    for z in (0.3, 0.7, 0.95):
        assert _kept(L.tail_free(x, z)) == ref_tail_free(x, z)
    k = L.top_k(x, 5)
    assert _kept(k) == set(torch.topk(x, 5).indices.tolist())


def _counts(params: SamplingParams, x: torch.Tensor, n: int) -> torch.Tensor:
    s = make_sampler(params)
    c = torch.zeros(x.numel())
    for _ in range(n):
        c[s(x)] += 1
    return c


@pytest.mark.parametrize(
    "kw,ref",
    [
        (dict(min_p=0.1), lambda x: ref_min_p(x, 0.1)),
        (dict(typical_p=0.6), lambda x: ref_typical(x, 0.6)),
        (dict(tfs_z=0.8), lambda x: ref_tail_free(x, 0.8)),
    ],
)
def test_samples_stay_in_the_kept_set_with_renormalised_frequencies(kw, ref) -> None:  # noqa: ANN001
    x = _logits(20, seed=3, scale=1.5)
    kept = ref(x)
    c = _counts(SamplingParams(temperature=1.0, seed=1, **kw), x, 4000)
    assert set(c.nonzero().flatten().tolist()) <= kept
    p = torch.tensor(_probs(x))
    want = torch.zeros_like(p)
    idx = torch.tensor(sorted(kept))
    want[idx] = p[idx] / p[idx].sum()
    # each frequency within 4.5 standard deviations of its binomial expectation
    sd = (want * (1 - want) / 4000).sqrt()
    assert ((c / 4000 - want).abs() <= 4.5 * sd + 1e-9).all()


def _zipf(v: int = 1000, s: float = 1.1) -> torch.Tensor:
    return -s * torch.log(torch.arange(1, v + 1, dtype=torch.float32))


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_tracks_its_target_surprise(version: int) -> None:
    """Mirostat steers the surprise of the token it draws, -log2 of its probability in the
    truncated, renormalised distribution, to tau; measured on the full distribution that is tau
    plus log2(1 / kept mass), so the mean lies a little above tau and follows it."""
    x = _zipf()
    full = _probs(x)
    means = []
    for tau in (2.0, 3.5, 5.0):  # below the entropy (about 6.7 bits), so reachable
        s = make_sampler(
            SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=tau, seed=0)
        )
        surprises = [-math.log2(full[s(x)]) for _ in range(3000)]
        means.append(sum(surprises[500:]) / len(surprises[500:]))
        assert tau - 0.3 < means[-1] < tau + 1.5, (version, tau, means[-1])
    assert means[0] < means[1] < means[2]
    # untruncated sampling of this distribution would average its entropy, far from 3 bits
    entropy = -sum(p * math.log2(p) for p in full)
    assert entropy > 6.0


def test_fsd_penalises_repeated_ngrams() -> None:
    prompt = [5, 7, 1, 5, 7, 2, 5, 7, 3, 5]
    x = torch.full((10,), -10.0)
    x[7], x[8] = 2.0, 1.8  # the model slightly prefers repeating "5 7"
    greedy = make_sampler(SamplingParams())
    fsd = make_sampler(SamplingParams(fsd_alpha=0.6, fsd_k=4, fsd_n=2))
    assert greedy(x, prompt, []) == 7
    assert fsd(x, prompt, []) == 8
    # alpha -> 0 is greedy; the anti-LM itself: after "5", 7 followed 3 of 3 times
    assert make_sampler(SamplingParams(fsd_alpha=1e-6, fsd_n=2))(x, prompt, []) == 7
    anti = NGramAntiLM(2)
    assert anti.probs(prompt, torch.tensor([7, 8])).tolist() == [1.0, 0.0]
    # an unseen context backs off to unigrams, discounted
    u = anti.probs([*prompt, 9], torch.tensor([5, 7]))
    assert u.tolist() == pytest.approx([0.5 * 4 / 11, 0.5 * 3 / 11])


def test_randomized_fsd_samples_first_then_fsd() -> None:
    prompt = [5, 7, 5, 7, 5]
    x = torch.full((10,), -10.0)
    x[7], x[8] = 2.0, 1.9
    s = make_sampler(
        SamplingParams(temperature=1.0, fsd_alpha=0.6, fsd_k=2, fsd_n=2, fsd_random_steps=2, seed=0)
    )
    firsts = {s(x, prompt, []) for _ in range(40)}  # step 0, forty draws
    assert firsts == {7, 8}  # sampled: both appear
    assert s(x, prompt, [8, 5]) == 8  # step 2: FSD (after "5": 7 twice, 8 once), deterministic


def test_penalties_and_bias_by_hand() -> None:
    x = torch.tensor([2.0, -1.0, 0.5, 3.0])
    rep = L.repetition_penalty(2.0)(x, [0], [1])
    assert rep.tolist() == [1.0, -2.0, 0.5, 3.0]
    pf = L.presence_frequency_penalty(0.5, 0.25)(x, [3], [2, 2, 0])
    assert pf.tolist() == [2.0 - 0.5 - 0.25, -1.0, 0.5 - 0.5 - 0.5, 3.0]  # prompt not counted
    assert L.logit_bias({1: 10.0})(x, [], []).argmax() == 1
    s = make_sampler(SamplingParams(min_new_tokens=2), end_ids=(3,))
    assert s(x, [], []) == 0 and s(x, [], [0, 0]) == 3


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(min_p=1.0), "min_p"),
        (dict(typical_p=0.0), "typical_p"),
        (dict(mirostat=3), "mirostat"),
        (dict(fsd_alpha=1.0), "fsd_alpha"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logit_bias={1: 500.0}), "logit_bias"),
        (dict(min_new_tokens=9, max_new_tokens=4), "min_new_tokens"),
        (dict(stop=("",)), "stop"),
        (dict(logprobs=50), "logprobs"),
    ],
)
def test_invalid_params_name_the_field(kw: dict, msg: str) -> None:
    with pytest.raises(RequestError, match=msg):
        SamplingParams(**kw)


# --- through the engine: stop strings and logprobs ----------------------------------------------


class _Letters:
    """A stand-in tokenizer: token t is the letter chr(97 + t % 26)."""

    eos_ids: tuple[int, ...] = ()

    class _Dec:
        def push(self, t: int) -> str:
            return chr(97 + t % 26)

        def flush(self) -> str:
            return ""

    def incremental_decoder(self, skip_special: bool = True, spaces: bool | None = None) -> _Dec:
        return self._Dec()


def _letters_engine(model) -> Engine:  # noqa: ANN001
    return Engine(model, _Letters(), EngineConfig())


def _run(eng: Engine, prompt: list[int], params: SamplingParams):  # noqa: ANN202
    return list(eng.stream(prompt, params))


def test_stop_strings_cut_the_text_and_hold_back_partial_matches(tiny_model) -> None:  # noqa: ANN001
    eng = _letters_engine(tiny_model)
    prompt = [3, 1, 4, 1, 5]
    free = "".join(o.text for o in _run(eng, prompt, SamplingParams(max_new_tokens=12)))
    assert len(free) == 12
    stop = free[4:6]
    outs = _run(eng, prompt, SamplingParams(max_new_tokens=12, stop=(stop, "zzzz")))
    text = "".join(o.text for o in outs)
    assert text == free[: free.index(stop)]
    assert outs[-1].finish_reason == "stop"
    # nothing of the stop string was ever emitted
    assert all(stop not in "".join(o.text for o in outs[: i + 1]) for i in range(len(outs)))
    # include_stop_str_in_output (vLLM's): the text ends with the stop string
    kept = SamplingParams(max_new_tokens=12, stop=("zzzz", stop), include_stop_str_in_output=True)
    outs = _run(eng, prompt, kept)
    assert "".join(o.text for o in outs) == free[: free.index(stop) + len(stop)]
    assert outs[-1].finish_reason == "stop"


def test_logprobs_are_log_softmax_of_the_model(tiny_model) -> None:  # noqa: ANN001
    from inferflow.engine.generate import new_cache, prefill

    eng = _letters_engine(tiny_model)
    prompt = [3, 1, 4, 1, 5]
    outs = _run(eng, prompt, SamplingParams(max_new_tokens=3, logprobs=3))
    toks = [o.token_ids[0] for o in outs]
    for i, o in enumerate(outs):
        ref = torch.log_softmax(
            prefill(tiny_model, prompt + toks[:i], new_cache(tiny_model, 32)), -1
        )
        (lp,) = o.logprobs
        assert lp.token_id == toks[i] == int(ref.argmax())
        assert lp.logprob == pytest.approx(float(ref.max()), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()
