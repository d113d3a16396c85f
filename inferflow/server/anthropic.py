"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), as vLLM,
SGLang and llama-server serve it for agent tools that speak it: a request becomes the chat
request it means (system, text, tool_use and tool_result blocks as chat messages; tools and
tool_choice as chat's) and runs on the chat route's path (template, tools, sampling, engine);
the reply comes back as a ``message`` (text and ``tool_use`` blocks, ``stop_reason``, usage) or
as its event stream (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` per
block, ``message_delta``, ``message_stop``). Errors take Anthropic's shape
(``guard.error_json``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError

from inferflow.engine.sampling import MAX_STOP, MAX_STOP_CHARS
from inferflow.errors import RequestError
from inferflow.server.generation import FAILED, Generation
from inferflow.server.guard import anthropic_error, describe_invalid
from inferflow.server.openapi import responses
from inferflow.server.protocol import MAX_MESSAGES, Body, Name
from inferflow.server.protocol_chat import ChatBody
from inferflow.server.state import ServerState
from inferflow.server.tools import ToolStream

Extra = dict[str, Any] | None  # (cache_control, citations: accepted, no effect on a local model)


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: Extra = None
    citations: list[Any] | None = None


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: Extra = None
    caller: Extra = None  # (the SDK's dump of a reply's block carries these two)
    toolset_name: Name | None = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: Name
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    is_error: bool = False
    cache_control: Extra = None

    def text(self) -> str:
        """The result as the tool message's text (a failed call's marked, as is_error says)."""
        if isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_MESSAGES)]


class AnthropicTool(Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: Extra = None


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool = False


class ThinkingOff(Body):
    type: Literal["disabled"]  # (extended thinking: no model here has it)


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    """The reply held to a JSON Schema (structured output); no effort levels here."""

    NULL_ONLY = frozenset({"effort"})
    format: OutputFormat | None = None


class Conversation(Body):
    """What both routes read: the model, the system prompt, the messages, the tools."""

    model: Name
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingOff | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: tool_result blocks as tool messages (before the
        user's text, as Anthropic orders them), tool_use blocks as the assistant's tool calls."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            out.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            blocks = (
                [TextBlock(type="text", text=m.content)]
                if isinstance(m.content, str)
                else m.content
            )
            texts = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
            if m.role == "user":
                for b in blocks:
                    if isinstance(b, ToolUseBlock):
                        raise RequestError(
                            f"messages.{i}.content: tool_use blocks are the assistant's; a "
                            "user message holds text and tool_result blocks",
                            f"messages.{i}.content",
                        )
                    if isinstance(b, ToolResultBlock):
                        out.append(
                            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                        )
                if texts or not blocks:
                    out.append({"role": "user", "content": texts})
                continue
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise RequestError(
                    f"messages.{i}.content: tool_result blocks are the user's; an assistant "
                    "message holds text and tool_use blocks",
                    f"messages.{i}.content",
                )
            out.append(
                {"role": "assistant", "content": texts, **({"tool_calls": calls} if calls else {})}
            )
        return out

    def as_chat(self, extra: dict[str, Any] | None = None) -> ChatBody:
        """The chat request of this conversation (with ``extra`` chat fields); RequestError
        naming the field a chat request would refuse."""
        fields = {"model": self.model, "messages": self.chat_messages(), **self.chat_tools()}
        try:
            return ChatBody.model_validate({**fields, **(extra or {})})
        except ValidationError as e:
            param, text = describe_invalid([dict(x) for x in e.errors()])
            raise RequestError(text.replace("stop:", "stop_sequences:"), param) from None

    def chat_tools(self) -> dict[str, Any]:
        """tools, tool_choice and parallel_tool_calls as chat takes them."""
        tools = [
            {
                "type": "function",
                "function": {  # (in FunctionDef's order: templates print the object)
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools or []
        ]
        c = self.tool_choice
        if c is None or not tools:
            return {
                "tools": tools or None,
                "tool_choice": "none" if c and c.type == "none" else None,
            }
        if c.type == "tool":
            if c.name is None:
                raise RequestError("tool_choice: type tool needs the tool's name", "tool_choice")
            choice: Any = {"type": "function", "function": {"name": c.name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[c.type]
        return {
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": not c.disable_parallel_tool_use,
        }


class MessagesBody(Conversation):
    max_tokens: int = Field(ge=1, description="at most the model's context")
    stop_sequences: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP),
        ]
        | None
    ) = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="at most the vocabulary size")
    stream: bool = False
    metadata: dict[str, Name | None] | None = None  # (user_id)
    service_tier: Literal["auto", "standard_only"] | None = None  # (one tier here: either)
    output_config: OutputConfig | None = None
    # a marker on the last cacheable block: the prefix cache here needs none (it is automatic)
    cache_control: Extra = None

    def as_chat(self, extra: dict[str, Any] | None = None) -> ChatBody:
        """The chat request this one means (stop strings kept in the text, so the reply can
        say which one ended it: ``MessageRun.ending``)."""
        fields: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "include_stop_str_in_output": bool(self.stop_sequences),
            "user": (self.metadata or {}).get("user_id"),
        }
        out = self.output_config.format if self.output_config else None
        if out is not None:
            schema = {"name": "output", "schema": out.schema_}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return super().as_chat({**fields, **(extra or {})})


STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class MessageRun:
    """One Messages API request's generation, as a message or its events."""

    def __init__(self, gen: Generation, model: str, stops: list[str]) -> None:
        self.gen, self.model, self.stops = gen, model, stops
        self.id = f"msg_{uuid.uuid4().hex}"

    def ending(self, text: str, reason: str | None) -> tuple[str, str, str | None]:
        """(the text without the stop sequence that ended it, stop_reason, stop_sequence)."""
        if reason == "stop":
            hit = next((s for s in self.stops if text.endswith(s)), None)
            if hit is not None:
                return text[: len(text) - len(hit)], "stop_sequence", hit
            return text, "end_turn", None
        return text, STOP_REASONS.get(reason or "", "end_turn"), None

    def usage(self) -> dict[str, int]:
        u = self.gen.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.gen.cached_tokens,
        }

    def message(
        self, content: list[dict[str, Any]], reason: str | None, seq: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": self.usage(),
        }

    async def response(self, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        choice = (await self.gen.response(disconnected))["choices"][0]
        msg = choice["message"]
        text, reason, seq = self.ending(msg.get("content") or "", choice["finish_reason"])
        content = [{"type": "text", "text": text}] if text else []
        content += [_tool_use(c) for c in msg.get("tool_calls") or []]
        return self.message(content, reason, seq)

    async def sse(self) -> AsyncIterator[str]:
        yield _event("message_start", message=self.message([], None, None))
        yield _event("ping")
        tools = ToolStream(self.gen.tools) if self.gen.tools is not None else None
        sent, index, opened = "", 0, False
        calls: list[dict[str, Any]] = []
        reason, seq = "end_turn", None
        async for _, out in self.gen.events():
            if out.finish_reason == "error":
                why = out.error or FAILED
                yield _event(
                    "error", error=anthropic_error(400 if out.error else 500, why)["error"]
                )
                return
            piece = out.text if tools is None else tools.push(out.text)
            if out.finished:
                if tools is not None:
                    rest, calls = tools.finish()
                    piece += rest
                kind = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
                whole, reason, seq = self.ending(sent + piece, kind)
                piece = whole[len(sent) :]
            if piece:
                if not opened:
                    block = {"type": "text", "text": ""}
                    yield _event("content_block_start", index=index, content_block=block)
                    opened = True
                sent += piece
                delta = {"type": "text_delta", "text": piece}
                yield _event("content_block_delta", index=index, delta=delta)
        if opened:
            yield _event("content_block_stop", index=index)
            index += 1
        for c in calls:
            use = {**_tool_use(c), "input": {}}
            yield _event("content_block_start", index=index, content_block=use)
            delta = {"type": "input_json_delta", "partial_json": c["function"]["arguments"]}
            yield _event("content_block_delta", index=index, delta=delta)
            yield _event("content_block_stop", index=index)
            index += 1
        usage = {"output_tokens": self.usage()["output_tokens"]}
        yield _event(
            "message_delta", delta={"stop_reason": reason, "stop_sequence": seq}, usage=usage
        )
        yield _event("message_stop")


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    f = call["function"]
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": f["name"],
        "input": json.loads(f["arguments"]),
    }


def _event(kind: str, **fields: Any) -> str:
    """One server-sent event as Anthropic sends them: named by its type."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


def add_anthropic_routes(app: FastAPI, state: ServerState, auth: bool) -> None:
    @app.post(
        "/v1/messages",
        response_model=None,
        responses=responses(auth, body=True, queued=True, sse=True, anthropic=True),
    )
    async def messages(body: MessagesBody, request: Request) -> Any:
        lm, runner = state.generating(body.model, chat=True)
        chat = body.as_chat()
        ids, plan = await state.chat_request_prompt(chat)
        limit = body.max_tokens
        gen = await state.start(lm, runner, [ids], chat, limit, None, "messages", tools=plan)
        run = MessageRun(gen, state.name, body.stop_sequences or [])
        if body.stream:
            return StreamingResponse(
                run.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return await run.response(request.is_disconnected)

    @app.post("/v1/messages/count_tokens", responses=responses(auth, body=True, anthropic=True))
    async def count_tokens(body: Conversation) -> dict[str, int]:
        state.generating(body.model, chat=True)
        ids, _ = await state.chat_request_prompt(body.as_chat())
        return {"input_tokens": len(ids)}
