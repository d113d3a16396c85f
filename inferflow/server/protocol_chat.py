"""Chat completion request bodies: messages (every field of OpenAI's message objects, so an
SDK's ``model_dump()`` of a reply goes back as it is), tools, and vLLM's chat extras (template
switches, echo, prompt log-probabilities)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from inferflow.errors import RequestError
from inferflow.server.jsonvalue import loads
from inferflow.server.protocol import MAX_MESSAGES, Body, Name, SamplingBody


class TextPart(Body):
    type: Literal["text"]
    text: str


class RefusalPart(Body):
    """An assistant message's refusal, as OpenAI returns it among the content parts."""

    type: Literal["refusal"]
    refusal: str


class CalledFunction(Body):
    name: Name
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: Name
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        str | Annotated[list[TextPart | RefusalPart], Field(max_length=MAX_MESSAGES)] | None
    ) = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_MESSAGES)] | None = None  # assistant
    tool_call_id: Name | None = None  # tool: the call this message answers
    # assistant fields of OpenAI's replies: a refusal is the turn's text; annotations (URL
    # citations) are not; function_call is the deprecated form of one tool call
    refusal: str | None = None
    annotations: Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    function_call: CalledFunction | None = None

    def as_template_input(self) -> dict[str, Any]:
        parts = [self.content] if isinstance(self.content, str) else self.content or []
        text = "".join(p if isinstance(p, str) else getattr(p, p.type) for p in parts)
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text or self.refusal or "",
        }
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(ToolCall(id=self.function_call.name, function=self.function_call))
        if calls:  # (templates read the arguments as an object, as transformers')
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: ToolCall) -> Any:
    try:
        return loads(call.function.arguments, f"the arguments of tool call {call.id!r}")
    except ValueError as e:
        raise RequestError(f"messages: {e}", "messages") from None


class FunctionDef(Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Body):
    name: Name


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


@dataclass(frozen=True)
class ChatRender:
    """How messages become a prompt: an assistant turn opened after them, or the last message
    left open for the reply to continue; the template's extra variables; BOS added to the
    rendered text (templates print it themselves)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = False


# template variables the server sets (chat_template_kwargs cannot replace them)
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "bos_token", "eos_token", "pad_token", "unk_token"}
)  # fmt: skip


class TemplateSwitches(Body):
    """vLLM's chat-template fields (chat completions and /tokenize): open an assistant turn
    (add_generation_prompt) or leave the last message open for the reply to continue
    (continue_final_message); the template's own switches (chat_template_kwargs, e.g.
    ``{"enable_thinking": false}``) and documents; BOS added to the rendered prompt
    (add_special_tokens)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # documents a RAG template prints (transformers' `documents`, e.g. {"title", "text"} each)
    documents: Annotated[list[dict[str, str]], Field(max_length=MAX_MESSAGES)] | None = None

    def render(self) -> ChatRender:
        """RequestError for switches that do not combine or a variable the server sets."""
        cont = self.continue_final_message
        # (continuing, add_generation_prompt left unset means false: vLLM wants both sent)
        gen = self.add_generation_prompt and not (
            cont and "add_generation_prompt" not in self.model_fields_set
        )
        if gen and cont:
            raise RequestError(
                "continue_final_message: continues the last message, so it needs "
                "add_generation_prompt false (it starts a new one)",
                "continue_final_message",
            )
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(kwargs.keys() & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise RequestError(
                f"chat_template_kwargs: {', '.join(map(repr, taken))} is set by the server "
                f"(reserved: {', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})",
                "chat_template_kwargs",
            )
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return ChatRender(gen, cont, kwargs, self.add_special_tokens)


class ChatBody(SamplingBody, TemplateSwitches):
    NULL_ONLY = frozenset(
        {
            "functions",
            "function_call",
            "audio",
            "modalities",
            "prediction",
            "store",
            "metadata",
            "service_tier",
            "reasoning_effort",
            "web_search_options",
        }
    )
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    # none: tools not offered; auto: the model may call them; required / a function: it must
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(None, ge=1, description="at most the model's context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's: the reply starts with the last message's text when that message has the reply's
    # role; the prompt's tokens scored as completions' prompt_logprobs
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    def reply_role(self, new_turn: bool) -> str:
        """The role of the message the reply is (vLLM's): assistant for a ``new_turn``, else the
        last message's own."""
        return "assistant" if new_turn else self.messages[-1].role
