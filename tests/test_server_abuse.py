"""Issue 48's abuse campaign against a real `inferflow serve`, each finding with a victim: a
greedy stream that runs alongside and must end with the very text it produces alone
(``--deterministic``) and no gap of more than MAX_GAP seconds between its chunks, while the bad
request gets its 400 (or is scored in chunks).

- grammars that overflowed the compiler's stack, or take exponential time, or compile but fail
  at their first step: 400 at admission, the process alive after;
- scoring (``prompt_logprobs``, ``echo``) in chunks between engine steps, stopped when its
  client leaves, capped per request;
- the prefix cache kept apart per ``cache_salt`` and per API key: ``cached_tokens`` and the
  answer's time no longer tell one client another's prompt;
- request fields nested past the bound: 400 naming them, not a RecursionError's 500.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from inferflow.fuzz import deep
from tests.conftest import smollm2_path
from tests.serving import check_error, run_server

pytestmark = pytest.mark.slow

KEYS = ("sk-one", "sk-two")
MAX_GAP = 2.0  # seconds between two chunks of the victim's stream, on this 2-core machine
VICTIM = "The history of the lighthouse"


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    smollm2_path()  # skips when the model package is missing
    tmp = tmp_path_factory.mktemp("abuse")
    args = ["--deterministic", "--grammar-timeout", "2", "--max-scored-tokens", "4096"]
    for key in KEYS:
        args += ["--api-key", key]
    with run_server(tmp, *args, verbose=True) as (url, _):
        yield url, next(tmp.glob("server-*.log"))


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The prefix cache's tests: without --deterministic, which turns the cache off."""
    smollm2_path()
    args = [a for key in KEYS for a in ("--api-key", key)]
    with run_server(tmp_path_factory.mktemp("cache"), *args) as (url, _):
        yield url


class Victim:
    """A greedy stream in a thread of its own: its text, and the longest wait between two of
    its chunks once the first came."""

    def __init__(self, url: str, tokens: int = 600) -> None:
        self.url, self.tokens = url, tokens
        self.text, self.gap, self.done = "", 0.0, False
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": VICTIM, "max_tokens": self.tokens, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        last = None
        with httpx.stream(
            "POST", f"{self.url}/v1/completions", json=body, headers=auth(), timeout=300
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    now = time.monotonic()
                    if last is not None:
                        self.gap = max(self.gap, now - last)
                    last = now
                    self.text += json.loads(line[6:])["choices"][0]["text"]
                    self.started.set()

    def __enter__(self) -> Victim:
        self.thread.start()
        assert self.started.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(300)


class Alone(dict[int, str]):
    """The victim's text with nothing else running, by length (computed on first use)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def __missing__(self, tokens: int) -> str:
        with Victim(self.url, tokens) as v:
            pass
        self[tokens] = v.text
        return v.text


@pytest.fixture(scope="module")
def alone(server: tuple[str, Path]) -> dict[int, str]:
    return Alone(server[0])


def _check_victim(v: Victim, alone: dict[int, str], what: str) -> None:
    assert v.done and v.text == alone[v.tokens], what
    assert v.gap <= MAX_GAP, f"{what}: the victim waited {v.gap:.2f} s between two chunks"


def _post(
    url: str, route: str, body: object, key: str = KEYS[0], timeout: float = 60
) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, headers=auth(key), timeout=timeout)


def _completion(extra: dict, prompt: str = "Answer:") -> dict:
    return {"prompt": prompt, "max_tokens": 8, **extra}


# --- 1, 6: grammars that killed the process, and grammars that fail at their first step ------


def test_grammars_out_of_bounds_get_400_naming_the_limit(
    server: tuple[str, Path], alone: dict[int, str]
) -> None:
    url, log = server
    before = log.stat().st_size
    cases = [  # the outside probe's, and one past each bound alone
        ({"grammar": deep.lark_chain(5000)}, "--grammar-max-alternatives"),
        ({"grammar": deep.lark_chain(1500).replace(" | ", " ")}, "--grammar-max-rules"),
        ({"grammar": deep.lark_nested(100)}, "--grammar-max-depth"),
        ({"json": deep.ref_chain(1000)}, "--grammar-max-rules"),
        ({"json": deep.any_of_objects(5000)}, "--grammar-max-alternatives"),
        ({"json": {"anyOf": [{"type": "integer"}] * 2000}}, "--grammar-max-alternatives"),
        ({"choice": deep.long_choices(256, 15000)}, "--grammar-max-bytes"),
        ({"regex": "(" * 80 + "a" + ")" * 80}, "--grammar-max-depth"),
    ]
    with Victim(url) as v:
        for so, flag in cases:
            t0 = time.monotonic()
            r = _post(url, "/v1/completions", _completion({"structured_outputs": so}))
            check_error(r, 400, "structured_outputs", flag)
            assert time.monotonic() - t0 < 3, flag
        # the OpenAI field too
        fmt = {"type": "json_schema", "json_schema": {"schema": deep.ref_chain(1000)}}
        check_error(
            _post(url, "/v1/completions", _completion({"response_format": fmt})),
            400,
            "response_format",
            "--grammar-max-rules",
        )
    _check_victim(v, alone, "grammars out of bounds")
    assert log.stat().st_size - before < 20_000  # (no grammar quoted in the log)


def test_a_grammar_failing_at_its_first_step_is_refused_at_admission(
    server: tuple[str, Path], alone: dict[int, str]
) -> None:
    url, log = server
    before = log.stat().st_size
    so = {"json": deep.self_reference()}
    with Victim(url, 300) as v:
        check_error(
            _post(url, "/v1/completions", _completion({"structured_outputs": so})),
            400,
            "fails at its first steps",
        )
        chat = {
            "messages": [{"role": "user", "content": "JSON please"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": so["json"]}},
            "stream": True,
        }
        check_error(_post(url, "/v1/chat/completions", chat), 400, "fails at its first steps")
    _check_victim(v, alone, "self-referencing schema")
    grown = log.read_text()[before:]
    assert "Traceback" not in grown and len(grown) < 20_000


def test_exponential_patterns_end_at_the_time_limit_and_starve_no_one(
    server: tuple[str, Path], alone: dict[int, str]
) -> None:
    url, _ = server
    so = {"json": deep.pattern_intersection(20)}
    with Victim(url) as v, ThreadPoolExecutor(8) as pool:
        t0 = time.monotonic()
        bombs = [
            pool.submit(_post, url, "/v1/completions", _completion({"structured_outputs": so}))
            for _ in range(8)
        ]
        time.sleep(0.5)
        first = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        unrelated = time.monotonic() - t0 - 0.5
        assert first.status_code == 200 and unrelated < MAX_GAP, unrelated
        for b in bombs:
            check_error(b.result(), 400, "--grammar-timeout")
    _check_victim(v, alone, "eight pattern intersections")


def test_min_tokens_does_not_combine_with_a_grammar(server: tuple[str, Path]) -> None:
    url, _ = server
    body = _completion({"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 5})
    check_error(_post(url, "/v1/completions", body), 400, "min_tokens", "structured output")


def test_a_grammar_that_crashes_its_compiler_costs_only_a_worker(tmp_path: Path) -> None:
    """With the bounds raised out of the way, the chains that overflowed the server's stack now
    end a worker process: 400, and the server serves on."""
    smollm2_path()
    # (a time limit the crash comes well within, though the worker runs niced beside the victim)
    args = ["--deterministic", "--max-body-bytes", str(64 << 20), "--grammar-timeout", "60"]
    for flag in ("--grammar-max-rules", "--grammar-max-alternatives", "--grammar-max-bytes"):
        args += [flag, str(10**8)]
    with run_server(tmp_path, *args) as (url, proc):
        lone = Alone(url)
        lone[300]
        with Victim(url, 300) as v:
            cases = [{"grammar": deep.lark_chain(20_000)}, {"json": deep.ref_chain(20_000)}]
            for so in cases:
                body = _completion({"structured_outputs": so})
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                check_error(r, 400, "ended the compiler")
                assert proc.poll() is None
        _check_victim(v, lone, "compiler crashes")
        assert httpx.get(f"{url}/health").status_code == 200


# --- 2: scoring -----------------------------------------------------------------------------


def _ids(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 200 for i in range(n)]


def test_a_long_scoring_request_is_scored_in_chunks(
    server: tuple[str, Path], alone: dict[int, str]
) -> None:
    url, _ = server
    body = {"prompt": _ids(2000), "max_tokens": 0, "echo": True, "prompt_logprobs": 0}
    with Victim(url) as v:
        r = _post(url, "/v1/completions", body, timeout=300)
        assert r.status_code == 200, r.text
        scored = r.json()["choices"][0]["prompt_logprobs"]
        assert len(scored) == 2000 and scored[0] is None and len(scored[1]) == 1
        assert not v.done, "the victim ended before the scoring: it proves nothing"
    _check_victim(v, alone, "a 2000-token prompt_logprobs request")


def test_many_short_scored_prompts_share_the_engine(
    server: tuple[str, Path], alone: dict[int, str]
) -> None:
    url, _ = server
    body = {"prompt": [_ids(16, s) for s in range(200)], "max_tokens": 0}
    body |= {"echo": True, "logprobs": 20}
    with Victim(url) as v:
        r = _post(url, "/v1/completions", body, timeout=300)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 200
    _check_victim(v, alone, "200 scored prompts")


def test_a_scoring_request_stops_when_its_client_leaves(
    server: tuple[str, Path], alone: dict[int, str]
) -> None:
    url, log = server
    before = log.stat().st_size
    body = {"prompt": _ids(4000, 3), "max_tokens": 0, "echo": True, "prompt_logprobs": 0}
    with Victim(url) as v:
        with pytest.raises(httpx.ReadTimeout):
            _post(url, "/v1/completions", body, timeout=3)
        left = time.monotonic()
        while "call over 1 inputs stopped" not in log.read_text()[before:]:
            assert time.monotonic() - left < 3, "the scoring went on after its client left"
            time.sleep(0.05)
    _check_victim(v, alone, "a scoring request whose client left")


def test_scoring_is_capped_per_request(server: tuple[str, Path]) -> None:
    url, _ = server
    body = {"prompt": [_ids(2100), _ids(2100, 2)], "max_tokens": 0, "echo": True, "logprobs": 0}
    check_error(_post(url, "/v1/completions", body), 400, "4200", "--max-scored-tokens")


# --- 4: the prefix cache --------------------------------------------------------------------

SECRET = (
    "You are the assistant of the north tower. Answer the guards' questions briefly and never "
    "say the code to anyone who does not give the password first. The vault code is {}."
)
FILLER = " The guards change at dawn and dusk, and the keys hang by the kitchen door." * 12


def _guess(url: str, code: str, key: str, salt: str | None = None) -> tuple[int, float]:
    body = {"prompt": SECRET.format(code) + FILLER, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    r = _post(url, "/v1/completions", body, key)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], took


def _replay(
    url: str, secret: str, victim: tuple[str, str | None], attacker: tuple[str, str | None]
) -> tuple[list[int], list[float], int]:
    """The oracle of the outside probe: the victim's prompt cached, then 16 candidates (one
    right) sent by the attacker; (cached tokens, seconds) per candidate and the right one's
    index."""
    _guess(url, secret, *victim)
    candidates = [f"{4000 + 37 * i}" for i in range(16)]
    right = 11
    candidates[right] = secret
    cached, times = [], []
    for c in candidates:
        n, t = _guess(url, c, *attacker)
        cached.append(n)
        times.append(t)
    return cached, times, right


def test_the_oracle_exists_without_isolation(cache_server: str) -> None:
    """The control: one key, one salt, and the right guess stands out (the test below would
    prove nothing if it did not)."""
    url = cache_server
    cached, _, right = _replay(url, "7391", (KEYS[0], "shared"), (KEYS[0], "shared"))
    wrong = [n for i, n in enumerate(cached) if i != right]
    assert cached[right] > max(wrong[1:]) > 0


@pytest.mark.parametrize("isolation", ["cache_salt", "api key"])
def test_salts_and_keys_never_share_blocks(cache_server: str, isolation: str) -> None:
    url = cache_server
    secret = "5826" if isolation == "cache_salt" else "6044"
    if isolation == "cache_salt":
        victim, attacker = (KEYS[0], "victim"), (KEYS[0], "attacker")
    else:
        victim, attacker = (KEYS[0], None), (KEYS[1], None)
    probe = secret[::-1]  # (the attacker must not have sent the secret before the replay)
    assert _guess(url, probe, *victim)[0] == 0  # (a prompt nobody sent yet)
    assert _guess(url, probe, *attacker)[0] == 0  # the same prompt, another salt
    assert _guess(url, probe, *victim)[0] > 0  # (the same salt shares it)
    cached, times, right = _replay(url, secret, victim, attacker)
    wrong = [n for i, n in enumerate(cached) if i != right]
    assert cached[right] == statistics.median(wrong[1:])
    median = statistics.median(t for i, t in enumerate(times) if i not in (0, right))
    assert times[right] >= 0.75 * median, (times[right], median)


# --- 5: nesting -----------------------------------------------------------------------------


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def test_nesting_past_the_bound_is_a_400_naming_the_field(
    server: tuple[str, Path], alone: dict[int, str]
) -> None:
    url, log = server
    deep_args = deep.nested_json(500)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_args}}
    history = [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    tools = [_tool(deep.nested_schema(250))]
    hi = [{"role": "user", "content": "Hi"}]
    cases = [
        ("/v1/chat/completions", {"messages": history}, "messages", "64 levels"),
        ("/v1/chat/completions", {"messages": hi, "tools": tools}, "tools", "64 levels"),
        ("/tokenize", {"messages": hi, "tools": tools}, "tools", "64 levels"),
        (
            "/v1/chat/completions",
            {"messages": hi, "tools": tools, "tool_choice": "required"},
            "tools",
            "64 levels",
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "f",
                     "arguments": deep.nested_object_json(2000)},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ]
            },
            "input",
            "64 levels",
        ),
    ]  # fmt: skip
    with Victim(url, 300) as v:
        for route, body, field, words in cases:
            check_error(_post(url, route, body), 400, field, words)
    _check_victim(v, alone, "nested fields")
    assert "RecursionError" not in log.read_text()
