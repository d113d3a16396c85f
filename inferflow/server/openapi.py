"""The OpenAPI schema (``GET /openapi.json``) as the server really answers: the request bodies
are the pydantic models of ``protocol``; every error is 400 / 401 / 404 / 413 / 429 / 500 / 503
with OpenAI's error object (FastAPI's default 422 never happens: validation errors are 400),
streaming routes answer ``text/event-stream`` too, and ``/metrics`` is Prometheus text."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from inferflow.server.protocol import ErrorResponse


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of Anthropic's Messages API routes."""

    type: Literal["error"]
    error: AnthropicErrorObject


# (a $ref, not FastAPI's "model": that would put the schema under a route's own media type,
# text/plain for /metrics, while errors are always JSON)
ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
ANTHROPIC_ERROR = {
    "application/json": {"schema": {"$ref": "#/components/schemas/AnthropicErrorResponse"}}
}
# one server-sent event, as schemathesis and browsers parse it: its data is a JSON chunk
# (the OpenAI object with ``object`` "text_completion" / "chat.completion.chunk") or [DONE]
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "string"}}}
# /health answers its own status object, never an error object
_STATUS = {
    "application/json": {"schema": {"type": "object", "properties": {"status": {"type": "string"}}}}
}
HEALTH: dict[int | str, dict[str, Any]] = {
    503: {"description": "loading", "content": _STATUS},
    500: {"description": "loading failed", "content": _STATUS},
}
WHY = {
    400: "a bad field (named in param), a prompt longer than the context, malformed JSON",
    401: "no or a wrong API key (Authorization: Bearer KEY)",
    404: "a model name that is not served here",
    413: "the request body is over --max-body-bytes",
    429: "the waiting queue (--max-waiting) is full; retry after Retry-After seconds",
    500: "the model failed to load, or the model failed on this request",
    503: "the model is still loading; retry after Retry-After seconds",
}


def responses(
    auth: bool = False,
    *,
    body: bool = False,
    queued: bool = False,
    sse: bool = False,
    metrics: bool = False,
    anthropic: bool = False,
) -> dict[int | str, dict[str, Any]]:
    """The responses a route can give besides its 200 JSON: ``body`` for routes that read a
    request body, ``queued`` for routes whose work waits in a bounded queue (429: completions,
    chat, embeddings), ``sse`` for routes that can stream (a text/event-stream 200),
    ``metrics`` for /metrics (it answers while the model loads, or after loading failed),
    ``anthropic`` for the Messages API (its error shape)."""
    codes = [401] if auth else []
    if not metrics:
        codes += [500, 503]
    if body:
        codes += [400, 404, 413]
    if queued:
        codes.append(429)
    out: dict[int | str, dict[str, Any]] = {
        c: {"description": WHY[c], "content": ANTHROPIC_ERROR if anthropic else ERROR}
        for c in sorted(codes)
    }
    for c in (429, 503):
        if c in out:
            out[c]["headers"] = RETRY_AFTER
    if sse:
        out[200] = {"content": {"text/event-stream": {"schema": SSE_EVENT}}}
    return out


def trim_schema(app: FastAPI, auth: bool) -> None:
    """Build the schema without FastAPI's 422 validation responses, and with the bearer scheme
    on every route but /health when an API key is set."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, ops in schema.get("paths", {}).items():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
                    if auth and path != "/health":
                        op["security"] = [{"bearer": []}]
            found = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                found.pop(name, None)
            error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            found.update(error.pop("$defs", {}))
            found["ErrorResponse"] = error
            error = AnthropicErrorResponse.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            found.update(error.pop("$defs", {}))
            found["AnthropicErrorResponse"] = error
            if auth:
                schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
                schemes["bearer"] = {"type": "http", "scheme": "bearer"}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
