"""OpenAI's Responses API on the chat path: ``POST /v1/responses`` (one response object, or
server-sent events typed ``response.created`` … ``response.completed``), ``GET`` and
``DELETE /v1/responses/{id}``. The input (a text, or message items) goes through the model's
chat template after ``instructions`` (a system message) and, with ``previous_response_id``,
after the stored conversation of that response; the tokens come from the same engine requests
as chat completions.

Responses are kept in memory (``store``, default true) so that ``previous_response_id`` can
continue them (``inferflow.server.store``); an id that is gone is a 400 saying so."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field

from inferflow.server.generation import FAILED, Generation
from inferflow.server.guard import APIError
from inferflow.server.openapi import ERROR, responses
from inferflow.server.protocol import MAX_MESSAGES, Body, GenerationBody, Name, Text
from inferflow.server.store import ResponseStore

if TYPE_CHECKING:
    from inferflow.server.app import ServerState

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value (per-token logprobs)


class ContentPart(Body):
    """A message's text part: ``input_text``, or ``output_text`` as a response returned it
    (its annotations and logprobs are taken and ignored)."""

    type: Literal["input_text", "output_text"]
    text: str
    # (as long as the body allows: --max-body-bytes bounds them)
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class InputMessage(Body):
    """A message item (the SDK's easy form ``{role, content}`` or a returned output message:
    its id and status are ignored)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)]
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def as_template_input(self) -> dict[str, Any]:
        text = (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(Body):
    """The Responses API's ``text.format``: plain text, any JSON object, or JSON following
    ``schema`` (the fields of chat's ``response_format.json_schema``, flattened)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Name = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body):
    NULL_ONLY = frozenset({"verbosity"})
    format: TextFormat | None = None


class ResponsesStreamOptions(Body):
    include_obfuscation: bool = False  # (no obfuscation padding is ever added)


class ResponsesBody(GenerationBody):
    """``POST /v1/responses``: OpenAI's fields, plus the engine extras of every generating
    route (top_k, min_p, seed, stop, ...)."""

    MAX_FIELD = "max_output_tokens"
    NULL_ONLY = frozenset(
        {
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "reasoning",
            "background",
            "conversation",
            "prompt",
            "prompt_cache_key",
            "prompt_cache_retention",
            "safety_identifier",
            "service_tier",
            "max_tool_calls",
            "context_management",
        }
    )
    input: Text | Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="at most the model's context")
    previous_response_id: Name | None = None
    store: bool = True
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] = "disabled"
    include: (
        Annotated[list[Literal["message.output_text.logprobs"]], Field(max_length=1)] | None
    ) = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream_options: ResponsesStreamOptions | None = None

    def constraint(self) -> tuple[str, str, Any] | None:
        f = self.text.format if self.text is not None else None
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return ("text.format", "json_object", None)
        return ("text.format", "json_schema", {} if f.schema_ is None else f.schema_)

    def messages(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m.as_template_input() for m in self.input]


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's usage in the Responses API's names."""
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": u["prompt_tokens_details"],
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


# a chat finish reason -> the response's status and incomplete_details
STATUS: dict[str | None, tuple[str, dict[str, Any] | None]] = {
    "stop": ("completed", None),
    "length": ("incomplete", {"reason": "max_output_tokens"}),
    "abort": ("cancelled", None),  # (the server shut down while it ran)
}


class ResponseRun:
    """One ``POST /v1/responses`` on a chat Generation: its response object, or its events."""

    SEQ: ClassVar[str] = "sequence_number"

    def __init__(
        self,
        gen: Generation,
        body: ResponsesBody,
        head: dict[str, Any],
        conversation: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        self.gen, self.body, self.store = gen, body, store
        self.conversation = conversation  # what the next turn continues (this input included)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.head = head  # the fields that do not change while it runs
        self.created = time.time()
        self.seq = 0

    def obj(
        self,
        status: str,
        text: str | None = None,
        logprobs: list[Any] | None = None,
        usage: dict[str, Any] | None = None,
        details: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object; ``text`` None: no output yet."""
        done = "completed" if status == "completed" else "incomplete"
        output = [] if text is None else [self.message(text, logprobs, done)]
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(self.created),
            "status": status,
            "error": error,
            "incomplete_details": details,
            "output": output,
            "usage": usage,
            **self.head,
        }

    def message(self, text: str, logprobs: list[Any] | None, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [self.part(text, logprobs)],
        }

    def part(self, text: str, logprobs: list[Any] | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def keep(self, obj: dict[str, Any], text: str) -> None:
        if self.body.store and obj["status"] in ("completed", "incomplete"):
            reply = {"role": "assistant", "content": text}
            self.store.put(self.id, [*self.conversation, reply], obj)

    async def response(self, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        done = await self.gen.response(disconnected)  # (500 when the model failed)
        choice = done["choices"][0]
        text = choice["message"]["content"]
        logprobs = (choice["logprobs"] or {}).get("content")
        status, details = STATUS[choice["finish_reason"]]
        obj = self.obj(status, text, logprobs, _usage(done["usage"]), details)
        self.keep(obj, text)
        return obj

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event, named by its type as OpenAI sends them."""
        data = {"type": kind, **fields, self.SEQ: self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        """created, in_progress, the message item and its text part added, a delta per new
        piece of text, then text / part / item done and completed (or incomplete, cancelled:
        ``response.incomplete``; the model failed: ``response.failed``)."""
        yield self.event("response.created", response=self.obj("in_progress"))
        yield self.event("response.in_progress", response=self.obj("in_progress"))
        where = {"item_id": self.item_id, "output_index": 0}
        item = self.message("", None, "in_progress")
        yield self.event("response.output_item.added", output_index=0, item=item)
        yield self.event(
            "response.content_part.added", **where, content_index=0, part=self.part("", None)
        )
        text, logprobs, reason = "", [], None
        async for _, out in self.gen.events():
            if out.finish_reason == "error":
                error = {"code": "server_error", "message": FAILED}
                yield self.event("response.failed", response=self.obj("failed", error=error))
                return
            lp = (self.gen.logprobs_of(out, 0) or {}).get("content", [])
            logprobs += lp
            if out.text or lp:
                text += out.text
                yield self.event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=out.text,
                    logprobs=lp,
                )
            if out.finished:
                reason = out.finish_reason
        part = self.part(text, logprobs)
        yield self.event(
            "response.output_text.done", **where, content_index=0, text=text, logprobs=logprobs
        )
        yield self.event("response.content_part.done", **where, content_index=0, part=part)
        status, details = STATUS[reason]
        obj = self.obj(status, text, logprobs, _usage(self.gen.usage()), details)
        yield self.event("response.output_item.done", output_index=0, item=obj["output"][0])
        self.keep(obj, text)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self.event(kind, response=obj)


def add_responses_routes(app: FastAPI, state: ServerState, auth: bool) -> None:
    from inferflow.server.app import _chat_ids  # (app imports this module)

    store = ResponseStore(state.cfg.responses)
    app.state.responses = store

    @app.post(
        "/v1/responses",
        response_model=None,
        responses=responses(auth, body=True, queued=True, sse=True),
    )
    async def create(body: ResponsesBody, request: Request) -> Any:
        lm, runner = state.generating(body.model, chat=True)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            found = store.get(body.previous_response_id)
            if found is None:
                raise APIError(
                    400, store.missing(body.previous_response_id), param="previous_response_id"
                )
            earlier = list(found.conversation)
        conversation = earlier + body.messages()
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        ids = await _chat_ids(state, system + conversation)
        logprobs = (body.top_logprobs or 0) if LOGPROBS in (body.include or ()) else None
        gen = await state.start(lm, runner, [ids], body, body.max_output_tokens, logprobs, "input")
        head: dict[str, Any] = {
            "model": state.name,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "temperature": gen.params.temperature,
            "top_p": gen.params.top_p,
            "top_logprobs": body.top_logprobs,
            "text": {
                "format": (
                    body.text.format.model_dump(by_alias=True, exclude_none=True)
                    if body.text is not None and body.text.format is not None
                    else {"type": "text"}
                )
            },
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "truncation": "disabled",
            "store": body.store,
            "metadata": body.metadata or {},
            "user": body.user,
            "system_fingerprint": state.fingerprint,
        }
        run = ResponseRun(gen, body, head, conversation, store)
        if body.stream:
            return StreamingResponse(
                run.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return await run.response(request.is_disconnected)

    lookup = {
        **responses(auth),
        404: {"description": "no stored response with this id", "content": ERROR},
    }

    @app.get("/v1/responses/{response_id}", responses=lookup)
    async def get(response_id: str) -> Response:
        state.ready()
        found = store.get(response_id)
        if found is None:
            raise APIError(404, store.missing(response_id), param="response_id")
        return Response(json.dumps(found.obj, ensure_ascii=False), media_type="application/json")

    @app.delete("/v1/responses/{response_id}", responses=lookup)
    async def delete(response_id: str) -> Any:
        state.ready()
        if not store.delete(response_id):
            raise APIError(404, store.missing(response_id), param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}
