"""Sampling vectorized across a step's rows (sampling.sample_batch, engine.batch_sampling):
every row draws exactly the token its own sampler draws alone, whatever its batch-mates; the
vectorized filters equal inferflow.engine.logits' filters composed, bit for bit; the inverse-CDF
draw against a plain-Python statement of it, its edge cases and its distribution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from inferflow.engine import batch_sampling as B
from inferflow.engine import logits as L
from inferflow.engine.sampling import (
    GREEDY,
    OWN,
    VECTOR,
    Sampler,
    SamplingParams,
    finite,
    make_sampler,
    sample_batch,
    scaled,
)
from inferflow.errors import RequestError

V = 1000
END = 3  # the end token banned below min_new_tokens

# one row each: every strategy, the vectorized ones with and without processors
MIX = [
    dict(),  # greedy
    dict(repetition_penalty=1.3),  # greedy with a processor
    dict(temperature=0.8),
    dict(temperature=1.2, top_k=20),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, min_p=0.05),
    dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.02),
    dict(temperature=1.0, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0.9, logit_bias={5: 8.0, 6: -100.0}),
    dict(temperature=1.0, top_k=5, min_new_tokens=3),
    dict(temperature=1e-300),  # underflows to greedy
    dict(temperature=1.0, mirostat=2, mirostat_tau=4.0),
    dict(temperature=1.0, mirostat=1),
    dict(fsd_alpha=0.5, fsd_k=4, fsd_n=2),
    dict(temperature=1.0, fsd_alpha=0.5, fsd_n=2, fsd_random_steps=2),
    dict(temperature=1.0, typical_p=0.7, top_k=40),
    dict(temperature=1.0, tfs_z=0.9, repetition_penalty=1.1),
]


def _samplers(seed: int = 100) -> list[Sampler]:
    return [make_sampler(SamplingParams(seed=seed + i, **kw), (END,)) for i, kw in enumerate(MIX)]


def _step_logits(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(len(MIX), V, generator=g) * 3
    x[9, END] = 25.0  # the min_new_tokens row: the end token wins as soon as it may
    x[4] /= 20  # flat: the top-p row's nucleus reaches past the first candidates (a full sort)
    return x


def _prompts(b: int = len(MIX)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, V, (12,), generator=g).tolist() for _ in range(b)]


def test_kinds_cover_the_mix() -> None:
    kinds = [s.kind([]) for s in _samplers()]
    assert {GREEDY, VECTOR, OWN} == set(kinds)
    assert kinds.count(VECTOR) == 10  # randomized FSD samples its first steps like the others


def test_batch_equals_each_sampler_alone_over_steps() -> None:
    """The same seeds drawn three ways for 8 steps: the whole mix in one batch, each sampler
    alone, and the rows split into two batches in reversed order (other batch-mates); the
    generators and mirostat / FSD states advance identically in all three."""
    batch, alone, split = _samplers(), _samplers(), _samplers()
    prompts = _prompts()
    outs: list[list[int]] = [[] for _ in MIX]
    idx = list(range(len(MIX)))
    halves = [idx[::2][::-1], idx[1::2][::-1]]
    for step in range(8):
        x = _step_logits(step)
        got = sample_batch(batch, x, prompts, outs)
        want = [alone[i](x[i], prompts[i], outs[i]) for i in idx]
        other = [0] * len(MIX)
        for rows in halves:
            toks = sample_batch(
                [split[i] for i in rows],
                x[rows],
                [prompts[i] for i in rows],
                [outs[i] for i in rows],
            )
            for i, t in zip(rows, toks, strict=True):
                other[i] = t
        assert got == want == other, step
        for o, t in zip(outs, got, strict=True):
            o.append(t)
    assert END not in outs[9][:3] and outs[9][3] == END
    assert len({tuple(o) for o in outs}) > 10  # the rows really sample different things


def _reference(z: torch.Tensor, k: int, p: float, m: float) -> torch.Tensor:
    """Probabilities (V,) float64 of one row by logits' own 1-D filters, composed."""
    return torch.softmax(L.min_p(L.top_p(L.top_k(z, k), p), m), -1).double()


def _reference_token(
    s: Sampler, u: float, x: torch.Tensor, prompt: list[int], out: list[int]
) -> int:
    """A vectorized row by the definitions: logits' own filters on the 1-D row, then, in draw
    order (vocabulary order without a filter, else descending logit with ties in id order), the
    first token whose running float64 sum exceeds u * total (a Python loop)."""
    p = s.params
    z = scaled(finite(s.process(x, prompt, out)), p.temperature)
    probs = _reference(z, p.top_k, p.top_p, p.min_p)
    sorted_ = (0 < p.top_k < len(z)) or p.top_p < 1
    order = sorted(range(len(z)), key=lambda i: -float(z[i])) if sorted_ else range(len(z))
    vals = [float(probs[i]) for i in order]
    target, acc = u * math.fsum(vals), 0.0
    for i, q in zip(order, vals, strict=True):
        acc += q
        if acc > target:
            return i
    raise AssertionError("no token reached u * total")


def test_vectorized_rows_match_a_reference_draw() -> None:
    """The same tokens as the reference draw over 4 steps (the probabilities agree to float
    rounding, so only a u within rounding of a boundary could differ: none of these)."""
    samplers, prompts = _samplers(), _prompts()
    refs = _samplers()  # twins, for their uniforms
    outs: list[list[int]] = [[] for _ in MIX]
    for step in range(4):
        x = _step_logits(step)
        got = sample_batch(samplers, x, prompts, outs)
        for i, s in enumerate(refs):
            if s.kind(outs[i]) == VECTOR:
                want = _reference_token(s, s.uniform(), x[i], prompts[i], outs[i])
                assert got[i] == want, (step, MIX[i])
            elif s.kind(outs[i]) == OWN:
                s(x[i], prompts[i], outs[i])  # keep the twin's state in step
        for o, t in zip(outs, got, strict=True):
            o.append(t)


def _vocab_probs(dists: list[B.Dist], b: int, v: int) -> tuple[torch.Tensor, dict[int, int]]:
    """The probabilities (b, V) the draw uses, back in vocabulary order, and each row's width."""
    out = torch.zeros(b, v, dtype=torch.float64)
    width = {}
    for d in dists:
        p = torch.diff(d.cdf, dim=-1, prepend=torch.zeros(len(d.rows), 1, dtype=torch.float64))
        out[d.rows] = (
            p if d.ids is None else torch.zeros(len(d.rows), v).double().scatter(1, d.ids, p)
        )
        width.update({i: d.cdf.shape[1] for i in d.rows})
    return out, width


ROW_K = [0, 1, 5, 40, 0, 10**6, 0, 0, 7, 100, 0, 2, 0, 0, 30, 1, 300, 5000, 0, 0]
ROW_P = [1.0, 1.0, 0.5, 1.0, 0.9, 1.0, 0.3, 0.99, 0.8, 0.95, 1.0, 1.0, 1e-9, 1.0, 0.7, 0.6]
ROW_P += [1.0, 0.9, 0.999, 0.6]
ROW_M = [0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.2, 0.0, 0.0, 0.9, 0.01, 0.0]
ROW_M += [0.0, 0.0, 0.0, 0.001]


@pytest.mark.parametrize("v", [1000, 8192])
@pytest.mark.parametrize("seed", range(3))
def test_distributions_equal_the_filters_composed(v: int, seed: int) -> None:
    """Per-row top-k / top-p / min-p, vectorized (candidates, widened up to a full sort), keep
    the tokens logits.top_k -> top_p -> min_p keep on each row alone, with the same
    probabilities to float rounding. Rows with sharp, flat and tied logits (rounded to
    quarters: ties at the candidates' edge), banned tokens, top-k past each width."""
    g = torch.Generator().manual_seed(seed)
    b = len(ROW_K)
    z = torch.randn(b, v, generator=g) * 3
    z[1::3] = (z[1::3] * 4).round() / 4
    z[3, ::5] = -math.inf
    z[7] /= 30  # flat: a 0.99 nucleus of most of the vocabulary
    z[18] /= 10
    got, width = _vocab_probs(B.distributions(z, ROW_K, ROW_P, ROW_M), b, v)
    for i in range(b):
        kept = set((got[i] > 0).nonzero().flatten().tolist())
        # a token whose mass before it is within float32 rounding of top_p may go either way
        # (the two sums run in different orders): the reference at p - 1e-5 and p + 1e-5 too
        ps = [ROW_P[i]] + ([ROW_P[i] - 1e-5, ROW_P[i] + 1e-5] if ROW_P[i] < 1 else [])
        wants = [_reference(z[i], ROW_K[i], q, ROW_M[i]) for q in ps]
        matching = [w for w in wants if set(_kept_ids(w, 1e-12)) <= kept <= set(_kept_ids(w))]
        assert matching, i
        torch.testing.assert_close(got[i], matching[0], rtol=1e-4, atol=1e-9)
    # widths: a sharp nucleus stays in the first candidates; a flat one takes a full sort
    assert width[2] == min(256, v) and width[7] == v
    # a row alone is what it is in the batch
    alone, _ = _vocab_probs(B.distributions(z[7:9], ROW_K[7:9], ROW_P[7:9], ROW_M[7:9]), 2, v)
    assert torch.equal(alone, got[7:9])


def test_ties_across_the_candidates_edge_widen_the_search() -> None:
    """300 tied most likely tokens (scattered ids): top-k 256 keeps all 300 (ties with the k-th
    stay) and top-p 0.5 keeps the first half of them in id order; neither is decidable from 256
    candidates, so both rows widen, and keep what logits' filters keep."""
    v = 8192
    z = torch.full((v,), -10.0)
    tied = torch.randperm(v, generator=torch.Generator().manual_seed(0))[:300]
    z[tied] = 1.0
    zz = z.expand(2, -1)
    got, width = _vocab_probs(B.distributions(zz, [256, 0], [1.0, 0.5], [0.0, 0.0]), 2, v)
    assert width == {0: 4096, 1: 4096}
    for i, (k, q) in enumerate([(256, 1.0), (0, 0.5)]):
        want = _reference(z, k, q, 0.0)
        assert _kept_ids(got[i]) == _kept_ids(want)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-9)
    assert len(_kept_ids(got[0])) == 300
    assert _kept_ids(got[1]) == sorted(tied.tolist())[: len(_kept_ids(got[1]))]


def _kept_ids(p: torch.Tensor, floor: float = 0.0) -> list[int]:
    return (p > floor).nonzero().flatten().tolist()


def test_inverse_cdf_edge_cases() -> None:
    probs = torch.tensor(
        [
            [0.0, 0.25, 0.0, 0.25, 0.5, 0.0, 0.0],  # banned tokens at both ends and inside
            [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],  # all on one token
            [1e-30, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],  # a vanishing token first
        ]
    )
    c = B.cdf(probs)
    below_one = math.nextafter(1.0, 0.0)
    for u, want in [(0.0, [1, 3, 0]), (0.2, [1, 3, 6]), (0.25, [3, 3, 6]), (below_one, [4, 3, 6])]:
        got = B.inverse_cdf(c, torch.full((3,), u, dtype=torch.float64)).tolist()
        assert got == want, u
    # u * total rounded up to the total: the last token with probability, not past the end
    assert B.inverse_cdf(c, torch.ones(3, dtype=torch.float64)).tolist() == [4, 3, 6]
    # many uniforms: a banned token never comes out
    u = torch.rand(3000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    drawn = B.inverse_cdf(B.cdf(probs[:1].expand(3000, -1)), u)
    assert set(drawn.tolist()) == {1, 3, 4}


def test_no_token_to_draw_is_a_request_error() -> None:
    probs = torch.tensor([[0.5, 0.5], [0.0, 0.0], [math.nan, 1.0]])
    with pytest.raises(RequestError, match=r"rows \[1, 2\]: no token has a positive probability"):
        B.cdf(probs)


def _broken(x: torch.Tensor, prompt: object, output: object) -> torch.Tensor:
    """A processor that fails (injected: the engine refuses up front every bad input it can
    see, such as a logit-bias token outside the vocabulary)."""
    raise RuntimeError("a processor failed")


def test_a_failing_row_fails_before_any_generator_moves() -> None:
    """A processor that fails raises before the vectorized rows take their uniforms, so a
    retry row by row draws the same tokens."""
    x = _step_logits(0)[:3]
    ok = [make_sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=s)) for s in (1, 2)]
    bad = make_sampler(SamplingParams(temperature=1.0, seed=3))
    bad.processors.append(_broken)
    states = [s.gen.get_state() for s in ok]
    with pytest.raises(RuntimeError, match="a processor failed"):
        sample_batch([ok[0], bad, ok[1]], x, [[]] * 3, [[]] * 3)
    assert all(torch.equal(s.gen.get_state(), st) for s, st in zip(ok, states, strict=True))


def test_a_row_squeezed_to_one_token_always_draws_it() -> None:
    x = torch.randn(V, generator=torch.Generator().manual_seed(2))
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.999), dict(temperature=1e-30)):
        s = make_sampler(SamplingParams(**{"temperature": 1.0, "seed": 0, **kw}))
        assert {s(x) for _ in range(50)} == {int(x.argmax())}, kw


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square with df degrees of freedom (Wilson-Hilferty; z = 3.09 is the
    normal's 0.999 quantile)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("kw", [dict(top_k=12), dict(top_p=0.8), dict()])
def test_draws_follow_the_probabilities(kw: dict) -> None:
    """50 seeded samplers in one batch for 400 steps (20000 draws) over 1000 tokens, 15 of them
    likely: the counts of the kept tokens pass a chi-square test at p = 0.001 against the
    renormalised kept probabilities (top-k 12, top-p 0.8: the candidate path; no filter: the
    vocabulary-order path, the unlikely tail pooled into one cell), and nothing else is drawn."""
    x = torch.full((1000,), -4.0)
    x[:15] = torch.linspace(2.0, -1.0, 15)
    x = x[torch.randperm(1000, generator=torch.Generator().manual_seed(5))]
    ps = SamplingParams(temperature=1.0, **kw)
    samplers = [make_sampler(dataclasses.replace(ps, seed=s)) for s in range(50)]
    counts = torch.zeros(1000)
    for _ in range(400):
        for t in sample_batch(samplers, x.expand(50, -1), [[]] * 50, [[]] * 50):
            counts[t] += 1
    want = _reference(x, ps.top_k, ps.top_p, ps.min_p)
    kept = _kept_ids(want, 1e-4)
    obs = counts[kept].tolist() + [float(counts.sum() - counts[kept].sum())]
    exp = [float(q) * 20000 for q in want[kept]] + [float(1 - want[kept].sum()) * 20000]
    if exp[-1] < 1e-6:  # nothing outside the kept set: it must not be drawn
        assert obs.pop() == 0 and exp.pop() < 1e-6
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    assert chi2 < _chi2_critical(len(obs) - 1), (chi2, len(obs))


# --- through the engine ---------------------------------------------------------------------


def test_engine_mixed_batch_equals_alone_and_isolates_a_bad_request(tiny_model) -> None:  # noqa: ANN001
    """Requests of every strategy in one engine batch draw what each draws alone; one whose
    processor fails ends with "error" alone (the batched draw fails, each request is drawn
    alone)."""
    from inferflow.engine.engine import Engine, EngineConfig
    from inferflow.engine.generate import generate_tokens

    base = dict(max_new_tokens=10, ignore_eos=True)
    kinds = [
        dict(),
        dict(temperature=3.0, seed=1),
        dict(temperature=2.0, top_p=0.9, seed=2),
        dict(temperature=2.5, top_k=8, min_p=0.01, repetition_penalty=1.2, seed=3),
        dict(temperature=2.0, mirostat=2, seed=4),
        dict(temperature=2.0, typical_p=0.8, seed=5),
        dict(temperature=2.0, n=2, seed=6),
    ]
    params = [SamplingParams(**base, **kw) for kw in kinds]
    bad = SamplingParams(**base, temperature=1.0, seed=7)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (5 + 3 * i,), generator=g).tolist() for i in range(8)]
    eng = Engine(tiny_model, None, EngineConfig())
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, [*params, bad], strict=True)]
    groups = [eng.requests[r] for r in rids]
    groups[-1][0].sampler.processors.append(_broken)
    while eng.has_unfinished():
        eng.step()
    assert groups[-1][0].finish_reason == "error"
    for p, sp, group in zip(prompts[:-1], params, groups[:-1], strict=True):
        for r in group:
            alone = SamplingParams(**{**sp.__dict__, "n": 1, "seed": r.params.seed})
            assert r.output_ids == [s.token_id for s in generate_tokens(tiny_model, p, alone)]
            assert r.finish_reason == "length"
    assert len({tuple(r.output_ids) for g in groups[1:-1] for r in g}) > 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_argmax_rows_is_torchs_argmax(dtype: torch.dtype) -> None:
    """Greedy rows' tokens (numpy's argmax on the CPU) are torch's argmax: the first of tied
    largest values, a NaN as the largest, all -inf -> 0, a large vocabulary, strided rows."""
    g = torch.Generator().manual_seed(3)
    z = torch.randint(-5, 6, (9, 151936), generator=g).to(dtype)  # (many ties)
    z[1, 7] = z[1, 100] = z[1, 151935] = 40  # three tied maxima: the first
    z[2, 50], z[2, 60] = math.nan, 100  # a NaN counts as the largest
    z[3] = -math.inf
    z[4, 151935] = math.inf
    z[5, :] = 0.0
    z[5, 9] = -0.0  # (-0 equals 0: the first still wins)
    z[6, 1000:2000] = torch.finfo(dtype).max
    for rows in (z, z[:, ::3], z[[8, 2, 2]], z[:1]):
        assert B.argmax_rows(rows) == rows.argmax(-1).tolist()
