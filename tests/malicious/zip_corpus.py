"""Malformed torch.save zip archives, written byte by byte by the fuzzer's own zip writer
(``inferflow.fuzz.mut_pickle.write_zip``), which writes what ``zipfile`` never would: names that
climb out of a folder, the same name twice, sizes that lie, local headers that disagree with the
central directory, overlapping entries, unsupported compression, truncation.

Each case: (name, archive bytes, what the loader's CheckpointError must say, whether
``detect_format`` can see the defect too: it reads the central directory only).
"""

from __future__ import annotations

import io
import zipfile
import zlib
from dataclasses import replace

import torch

from inferflow.fuzz.mut_pickle import ZipEntry, read_entries, write_zip

Case = tuple[str, bytes, str, bool]


def valid_entries() -> list[ZipEntry]:
    """The entries of a real torch.save archive of a small state dict, in its own order."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, buf)
    return read_entries(buf.getvalue())


def _with(entries: list[ZipEntry], match: str, **changes: object) -> list[ZipEntry]:
    return [replace(e, **changes) if e.name.endswith(match) else e for e in entries]  # type: ignore[arg-type]


def _patch(data: bytes, offset: int, raw: bytes) -> bytes:
    return data[:offset] + raw + data[offset + len(raw) :]


def cases() -> list[Case]:
    entries = valid_entries()
    prefix = next(e.name for e in entries if e.name.endswith("/data.pkl"))[: -len("data.pkl")]
    pkl = next(e for e in entries if e.name.endswith("/data.pkl"))
    out: list[Case] = []
    # ---- names that would escape the extraction folder ---------------------------------------
    for bad in ("../../evil", "/etc/evil", f"{prefix}../../evil", f"{prefix}data\\..\\..\\evil",
                f"{prefix}data//0", "C:\\evil"):  # fmt: skip
        archive = write_zip([*entries, ZipEntry(bad, b"owned")])[0]
        out.append((f"traversal {bad!r}", archive, "unsafe entry name", True))
    renamed = [replace(e, name="../" + e.name) if e is pkl else e for e in entries]
    out.append(("traversal data.pkl", write_zip(renamed)[0], "unsafe entry name", True))
    # ---- the same entry twice ----------------------------------------------------------------
    out.append(("duplicate data.pkl", write_zip([*entries, pkl])[0], "duplicate entry", True))
    storage = next(e for e in entries if "/data/" in e.name)
    out.append(("duplicate storage", write_zip([storage, *entries])[0], "duplicate entry", True))
    # ---- declared sizes that cannot be true (zip bombs) --------------------------------------
    huge = 0xFFFFFFF0  # ~4 GiB claimed by the central directory and the local header
    bomb = _with(entries, "/data.pkl", method=zipfile.ZIP_DEFLATED, declared_size=huge)
    out.append(("4 GiB data.pkl", write_zip(bomb)[0], "impossible size", True))
    bomb = _with(entries, f"{prefix}data/0", method=zipfile.ZIP_DEFLATED, declared_size=huge)
    out.append(("4 GiB storage", write_zip(bomb)[0], "impossible size", True))
    stored = _with(entries, f"{prefix}data/0", declared_size=huge)
    out.append(("stored sizes differ", write_zip(stored)[0], "inconsistent sizes", True))
    # a real deflate bomb: 64 MiB of zeros in ~64 KiB, as a storage the pickle declares small
    zeros = _with(entries, f"{prefix}data/0", data=bytes(64 << 20), method=zipfile.ZIP_DEFLATED)
    out.append(("deflate bomb storage", write_zip(zeros)[0], "compressed storage '0' inflates", False))  # fmt: skip
    # ---- one stretch of bytes counted for several entries ------------------------------------
    archive, _ = write_zip(entries)
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    out.append(
        ("overlapping entries", _overlap(archive, infos, prefix), "overlapping entries", True)
    )
    # ---- local header that disagrees with the central directory ------------------------------
    lied = _with(entries, f"{prefix}data/0", local_name=f"{prefix}data/9")
    out.append(("local name differs (storage)", write_zip(lied)[0], "local header naming", False))  # fmt: skip
    lied = _with(entries, "/data.pkl", local_name=f"{prefix}data.pk_")
    out.append(
        ("local name differs (data.pkl)", write_zip(lied)[0], "cannot read zip entry", False)
    )
    local_sig = archive.index(f"{prefix}data/0".encode()) - 30
    out.append(("local header destroyed", _patch(archive, local_sig, b"XXXX"), "bad local header", False))  # fmt: skip
    # ---- compression torch never writes ------------------------------------------------------
    for method in (zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA, 99):
        odd = _with(entries, "/data.pkl", method=method)
        out.append((f"compression {method}", write_zip(odd)[0], "unsupported compression", True))
    # ---- a corrupt pickle inside a well-formed archive: the CRC catches it -------------------
    crc = _with(entries, "/data.pkl", crc=zlib.crc32(pkl.data) ^ 1)
    out.append(("bad CRC", write_zip(crc)[0], "cannot read zip entry", False))
    return out


def _overlap(archive: bytes, infos: dict[str, zipfile.ZipInfo], prefix: str) -> bytes:
    """``archive`` with the central record of one storage pointing at another's local header."""
    a, b = infos[f"{prefix}data/0"], infos[f"{prefix}data/1"]
    name = b.filename.encode()
    rec = archive.index(b"PK\x01\x02")
    while archive[rec + 46 : rec + 46 + len(name)] != name:
        rec = archive.index(b"PK\x01\x02", rec + 4)
    return _patch(archive, rec + 42, a.header_offset.to_bytes(4, "little"))


def truncations() -> list[bytes]:
    """Prefixes of a valid archive, cut inside every region (headers, data, central directory)."""
    archive = write_zip(valid_entries())[0]
    return [archive[:n] for n in range(0, len(archive), max(1, len(archive) // 97))]
