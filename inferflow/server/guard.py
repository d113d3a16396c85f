"""What stands between a request and the routes: OpenAI-style errors for every exception a
request can cause (pydantic's validation errors as one message naming the field:
``describe_invalid``), and the ``Guard`` middleware (API key, 503 while draining, body size, the
count of requests in flight)."""

from __future__ import annotations

import functools
import hmac
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflow.engine.scheduler import QueueFull
from inferflow.errors import InferflowError, Stopped
from inferflow.server.api_error import CLIENT_KEY, APIError
from inferflow.server.protocol import NOT_SERVED, Body, error_body
from inferflow.server.runner import ClientGone, ModelFailed

if TYPE_CHECKING:
    from inferflow.server.state import ServerState

log = logging.getLogger(__name__)


KINDS = {401: "authentication_error", 404: "not_found_error"}  # others: invalid_request_error


# Anthropic's Messages API answers errors in its own shape: {"type": "error", "error": {"type",
# "message"}}, the type following the status
ANTHROPIC_PATHS = frozenset(
    {"/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens"}
)
ANTHROPIC_KINDS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error",
}  # fmt: skip


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_KINDS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_json(
    path: str,
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An error response in the shape the route's clients parse: OpenAI's error object, or
    Anthropic's on the Messages API."""
    if path in ANTHROPIC_PATHS:
        return JSONResponse(anthropic_error(status, message), status, headers=headers)
    return JSONResponse(error_body(message, kind, param, code), status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON body, or Anthropic's on its routes (the client
    disconnected: nothing, one log line)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        path = request.url.path
        return error_json(path, e.status, e.message, e.kind, e.param, e.code, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = KINDS.get(e.status_code, "invalid_request_error")
        headers = e.headers
        if e.status_code == 405:  # (Starlette names the methods of the first route that matched)
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(app, request))}
        return error_json(request.url.path, e.status_code, str(e.detail), kind, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        errors = list(e.errors())
        if "json" not in kind and errors and tuple(errors[0].get("loc", ())) == ("body",):
            text = f"the body must be JSON, sent as Content-Type: application/json (got {kind!r})"
            return error_json(request.url.path, 400, text, "invalid_request_error")
        param, text = describe_invalid(errors)
        return error_json(request.url.path, 400, text, "invalid_request_error", param)

    @app.exception_handler(QueueFull)
    async def full(request: Request, e: QueueFull) -> JSONResponse:
        retry = {"Retry-After": "1"}
        return error_json(request.url.path, 429, str(e), "rate_limit_error", headers=retry)

    @app.exception_handler(InferflowError)
    async def bad(request: Request, e: InferflowError) -> JSONResponse:
        param = getattr(e, "param", None)  # (RequestError's field at fault, and code)
        code = getattr(e, "code", None)
        return error_json(request.url.path, 400, str(e), "invalid_request_error", param, code)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, _: ClientGone) -> Response:
        log.info("%s %s: the client disconnected", request.method, request.url.path)
        return Response(status_code=499)  # (nobody reads it)

    @app.exception_handler(Stopped)
    async def stopped(request: Request, e: Stopped) -> JSONResponse:
        # a batched call stopped for the shutdown (a client that left gets ClientGone)
        text, retry = f"the server is shutting down: {e}", {"Retry-After": "5"}
        return error_json(request.url.path, 503, text, "server_error", headers=retry)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, _: RecursionError) -> JSONResponse:
        # (a backstop: request fields are bounded in depth; one that was missed is the
        # client's 400, not the server's 500)
        log.warning("%s %s: a RecursionError, answered 400", request.method, request.url.path)
        text = "the request nests too deeply to be handled"
        return error_json(request.url.path, 400, text, "invalid_request_error")

    @app.exception_handler(ModelFailed)
    async def failed(request: Request, e: ModelFailed) -> JSONResponse:
        return error_json(request.url.path, 500, str(e), "server_error")


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (a path with a route per
    method: GET and DELETE /v1/responses/{id})."""
    path = request.scope["path"]
    found = {
        m
        for r in app.routes
        if isinstance(r, APIRoute) and r.path_regex.match(path)
        for m in r.methods or ()
    }
    return sorted(found)


class Guard:
    """Pure ASGI middleware (it must not buffer streaming responses): the API key on every
    route but /health, 503 while the server drains, the body size limit (by Content-Length and
    while the body streams), and the count of requests in flight."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state
        self.keys = [f"Bearer {k}".encode() for k in state.cfg.api_keys]
        self.limit = state.cfg.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            # a browser's CORS preflight (with --cors-origin, CORSMiddleware answers it first)
            origin = headers.get(b"origin", b"").decode("latin-1")
            msg = (
                f"cross-origin requests are off: this server allows no origin ({origin!r} "
                "asked); start it with --cors-origin ORIGIN (repeatable, or '*')"
            )
            return await error_json(scope["path"], 403, msg, "permission_error")(
                scope, receive, send
            )
        if self.keys:
            given = headers.get(b"authorization", b"")
            if not given and b"x-api-key" in headers:  # (Anthropic's SDK sends the key so)
                given = b"Bearer " + headers[b"x-api-key"]
            # (every key compared, in constant time: the answer's time names none of them)
            match = [i for i, k in enumerate(self.keys) if hmac.compare_digest(given, k)]
            if not match:
                msg = (
                    "invalid or missing API key (send the header Authorization: Bearer KEY, or "
                    "x-api-key: KEY)"
                )
                return await error_json(scope["path"], 401, msg, "authentication_error")(
                    scope, receive, send
                )
            if len(self.keys) > 1:
                CLIENT_KEY.set(match[0])
        if scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        if self.state.draining:
            msg = "the server is shutting down; retry on another instance or later"
            retry = {"Retry-After": "5"}
            return await error_json(scope["path"], 503, msg, "server_error", headers=retry)(
                scope, receive, send
            )
        if not headers.get(b"content-type"):  # (curl -d without -H, some clients): JSON
            scope = {
                **scope,
                "headers": [
                    *(h for h in scope["headers"] if h[0] != b"content-type"),
                    (b"content-type", b"application/json"),
                ],
            }
        self.state.active += 1
        try:
            await self._limited(scope, receive, send, headers)
        finally:
            self.state.active -= 1

    async def _limited(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes]
    ) -> None:
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.limit:
            msg = f"the request body has {int(size)} bytes; the limit is {self.limit}"
            return await error_json(scope["path"], 413, msg, "invalid_request_error")(
                scope, receive, send
            )
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise StarletteHTTPException(
                    413, f"the request body exceeds the limit of {self.limit} bytes"
                )
            return msg

        await self.app(scope, limited, send)


# --- pydantic's validation errors as one OpenAI error ------------------------------------


def _bodies(cls: type[BaseModel] = Body) -> list[type[BaseModel]]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_bodies(sub))]


@functools.cache
def _fields() -> frozenset[str]:
    """Every field name of a request body (once all route modules have defined theirs): in an
    error's path, what is not one is a union member."""
    return frozenset(name for m in _bodies() for name in m.model_fields)


def describe_invalid(errors: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(param, message) for pydantic's errors of a request body: the first error, with the
    union members pydantic names in its path ('str', 'list[int]', ...) left out. When no member
    of a union matched, the message lists the members; when one matched in type but broke a
    constraint (a prompt token id < 0), that constraint is the message."""
    if not errors:
        return None, "invalid request"
    if errors[0].get("type") == "json_invalid":  # (its loc is the character position)
        why = (errors[0].get("ctx") or {}).get("error", "")
        return None, f"the body is not valid JSON: {why} (at character {errors[0]['loc'][-1]})"

    def split(e: dict[str, Any]) -> tuple[str, list[str]]:
        loc = list(e.get("loc", ()))
        loc = loc[1:] if loc[:1] == ["body"] else loc
        unknown = e.get("type") == "extra_forbidden"  # (its last element names the field)
        kept, tags = [], []
        for i, x in enumerate(loc):
            if isinstance(x, int) or x in _fields() or (unknown and i == len(loc) - 1):
                kept.append(str(x))
            else:
                tags.append(str(x))
        return ".".join(kept), tags

    first = errors[0]
    param, tags = split(first)
    if tags and len(errors) > 1:  # a union: the members' errors come one after another
        members = [e for e in errors if split(e)[0].startswith(param) and split(e)[1]]
        shaped = [e for e in members if not str(e.get("type", "")).endswith("_type")]
        if shaped:
            first = shaped[0]
            param = split(first)[0]
        else:
            forms = dict.fromkeys(split(e)[1][0].replace("constrained-", "") for e in members)
            got = json.dumps(first.get("input"), default=str)[:80]
            return param or None, f"{param}: expected one of {', '.join(forms)} (got {got})"
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        name = str(first.get("loc", ("",))[-1])
        msg = NOT_SERVED.get(name, "unknown field; see the API reference for the allowed fields")
    text = f"{param}: {msg}" if param else msg
    if "input" in first and first.get("type") not in ("missing", "extra_forbidden"):
        text += f" (got {json.dumps(first['input'], default=str)[:80]})"
    return param or None, text
