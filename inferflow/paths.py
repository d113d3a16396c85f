"""File references in specs: relative (to the spec's folder), absolute, ``~/...``, and
``package://<python package>/<path>`` for files shipped inside an installed package."""

from __future__ import annotations

import errno
import importlib.util
import json
from pathlib import Path
from typing import Any

from inferflow.errors import SpecError

PACKAGE_SCHEME = "package://"
# a JSON file beside a checkpoint (config.json, a sharded index, tokenizer_config.json): a few
# kilobytes to a few megabytes; json holds up to ~8x its size in objects while it parses
MAX_JSON_BYTES = 16 << 20


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A small JSON file, parsed. OSError past ``limit`` bytes (errno EFBIG, the limit named)
    or when unreadable; ValueError (UnicodeDecodeError, JSONDecodeError) when not JSON."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1)  # (not stat(): a device or a pipe reports no size)
    if len(raw) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes, the limit for this file")
    return json.loads(raw.decode("utf-8"))


def resolve_ref(ref: str, base_dir: Path, *, what: str = "file") -> Path:
    """Turn a spec file reference into a path; does not check that it exists."""
    if ref.startswith(PACKAGE_SCHEME):
        pkg, _, rel = ref[len(PACKAGE_SCHEME) :].partition("/")
        if not pkg or not rel:
            raise SpecError(f"{what}: {ref!r} must look like package://<python package>/<path>")
        spec = importlib.util.find_spec(pkg) if pkg.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise SpecError(
                f"{what}: python package {pkg!r} of {ref!r} is not installed "
                f"(install the model packages with `make models`)"
            )
        root = Path(next(iter(spec.submodule_search_locations))).resolve()
        try:
            path = (root / rel).resolve()
        except (OSError, ValueError) as e:  # a NUL byte, a symlink loop
            raise SpecError(f"{what}: cannot resolve {ref!r}: {e}") from None
        if not path.is_relative_to(root):  # '..' or a link out of the package
            raise SpecError(
                f"{what}: {ref!r} resolves to {path}, outside the folder {root} of package {pkg!r}"
            )
        return path
    p = expand_user(ref, what)
    return p if p.is_absolute() else (base_dir / p)


def expand_user(ref: str | Path, what: str = "file") -> Path:
    """``Path(ref)`` with a leading ``~`` / ``~user`` expanded; an unknown user is a SpecError."""
    try:
        return Path(ref).expanduser()
    except RuntimeError as e:  # "~name" of no such user, or no home directory at all
        raise SpecError(f"{what}: cannot expand {str(ref)!r}: {e}") from None
