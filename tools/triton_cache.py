"""Carry Triton's compiled kernels from one GPU machine to the next.

    python tools/triton_cache.py pack CACHE_DIR OUT_PREFIX   # OUT_PREFIX.00, .01, ... (15 MiB parts)
    python tools/triton_cache.py unpack CACHE_DIR PART...    # into an empty CACHE_DIR

A kernel's cache entry holds every stage Triton went through (source, TTIR, TTGIR, LLVM IR, PTX)
beside the metadata and the machine code it loads; ``pack`` keeps what loading needs (the
metadata ``.json``, the ``.cubin`` and the compiled launchers ``.so``), rewrites each group file to
list only those, and compresses the rest of the way with xz. ``unpack`` points the group files
at the new cache folder. A fresh machine then loads every kernel an earlier one compiled instead
of compiling it again (Triton checks the version, options and source hash as always).
"""

from __future__ import annotations

import io
import json
import lzma
import sys
import tarfile
from pathlib import Path

KEEP = (".json", ".cubin", ".so")
PART_BYTES = 15 << 20


def _kept(path: Path) -> bool:
    return path.suffix in KEEP


def pack(cache: Path, prefix: Path) -> list[Path]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(cache.rglob("*")):
            if not path.is_file() or not _kept(path):
                continue
            rel = path.relative_to(cache).as_posix()
            if path.name.startswith("__grp__"):
                group = json.loads(path.read_text())
                group["child_paths"] = {name: Path(p).relative_to(cache).as_posix()
                                        for name, p in group.get("child_paths", {}).items() if _kept(Path(p))}
                data = json.dumps(group).encode()
                info = tarfile.TarInfo(rel)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.add(path, rel)
    packed = lzma.compress(buf.getvalue(), preset=6)
    parts = []
    for i in range(0, len(packed), PART_BYTES):
        part = prefix.with_name(f"{prefix.name}.{i // PART_BYTES:02d}")
        part.write_bytes(packed[i : i + PART_BYTES])
        parts.append(part)
    print(f"compiled kernels: {len(buf.getvalue()) >> 20} MiB kept, {len(packed) >> 20} MiB packed in {len(parts)} parts")
    return parts


def unpack(cache: Path, parts: list[Path]) -> None:
    data = lzma.decompress(b"".join(p.read_bytes() for p in sorted(parts)))
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(cache, filter="data")
    groups = list(cache.rglob("__grp__*"))
    for path in groups:
        group = json.loads(path.read_text())
        group["child_paths"] = {name: str(cache / rel) for name, rel in group["child_paths"].items()}
        path.write_text(json.dumps(group))
    print(f"compiled kernels: {len(groups)} unpacked into {cache}")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("pack", "unpack"):
        print("\n".join(__doc__.strip().splitlines()[2:4]), file=sys.stderr)
        return 2
    if argv[0] == "pack":
        pack(Path(argv[1]), Path(argv[2]))
    else:
        unpack(Path(argv[1]), [Path(p) for p in argv[2:]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
