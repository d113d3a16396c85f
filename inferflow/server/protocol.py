"""OpenAI request bodies (pydantic; unknown fields are refused, naming the allowed ones) and
their mapping onto SamplingParams. Engine extras (top_k, min_p, mirostat, FSD, ...) are
accepted as extra body fields, as vLLM does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inferflow.engine.sampling import MAX_N, SamplingParams
from inferflow.errors import RequestError
from inferflow.spec.types import GenerationDefaults


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object (HTTP error responses and the SSE error event)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Body):
    include_usage: bool = False


SPEC_DEFAULTED = ("temperature", "top_k", "top_p")
# body fields passed to SamplingParams under the same name, unchanged
SAME_NAME = (
    "min_p", "typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "fsd_alpha",
    "fsd_k", "fsd_n", "fsd_random_steps", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "ignore_eos", "n", "beam_width", "length_penalty",
)  # fmt: skip


class SamplingBody(Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    # unset: the spec's generation defaults (as vLLM takes the model's generation config)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # engine extras
    top_k: int | None = Field(None, ge=0)
    min_p: float = Field(0.0, ge=0, lt=1)
    typical_p: float = Field(1.0, gt=0, le=1)
    tfs_z: float = Field(1.0, gt=0, le=1)
    mirostat: Literal[0, 1, 2] = 0
    mirostat_tau: float = Field(5.0, gt=0)
    mirostat_eta: float = Field(0.1, gt=0)
    fsd_alpha: float = Field(0.0, ge=0, lt=1)
    fsd_k: int = Field(6, ge=1)
    fsd_n: int = Field(3, ge=1)
    fsd_random_steps: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    beam_width: int = Field(1, ge=1, le=MAX_N)  # > 1: beam search, the n best beams returned
    length_penalty: float = 1.0

    def sampling(
        self, max_tokens: int, logprobs: int | None, vocab: int, defaults: GenerationDefaults
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < vocab:
                raise RequestError(f"logit_bias: key {k!r} is not a token id in 0..{vocab - 1}")
            bias[int(k)] = v
        unset = {  # fields a request may leave to the spec's generation defaults
            k: getattr(defaults, k) if getattr(self, k) is None else getattr(self, k)
            for k in SPEC_DEFAULTED
        }
        return SamplingParams(
            **unset,
            **{k: getattr(self, k) for k in SAME_NAME},
            logit_bias=bias,
            max_new_tokens=max_tokens,
            min_new_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            logprobs=logprobs,
        )


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(p.text for p in self.content or [])
        )
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class EmbeddingBody(Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class TokenizeBody(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True


class DetokenizeBody(Body):
    model: str | None = None
    tokens: list[int]


def prompt_list(p: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts (text or token ids)."""
    if isinstance(p, str):
        return [p]
    if not p:
        raise RequestError("prompt: the list is empty; give at least one prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]
