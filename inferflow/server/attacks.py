"""Hostile requests the server must answer alone (issue 24's outside probe): each with the
status it must get and words its error message must hold; and ``Health``, which watches how
fast /health answers meanwhile. Used by tests/test_hardening.py and benchmarks/serve_chaos.py
(so this module imports nothing heavy: the load client stays light).

The template attacks need the served spec's chat template to be ``HOSTILE_TEMPLATE`` (a model
file's template is untrusted code): it loops forever, doubles a string, asks for range(10**9)
or prints 10**5100 when the last message says so, and is ChatML otherwise."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

HOSTILE_TEMPLATE = """\
{%- set c = messages[-1]['content'] -%}
{%- if c == 'LOOP' -%}
{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor -%}
{%- elif c == 'DOUBLE' -%}
{%- set ns = namespace(s='xxxxxxxx') -%}
{%- for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor -%}{{ ns.s }}
{%- elif c == 'RANGE' -%}{{ range(10**9) | list | length }}
{%- elif c == 'BIG' -%}{{ (10 ** (c | length * 1700)) | string }}
{%- else -%}
{%- for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}<|im_start|>assistant
{% endif -%}
"""


def hostile_tokenizer() -> str:
    """The YAML lines of a spec's ``tokenizer:`` section (GGUF vocabulary) whose chat template
    is HOSTILE_TEMPLATE."""
    lines = "".join(f"    {line}\n" for line in HOSTILE_TEMPLATE.splitlines())
    return f"tokenizer:\n  from: gguf\n  chat_template: |\n{lines}"


class Attack(NamedTuple):
    route: str
    body: Any  # a JSON value, or str: raw JSON text (what json.dumps cannot write)
    status: int
    words: tuple[str, ...]  # what the error message names
    seconds: float = 1.0  # the answer comes within this (templates: the budget, plus slack)


def _chat(content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


# the template attacks' time assumes --template-timeout 1: a worker renders until it reaches a
# limit (time, or 512 MiB of memory for the doubling), and is replaced after it
ATTACKS: dict[str, Attack] = {
    "fsd_n 2**62": Attack(
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "fsd_alpha": 0.5, "fsd_n": 4611686018427387904},
        400,
        ("fsd_n", "16"),
    ),
    "length_penalty 1e308": Attack(
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "beam_width": 2, "length_penalty": 1e308},
        400,
        ("length_penalty", "10"),
    ),
    "template loop": Attack("/v1/chat/completions", _chat("LOOP"), 400, ("time limit",), 2.5),
    "template doubling": Attack("/v1/chat/completions", _chat("DOUBLE"), 400, ("limit",), 2.5),
    "template range(10**9)": Attack(
        "/v1/chat/completions", _chat("RANGE"), 400, ("chat template",)
    ),
    "template 10**5100": Attack("/v1/chat/completions", _chat("BIG"), 400, ("chat template",)),
    "tokenize surrogate": Attack("/tokenize", '{"prompt": "a\\udfff b"}', 400, ("surrogate",)),
    "chat surrogate": Attack(
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "a\\udfff b"}]}',
        400,
        ("surrogate",),
    ),
    "logit_bias 5000 digits": Attack(
        "/v1/completions",
        '{"prompt": "hi", "logit_bias": {"' + "7" * 5000 + '": 1}}',
        400,
        ("logit_bias", "10 characters"),
    ),
    "300 prompts": Attack(
        "/v1/completions",
        {"prompt": [[1, 2, 3]] * 300, "max_tokens": 2},
        400,
        ("300 prompts", "--max-waiting"),
    ),
    "max_tokens past the context": Attack(
        "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, ("max_tokens", "context")
    ),
}


class Health:
    """Polls ``url``/health every 0.1 s from a thread of its own (a context manager); ``worst``
    is the slowest answer in seconds, ``failures`` the answers that were not 200."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.failures, self.polls = url, 0.0, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import httpx  # (a client's dependency, not the server's)

        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = c.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.failures += not ok
                self.polls += 1
                time.sleep(0.1)

    def __enter__(self) -> Health:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
