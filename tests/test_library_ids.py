"""Token ids in, numbers out, through the library (``LanguageModel.logits``, ``.hidden_states``,
``.classify_logits``, ``.classify`` on ids) for each network kind, against an independent
reference: transformers on SmolLM2's GGUF (decoder-only), transformers' BERT on rxnfp's
checkpoint (encoder-only with a head), tg2fa-translit's own nn.Transformer (encoder-decoder).
"""

from __future__ import annotations

import pytest
import torch

from inferflow.errors import RequestError
from inferflow.runtime import load
from tests.serving import smollm2_transformers
from tests.test_real_packages import REACTIONS, TAJIK, _package_dir


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert got.shape == want.shape and err <= rel, f"relative error {err:.2e}"


def test_decoder_only_logits_and_hidden_states() -> None:
    ref, tok = smollm2_transformers()
    lm = load("smollm2-135m-instruct", "float32", quant="none")
    ids = tok("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
    _close(lm.logits(ids), out.logits[0])
    _close(lm.hidden_states(ids), out.hidden_states[-1][0])  # (after the final norm)
    with pytest.raises(RequestError, match="has no encoder: source ids do not apply"):
        lm.logits(ids, source=[1, 2])


def test_encoder_only_hidden_states_and_classifier_logits() -> None:
    import transformers

    root = _package_dir("rxnfp") / "models" / "transformers" / "bert_ft_10k_25s"
    ref = transformers.BertForSequenceClassification.from_pretrained(str(root)).eval()
    lm = load("rxnfp-reaction-classifier", "float32")
    assert lm.tokenizer is not None
    inputs = [lm.tokenizer.encode(r) for r in REACTIONS]
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([x])).logits for x in inputs])
        states = ref.bert(torch.tensor([inputs[0]])).last_hidden_state[0]
    _close(lm.classify_logits(inputs), want)
    _close(lm.classify(inputs), torch.softmax(want, -1))  # ids in: the same as text in
    _close(lm.hidden_states(inputs[0]), states)
    with pytest.raises(RequestError, match="encoder_only: it has no token logits"):
        lm.logits(inputs[0])


def test_encoder_decoder_logits_and_encoder_states() -> None:
    _package_dir("tg2fa_translit")
    import numpy as np
    from tg2fa_translit.decode import tg_voc
    from tg2fa_translit.transformer import transformer

    lm = load("tg2fa-translit", "float32")
    for word in TAJIK[:3]:
        src = [2, *(tg_voc[c] for c in word), 3]
        tgt = [2, 41, 11, 9, 10]  # any decoder ids: teacher forcing
        s = np.array(src).reshape(-1, 1)
        with torch.no_grad():
            memory = transformer.encode(s, np.zeros((len(src), len(src)), bool))
            mask = (np.triu(np.ones((len(tgt), len(tgt)))) == 0).T
            dec = transformer.decode(np.array(tgt).reshape(-1, 1), memory, mask)
            want = transformer.generator(dec[0])
        _close(lm.logits(tgt, source=src), want)
        _close(lm.hidden_states(src), memory[:, 0])
    with pytest.raises(RequestError, match="encoder_decoder: logits need the source ids"):
        lm.logits([2, 5])
