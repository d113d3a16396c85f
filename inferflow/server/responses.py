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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from inferflow.server.api_error import APIError
from inferflow.server.generation import FAILED, Generation
from inferflow.server.openapi import ERROR, responses
from inferflow.server.responses_body import LOGPROBS, NamedFunction, ResponsesBody
from inferflow.server.store import ResponseStore
from inferflow.server.tools import ToolStream

if TYPE_CHECKING:
    from inferflow.server.state import ServerState


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
    "tool_calls": ("completed", None),
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
        calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The response object: its message (``text``; None: none), then its function calls
        (chat ``tool_calls``)."""
        done = "completed" if status == "completed" else "incomplete"
        output = [] if text is None else [self.message(text, logprobs, done)]
        output += [self.call_item(c, "completed") for c in calls or []]
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

    def call_item(self, call: dict[str, Any], status: str) -> dict[str, Any]:
        """A chat tool call as a ``function_call`` output item."""
        f = call["function"]
        return {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": f["name"],
            "arguments": f["arguments"] if status != "in_progress" else "",
            "status": status,
        }

    def part(self, text: str, logprobs: list[Any] | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def keep(self, obj: dict[str, Any], text: str, calls: list[dict[str, Any]]) -> None:
        if self.body.store and obj["status"] in ("completed", "incomplete"):
            reply: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:  # (as the template reads them: arguments as objects)
                reply["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": json.loads(c["function"]["arguments"]),
                        },
                    }
                    for c in calls
                ]
            self.store.put(self.id, [*self.conversation, reply], obj)

    async def response(self, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        done = await self.gen.response(disconnected)  # (500 when the model failed)
        choice = done["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        text = choice["message"]["content"] or ""
        logprobs = (choice["logprobs"] or {}).get("content")
        status, details = STATUS[choice["finish_reason"]]
        shown = text if text or not calls else None
        obj = self.obj(status, shown, logprobs, _usage(done["usage"]), details, calls=calls)
        self.keep(obj, text, calls)
        return obj

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event, named by its type as OpenAI sends them."""
        data = {"type": kind, **fields, self.SEQ: self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        """created, in_progress, the message item and its text part added, a delta per new
        piece of text, then text / part / item done; each function call as an item added, its
        arguments (one delta) and done; then completed (or incomplete, cancelled:
        ``response.incomplete``; the model failed: ``response.failed``). With tools offered
        the message item opens with its first text (a reply may be calls only)."""
        yield self.event("response.created", response=self.obj("in_progress"))
        yield self.event("response.in_progress", response=self.obj("in_progress"))
        where = {"item_id": self.item_id, "output_index": 0}
        tools = ToolStream(self.gen.tools) if self.gen.tools is not None else None
        opened = False

        def open_message() -> Iterator[str]:
            item = self.message("", None, "in_progress")
            yield self.event("response.output_item.added", output_index=0, item=item)
            yield self.event(
                "response.content_part.added", **where, content_index=0, part=self.part("", None)
            )

        if tools is None:
            for e in open_message():
                yield e
            opened = True
        text, reason = "", None
        logprobs: list[Any] = []
        calls: list[dict[str, Any]] = []
        async for _, out in self.gen.events():
            if out.finish_reason == "error":
                error = {"code": "server_error", "message": out.error or FAILED}
                yield self.event("response.failed", response=self.obj("failed", error=error))
                return
            lp = (self.gen.logprobs_of(out, 0) or {}).get("content", [])
            logprobs += lp
            piece = out.text if tools is None else tools.push(out.text)
            if out.finished and tools is not None:
                rest, calls = tools.finish()
                piece += rest
            if piece or lp:
                if not opened:
                    for e in open_message():
                        yield e
                    opened = True
                text += piece
                yield self.event(
                    "response.output_text.delta", **where, content_index=0, delta=piece, logprobs=lp
                )
            if out.finished:
                reason = out.finish_reason
        if not opened and not calls:  # (an empty reply is still a message)
            for e in open_message():
                yield e
            opened = True
        status, details = STATUS["tool_calls" if calls and reason == "stop" else reason]
        obj = self.obj(
            status,
            text if opened else None,
            logprobs,
            _usage(self.gen.usage()),
            details,
            calls=calls,
        )
        if opened:
            part = self.part(text, logprobs)
            yield self.event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=logprobs
            )
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
            yield self.event("response.output_item.done", output_index=0, item=obj["output"][0])
        for k, call in enumerate(calls, start=int(opened)):
            item = obj["output"][k]
            at = {"item_id": item["id"], "output_index": k}
            yield self.event(
                "response.output_item.added",
                output_index=k,
                item=self.call_item(call, "in_progress"),
            )
            yield self.event(
                "response.function_call_arguments.delta", **at, delta=item["arguments"]
            )
            yield self.event(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            )
            yield self.event("response.output_item.done", output_index=k, item=item)
        self.keep(obj, text, calls)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self.event(kind, response=obj)


def add_responses_routes(app: FastAPI, state: ServerState, auth: bool) -> None:
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
        choice = body.tool_choice
        ids, plan = await state.chat_prompt(
            system + conversation,
            [t.as_chat_tool() for t in body.tools or []],
            choice if isinstance(choice, str) else None,
            choice.name if isinstance(choice, NamedFunction) else None,
            body.parallel_tool_calls,
        )
        logprobs = (body.top_logprobs or 0) if LOGPROBS in (body.include or ()) else None
        limit = body.max_output_tokens
        gen = await state.start(lm, runner, [ids], body, limit, logprobs, "input", tools=plan)
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
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": (
                choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto"
            ),
            "parallel_tool_calls": body.parallel_tool_calls,
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
