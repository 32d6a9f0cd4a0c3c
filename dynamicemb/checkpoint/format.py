"""The on-disk format of a dynamic-table checkpoint (API.md §4).

    PATH/manifest.json
    PATH/<table>/rank00000.part00000.safetensors   keys, values, optimizer_state,
                                                   scores[, timestamps]
    PATH/<table>/rank00000.counter00000.safetensors  admission counter: keys, counts

Each part is a standard safetensors file (readable without dynamicemb) holding
one chunk of one rank's shard. Scores that are clock readings (TIMESTAMP,
NO_EVICTION, the pair's access times) are stored as ages in ns at dump time,
so that another host's clock does not matter, with each rank's clock
reading at the dump in the table's manifest entry (clock.py: a load on the
same clock gives the readings back). The manifest lists every file
with its row count, size and CRC-32, and carries a CRC-32 of its own
content. Every file is fsynced before the manifest
is written and the directory published.
"""
import glob
import json
import math
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Optional

import torch
from safetensors import safe_open

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 8 << 20  # bytes per read / checksum step


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, or does not match the model."""


def part_name(table: str, rank: int, kind: str, index: int) -> str:
    return os.path.join(table, f"rank{rank:05d}.{kind}{index:05d}.safetensors")


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
           torch.int32: "I32", torch.float64: "F64"}


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class Syncer:
    """fsyncs and closes written files on one background thread, so that a
    file's flush to disk overlaps the writing of the next; wait() returns once
    all are durable (and re-raises an error)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynamicemb-fsync")
        self._pending = []

    def submit(self, f) -> None:
        def sync():
            with f:
                os.fsync(f.fileno())
        self._pending.append(self._pool.submit(sync))

    def wait(self) -> None:
        try:
            for p in self._pending:
                p.result()
        finally:
            self._pool.shutdown()


def _blocks(v) -> Iterator[torch.Tensor]:
    """The CPU blocks of a tensor, or of a RowBlocks (storage.py) read on demand."""
    if isinstance(v, torch.Tensor):
        yield v
    else:
        yield from v.blocks()


def write_part(root: str, rel: str, tensors: Dict[str, Any], syncer: Optional[Syncer] = None) -> dict:
    """Writes one safetensors file, streaming each tensor's bytes (no second
    copy of the chunk in memory; a RowBlocks is gathered a block at a time)
    and checksumming them as they go, then fsyncs it (on the syncer's thread
    when given); returns its manifest entry."""
    tensors = {k: v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    header, offset = {}, 0
    for k, v in tensors.items():
        n = math.prod(v.shape) * v.dtype.itemsize
        header[k] = {"dtype": _DTYPES[v.dtype], "shape": list(v.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prefix = struct.pack("<Q", len(head)) + head
    crc = zlib.crc32(prefix)
    f = open(path, "wb")
    try:
        f.write(prefix)
        for v in tensors.values():
            for block in _blocks(v):
                if block.numel():
                    raw = _raw(block)
                    crc = zlib.crc32(raw, crc)
                    f.write(raw)
                    del raw, block  # free the block before gathering the next
        f.flush()
    except BaseException:
        f.close()
        raise
    if syncer is not None:
        syncer.submit(f)
    else:
        with f:
            os.fsync(f.fileno())  # durable before the manifest names it
    return {"file": rel, "rows": int(next(iter(tensors.values())).shape[0]), "bytes": len(prefix) + offset,
            "crc32": crc}


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def check_file(root: str, entry: dict, table: str, crc: bool = True) -> str:
    """Refuses a missing, truncated (size) or, with crc, corrupted file of the
    manifest with a message naming the table and the file; returns its path."""
    path = os.path.join(root, entry["file"])
    if not os.path.exists(path):
        raise CheckpointError(f"table {table!r}: file {path} is missing")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise CheckpointError(f"table {table!r}: file {path} has {size} bytes, the manifest says "
                              f"{entry['bytes']} (truncated or replaced)")
    if crc and _file_crc(path) != entry["crc32"]:
        raise CheckpointError(f"table {table!r}: file {path} fails its checksum (corrupted)")
    return path


def read_header(path: str) -> Dict[str, dict]:
    """The tensors of a safetensors file: {name: {"dtype", "shape"}}, read
    from its header alone."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        n = struct.unpack("<Q", raw)[0]
        if n > os.path.getsize(path) - 8:
            raise ValueError(f"header length {n} exceeds the file")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: {"dtype": v["dtype"], "shape": list(v["shape"])} for k, v in header.items()}


def check_tensors(root: str, entry: dict, table: str, expected: Dict[str, tuple]) -> None:
    """Refuses a file of the manifest whose tensors are not exactly
    `expected` ({name: (safetensors dtype, shape)}), naming the table and the
    file: a manifest that does not match its files."""
    path = os.path.join(root, entry["file"])
    try:
        got = read_header(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"table {table!r}: file {path} has no readable safetensors header: {e}") from None
    got = {k: (v["dtype"], tuple(v["shape"])) for k, v in got.items()}
    if set(got) != set(expected):
        raise CheckpointError(f"table {table!r}: file {path} holds tensors {sorted(got)}, the manifest implies "
                              f"{sorted(expected)}")
    for k, want in expected.items():
        if got[k] != want:
            raise CheckpointError(f"table {table!r}: file {path}: tensor {k!r} is {got[k][0]} of shape "
                                  f"{list(got[k][1])}, the manifest implies {want[0]} of shape {list(want[1])}")


def dtype_code(dtype: str) -> str:
    """The safetensors dtype of a manifest dtype name ("float32" -> "F32")."""
    return _DTYPES[getattr(torch, dtype)]


def read_tensors(root: str, entry: dict, names) -> Dict[str, torch.Tensor]:
    """Some tensors of a file of the manifest (e.g. only its keys), unchecked."""
    with safe_open(os.path.join(root, entry["file"]), framework="pt") as f:
        return {k: f.get_tensor(k) for k in names}


def read_part(root: str, entry: dict, table: str, crc: bool = True) -> Dict[str, torch.Tensor]:
    """Reads one file of the manifest after check_file (crc=False: the caller
    verified it already)."""
    with safe_open(check_file(root, entry, table, crc), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


_MANIFEST_CRC = "manifest_crc32"  # of the manifest's other fields, canonical JSON


def _manifest_crc(manifest: dict) -> int:
    body = {k: v for k, v in manifest.items() if k != _MANIFEST_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(root: str, manifest: dict) -> None:
    """Writes the manifest with a CRC-32 of its content: a flipped digit
    (a step, a row count) would otherwise load as a different checkpoint."""
    path = os.path.join(root, MANIFEST)
    with open(path, "w") as f:
        # Unsorted: the tables stay in the model's order (from_dump serves them so); the CRC is of sorted keys.
        json.dump({**manifest, _MANIFEST_CRC: _manifest_crc(manifest)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise CheckpointError(f"no checkpoint at {root}{_old_hint(root)}")
    if not os.path.exists(path):
        raise CheckpointError(f"{root} has no {MANIFEST}: not a complete dynamicemb checkpoint")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "dynamicemb" \
            or manifest.get("format_version") != FORMAT_VERSION:
        got = manifest if isinstance(manifest, dict) else {}
        raise CheckpointError(f"{path}: unsupported format {got.get('format')!r} version "
                              f"{got.get('format_version')!r} (expected dynamicemb {FORMAT_VERSION})")
    # (Dumps written before the checksum have none: they load unchecked.)
    if _MANIFEST_CRC in manifest and manifest[_MANIFEST_CRC] != _manifest_crc(manifest):
        raise CheckpointError(f"{path}: checksum mismatch: the manifest was changed or damaged after it was written")
    manifest.pop(_MANIFEST_CRC, None)
    _check_fields(path, manifest)
    return manifest


# The fields every reader takes from a manifest (a dump written before the
# checksum, or one whose checksum was removed, is checked for these alone).
_TABLE_FIELDS = {"files": list, "rows_per_rank": list, "dim": int, "dtype": str, "score_strategy": int,
                 "has_optimizer_state": bool}
_FILE_FIELDS = {"file": str, "bytes": int, "kind": str}


def _check_fields(path: str, manifest: dict) -> None:
    def need(where: str, d, fields: dict) -> None:
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: {where} is not an object: the manifest is damaged")
        for key, kind in fields.items():
            if not isinstance(d.get(key), kind):
                got = "missing" if key not in d else f"{type(d[key]).__name__} {d[key]!r:.40}"
                raise CheckpointError(f"{path}: {where} field {key!r} is {got}, expected {kind.__name__}: "
                                      f"the manifest is damaged")
    need("the manifest", manifest, {"tables": dict, "world_size": int})
    for name, meta in manifest["tables"].items():
        need(f"table {name!r}", meta, _TABLE_FIELDS)
        for k, entry in enumerate(meta["files"]):
            need(f"table {name!r} file {k}", entry, _FILE_FIELDS)


def _old_hint(root: str) -> str:
    """Where a dump that died while replacing PATH (the two-rename fallback of
    dump._publish) left the previous dump: PATH.old-<id>."""
    old = [d for d in stale_siblings(root) if ".old-" in os.path.basename(d)
           and os.path.exists(os.path.join(d, MANIFEST))]
    if not old:
        return ""
    return (f"; {', '.join(old)} holds a complete earlier dump, moved aside by a dump to {root} that died while "
            f"replacing it: rename it to {root} to load it")


def verify_files(root: str, manifest: dict) -> int:
    """Checks every file's size and checksum; returns the bytes verified."""
    total = 0
    for name, table in manifest["tables"].items():
        for entry in table["files"]:
            check_file(root, entry, name)
            total += entry["bytes"]
    return total


def stale_siblings(path: str) -> List[str]:
    """PATH.tmp-* / PATH.old-* directories: left by dumps that died (or are
    running right now); see dump.py."""
    base = glob.escape(os.path.abspath(path))
    return sorted(glob.glob(base + ".tmp-*") + glob.glob(base + ".old-*"))
