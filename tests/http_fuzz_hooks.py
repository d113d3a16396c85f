"""Schemathesis hooks for fuzzing `inferflow serve` (SCHEMATHESIS_HOOKS=tests.http_fuzz_hooks;
tests/test_server_fuzz.py sets it): one extra check and two hooks.

- ``openai_error_body``: every 4xx / 5xx answer but /health's is OpenAI's error object
  (Anthropic's on /v1/messages).
- ``before_call``: schema-valid token counts are capped at FUZZ_MAX_TOKENS (default 4), and a
  completion without max_tokens gets it, so a case takes milliseconds on CPU; a value of the
  wrong type or range is sent as generated.
- ``before_call`` also gives every third completion or chat request one of issue 48's deep
  shapes (``inferflow.fuzz.deep``), in turn and at sizes from small to past every bound: a
  chained or nested grammar or schema, nested tool parameters, nested tool-call arguments.
- ``before_call`` names the served model (``$FUZZ_MODEL``) in Messages API requests, whose
  ``model`` is required.
- ``after_call``: appends "METHOD PATH<TAB>STATUS<TAB>SECONDS" per request to
  $INFERFLOW_FUZZ_LOG (if set), from which the test counts the cases each operation ran.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import schemathesis

from inferflow.fuzz import deep

MAX_TOKENS = int(os.environ.get("FUZZ_MAX_TOKENS", "4"))
SERVED = os.environ.get("FUZZ_MODEL", "smollm2-embed")  # the served model's name
SIZES = (3, 40, 700, 3000)
NESTED = 200  # nested objects sent at most this deep (schemathesis recurses on the body)
# (the pattern intersection stays small: past ~12 patterns each case waits for the time limit)
DEEP = (
    [(shape, n) for n in SIZES for shape in sorted(deep.CONSTRAINTS)]
    + [("tool parameters", n) for n in SIZES]
    + [("tool arguments", n) for n in SIZES]
)
_turn = itertools.count()


def _deep_fields(path: str, shape: str, n: int) -> dict[str, Any]:
    """The fields that carry ``shape`` at size ``n`` in a request to ``path``."""
    if shape == "tool parameters":  # (nested objects: the client's own code recurses on them)
        schema = deep.nested_schema(min(n, NESTED))
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        return {"tools": [tool]} if path.endswith("chat/completions") else {}
    if shape == "tool arguments":
        if not path.endswith("chat/completions"):
            return {}
        call = {"id": "c", "type": "function",
                "function": {"name": "f", "arguments": deep.nested_json(n)}}  # fmt: skip
        return {"messages": [{"role": "user", "content": "x"},
                             {"role": "assistant", "tool_calls": [call]}]}  # fmt: skip
    kind, build = deep.CONSTRAINTS[shape]
    size = min(n, 10) if "allOf" in shape else min(n, NESTED) if shape == "schema nested" else n
    return {"structured_outputs": deep.structured_outputs(kind, build(size))}


@schemathesis.check
def openai_error_body(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code < 400 or case.operation.path == "/health":
        return None
    body = response.json()
    err = body.get("error") if isinstance(body, dict) else None
    if case.operation.path.startswith("/v1/messages"):  # (Anthropic's Messages API: its shape)
        assert isinstance(err, dict) and body.get("type") == "error", f"not Anthropic's: {body!r}"
        assert set(body) == {"type", "error"} and set(err) == {"type", "message"}, body
        assert isinstance(err["message"], str) and err["message"], f"no message: {err!r}"
        return True
    assert isinstance(err, dict) and set(body) == {"error"}, f"not an OpenAI error: {body!r}"
    assert set(err) == {"message", "type", "param", "code"}, f"error fields: {sorted(err)}"
    assert isinstance(err["message"], str) and err["message"], f"no message: {err!r}"
    assert isinstance(err["type"], str) and err["type"], f"no type: {err!r}"
    assert err["param"] is None or isinstance(err["param"], str), f"param: {err!r}"
    return True


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    v = body.get("max_tokens")
    if v is None and "prompt" in body:  # completions' default (16) times n times the prompts
        body["max_tokens"] = MAX_TOKENS
    for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(k)
        if type(v) is int and v > MAX_TOKENS:
            body[k] = MAX_TOKENS
    path = case.operation.path
    if path.startswith("/v1/messages") and isinstance(body.get("model"), str):
        body["model"] = SERVED  # (required there: a random name stops every case at 404)
    turn = next(_turn) if path in ("/v1/completions", "/v1/chat/completions") else 1
    if turn % 3 == 0:
        shape, n = DEEP[turn // 3 % len(DEEP)]
        body.update(_deep_fields(path, shape, n))


@schemathesis.hook
def after_call(context: Any, case: Any, response: Any) -> None:
    path = os.environ.get("INFERFLOW_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{case.operation.label}\t{response.status_code}\t{response.elapsed:.3f}\n")
