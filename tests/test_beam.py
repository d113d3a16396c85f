"""Beam search in the engine against transformers' beam search (fp32, early_stopping=True), with
and without end tokens; beams share blocks (copy-on-write) and give every block back."""

from __future__ import annotations

import pytest
import torch

from inferflow.engine.engine import Engine
from inferflow.engine.sampling import SamplingParams
from inferflow.errors import RequestError
from tests.conftest import tiny_llama

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp("beam")
    return tiny_llama(d, sharpen=2.0, seed=3, eos_token_id=None, bos_token_id=None)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (int(5 + 7 * i),), generator=g).tolist() for i in range(n)]


def _hf_beams(ref, prompt, width, new, eos=None, lp=1.0, min_new=0):  # noqa: ANN001, ANN202
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # token 0 is no pad
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=min_new,
            early_stopping=True,
            length_penalty=lp,
            eos_token_id=eos,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    seqs = [s[len(prompt) :].tolist() for s in out.sequences]
    if eos is not None:  # transformers pads ended beams after their end token
        seqs = [s[: s.index(eos) + 1] if eos in s else s for s in seqs]
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_without_end_token(pair, width: int) -> None:
    ref, ours = pair
    eng = Engine(ours)
    free0 = eng.cache.alloc.num_free
    prompts = _prompts(3)
    params = SamplingParams(beam_width=width, n=width, max_new_tokens=10)
    got = eng.generate(prompts, params)  # three beam searches side by side
    for i, p in enumerate(prompts):
        want, scores = _hf_beams(ref, p, width, 10)
        beams = got[i * width : (i + 1) * width]
        assert [b.output_ids for b in beams] == want
        for b, s in zip(beams, scores, strict=True):
            assert b.beam_logprob / 10 == pytest.approx(s, abs=1e-4)
            assert b.finish_reason == "length"
    assert eng.cache.alloc.num_free == free0 and not eng.requests and not eng.beams


def test_beams_with_an_end_token_equal_transformers(pair) -> None:
    ref, ours = pair
    prompts = _prompts(4)
    # an end token the beams meet: the one transformers' best beam picks 5th for one prompt
    eos = _hf_beams(ref, prompts[1], 3, 6)[0][0][4]
    # min_new_tokens bans the end token below 6 tokens through the request's logits processors
    for lp, min_new in ((1.0, 0), (0.5, 0), (1.0, 6)):
        eng = Engine(ours)
        params = SamplingParams(
            beam_width=3,
            n=3,
            max_new_tokens=12,
            min_new_tokens=min_new,
            stop_token_ids=(eos,),
            length_penalty=lp,
        )
        got = eng.generate(prompts, params)
        ended = 0
        for i, p in enumerate(prompts):
            want, scores = _hf_beams(ref, p, 3, 12, eos=eos, lp=lp, min_new=min_new)
            beams = got[i * 3 : (i + 1) * 3]
            assert [b.output_ids for b in beams] == want, (i, lp, min_new)
            for b, s in zip(beams, scores, strict=True):
                assert b.beam_logprob / len(b.output_ids) ** lp == pytest.approx(s, abs=1e-4)
                assert len(b.output_ids) >= min_new
            ended += sum(b.finish_reason == "stop" for b in beams)
        assert ended > 0  # the end token did end some beams
        assert eng.cache.alloc.num_free == eng.cache.alloc.num_blocks  # no beam kept a block


def test_beams_share_blocks_and_run_beside_other_requests(pair) -> None:
    _, ours = pair
    prompt = _prompts(6)[5]  # 40 tokens: 2 full blocks shared by every beam
    eng = Engine(ours)
    free0 = eng.cache.alloc.num_free
    alone = Engine(ours).generate([prompt], SamplingParams(beam_width=4, n=2, max_new_tokens=8))
    rid = eng.add_request(prompt, SamplingParams(beam_width=4, n=2, max_new_tokens=8))
    other = eng.add_request(_prompts(2)[1], SamplingParams(max_new_tokens=8))
    eng.step()  # prefill
    eng.step()  # four beams now
    beams = [r for r in eng.requests[rid] if r.status != "finished"]
    assert len(beams) == 4
    assert len({tuple(b.kv.blocks[:2]) for b in beams}) == 1  # prompt blocks shared
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    final = [o for o in outs if o.request_id == rid]
    assert [o.index for o in final] == [0, 1] and all(o.finished for o in final)
    assert [o.token_ids for o in final] == [r.output_ids for r in alone]
    assert any(o.request_id == other and o.finished for o in outs)
    assert eng.cache.alloc.num_free == free0


def test_beam_abort_and_bad_params(pair) -> None:
    _, ours = pair
    eng = Engine(ours)
    free0 = eng.cache.alloc.num_free
    rid = eng.add_request(_prompts(3)[2], SamplingParams(beam_width=3, max_new_tokens=50))
    for _ in range(4):
        eng.step()
    assert eng.abort(rid)
    eng.step()
    assert eng.cache.alloc.num_free == free0 and not eng.beams and not eng.has_unfinished()
    with pytest.raises(RequestError, match="exceeds beam_width"):
        SamplingParams(beam_width=2, n=3)
    with pytest.raises(RequestError, match="stop strings, logprobs"):
        SamplingParams(beam_width=2, logprobs=1)
