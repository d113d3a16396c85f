"""``echo``, ``logprobs`` and vLLM's ``prompt_logprobs`` on ``/v1/completions`` (what
evaluation harnesses, lm-evaluation-harness ``local-completions``, score) and chat. The prompt's own
token log-probabilities come from one teacher-forced pass over it
(``evaluate.prompt_logprobs_steps``), not from the engine's prefill, which the prefix cache may
skip; ``max_tokens: 0`` with ``echo`` scores the prompt and generates nothing. The pass runs
through the runner's batcher as a resumable call, ``chunk`` positions at a time with an engine
step between two chunks, so a long prompt delays no stream by more than a chunk, and a client
that leaves stops it within one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from inferflow.evaluate import PromptLogprobs, prompt_logprobs_steps
from inferflow.runtime import LanguageModel
from inferflow.server.batcher import Steps
from inferflow.server.runner import EngineRunner, until_disconnect
from inferflow.tokenizer import Tokenizer


@dataclass
class Echo:
    """What a prompt's choices start with: its text (``echo``), its tokens' OpenAI logprobs
    part (``echo`` with ``logprobs``) and vLLM's ``prompt_logprobs`` list."""

    text: str = ""
    logprobs: dict[str, list[Any]] | None = None
    prompt_logprobs: list[Any] | None = None


async def echoes(
    lm: LanguageModel,
    runner: EngineRunner,
    prompts: list[list[int]],
    texts: list[str] | None,
    echo_logprobs: int | None,
    prompt_logprobs: int | None,
    disconnected: Callable[[], Awaitable[bool]],
    chunk: int,
) -> list[Echo]:
    """Per prompt, its Echo: ``texts``, what each prompt's choices start with (None: nothing);
    ``echo_logprobs``: the echoed prompt's OpenAI logprobs part, with this many alternatives
    (completions' echo with logprobs); ``prompt_logprobs``: vLLM's list, this many
    alternatives; ``chunk``: positions scored between two engine steps."""
    tok = lm.tokenizer
    assert tok is not None  # (a model without a tokenizer takes token ids and answers none)
    scores: list[PromptLogprobs] = []
    if echo_logprobs is not None or prompt_logprobs is not None:
        top = max(echo_logprobs or 0, prompt_logprobs or 0)

        def run(batch: list[list[int]], stop: Callable[[], bool]) -> Steps:
            out = []  # (the batcher checks for the client before each chunk)
            for ids in batch:
                out.append((yield from prompt_logprobs_steps(lm.model, ids, top, chunk)))
            return out

        # (a key of its own: a scoring call serves one request, so its client's leaving stops it)
        job = runner.batch(("prompt_logprobs", uuid.uuid4().hex), prompts, run)
        scores = await until_disconnect(job, disconnected)

    def build() -> list[Echo]:  # (a long prompt's logprobs are many small objects)
        out = []
        for i, ids in enumerate(prompts):
            e = Echo(texts[i] if texts is not None else "")
            if echo_logprobs is not None:
                e.logprobs = _openai_part(tok, ids, scores[i], echo_logprobs)
            if prompt_logprobs is not None:
                e.prompt_logprobs = _vllm_list(tok, ids, scores[i], prompt_logprobs)
            out.append(e)
        return out

    return await asyncio.to_thread(build)


def _openai_part(tok: Tokenizer, ids: list[int], s: PromptLogprobs, k: int) -> dict[str, Any]:
    """The completions logprobs of the prompt's tokens, as vLLM echoes them: the first token
    has none; each later one its own and the ``k`` most likely, its own added."""
    pieces = [tok.token_to_piece(t) for t in ids]
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    tops: list[dict[str, float] | None] = [None]
    for j in range(len(ids) - 1):
        entry = {tok.token_to_piece(x): v for x, v in s.top[j][:k]}
        entry.setdefault(pieces[j + 1], s.chosen[j])
        tops.append(entry)
    return {
        "tokens": pieces,
        "token_logprobs": [None, *s.chosen],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _vllm_list(tok: Tokenizer, ids: list[int], s: PromptLogprobs, k: int) -> list[Any]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token ``{id: {logprob,
    rank, decoded_token}}`` for the token itself and the ``k`` most likely."""
    out: list[Any] = [None]
    for j, t in enumerate(ids[1:]):
        entry = {
            str(x): {"logprob": v, "rank": r + 1, "decoded_token": tok.token_to_piece(x)}
            for r, (x, v) in enumerate(s.top[j][:k])
        }
        entry.setdefault(
            str(t),
            {"logprob": s.chosen[j], "rank": s.rank[j], "decoded_token": tok.token_to_piece(t)},
        )
        out.append(entry)
    return out
