"""OpenAI request bodies (pydantic; unknown fields are refused, naming the allowed ones) and
their mapping onto SamplingParams. Engine extras (top_k, min_p, mirostat, FSD, ...) are
accepted as extra body fields, as vLLM does."""

from __future__ import annotations

import functools
import json
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from inferflow.engine.sampling import (
    MAX_FSD_K,
    MAX_FSD_N,
    MAX_LENGTH_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_MIROSTAT_ETA,
    MAX_MIROSTAT_TAU,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    SEED_RANGE,
    SamplingParams,
)
from inferflow.errors import RequestError
from inferflow.server.jsonvalue import check_value, loads
from inferflow.spec.types import GenerationDefaults


def sse_event(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON (``data: {...}`` and a blank line)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object (HTTP error responses and the SSE error event)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error response (the OpenAPI schema's 4xx / 5xx bodies)."""

    error: ErrorObject


# Bounds of request fields that hold whatever the model: the body (--max-body-bytes) bounds
# the rest, and the model's context and vocabulary bound lengths and token ids (checked before
# queueing: SamplingBody.sampling, Engine.check). README "Security model" lists them all.
MAX_PROMPTS = 1024  # texts or token lists in one prompt / input (and at most --max-waiting)
MAX_MESSAGES = 4096  # chat messages, and text parts of one message
MAX_NAME_CHARS = 256  # a message's name, the user field, the model name
MAX_TOKEN_ID = 2**31 - 1  # token ids past any vocabulary are refused as numbers, not converted


def _nullable(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The OpenAPI schema says what ``Body._nulls`` does: an optional field takes null."""
    required = set(schema.get("required", []))
    props = schema.get("properties", {})
    for name, prop in list(props.items()):
        alts = prop.get("anyOf", [prop])
        if name not in required and not any(a.get("type") == "null" for a in alts):
            props[name] = {"anyOf": [prop, {"type": "null"}]}
    for name in getattr(cls, "NULL_ONLY", ()):
        props[name] = {"type": "null", "description": "not implemented: only null (not set)"}


# Fields of OpenAI's or vLLM's APIs that this server does not serve: null (as SDKs send for unset
# options) means "not set"; any other value is a 400 saying why (not "unknown field")
NOT_SERVED = {
    "best_of": "not supported: use n (samples) or beam_width (beam search)",
    "use_beam_search": "use beam_width (> 1: beam search)",
    "suffix": "not supported (no fill-in-the-middle)",
    "functions": "OpenAI's deprecated form: use tools",
    "function_call": "OpenAI's deprecated form: use tool_choice",
    "audio": "not supported: this server writes text only",
    "modalities": "not supported: this server writes text only",
    "prediction": "not supported (predicted outputs)",
    "store": "not supported on chat completions (the Responses API stores responses)",
    "metadata": "not supported on chat completions",
    "service_tier": "not supported (one tier)",
    "reasoning_effort": "not supported",
    "web_search_options": "not supported (no web search)",
    "guided_decoding_backend": "structured output always runs on llguidance; leave it unset",
    "guided_whitespace_pattern": "not supported (JSON output has no free whitespace)",
    "structural_tag": "not supported: use structured_outputs or response_format",
    "logits_processors": "not supported (no custom logits processors)",
    "allowed_token_ids": "not supported: use logit_bias",
    "bad_words": "not supported: use logit_bias",
    "truncate_prompt_tokens": "not supported: prompts are never truncated",
    "chat_template": "not supported: the model's own chat template renders messages",
    "mm_processor_kwargs": "not supported: text-only models",
    "kv_transfer_params": "not supported (no disaggregated serving)",
    "priority": "not supported (requests run first come, first served)",
    "return_tokens_as_token_ids": "not supported",
    "vllm_xargs": "not supported",
    "prompt_embeds": "not supported: send text or token ids",
    "media_io_kwargs": "not supported: text-only models",
    "repetition_detection": "not supported: use repetition_penalty or stop strings",
    "enable_response_messages": "not supported",
    "previous_input_messages": "not supported: use previous_response_id",
    # Anthropic's
    "effort": "not supported (no reasoning effort levels)",
    "container": "not supported (no code-execution containers)",
    "diagnostics": "not supported (no prompt-cache diagnostics)",
    "inference_geo": "not supported (inference runs on this server)",
    "speed": "not supported (one speed)",
    "user_profile_id": "not supported",
    "workspace_id": "not supported",
}

# values of those fields that ask for what the server does anyway (SDKs and vLLM clients send
# them): taken as "not set" too
NOT_SERVED_DEFAULTS: dict[str, Any] = {
    "best_of": 1, "use_beam_search": False, "priority": 0, "return_tokens_as_token_ids": False,
    "bad_words": [], "modalities": ["text"], "store": False,
}  # fmt: skip


@functools.cache
def _integer_fields(cls: type[BaseModel]) -> frozenset[str]:
    """Fields that take an integer and no other number: ``2.0`` is read as ``2`` there, as
    OpenAI reads it (JSON Schema's integer includes it)."""

    def kinds(ann: Any) -> set[Any]:
        origin = get_origin(ann)
        if origin is Annotated:
            return kinds(get_args(ann)[0])
        if origin in (Union, types.UnionType):
            return set().union(*(kinds(a) for a in get_args(ann)))
        return {ann if origin is None else origin}

    return frozenset(
        name
        for name, f in cls.model_fields.items()
        if int in (k := kinds(f.annotation)) and float not in k
    )


class Body(BaseModel):
    # strict: JSON types as the schema states them ("5" is not an integer, 1 not a boolean);
    # NaN / Infinity (which Python's JSON parser accepts) are refused for every number
    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=_nullable
    )
    # OpenAI fields a route does not implement: null (as SDKs send for unset options) is
    # accepted as "not set"; any other value is refused as an unknown field
    NULL_ONLY: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """``null`` for a known optional field means "not set": its default applies."""
        if not isinstance(data, dict):
            return data
        optional = {n for n, f in cls.model_fields.items() if not f.is_required()}
        skip = optional | cls.NULL_ONLY | NOT_SERVED.keys()
        ints = _integer_fields(cls)
        return {
            k: int(v) if k in ints and type(v) is float and v.is_integer() else v
            for k, v in data.items()
            if not (v is None and k in skip)
            and not (k in NOT_SERVED_DEFAULTS and k not in cls.model_fields
                     and v == NOT_SERVED_DEFAULTS[k] and type(v) is type(NOT_SERVED_DEFAULTS[k]))
        }  # fmt: skip

    @field_validator("*", mode="after")
    @classmethod
    def _text(cls, value: Any) -> Any:
        check_value(value, "the value")
        return value


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Text = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# OpenAI's four prompt shapes: a text, texts, token ids, lists of token ids
Prompt = (
    Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
)  # fmt: skip


class StreamOptions(Body):
    include_usage: bool = False


SPEC_DEFAULTED = ("temperature", "top_k", "top_p")
# body fields passed to SamplingParams under the same name, unchanged
SAME_NAME = (
    "min_p", "typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "fsd_alpha",
    "fsd_k", "fsd_n", "fsd_random_steps", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "ignore_eos", "beam_width", "length_penalty",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
)  # fmt: skip


class GenerationBody(Body):
    """Fields every generating route takes (completions, chat, responses): the model, the
    spec-defaulted sampling fields, streaming and the engine's extras."""

    MAX_FIELD: ClassVar[str] = "max_tokens"  # the field that bounds the generated tokens
    model: Name | None = None
    # unset: the spec's generation defaults (as vLLM takes the model's generation config)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP),
        ]
        | None
    ) = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    user: Name | None = None
    # engine extras
    top_k: int | None = Field(None, ge=0, description="at most the vocabulary size")
    min_p: float = Field(0.0, ge=0, lt=1)
    typical_p: float = Field(1.0, gt=0, le=1)
    tfs_z: float = Field(1.0, gt=0, le=1)
    mirostat: int = Field(0, ge=0, le=2)  # (not Literal: that takes false for 0)
    mirostat_tau: float = Field(5.0, gt=0, le=MAX_MIROSTAT_TAU)
    mirostat_eta: float = Field(0.1, gt=0, le=MAX_MIROSTAT_ETA)
    fsd_alpha: float = Field(0.0, ge=0, lt=1)
    fsd_k: int = Field(6, ge=1, le=MAX_FSD_K)
    fsd_n: int = Field(3, ge=1, le=MAX_FSD_N)
    fsd_random_steps: int = Field(0, ge=0, description="at most the model's context")
    repetition_penalty: float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, description="at most the model's context")
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    beam_width: int = Field(1, ge=1, le=MAX_N)  # > 1: beam search, the n best beams returned
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    # vLLM's: the prefix cache shares prompt blocks only between requests of equal salts
    cache_salt: Name | None = None
    # vLLM's: the response's id is made of it (chat: "chatcmpl-ID", completions: "cmpl-ID")
    request_id: Name | None = None
    # vLLM's: each choice carries its prompt's and its output's token ids (always on for a
    # model without a tokenizer: the ids are then its only output)
    return_token_ids: bool | None = None
    # vLLM's: the text keeps the stop string that ended it; special tokens are dropped from the
    # text, or kept (and then, with spaces_between_special_tokens, set apart by spaces)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None

    def constraint(self) -> tuple[str, str, Any] | None:
        """Structured output: (the request field, the constraint's kind, its value)."""
        return None

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (OpenAI takes one string or several)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        vocab: int,
        context: int,
        defaults: GenerationDefaults,
    ) -> SamplingParams:
        """The request's SamplingParams; RequestError (400) for a value out of its bounds,
        those tied to the model included (``vocab`` tokens, ``context`` positions)."""
        for name, value, most in (
            (self.MAX_FIELD, max_tokens, context),
            ("min_tokens", self.min_tokens, context),
            ("fsd_random_steps", self.fsd_random_steps, context),
            ("top_k", self.top_k or 0, vocab),
        ):
            if value > most:
                what = "vocabulary size" if name == "top_k" else "context (tokens)"
                raise RequestError(f"{name}: {value} exceeds the model's {what}, {most}")
        bias = {}
        # (n and logit_bias: completions and chat; the Responses API has one output, no bias;
        # keys are at most 10 characters)
        for k, v in (getattr(self, "logit_bias", None) or {}).items():
            if not k.isdigit() or not 0 <= int(k) < vocab:
                raise RequestError(f"logit_bias: key {k!r} is not a token id in 0..{vocab - 1}")
            bias[int(k)] = v
        unset = {  # fields a request may leave to the spec's generation defaults
            k: getattr(defaults, k) if getattr(self, k) is None else getattr(self, k)
            for k in SPEC_DEFAULTED
        }
        return SamplingParams(
            **unset,
            **{k: getattr(self, k) for k in SAME_NAME},
            n=getattr(self, "n", 1),
            logit_bias=bias,
            max_new_tokens=max_tokens,
            min_new_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(self.stop_strings()),
            logprobs=logprobs,
        )


class JSONSchemaSpec(Body):
    """OpenAI's ``response_format.json_schema`` (and the Responses API's ``text.format``)."""

    name: Name = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # (None: any JSON value)
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or JSON following
    ``json_schema.schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    def constraint(self) -> tuple[str, Any] | None:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format: type json_schema needs a json_schema object")
            s = self.json_schema.schema_
            return ("json_schema", {} if s is None else s)
        return ("json_object", None) if self.type == "json_object" else None


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs`` extra: exactly one of a JSON Schema, any JSON object, a
    regex, a choice among strings, or a Lark grammar."""

    json_: dict[str, Any] | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | None = None
    grammar: Text | None = None

    def constraint(self) -> tuple[str, Any]:
        given = {
            "json_schema": self.json_,
            "json_object": self.json_object or None,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
        }
        set_ = [(k, v) for k, v in given.items() if v is not None]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs: give exactly one of json, json_object, regex, choice, "
                f"grammar (got {len(set_)})"
            )
        return set_[0]


class SamplingBody(GenerationBody):
    """Completions and chat: OpenAI's sampling fields besides the shared ones."""

    max_tokens: int | None = Field(None, ge=1, description="at most the model's context")
    n: int = Field(1, ge=1, le=MAX_N)
    logit_bias: (
        Annotated[
            dict[Annotated[str, Field(max_length=10)], Annotated[float, Field(ge=-100, le=100)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    stream_options: StreamOptions | None = None
    # structured output (inferflow.engine.constrain): OpenAI's, vLLM's extra, or vLLM's older
    # guided_* fields (a JSON Schema, given as an object or as JSON text; a regex; a choice; a
    # Lark grammar)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | None = None
    guided_grammar: Text | None = None

    def constraint(self) -> tuple[str, str, Any] | None:
        """(the request field, the constraint's kind, its value), or None."""
        guided = {
            "guided_json": "json_schema",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        given = [f for f in ("response_format", "structured_outputs", *guided) if getattr(self, f)]
        if len(given) > 1:
            raise RequestError(
                f"{given[1]}: give one structured-output field, not {' and '.join(given)}",
                given[1],
            )
        try:
            if self.structured_outputs is not None:
                return ("structured_outputs", *self.structured_outputs.constraint())
            if given and given[0] in guided:
                value = getattr(self, given[0])
                if given[0] == "guided_json" and isinstance(value, str):
                    value = loads(value, "guided_json")
                    if not isinstance(value, dict):
                        raise ValueError("guided_json: a JSON Schema is an object")
                return (given[0], guided[given[0]], value)
            c = self.response_format.constraint() if self.response_format else None
        except ValueError as e:
            raise RequestError(str(e)) from None
        return None if c is None else ("response_format", *c)


class CompletionBody(SamplingBody):
    NULL_ONLY = frozenset({"best_of", "suffix"})
    prompt: Prompt
    max_tokens: int | None = Field(
        16, ge=0, description="at most the model's context; 0 (with echo): score the prompt only"
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    # vLLM's extra: per prompt token, its log-probability, rank and the most likely
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    add_special_tokens: bool = True  # (vLLM's) text prompts begin with BOS where the model's do


def prompt_list(p: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes (validated: no list is empty) as a list of prompts (text or
    token ids)."""
    if isinstance(p, str):
        return [p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]
