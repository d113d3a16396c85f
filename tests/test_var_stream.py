"""Variable-width beam search and VAR-STREAM (inferflow.engine.var_stream) on a tiny random BART
over 240 sources of 2..40 tokens whose searches end at every length up to the limit.

- Streaming gives the hypotheses of the non-streaming search (token ids, end flags, order of the
  n best; scores to float rounding) and expands exactly the same beams, for several pruning
  settings, refill thresholds and batch capacities.
- Fixed width: a finite delta too large to prune (with max_per_parent = K) runs the pruning code
  and is the existing search.
- Pruning prunes: delta = 0 is greedy search; smaller settings expand fewer beams.
- The Python API and `inferflow translate --refill` give the same lines as without --refill.

Floating point: a step's GEMMs see other rows in the two searches, and a row's rounding may depend
on the number of rows (on the development machine: with fewer than 12), so scores can differ in
the last bits. The test model has large random weights (init_std 0.5): sources matter and the
logits are sharp, so no decision is anywhere near a tie that such rounding could flip; summed
scores are compared to 1e-4 (logits of this size carry a few 1e-6 of rounding per step).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from inferflow.engine.beam import Hypothesis
from inferflow.engine.search import SearchParams, SearchStats, beam_search
from inferflow.engine.var_stream import stream_search
from inferflow.errors import RequestError
from inferflow.model.build import load_model
from inferflow.runtime import LanguageModel
from inferflow.spec import load_spec
from tests.conftest import randomize, save_reference, tiny_llama
from tests.test_seq2seq_parity import ENC_DEC

tf = pytest.importorskip("transformers")
EOS = 2
K = 3
MAX_NEW = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # thousands of small steps: on a loaded machine, intra-op threads waiting for each other at
    # every op made this module 20x slower (300 s instead of 15 s); one thread, restored after
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bart(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    torch.manual_seed(0)
    # large weights: outputs depend on the source, logits are sharp; the end token's bias
    # spreads the search lengths from 1 to the limit
    ref = tf.BartForConditionalGeneration(tf.BartConfig(**ENC_DEC, init_std=0.5)).eval()
    randomize(ref)
    with torch.no_grad():
        ref.final_logits_bias[0, EOS] += 6.0
    d = tmp_path_factory.mktemp("bart")
    save_reference(ref, d)
    spec = {"name": "tiny-bart", "base": "arch/bart", "source": {"format": "hf", "files": [str(d)]}}
    (d / "spec.yaml").write_text(repr(spec).replace("'", '"'))
    return load_model(load_spec(d / "spec.yaml"))


def _sources(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 41, (n,), generator=g).tolist()
    return [torch.randint(3, 128, (k,), generator=g).tolist() for k in lengths]


SOURCES = _sources(240, seed=1)


def _params(delta: float = math.inf, per_parent: int | None = None) -> SearchParams:
    return SearchParams(
        beam_width=K,
        num_return=2,
        max_new_tokens=MAX_NEW,
        prune_delta=delta,
        max_per_parent=per_parent,
    )


_static: dict[SearchParams, tuple[list[list[Hypothesis]], SearchStats]] = {}


def static(model: torch.nn.Module, p: SearchParams) -> tuple[list[list[Hypothesis]], SearchStats]:
    """The non-streaming search over all sources in one batch (computed once per parameters)."""
    if p not in _static:
        stats = SearchStats()
        _static[p] = beam_search(model, SOURCES, p, stats=stats), stats
    return _static[p]


def assert_same(got: list[list[Hypothesis]], want: list[list[Hypothesis]]) -> None:
    assert [[(h.tokens, h.ended) for h in hs] for hs in got] == [
        [(h.tokens, h.ended) for h in hs] for hs in want
    ]
    scores = [h.logprob for hs in got for h in hs]
    torch.testing.assert_close(scores, [h.logprob for hs in want for h in hs], rtol=1e-4, atol=1e-4)


def test_sources_end_at_mixed_lengths(bart) -> None:
    hyps, _ = static(bart, _params())
    lengths = {len(hs[0].tokens) for hs in hyps}
    assert min(lengths) <= 3 and max(lengths) == MAX_NEW and len(lengths) >= 8
    assert len({tuple(hs[0].tokens) for hs in hyps}) > 150  # the source matters


@pytest.mark.parametrize(
    "delta, per_parent, refill, batch",
    [
        (math.inf, None, 0.5, 16),  # fixed width
        (1.0, 2, 0.5, 16),
        (2.5, None, 0.0, 8),  # refill only once the batch is empty
        (math.inf, 1, 1.0, 8),  # refill whenever an input finishes
        (0.5, 2, 0.2, 40),
    ],
)
def test_stream_equals_non_streaming(
    bart, delta: float, per_parent: int | None, refill: float, batch: int
) -> None:
    p = _params(delta, per_parent)
    want, want_stats = static(bart, p)
    stats = SearchStats()
    got = stream_search(bart, SOURCES, p, refill=refill, batch_size=batch, stats=stats)
    assert_same(got, want)
    assert stats.rows == want_stats.rows  # the same beams were expanded
    assert stats.refills > 1


def test_stream_equals_batched_non_streaming(bart) -> None:
    """Against the non-streaming search run batch by batch (as the CLI does without --refill)."""
    p = _params(1.0, 2)
    want: list[list[Hypothesis]] = []
    for at in range(0, len(SOURCES), 32):
        want += beam_search(bart, SOURCES[at : at + 32], p)
    assert_same(stream_search(bart, SOURCES, p, refill=0.25, batch_size=32), want)


def test_steps_expand_every_beam_of_the_smallest_length(bart, monkeypatch) -> None:
    """Every step expands all live beams of the smallest hypothesis length and no other; a
    refill brings the live beams back to n = B x K (newcomers join with one beam each), so a
    step and the cache hold more than n beams at times but never more than K x n; and it takes
    fewer, fuller steps than the static batches of B sources."""
    from inferflow.engine.var_stream import _Stream

    steps: list[tuple[int, int]] = []  # (beams stepped, live beams)
    expand = _Stream._expand

    def record(self, places):  # type: ignore[no-untyped-def]
        lengths = [len(b.out) for b in self.beams]
        shortest = min(lengths)
        assert sorted(places) == [i for i, n in enumerate(lengths) if n == shortest]
        steps.append((len(places), len(lengths)))
        return expand(self, places)

    monkeypatch.setattr(_Stream, "_expand", record)
    B, p = 8, _params(1.0, 2)
    n = B * K
    stats = SearchStats()
    # refill whenever an input is over: at 0.25 the batch was empty at every refill here (the
    # inputs of one refill often reach the length limit together), so no beam ever waited
    stream_search(bart, SOURCES, p, refill=1.0, batch_size=B, stats=stats)
    assert len(steps) == stats.steps
    assert steps[0] == (n, n)  # the first refill: n sources, one beam each
    assert max(size for size, _ in steps) > n  # the newcomers widened past n in one step
    assert all(size <= live <= K * n for size, live in steps)
    assert any(size < live for size, live in steps)  # longer beams waited
    assert n < stats.peak_rows <= K * n
    static_stats = SearchStats()
    for at in range(0, len(SOURCES), B):
        beam_search(bart, SOURCES[at : at + B], p, stats=static_stats)
    assert stats.rows == static_stats.rows and stats.steps < static_stats.steps
    assert static_stats.peak_rows <= n


def test_fixed_width_is_the_existing_search(bart) -> None:
    fixed, fixed_stats = static(
        bart, SearchParams(beam_width=K, num_return=2, max_new_tokens=MAX_NEW)
    )
    # a finite delta too large to prune runs the pruning code and changes nothing, floats included
    stats = SearchStats()
    assert beam_search(bart, SOURCES, _params(1e9, K), stats=stats) == fixed
    assert stats.rows == fixed_stats.rows


def test_pruning_prunes(bart) -> None:
    fixed, fixed_stats = static(bart, _params())
    # delta = 0 keeps only each step's best candidate: greedy search
    greedy_stats = SearchStats()
    greedy = beam_search(
        bart, SOURCES, SearchParams(beam_width=1, max_new_tokens=MAX_NEW), stats=greedy_stats
    )
    zero, zero_stats = static(bart, _params(0.0))
    assert [hs[0].tokens for hs in zero] == [hs[0].tokens for hs in greedy]
    assert zero_stats.rows == greedy_stats.rows
    assert all(len(hs) == 1 for hs in zero)  # one hypothesis finishes, fewer than the 2 asked
    # a wider delta expands strictly more beams and comes closer to the fixed-width results
    deltas = (0.5, 1.0, 2.0)
    runs = [static(bart, _params(delta)) for delta in deltas]
    rows = [zero_stats.rows, *(stats.rows for _, stats in runs), fixed_stats.rows]
    assert rows == sorted(set(rows))
    same = [_same_best(hyps, fixed) for hyps, _ in runs]
    assert same == sorted(same) and 0 < same[0] and same[-1] < len(SOURCES)
    # one live child per beam: the width never grows past the first step's single beam
    one, one_stats = static(bart, _params(math.inf, 1))
    assert one_stats.rows <= len(SOURCES) * MAX_NEW < fixed_stats.rows
    assert 0 < _same_best(one, fixed) < len(SOURCES)


def _same_best(a: list[list[Hypothesis]], b: list[list[Hypothesis]]) -> int:
    return sum(x[0].tokens == y[0].tokens for x, y in zip(a, b, strict=True))


def test_decoder_only_stream(tmp_path: Path) -> None:
    """Prompts of different lengths: rows of one step have different cache lengths."""
    _, model = tiny_llama(tmp_path, sharpen=6.0, eos_token_id=EOS, bos_token_id=None)
    prompts = _sources(40, seed=3)
    p = SearchParams(beam_width=K, max_new_tokens=10, prune_delta=1.5, num_return=2)
    assert_same(
        stream_search(model, prompts, p, refill=0.5, batch_size=6), beam_search(model, prompts, p)
    )


def test_translate_api(bart) -> None:
    lm = LanguageModel(bart.spec, bart, None)
    sources = [SOURCES[0], [], *SOURCES[1:30]]
    p = _params(1.0, 2)
    out = lm.translate_ids(sources, p, refill=0.5, batch_size=4)
    assert out == lm.translate_ids(sources, p) == lm.translate_ids(sources, p, batch_size=7)
    assert out[1] == [[], []]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"prune_delta": -1.0}, "prune_delta: must be >= 0 (inf = off), got -1.0"),
        ({"prune_delta": math.nan}, "prune_delta: must be >= 0"),
        ({"max_per_parent": 0}, "max_per_parent: must be in [1, beam_width = 3], got 0"),
        ({"max_per_parent": 4}, "max_per_parent: must be in [1, beam_width = 3], got 4"),
    ],
)
def test_bad_parameters(kw: dict, message: str) -> None:
    with pytest.raises(RequestError) as e:
        SearchParams(beam_width=K, **kw)
    assert message in str(e.value)


def test_bad_stream_arguments(bart) -> None:
    with pytest.raises(RequestError, match=r"refill: must be in \[0, 1\], got 1.5"):
        stream_search(bart, SOURCES[:2], _params(), refill=1.5)
    with pytest.raises(RequestError, match="batch_size: must be at least 1, got 0"):
        stream_search(bart, SOURCES[:2], _params(), batch_size=0)
    with pytest.raises(RequestError, match="source 1 is empty"):  # checked before anything runs
        stream_search(bart, [[5], []], _params())


def _write_ids(path: Path, sources: list[list[int]]) -> None:
    path.write_text("".join(" ".join(map(str, s)) + "\n" for s in sources))


def test_cli_refill_round_trip(bart, tmp_path: Path, capsys) -> None:
    from inferflow.cli.main import main

    sources = [*SOURCES[:20], [], *SOURCES[20:60]]
    src = tmp_path / "src.txt"
    _write_ids(src, sources)
    common = ["translate", str(bart.spec.path), "--input", str(src), "--ids", "--beam", str(K)]
    common += ["--max-tokens", str(MAX_NEW), "--n-best", "2", "--batch-size", "8"]
    common += ["--prune-delta", "1.0", "--max-per-parent", "2"]
    assert main([*common, "--refill", "0.5"]) == 0
    streamed = capsys.readouterr().out.splitlines()
    assert main(common) == 0
    assert streamed == capsys.readouterr().out.splitlines()
    assert len(streamed) == len(sources) and streamed[20] == "\t"  # two empty hypotheses
    hyps = stream_search(bart, [s for s in sources if s], _params(1.0, 2), refill=0.5, batch_size=8)
    want = [
        "\t".join(" ".join(map(str, h.tokens[:-1] if h.ended else h.tokens)) for h in hs)
        for hs in hyps
    ]
    assert [line for i, line in enumerate(streamed) if i != 20] == want


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--refill", "1.5"], "--refill: must be in [0, 1], got 1.5"),
        (["--refill", "-0.1"], "--refill: must be in [0, 1], got -0.1"),
        (["--prune-delta", "-2"], "--prune-delta: must be >= 0 (inf = off), got -2.0"),
        (["--max-per-parent", "5"], "--max-per-parent: must be in [1, --beam = 4], got 5"),
        (["--max-per-parent", "0"], "--max-per-parent: must be in [1, --beam = 4], got 0"),
        (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
        (["--n-best", "5"], "--n-best (5) exceeds --beam (4)"),
        (["--max-tokens", "0"], "--max-tokens: must be at least 1, got 0"),
    ],
)
def test_cli_bad_values(bart, flags: list[str], message: str, capsys, monkeypatch) -> None:
    """The library's checks, named as flags, before the weights load."""
    from inferflow.cli import translate
    from inferflow.cli.main import main

    def no_load(*args: object, **kw: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(translate, "load", no_load)
    assert main(["translate", str(bart.spec.path), "--beam", "4", *flags]) == 2
    assert message in capsys.readouterr().err


def test_annalog_translate_refill() -> None:
    """The real SMILES model: streaming text translation equals the non-streaming one."""
    import importlib.util

    if importlib.util.find_spec("annalog") is None:
        pytest.skip("annalog is not installed (python tools/fetch_models.py annalog)")
    from inferflow.runtime import load

    lm = load("annalog-smiles")
    lines = ["CCO", "c1ccccc1O", "", "CC(=O)Nc1ccc(O)cc1", "Clc1ccc(Br)cc1", "O=C1CCCN1"] * 2
    p = SearchParams(beam_width=4, max_new_tokens=60, prune_delta=3.0, max_per_parent=2)
    got = lm.translate(lines, p, refill=0.5, batch_size=2)
    assert got == lm.translate(lines, p)
    assert got[2] == "" and all(got[i] for i in (0, 1, 3))
