"""One HTTP generation request: its engine streams, merged into OpenAI choices, as one response
object or as SSE chunks. Whatever way the handler ends (done, client gone, cancelled), every
sample still running is aborted, so its KV blocks return to the pool within one engine step."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from inferflow.engine.request import RequestOutput
from inferflow.engine.sampling import SamplingParams
from inferflow.errors import RequestError
from inferflow.server.echo import Echo
from inferflow.server.protocol import error_body, sse_event
from inferflow.server.runner import ClientGone, EngineRunner, ModelFailed, until_disconnect
from inferflow.server.tools import CallParser, ToolStream
from inferflow.tokenizer import Tokenizer

# what a client gets when the engine ended one of its samples with finish reason "error"
# (ModelFailed, or an SSE error event; the cause is logged on the engine side)
FAILED = "the engine failed while generating this request"


def failure(choices: list[Choice]) -> Exception:
    """What a request whose samples ended with "error" answers: 400 with the reason when the
    request caused it (its grammar failed), else ModelFailed (500)."""
    own = next((c.error for c in choices if c.error), None)
    return RequestError(own) if own else ModelFailed(FAILED)


@dataclass
class Choice:
    index: int
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)  # per output, its OpenAI logprobs part
    error: str | None = None  # finish reason "error" of the request's own making: why
    ids: list[int] = field(default_factory=list)  # the output's token ids


class Generation:
    def __init__(
        self,
        runner: EngineRunner,
        tokenizer: Tokenizer | None,
        model_name: str,
        chat: bool,
        prompts: list[list[int]],
        params: SamplingParams,
        fingerprint: str | None = None,
        echo: list[Echo] | None = None,
        generate: bool = True,
        tools: CallParser | None = None,
        request_id: str | None = None,
        token_ids: bool = False,
    ) -> None:
        """``echo``: per prompt, what its choices start with (completions' echo and
        prompt_logprobs); ``generate`` False (max_tokens 0): no engine request, each choice
        is its echo, finished ("length"); ``tools``: how tool calls are parsed out of chat
        replies into ``tool_calls``; ``request_id``: the client's, in the response's id;
        ``token_ids``: each choice carries its prompt's and its output's token ids (vLLM's
        return_token_ids; always, for a model without a tokenizer)."""
        self.token_ids = token_ids or tokenizer is None
        self.prompts = prompts
        self.tools = tools
        self.runner, self.tok, self.model, self.chat = runner, tokenizer, model_name, chat
        self.fingerprint = fingerprint  # OpenAI's system_fingerprint
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.params = params
        self.n = params.n
        self.prompt_tokens = sum(map(len, prompts))
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.streams = runner.submit(prompts, params, self.queue) if generate else []
        self.order = {s.id: i for i, s in enumerate(self.streams)}
        self.choices = [Choice(i) for i in range(len(prompts) * self.n)]
        self.echo = echo
        if echo is not None:
            for c in self.choices:
                e = echo[c.index // self.n]
                c.text = e.text
                c.logprobs = [] if e.logprobs is None else [e.logprobs]
                c.finish_reason = None if generate else "length"
        self.left = len(self.choices) if generate else 0

    def abort(self) -> None:
        for s in self.streams:
            if s.n > 0:
                self.runner.abort(s.id)

    async def events(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        try:
            while self.left:
                out = await self.queue.get()
                c = self.choices[self.order[out.request_id] * self.n + out.index]
                if out.prompt_token_ids is not None and out.index == 0:
                    self.cached_tokens += out.cached_tokens  # (once per prompt)
                c.tokens += len(out.token_ids)
                if self.token_ids:  # (kept only when the response carries them)
                    c.ids += out.token_ids
                c.text += out.text
                if out.finished:
                    c.finish_reason, c.error = out.finish_reason, out.error
                    self.left -= 1
                yield c, out
        finally:
            if self.left:
                self.abort()

    # --- OpenAI objects ----------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        done = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def logprobs_of(self, out: RequestOutput, offset: int) -> Any:
        if not out.logprobs or self.tok is None:
            return None
        piece = self.tok.token_to_piece
        if self.chat:

            def entry(t: int, lp: float) -> dict[str, Any]:
                return {"token": piece(t), "logprob": lp, "bytes": list(self.tok.token_to_bytes(t))}  # type: ignore[union-attr]

            return {
                "content": [
                    {
                        **entry(x.token_id, x.logprob),
                        "top_logprobs": [entry(t, v) for t, v in x.top],
                    }
                    for x in out.logprobs
                ]
            }
        return {
            "tokens": [piece(x.token_id) for x in out.logprobs],
            "token_logprobs": [x.logprob for x in out.logprobs],
            "top_logprobs": [{piece(t): v for t, v in x.top} for x in out.logprobs],
            "text_offset": [offset] * len(out.logprobs),
        }

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.chat
            else "text_completion"
        )
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    async def response(self, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        """Collect everything; abort if the client goes away first."""

        async def consume() -> None:
            async for c, out in self.events():
                lp = self.logprobs_of(out, len(c.text) - len(out.text))
                if lp is not None:
                    c.logprobs.append(lp)

        try:
            await until_disconnect(consume(), disconnected)
        except (asyncio.CancelledError, ClientGone):
            self.abort()  # (at once: the cancelled task's own cleanup runs later)
            raise
        if any(c.finish_reason == "error" for c in self.choices):
            raise failure(self.choices)
        return {
            **self._envelope([self._final(c) for c in self.choices], False),
            **self._prompt_logprobs(),
            "usage": self.usage(),
        }

    def _prompt_logprobs(self) -> dict[str, Any]:
        """Chat's prompt_logprobs (vLLM's: beside the choices; completions': in each choice)."""
        if self.chat and self.echo and self.echo[0].prompt_logprobs is not None:
            return {"prompt_logprobs": self.echo[0].prompt_logprobs}
        return {}

    def _final(self, c: Choice) -> dict[str, Any]:
        lp: Any = None
        lps = c.logprobs
        if lps and self.chat:
            lp = {"content": [x for d in lps for x in d["content"]]}
        elif lps:
            lp = {k: [x for d in lps for x in d[k]] for k in lps[0]}
        body: dict[str, Any] = (
            {"message": {"role": "assistant", "content": c.text}} if self.chat else {"text": c.text}
        )
        reason = c.finish_reason
        if self.tools is not None:
            content, calls = self.tools.parse(c.text)
            if calls:
                body["message"] = {"role": "assistant", "content": content or None}
                body["message"]["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        extra = {}
        if not self.chat and self.echo and (e := self.echo[c.index // self.n]).prompt_logprobs:
            extra["prompt_logprobs"] = e.prompt_logprobs
        out = {"index": c.index, **body, "logprobs": lp, "finish_reason": reason}
        if self.token_ids:
            extra |= {"prompt_token_ids": self.prompts[c.index // self.n], "token_ids": c.ids}
        return {**out, **extra}

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new piece of text, ending with ``data: [DONE]``."""

        if self.chat:  # the role comes first, in a chunk of its own
            yield sse_event(
                {
                    **self._envelope(
                        [
                            {
                                "index": c.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            for c in self.choices
                        ],
                        True,
                    ),
                    **self._prompt_logprobs(),
                }
            )
        for c in self.choices if self.echo else ():  # the prompt first (echo, prompt_logprobs)
            if self.chat:
                if not c.text:
                    continue
                part = {"index": c.index, "delta": {"content": c.text}, "logprobs": None}
            else:
                part = self._final(c)
            part["finish_reason"] = None if self.left else c.finish_reason
            yield sse_event(self._envelope([part], True))
        calls = {c.index: ToolStream(self.tools) for c in self.choices} if self.tools else {}
        async for c, out in self.events():
            if out.finish_reason == "error":
                why, kind = (
                    (out.error, "invalid_request_error") if out.error else (FAILED, "server_error")
                )
                yield sse_event(error_body(why, kind))
                continue
            text, delta = out.text, {}
            if c.index in calls:  # content as it comes; a tool call once complete
                text = calls[c.index].push(text)
                if out.finished:
                    rest, found = calls[c.index].finish()
                    text += rest
                    if found:
                        delta["tool_calls"] = [{"index": k, **f} for k, f in enumerate(found)]
            if not text and not delta and not out.finished and not out.logprobs:
                continue  # (text held back: a stop string or a tool call may be starting)
            lp = self.logprobs_of(out, len(c.text) - len(out.text))
            reason = out.finish_reason if out.finished else None
            if reason == "stop" and delta:
                reason = "tool_calls"
            part = (
                {"delta": ({"content": text} if text else {}) | delta}
                if self.chat
                else {"text": text}
            )
            ids = {"token_ids": list(out.token_ids)} if self.token_ids else {}
            yield sse_event(
                self._envelope(
                    [{"index": c.index, **part, "logprobs": lp, "finish_reason": reason, **ids}],
                    True,
                )
            )
        if include_usage:
            yield sse_event({**self._envelope([], True), "usage": self.usage()})
        yield "data: [DONE]\n\n"
