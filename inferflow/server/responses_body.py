"""The request bodies of OpenAI's Responses API (``POST /v1/responses``): input items (messages,
function calls and their outputs), function tools, ``text.format``; and how they become chat
template messages (``inferflow.server.responses`` serves them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from inferflow.errors import RequestError
from inferflow.server.jsonvalue import loads
from inferflow.server.protocol import MAX_MESSAGES, Body, GenerationBody, Name, Text

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


class FunctionCallItem(Body):
    """A function call the model made (a returned ``function_call`` output item)."""

    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: str
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def as_call(self) -> dict[str, Any]:
        try:
            args = loads(self.arguments, f"the arguments of function call {self.call_id!r}")
        except ValueError as e:
            raise RequestError(f"input: {e}", "input") from None
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": args},
        }


class FunctionCallOutput(Body):
    """What a function returned, for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: Name
    output: str
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else "message"
    return kind if kind in ("function_call", "function_call_output") else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class ResponsesTool(Body):
    """A function tool (the Responses API's flat form of chat's ``{"function": {...}}``)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        f = self.model_dump(exclude_none=True, exclude={"type", "strict"})
        return {"type": "function", "function": f}


class NamedFunction(Body):
    type: Literal["function"]
    name: Name


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
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[ResponsesTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
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
        """The input as chat-template messages: function calls join one assistant message,
        their outputs are tool messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                    last = {"role": "assistant", "content": "", "tool_calls": []}
                    out.append(last)
                last["tool_calls"].append(item.as_call())
            elif isinstance(item, FunctionCallOutput):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                out.append(item.as_template_input())
        return out
