"""Batched beam search (inferflow.engine.search) against transformers' generate(num_beams=k):
encoder-decoder and decoder-only tiny models, several inputs of different lengths searched in
one batch, each compared with transformers run on that input alone; token ids and scores."""

from __future__ import annotations

import pytest
import torch

from inferflow.engine.output_layer import fused_topk, naive_topk
from inferflow.engine.search import (
    Decoding,
    SearchParams,
    SearchStats,
    beam_search,
    ngram_bans,
    prune_mask,
)
from inferflow.engine.var_stream import stream_search
from inferflow.errors import Stopped
from inferflow.model.build import load_model
from inferflow.spec import load_spec
from tests.conftest import randomize, save_reference, tiny_llama
from tests.test_seq2seq_parity import ENC_DEC

tf = pytest.importorskip("transformers")
EOS = 2


def _sharpen_enc_dec(model: torch.nn.Module) -> None:
    # random logits are nearly flat: sharpen them, and make the end token likely enough to
    # end some hypotheses early
    with torch.no_grad():
        model.final_logits_bias.mul_(3.0)
        model.final_logits_bias[0, EOS] = model.final_logits_bias.max() + 0.5


@pytest.fixture(scope="module")
def bart(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    ref = tf.BartForConditionalGeneration(tf.BartConfig(**ENC_DEC)).eval()
    randomize(ref)
    _sharpen_enc_dec(ref)
    d = tmp_path_factory.mktemp("bart")
    save_reference(ref, d)
    spec = {"name": "tiny-bart", "base": "arch/bart", "source": {"format": "hf", "files": [str(d)]}}
    (d / "spec.yaml").write_text(repr(spec).replace("'", '"'))
    return ref, load_model(load_spec(d / "spec.yaml"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("llama")
    return tiny_llama(d, sharpen=6.0, eos_token_id=EOS, bos_token_id=None, pad_token_id=0)


def _inputs(n: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (k,), generator=g).tolist() for k in lengths[:n]]


def _reference(
    ref, ids: list[int], enc_dec: bool, p: SearchParams
) -> list[tuple[list[int], float]]:
    kw = dict(
        num_beams=p.beam_width,
        num_return_sequences=p.num_return,
        length_penalty=p.length_penalty,
        early_stopping=p.early_stopping,
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        no_repeat_ngram_size=p.no_repeat_ngram,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        eos_token_id=EOS,
        forced_eos_token_id=None,  # BART's config forces the end token at the length limit
        forced_bos_token_id=None,
        pad_token_id=0 if not enc_dec else 1,
    )
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor([ids]), **kw)
    skip = 1 if enc_dec else len(ids)
    result = []
    for r, seq in enumerate(out.sequences.tolist()):
        toks = seq[skip:]
        if EOS in toks:
            toks = toks[: toks.index(EOS) + 1]
        score = float(out.sequences_scores[r]) if p.beam_width > 1 else float("nan")
        result.append((toks, score))
    return result


PARAMS = [
    SearchParams(beam_width=1, max_new_tokens=12),
    SearchParams(beam_width=4, max_new_tokens=12),
    SearchParams(beam_width=4, num_return=3, length_penalty=0.6, max_new_tokens=10),
    SearchParams(beam_width=4, early_stopping=False, length_penalty=1.3, max_new_tokens=10),
    SearchParams(beam_width=4, min_new_tokens=4, no_repeat_ngram=2, max_new_tokens=10),
]


def _check(ref, model, enc_dec: bool, p: SearchParams, fused: bool) -> None:
    inputs = _inputs(4, (9, 3, 14, 6), seed=p.beam_width + p.max_new_tokens)
    ours = beam_search(model, inputs, p, fused=fused)
    for ids, hyps in zip(inputs, ours, strict=True):
        expect = _reference(ref, ids, enc_dec, p)
        assert [h.tokens for h in hyps] == [t for t, _ in expect]
        if p.beam_width > 1:
            got = [h.score(p.length_penalty) for h in hyps]
            torch.testing.assert_close(got, [s for _, s in expect], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "naive"])
@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"w{p.beam_width}")
def test_encoder_decoder_matches_transformers(bart, p: SearchParams, fused: bool) -> None:
    ref, model = bart
    _check(ref, model, True, p, fused)


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"w{p.beam_width}")
def test_decoder_only_matches_transformers(llama, p: SearchParams) -> None:
    ref, model = llama
    _check(ref, model, False, p, True)


def test_some_hypotheses_end_early(bart) -> None:
    """The fixtures exercise the end-token path: not every hypothesis runs to the limit."""
    _, model = bart
    p = SearchParams(beam_width=4, max_new_tokens=12)
    hyps = beam_search(model, _inputs(4, (9, 3, 14, 6), seed=16), p)
    assert any(h.ended for hs in hyps for h in hs)


def test_dropping_finished_inputs_changes_nothing(bart) -> None:
    _, model = bart
    p = SearchParams(beam_width=4, max_new_tokens=12)
    inputs = _inputs(4, (9, 3, 14, 6), seed=5)
    assert beam_search(model, inputs, p) == beam_search(model, inputs, p, drop_finished=False)


def test_cache_rows_hold_each_input_not_more(llama) -> None:
    """A row holds one input's prefix and new tokens, both bounded by the context: a short
    prompt's many new tokens and a long prompt's few are not added up (that allocated nearly
    twice the context)."""
    _, model = llama
    n_pos = model.spec.hparams.max_positions
    inputs = _inputs(2, (1, n_pos - 50), seed=3)
    core = Decoding(model, SearchParams(max_new_tokens=10 * n_pos), {EOS}, True, SearchStats())
    limits = core.limits(inputs)
    assert limits == [n_pos - 1, 50]
    assert core.new_cache(inputs, limits, capacity=2).k.shape[2] == n_pos


def test_stop_ends_a_search_between_steps(bart) -> None:
    """``stop`` is asked before every step: plain and streaming searches end with Stopped at
    the step it first answers True (the server's abort of a search every client left), and
    one that never answers True changes nothing."""
    _, model = bart
    p = SearchParams(beam_width=3, max_new_tokens=12)
    inputs = _inputs(4, (9, 3, 14, 6), seed=5)
    for run in (
        lambda stop: beam_search(model, inputs, p, stop=stop),
        lambda stop: stream_search(model, inputs, p, refill=0.5, batch_size=2, stop=stop),
    ):
        asked: list[int] = []

        def stop_at_third(asked: list[int] = asked) -> bool:
            asked.append(1)
            return len(asked) == 3

        with pytest.raises(Stopped, match="stopped before it finished"):
            run(stop_at_third)
        assert len(asked) == 3  # no step ran after the answer
        assert run(lambda: False) == beam_search(model, inputs, p)


def test_fused_output_layer_equals_naive() -> None:
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(5, 16, generator=g), torch.randn(300, 16, generator=g), torch.randn(300)
    banned = [[], [3, 7], [], [299], list(range(0, 300, 2))]
    for chunk in (7, 64, 300):
        v1, i1 = fused_topk(h, w, b, 6, banned, chunk=chunk)
        v2, i2 = naive_topk(h, lambda x: torch.nn.functional.linear(x, w, b), 6, banned)
        assert torch.equal(i1, i2)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
    assert not (i1[4] % 2 == 0).any()  # banned tokens are never candidates


def test_ngram_bans() -> None:
    assert ngram_bans([5, 6, 5], 2) == [6]
    assert ngram_bans([1, 2, 3, 1, 2], 3) == [3]
    assert ngram_bans([1, 2], 3) == []
    assert sorted(ngram_bans([4, 4, 9], 1)) == [4, 4, 9]


def test_prune_mask_by_hand() -> None:
    """Two beams (W = 2) with their 2W candidates, best first; token 2 ends a hypothesis."""
    total = torch.tensor([[-0.5, -1.0, -1.25, -3.0], [-0.75, -1.25, -1.5, -2.0]])
    toks = torch.tensor([[5, 2, 7, 8], [2, 9, 6, 2]])
    ends = torch.tensor([2])
    F, T = False, True

    def mask(last: bool = False, **kw: float) -> list[list[bool]] | None:
        p = SearchParams(beam_width=2, **kw)
        m = prune_mask(total[None], toks[None], ends, p, torch.tensor([last]))
        return None if m is None else m[0].tolist()

    # more than delta = 1 below the best (-0.5): under -1.5; -1.5 itself stays
    assert mask(prune_delta=1.0) == [[F, F, F, T], [F, F, F, T]]
    # one live child per beam: an end token is none (row 0: 7 is the second live child, row 1:
    # 9 the first), so the ending candidates stay
    assert mask(max_per_parent=1) == [[F, F, T, T], [F, F, T, F]]
    assert mask(prune_delta=1.0, max_per_parent=1) == [[F, F, T, T], [F, F, T, T]]
    # at the last step every candidate finishes: no cap, delta still applies
    assert mask(last=True, prune_delta=1.0, max_per_parent=1) == [[F, F, F, T], [F, F, F, T]]
    assert mask(last=True, max_per_parent=1) == [[F] * 4] * 2
    # fixed width: a cap of W never binds, so nothing is computed
    assert mask() is None
    assert mask(max_per_parent=2) is None


def test_prune_mask_takes_each_inputs_own_best_and_last_step() -> None:
    """Two inputs ranked together: delta counts from each input's own best, and the cap on
    live children lifts only for the input at its last step."""
    total = torch.tensor([[[-0.5, -1.0, -1.75, -2.0]], [[-5.0, -5.5, -6.25, -9.0]]])
    toks = torch.tensor([[[4, 5, 6, 7]], [[4, 5, 6, 7]]])
    F, T = False, True
    p = SearchParams(beam_width=2, prune_delta=1.0)
    m = prune_mask(total, toks, torch.tensor([2]), p, torch.tensor([False, False]))
    assert m is not None and m.tolist() == [[[F, F, T, T]], [[F, F, T, T]]]
    p = SearchParams(beam_width=2, max_per_parent=1)
    m = prune_mask(total, toks, torch.tensor([2]), p, torch.tensor([False, True]))
    assert m is not None and m.tolist() == [[[F, T, T, T]], [[F, F, F, F]]]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"beam_width": 0}, "beam_width: must be at least 1"),
        ({"beam_width": 2, "num_return": 3}, "num_return (3) exceeds beam_width (2)"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens (9) exceeds"),
    ],
)
def test_bad_parameters(kw: dict, message: str) -> None:
    from inferflow.errors import RequestError

    with pytest.raises(RequestError) as e:
        SearchParams(**kw)
    assert message in str(e.value)


def test_bad_inputs(bart) -> None:
    from inferflow.errors import RequestError

    _, model = bart
    with pytest.raises(RequestError, match="source 1 is empty"):
        beam_search(model, [[5], []], SearchParams())
    with pytest.raises(RequestError, match="source 0 has 80 tokens; the model takes at most 64"):
        beam_search(model, [[5] * 80], SearchParams())


def test_translate_cli_ids(bart, tmp_path, capsys) -> None:
    """One output line per input line, an empty line for an empty line, ids in and out; the
    outputs are transformers' beam search results."""
    from inferflow.cli.main import main

    ref, model = bart
    inputs = _inputs(3, (9, 3, 14), seed=7)
    src = tmp_path / "src.txt"
    src.write_text(
        "\n".join([" ".join(map(str, inputs[0])), "", *(" ".join(map(str, x)) for x in inputs[1:])])
        + "\n"
    )
    spec = str(model.spec.path)
    rc = main(
        [
            "translate",
            spec,
            "--input",
            str(src),
            "--ids",
            "--beam",
            "4",
            "--max-tokens",
            "12",
            "--batch-size",
            "2",
        ]
    )
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1] == ""
    p = SearchParams(beam_width=4, max_new_tokens=12)
    for line, ids in zip([lines[0], lines[2], lines[3]], inputs, strict=True):
        toks, _ = _reference(ref, ids, True, p)[0]
        assert line == " ".join(map(str, toks[:-1] if toks[-1] == EOS else toks))


def test_translate_cli_errors(bart, tmp_path, capsys) -> None:
    from inferflow.cli.main import main

    _, model = bart
    src = tmp_path / "src.txt"
    src.write_text("5 6\n" + " ".join(["7"] * 70) + "\n")
    assert main(["translate", str(model.spec.path), "--input", str(src), "--ids"]) == 2
    err = capsys.readouterr().err
    assert "line 2 has 70 tokens; the model takes at most 64" in err
    src.write_text("5 x\n")
    assert main(["translate", str(model.spec.path), "--input", str(src), "--ids"]) == 2
    assert "line 1: not space-separated token ids" in capsys.readouterr().err
    src.write_text("5 999\n")
    assert main(["translate", str(model.spec.path), "--input", str(src), "--ids"]) == 2
    assert "token id 999 is outside the vocabulary 0..127" in capsys.readouterr().err


def test_engine_refuses_encoder_decoder(bart) -> None:
    from inferflow.engine.engine import Engine
    from inferflow.errors import SpecError

    with pytest.raises(SpecError, match="runs decoder_only networks, not encoder_decoder"):
        Engine(bart[1])
