"""What a route raises to answer an error on purpose (``APIError``; ``guard`` turns it into the
error object its clients parse), and which API key a request came with (``CLIENT_KEY``, set by
``guard.Guard``)."""

from __future__ import annotations

from contextvars import ContextVar


class APIError(Exception):
    """An error a route raises on purpose: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.code, self.headers = code, headers


# Which of several API keys the request came with (its index among --api-key's), set by Guard
# for the route it calls: the prefix cache keeps each key's prompts apart. None with one key.
CLIENT_KEY: ContextVar[int | None] = ContextVar("inferflow_client_key", default=None)
