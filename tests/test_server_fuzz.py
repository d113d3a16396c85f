"""HTTP API fuzzing with schemathesis against the server's own OpenAPI schema (/openapi.json):
every operation, in its examples, coverage (boundary and type-violating values) and fuzzing
phases, schema-valid and schema-violating requests (``--mode all``), against the real server
process with an API key. Checks: no 5xx; status codes, content types, headers and bodies as
the schema declares; schema-violating requests refused; every error OpenAI's error object
(tests/http_fuzz_hooks.py); and the server healthy, idle and with every KV block free after.

Not checked: that every schema-valid request is accepted (schemathesis' positive_data_acceptance)
— what depends on the model (the vocabulary's token ids, the context length after tokenization,
a chat template's rules) is not in the schema and answers 400 by design.

A longer campaign, by hand (the server from `make run`, without an API key):

    SCHEMATHESIS_HOOKS=tests.http_fuzz_hooks .venv/bin/schemathesis run \\
        http://127.0.0.1:8000/openapi.json --mode all --checks all \\
        --exclude-checks positive_data_acceptance --max-examples 1000
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import smollm2_path
from tests.serving import NAME, metric, run_server, wait_for

pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.slow

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
# cases per operation and phase: about a minute in all on 2 idle CPU cores
EXAMPLES = int(os.environ.get("INFERFLOW_FUZZ_EXAMPLES", "200"))
SEED = os.environ.get("INFERFLOW_FUZZ_SEED", "20260101")
OPERATIONS = {
    "GET /health",
    "GET /metrics",
    "GET /v1/models",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/embeddings",
    "POST /v1/classify",
    "POST /v1/rerank",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /tokenize",
    "GET /tokenizer_info",
    "POST /detokenize",
}
ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "schemathesis.toml"  # (413 is a rejection of invalid data too)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    smollm2_path()  # skips when the model package is missing
    # chat's default length (the spec's max_new_tokens) kept as short as the capped max_tokens
    with run_server(
        tmp_path_factory.mktemp("fuzz"),
        "--api-key",
        KEY,
        "--kv-cache-memory",
        "64MiB",
        spec_extra="generation: {max_new_tokens: 4}\n",
    ) as (url, _):
        yield url


def test_schema_lists_every_route(server: str) -> None:
    schema = httpx.get(f"{server}/openapi.json", headers=AUTH).json()
    found = {f"{m.upper()} {p}" for p, ops in schema["paths"].items() for m in ops}
    assert found == OPERATIONS
    for p, ops in schema["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], p  # validation errors are 400s
            if p != "/health":
                assert op["security"] == [{"bearer": []}], p


def test_schemathesis_finds_nothing(server: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls.tsv"
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.http_fuzz_hooks",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "INFERFLOW_FUZZ_LOG": str(calls),
        "FUZZ_MODEL": NAME,
    }
    cmd = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG)),
        *("run", f"{server}/openapi.json"),
        *("--header", f"Authorization: Bearer {KEY}"),
        *("--mode", "all", "--checks", "all", "--exclude-checks", "positive_data_acceptance"),
        *("--phases", "examples,coverage,fuzzing", "--max-examples", str(EXAMPLES)),
        # a request that takes a minute is a hang (none generates more than 4 tokens a sample)
        *("--seed", SEED, "--workers", "1", "--request-timeout", "60", "--max-response-time", "60"),
        *("--generation-database", "none", "--no-color"),
    ]
    r = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    ran: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[str] = collections.Counter()
    for line in calls.read_text().splitlines() if calls.exists() else []:
        op, status, _ = line.split("\t")
        ran[op] += 1
        statuses[status] += 1
    summary = ", ".join(f"{op}: {n}" for op, n in sorted(ran.items()))
    print(f"\nschemathesis requests per operation: {summary}; statuses {dict(statuses)}")
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-5000:]
    assert set(ran) == OPERATIONS, summary
    assert not [s for s in statuses if s.startswith("5")], statuses
    # the server after all of it: healthy, nothing running, every KV block free
    assert httpx.get(f"{server}/health").status_code == 200
    assert wait_for(lambda: metric(server, "inferflow_requests_running", AUTH) == 0)
    assert wait_for(lambda: metric(server, "inferflow_kv_cache_usage_ratio", AUTH) == 0)
    ok = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2},
        headers=AUTH,
        timeout=30,
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
