"""Load everything a spec names: network with weights, tokenizer. The Python entry point:

from inferflow.runtime import load
lm = load("smollm2-135m-instruct")
print(lm.complete("The capital of France is", SamplingParams(max_new_tokens=8)).text)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from inferflow.engine.beam import Hypothesis
from inferflow.engine.classify import (
    classify_batch,
    classify_head,
    probabilities,
    token_classify_batch,
)
from inferflow.engine.embed import embed_batch, resolve_pooling
from inferflow.engine.generate import StepOutput, generate_tokens
from inferflow.engine.sampling import SamplingParams
from inferflow.engine.search import SearchParams, StopCheck, beam_search
from inferflow.engine.token_ids import final_hidden_states, token_logits
from inferflow.engine.var_stream import stream_search
from inferflow.errors import RequestError, SpecError
from inferflow.heap import keep_freed_memory
from inferflow.model.batch import check_input
from inferflow.model.build import load_model, parse_dtype
from inferflow.model.network import Network
from inferflow.quant import get_format
from inferflow.quant.linear import ACT8, set_activations
from inferflow.spec import Spec, load_spec
from inferflow.spec.types import QuantSpec
from inferflow.tokenizer import Tokenizer, load_tokenizer
from inferflow.tokenizer.sources import SourceContext

log = logging.getLogger(__name__)

AUTO = "auto"  # dtype: act8 where the model has integer products, else float32 (load's doc)


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    extra: dict[str, Any] = field(default_factory=dict)


def tokenizer_for(spec: Spec, side: str = "target") -> Tokenizer | None:
    """The spec's tokenizer; ``side`` "source": an encoder-decoder's source-side one where the
    spec gives two (``tokenizer: {source, target}``), else the one tokenizer."""
    two = spec.source_tokenizer is not None
    t = spec.source_tokenizer if side == "source" and two else spec.tokenizer
    assert t is not None
    where = f"tokenizer.{side}" if two else "tokenizer"
    if t.kind == "none":
        return None
    metadata = None
    if t.kind == "gguf" and not t.files:
        from inferflow.loaders.gguf import read_gguf_metadata

        metadata = read_gguf_metadata(spec.source.files[0])
    overrides = {
        k: v
        for k, v in (
            ("chat_template", t.chat_template),
            ("add_bos", t.add_bos),
            ("add_eos", t.add_eos),
        )
        if v is not None
    }
    return load_tokenizer(
        t.kind,
        t.files,
        metadata,
        overrides,
        pattern=t.pattern,
        pipeline=t.pipeline,
        sources=SourceContext(spec.source.config),
        where=where,
    )


def require_tokenizer(spec: Spec, tok: Tokenizer | None) -> Tokenizer:
    if tok is None:
        raise RequestError(
            f"spec {spec.name!r} declares no tokenizer: pass token ids (the CLI's --ids)"
        )
    return tok


def ids_from_text(text: str, where: str = "input") -> list[int]:
    """Space-separated token ids (``"12 7 431"``); anything else is an error naming ``where``."""
    try:
        return [int(t) for t in text.split()]
    except ValueError:
        raise RequestError(f"{where}: not space-separated token ids: {text[:60]!r}") from None


def encode_prompt(
    tok: Tokenizer, prompt: str, chat: bool = False, system: str | None = None
) -> list[int]:
    """A prompt's token ids: raw text with the tokenizer's special tokens, or (``chat``) the
    user message (after ``system``) through the chat template. Needs no weights: commands call
    it before loading them, so a missing template fails at once."""
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        # the template writes BOS itself where the model wants one
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(prompt, add_special_tokens=True)


@dataclass
class LanguageModel:
    spec: Spec
    model: Network
    tokenizer: Tokenizer | None  # an encoder-decoder's target side, when the sides differ
    source_tokenizer: Tokenizer | None = None  # the source side, where the spec gives one

    @property
    def input_tokenizer(self) -> Tokenizer | None:
        """What encodes input text: the source side's, else the one tokenizer."""
        return self.source_tokenizer or self.tokenizer

    def encode_prompt(
        self, prompt: str, chat: bool = False, system: str | None = None
    ) -> list[int]:
        return encode_prompt(self._tok(), prompt, chat, system)

    def encode_source(self, text: str, ids: bool = False, where: str = "input") -> list[int]:
        """A source line as token ids (``ids``: the line is space-separated ids); an empty
        line gives no tokens; too long a line is an error naming ``where`` and both lengths."""
        if not text.strip():
            return []
        if not ids:
            out = require_tokenizer(self.spec, self.input_tokenizer).encode(text)
        else:
            out = ids_from_text(text, where)
        h = self.spec.encoder_hparams
        check_input(out, h.vocab_size, h.max_positions, where)
        return out

    def search(
        self,
        sources: list[list[int]],
        params: SearchParams,
        refill: float | None = None,
        batch_size: int | None = None,
        stop: StopCheck | None = None,
    ) -> list[list[Hypothesis]]:
        """For each source, its best hypotheses (at most ``num_return``, best first; generated
        ids with the end token, if it ended); an empty source gets none. ``batch_size``: sources
        searched together (default: all at once). ``refill``: search streaming (VAR-STREAM,
        inferflow.engine.var_stream), refilled with waiting sources up to ``batch_size``
        (default 32) x beam width live beams when they drop to ``refill`` x that;
        the hypotheses are the same, only the speed differs. ``stop``: asked before every step;
        True ends the search with ``Stopped``."""
        todo = [i for i, s in enumerate(sources) if s]
        todo_ids = [sources[i] for i in todo]
        if batch_size is not None and batch_size < 1:
            raise RequestError(f"batch_size: must be at least 1, got {batch_size}")
        if refill is not None:
            hyps = stream_search(
                self.model, todo_ids, params, self._end_ids(), refill, batch_size or 32, stop=stop
            )
        else:
            step = batch_size or max(1, len(todo_ids))
            hyps = [
                h
                for at in range(0, len(todo_ids), step)
                for h in beam_search(
                    self.model, todo_ids[at : at + step], params, self._end_ids(), stop=stop
                )
            ]
        out: list[list[Hypothesis]] = [[] for _ in sources]
        for i, hs in zip(todo, hyps, strict=True):
            out[i] = hs
        return out

    def translate_ids(
        self,
        sources: list[list[int]],
        params: SearchParams,
        refill: float | None = None,
        batch_size: int | None = None,
    ) -> list[list[list[int]]]:
        """For each source, its best outputs (at most ``num_return``; token ids, end token
        dropped); an empty source gives ``num_return`` empty outputs. The arguments are
        ``search``'s."""
        return [
            [h.tokens[:-1] if h.ended else h.tokens for h in hs] or [[]] * params.num_return
            for hs in self.search(sources, params, refill, batch_size)
        ]

    def translate(
        self,
        lines: list[str],
        params: SearchParams | None = None,
        refill: float | None = None,
        batch_size: int | None = None,
    ) -> list[str]:
        """The best output text for each input line (an empty line gives an empty output);
        ``refill`` and ``batch_size`` as in ``translate_ids``."""
        p = params or SearchParams(beam_width=4, max_new_tokens=self.spec.generation.max_new_tokens)
        ids = [self.encode_source(t, where=f"line {n}") for n, t in enumerate(lines, 1)]
        return [self.decode_target(o[0]) for o in self.translate_ids(ids, p, refill, batch_size)]

    def decode_target(self, ids: list[int], ids_only: bool = False) -> str:
        if ids_only or self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids)

    def _end_ids(self) -> tuple[int, ...]:
        eos = tuple(self.tokenizer.eos_ids) if self.tokenizer else ()
        if not eos and self.spec.hparams.eos_id is not None:
            eos = (self.spec.hparams.eos_id,)
        return eos

    def _tok(self) -> Tokenizer:
        return require_tokenizer(self.spec, self.tokenizer)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        return generate_tokens(self.model, prompt_ids, params, self._end_ids())

    def complete(
        self, prompt: str | list[int], params: SamplingParams, chat: bool = False
    ) -> Completion:
        ids = list(prompt) if isinstance(prompt, list) else self.encode_prompt(prompt, chat)
        out, reason = [], None
        for step in self.stream(ids, params):
            out.append(step.token_id)
            reason = step.finish_reason
        shown = out[:-1] if reason == "stop" else out
        text = self.tokenizer.decode(shown) if self.tokenizer else ""
        return Completion(text, ids, out, reason)

    def embed(
        self,
        texts: Sequence[str | list[int]],
        pooling: str | None = None,
        normalize: bool | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Embeddings of texts (or token-id lists), all in packed batches: (B, hidden), or a list
        of (T_i, hidden) for pooling "none". Pooling and normalisation default to the spec's
        ``embeddings:`` (an encoder-only network without one: mean, L2-normalised)."""
        if isinstance(texts, str):
            raise RequestError("embed takes a list of texts, got one string")
        pooling, normalize = resolve_pooling(self.spec, pooling, normalize)
        ids = [
            list(t) if isinstance(t, list) else self._tok().encode(t, add_special_tokens=True)
            for t in texts
        ]
        return embed_batch(self.model, ids, pooling, normalize)

    def logits(self, ids: list[int], source: list[int] | None = None) -> torch.Tensor:
        """Teacher-forced logits (T, vocab) at each position of token ``ids`` (row t predicts
        token t + 1); an encoder-decoder's are its decoder's, given the ``source`` ids."""
        return token_logits(self.model, ids, source)

    def hidden_states(self, ids: list[int]) -> torch.Tensor:
        """Final hidden states (T, hidden) of token ``ids`` (an encoder-decoder: its encoder's
        output for source ids)."""
        return final_hidden_states(self.model, ids)

    def classify_logits(self, inputs: Sequence[list[int]]) -> torch.Tensor:
        """A classification head's logits (B, labels) of token-id inputs, before any softmax
        (``classify`` gives the probabilities)."""
        return classify_batch(self.model, [list(x) for x in inputs])

    def token_classify(self, inputs: Sequence[str | list[int]]) -> list[torch.Tensor]:
        """A ``token_classify`` head's label probabilities for every token (T_i, labels) of
        texts or token-id lists (a text's tokens: ``self.tokenizer.encode(text)``)."""
        ids = [list(x) if isinstance(x, list) else self._tok().encode(x) for x in inputs]
        spans = classify_head(self.model).spans()
        return [probabilities(x, spans) for x in token_classify_batch(self.model, ids)]

    def classify(self, inputs: Sequence[str | tuple[str, str] | list[int]]) -> torch.Tensor:
        """Label probabilities (B, labels) of texts, text pairs (a cross-encoder's (query,
        document)) or token-id lists, in packed batches; a one-label head gives sigmoid relevance scores
        (``inferflow.engine.classify``). Labels: ``self.spec.hparams.labels``."""
        if isinstance(inputs, str):
            raise RequestError("classify takes a list of texts, got one string")
        ids, types = [], []
        for x in inputs:
            if isinstance(x, list):  # token ids already
                i, t = list(x), None
            else:
                tok = self._tok()
                i, t = tok.encode_pair(*x) if isinstance(x, tuple) else (tok.encode(x), None)
            ids.append(i)
            types.append(t or [0] * len(i))
        pairs = any(isinstance(x, tuple) for x in inputs)
        logits = classify_batch(self.model, ids, types if pairs else None)
        return probabilities(logits, classify_head(self.model).spans())


def quant_for(spec: Spec, quant: str | None) -> QuantSpec | None:
    """The quantization ``load(spec, quant=quant)`` runs with (None: the spec's own). A format
    name replaces the spec's default format and keeps the rest of its quant section (overrides,
    kernel, dense_batch); "none" runs everything in float, the checkpoint's own quantized blocks
    too. An unknown name fails here, listing the known ones, before anything is loaded."""
    if quant is None:
        return None
    if quant == "none":
        return replace(spec.quant, weights=None, overrides=(), checkpoint="dequantize")
    get_format(quant)
    return replace(spec.quant, weights=quant)


def load(
    ref: str | Path | Spec,
    dtype: str | torch.dtype = "float32",
    quant: str | None = None,
    tokenizer: Tokenizer | None = None,
) -> LanguageModel:
    """``quant`` replaces the spec's default weight format (``quant_for``): a format name
    re-quantizes every linear layer, "none" runs everything in float. ``tokenizer``: one
    already made by ``tokenizer_for(spec)`` (checks that need no weights ran on it).
    ``dtype`` "auto" (the CLI's default): act8 where some quantized layer takes 8-bit inputs
    into integer products, else float32 (float checkpoints, no C kernels, partitioned models)."""
    spec = ref if isinstance(ref, Spec) else load_spec(ref)
    keep_freed_memory()  # (the process runs a model: its step buffers stay with it)
    # (a bad source-side tokenizer fails before weights load, too)
    source_tok = tokenizer_for(spec, "source") if spec.source_tokenizer is not None else None
    auto = dtype == AUTO
    act8 = dtype == ACT8 or auto  # float32, with 8-bit inputs into integer products
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    q = quant_for(spec, quant)
    if spec.partition is not None:  # every rank loads its own share (inferflow.parallel)
        if auto:
            act8 = False
            log.info("dtype auto: float32 (a partitioned model)")
        if act8:
            raise SpecError(f"dtype {ACT8!r}: not for partitioned models yet; use float32")
        from inferflow.parallel.layout import resolve_layout
        from inferflow.parallel.runtime import launch

        layout = resolve_layout(spec.partition, spec, q)
        tokenizer = (
            tokenizer if tokenizer is not None else tokenizer_for(spec)
        )  # (a bad one fails before processes start)
        return LanguageModel(spec, launch(spec, layout, dt, q), tokenizer, source_tok)
    tokenizer = (
        tokenizer if tokenizer is not None else tokenizer_for(spec)
    )  # (a bad one fails before weights load)
    if spec.source.format == "gguf":  # the tokenizer holds what it needs of the vocabulary
        from inferflow.loaders.gguf import forget_metadata

        forget_metadata()
    model = load_model(spec, dt, q)
    if act8:
        n = set_activations(model, True)
        if n:
            log.info(
                "dtype %s%s: %d layers take 8-bit inputs into integer dot products (--dtype "
                "float32: the exact mode)",
                ACT8,
                " (auto: quantized weights)" if auto else "",
                n,
            )
        elif auto:
            set_activations(model, False)
            log.info("dtype auto: float32 (no quantized layer with an integer path here)")
        else:
            log.warning(
                "dtype %s: no layer of %s has an integer path here (quantized codes on their C "
                "plane: every tile on AVX-512 builds with VNNI, 4-bit tiles on portable ones): "
                "it runs as float32",
                ACT8,
                spec.name,
            )
    else:
        log.info("dtype %s", dtype)
    return LanguageModel(spec, model, tokenizer, source_tok)
