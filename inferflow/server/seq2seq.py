"""``/v1/completions`` for encoder-decoder models: source text in, target text out.

Each prompt is a source; the model searches (``LanguageModel.search``: greedy at width 1, beam
search above) and each source gets ``n`` choices, its ``n`` best hypotheses, at indices
``source * n + rank``. Concurrent requests with the same search parameters run in one batched
search (``Batcher``), and one request's list of prompts is a batch in itself: that is the
server's ``/v1/translations``-style batch use.

Search is deterministic: the fields that shape a sampling distribution (temperature, top_p,
penalties, ...) are refused unless they hold their neutral value; ``seed`` and ``user`` are
accepted and change nothing. ``max_tokens`` left unset takes the spec's
``generation.max_new_tokens`` (not OpenAI's 16: a target is a whole sentence or molecule).
Streaming sends each choice's whole text in one chunk once the search is done, then the usage
(if asked) and ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from inferflow.engine.beam import Hypothesis
from inferflow.engine.search import SearchParams
from inferflow.errors import RequestError
from inferflow.model.batch import check_inputs
from inferflow.runtime import LanguageModel
from inferflow.server.protocol import CompletionBody, sse_event
from inferflow.server.runner import EngineRunner, until_disconnect

SEARCH_BATCH = 32  # sources searched together at most

# request fields a search cannot honour, with the values that mean "off"
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "temperature": (None, 0.0),
    "top_p": (None, 1.0),
    "top_k": (None, 0),
    "min_p": (0.0,),
    "typical_p": (1.0,),
    "tfs_z": (1.0,),
    "mirostat": (0,),
    "fsd_alpha": (0.0,),
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "logit_bias": (None, {}),
    "logprobs": (None,),
    "ignore_eos": (False,),
    "stop_token_ids": (None, []),
}
SUPPORTED = "max_tokens, min_tokens, n, beam_width, length_penalty, stop, stream"


def search_params(body: CompletionBody, lm: LanguageModel) -> SearchParams:
    for name, off in NEUTRAL.items():
        if getattr(body, name) not in off:
            raise RequestError(
                f"{name}: model {lm.spec.name!r} is encoder_decoder and decodes by search "
                f"(greedy, or beam search with beam_width > 1), not by sampling; leave {name} "
                f"unset. Supported: {SUPPORTED}"
            )
    max_new = (
        body.max_tokens
        if "max_tokens" in body.model_fields_set and body.max_tokens is not None
        else lm.spec.generation.max_new_tokens
    )
    return SearchParams(
        beam_width=max(body.beam_width, body.n),
        length_penalty=body.length_penalty,
        num_return=body.n,
        max_new_tokens=max_new,
        min_new_tokens=min(body.min_tokens, max_new),
    )


async def complete(
    lm: LanguageModel,
    runner: EngineRunner,
    head: dict[str, Any],
    body: CompletionBody,
    sources: list[list[int]],
    request: Request,
) -> Any:
    params = search_params(body, lm)
    h = lm.spec.encoder_hparams
    check_inputs(sources, h.vocab_size, h.max_positions, "prompt")

    def search(inputs: list[list[int]], stop: Callable[[], bool]) -> list[list[Hypothesis]]:
        return lm.search(inputs, params, batch_size=SEARCH_BATCH, stop=stop)

    hyps = await until_disconnect(
        runner.batch(("search", params), sources, search), request.is_disconnected
    )
    stop = body.stop_strings()
    choices, generated = [], 0
    for i, hs in enumerate(hyps):
        # (n of them unless the search finished fewer: no empty choice stands in for those)
        for j, hyp in enumerate(hs):
            generated += len(hyp.tokens)
            text, reason = _text(lm, hyp, stop)
            choice = {"index": i * body.n + j, "text": text, "logprobs": None}
            choice["finish_reason"] = reason
            if body.return_token_ids or lm.tokenizer is None:  # (vLLM's return_token_ids)
                choice["prompt_token_ids"] = sources[i]
                choice["token_ids"] = hyp.tokens
            choices.append(choice)
    prompt = sum(map(len, sources))
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": generated}
    usage["total_tokens"] = prompt + generated
    usage["prompt_tokens_details"] = {"cached_tokens": 0}  # (sources are encoded afresh)
    head = {  # (head: the model's name and the server's system_fingerprint)
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        **head,
    }
    if not body.stream:
        return {**head, "choices": choices, "usage": usage}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def sse() -> AsyncIterator[str]:
        for c in choices:
            yield sse_event({**head, "choices": [c]})
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _text(lm: LanguageModel, hyp: Hypothesis, stop: list[str]) -> tuple[str, str]:
    """The hypothesis' text (end token dropped) cut before the first stop string, and its
    finish reason: "stop" for an end token or a stop string, "length" at the token limit."""
    text = lm.decode_target(hyp.tokens[:-1] if hyp.ended else hyp.tokens)
    cuts = [at for at in (text.find(s) for s in stop) if at >= 0]
    if cuts:
        return text[: min(cuts)], "stop"
    return text, "stop" if hyp.ended else "length"
