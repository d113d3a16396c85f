"""Token ids in, tensors out, for every network kind: what a library user reaches for when a
model has no tokenizer or when the numbers themselves are wanted (``LanguageModel.logits``,
``.hidden_states``, ``.classify_logits`` call these).

- ``token_logits``: teacher-forced logits at every position: a decoder-only model's ids, or an
  encoder-decoder's decoder ids given its source ids.
- ``final_hidden_states``: the final hidden states (after the final norm where the network has
  one) of an encoder-only or decoder-only model's ids, or of an encoder-decoder's source ids
  (its encoder's output).
"""

from __future__ import annotations

import torch

from inferflow.engine.generate import new_cache
from inferflow.errors import RequestError
from inferflow.model.batch import FlatBatch, check_input, packed
from inferflow.model.cross import CrossBank
from inferflow.model.decoder import DecoderOnly
from inferflow.model.encoder import EncoderDecoder, EncoderOnly
from inferflow.model.network import Network


@torch.inference_mode()
def token_logits(model: Network, ids: list[int], source: list[int] | None = None) -> torch.Tensor:
    """Logits (T, vocab), float32, at each of ``ids``' positions (row t predicts token t + 1);
    an encoder-decoder needs ``source`` (its decoder ids start with its start token)."""
    h = model.spec.hparams
    if not ids:
        raise RequestError("ids: give at least one token")
    check_input(ids, h.vocab_size, h.max_positions, "ids")
    batch = FlatBatch.single(torch.tensor(ids), 0, new_cache(model, len(ids)))
    if isinstance(model, EncoderDecoder):
        if source is None:
            raise RequestError(
                f"model {model.spec.name!r} is encoder_decoder: logits need the source ids too"
            )
        memory = model.cross_memory(model.encode([source])[0])
        batch.cross = CrossBank.of([memory]).rows([0], [len(ids)])
    elif source is not None:
        raise RequestError(f"model {model.spec.name!r} has no encoder: source ids do not apply")
    elif isinstance(model, EncoderOnly):
        raise RequestError(
            f"model {model.spec.name!r} is encoder_only: it has no token logits; use "
            "hidden_states (or classify_logits with a classification head)"
        )
    batch.logits_rows = torch.arange(len(ids))
    return model(batch).float()


@torch.inference_mode()
def final_hidden_states(model: Network, ids: list[int]) -> torch.Tensor:
    """Final hidden states (T, hidden), float32; an encoder-decoder's are its encoder's, of
    source ids."""
    if isinstance(model, EncoderDecoder):
        return model.encode([ids])[0].float()
    h = model.spec.hparams
    if not ids:
        raise RequestError("ids: give at least one token")
    check_input(ids, h.vocab_size, h.max_positions, "ids")
    if isinstance(model, EncoderOnly):
        return model.hidden_states(packed([ids])).float()
    if not isinstance(model, DecoderOnly):
        raise RequestError(f"model {model.spec.name!r}: hidden states of a whole model only")
    batch = FlatBatch.single(torch.tensor(ids), 0, new_cache(model, len(ids)))
    return model.hidden_states(batch).float()
