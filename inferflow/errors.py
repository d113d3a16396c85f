"""Error types for everything a user can cause (bad spec, bad file, bad request).

Every message names the bad value and, where there is a closed set, the allowed ones.
"""

from __future__ import annotations

import re


class InferflowError(Exception):
    """Base class of Inferflow's own errors: the CLI prints these without a traceback and
    exits with ``exit_code`` (2: bad input)."""

    exit_code = 2


class Unavailable(InferflowError):
    """Something the command needs is not available now (a port in use): exit status 1."""

    exit_code = 1


class SpecError(InferflowError):
    """A model spec is invalid (schema, unknown name, bad override, missing file)."""


class CheckpointError(InferflowError):
    """A checkpoint file is malformed, truncated or of an unsupported kind."""


class UnsafePickleError(CheckpointError):
    """A pickle stream asks for a global or an operation outside the allow-list."""


class WeightBindingError(InferflowError):
    """Checkpoint tensors do not match the network the spec describes (missing, unused, shape)."""


class TokenizerError(InferflowError):
    """The tokenizer cannot be built from the files or metadata given."""


class QuantError(InferflowError):
    """Unknown quantization format or data that does not fit the format's layout."""


class RequestError(InferflowError):
    """A generation request is invalid (parameters out of range, prompt too long, ...).
    ``param``: the request field at fault (the server's error ``param``); by default the name a
    message starts with, as in "top_k: 1000000 exceeds the model's vocabulary size"."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        lead = re.match(r"([a-z][a-z0-9_]*): ", message)
        self.param = param if param is not None else (lead[1] if lead else None)
        self.code = code  # OpenAI's error code, where clients branch on one


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def context_exceeded(
    limit: int, prompt: int, new: int = 0, where: str = "", what: str = "input"
) -> RequestError:
    """A prompt (with ``new`` tokens asked after it) past the ``limit`` a sequence may hold, in
    the words OpenAI and vLLM use (LangChain, LiteLLM and others match them) and with OpenAI's
    code; ``where``: what the limit is when not the model's context; ``what``: the request's
    field holding the prompt."""
    head = f"This model's maximum context length is {limit} tokens{where}. However, "
    if new:
        return RequestError(
            head + f"you requested {prompt + new} tokens ({prompt} in the {what}, {new} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    return RequestError(
        head + f"your request has {prompt} input tokens. Please reduce the length of the {what}.",
        "prompt",
        CONTEXT_LENGTH_EXCEEDED,
    )


class Stopped(InferflowError):
    """Work stopped on request before it finished (e.g. every client that asked for a search
    went away); no partial result is returned."""
