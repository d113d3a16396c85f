"""Error types for everything a user can cause (bad spec, bad file, bad request).

Every message names the bad value and, where there is a closed set, the allowed ones.
"""

from __future__ import annotations


class InferflowError(Exception):
    """Base class of Inferflow's own errors: the CLI prints these without a traceback."""


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
    """A generation request is invalid (parameters out of range, prompt too long, ...)."""


class Stopped(InferflowError):
    """Work stopped on request before it finished (e.g. every client that asked for a search
    went away); no partial result is returned."""
