"""Criteo's click logs: the Kaggle display-advertising train.txt and the
Terabyte day_N files (plain or .gz).

One sample per line, 40 tab-separated fields: the label (0/1), 13 integer
features (counts; may be negative or empty) and 26 categorical features
(32-bit hashes as 8 hex digits; may be empty). An empty field is a missing
value: 0 for a dense feature, an empty bag for a sparse one. The raw hash is
the id (dynamic tables take any int64).
"""
import gzip
import itertools
from typing import Optional

import numpy as np

from example_data import NUM_DENSE, SPARSE_FEATURES, ClickRows, dense_transform

FIELDS = 1 + NUM_DENSE + len(SPARSE_FEATURES)

# Hex digit value per byte; -1 for a byte that is no hex digit, 0 for the
# NUL padding of shorter fields (numpy's fixed-width byte strings).
_HEX = np.full(256, -1, dtype=np.int64)
_HEX[0] = 0
for _c in b"0123456789abcdef":
    _HEX[_c] = int(chr(_c), 16)
    _HEX[ord(chr(_c).upper())] = int(chr(_c), 16)


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _fail(path: str, line: int, column: str, problem: str):
    raise ValueError(f"{path}: line {line}, {column}: {problem}")


def parse_criteo_lines(lines, path: str = "<input>", first_line: int = 1) -> ClickRows:
    """ClickRows of Criteo TSV lines (bytes, with or without the newline)."""
    rows = [line.rstrip(b"\r\n").split(b"\t") for line in lines]
    for n, r in enumerate(rows):
        if len(r) != FIELDS:
            _fail(path, first_line + n, "the line", f"has {len(r)} tab-separated fields, expected {FIELDS} "
                                                   f"(label, {NUM_DENSE} integers, {len(SPARSE_FEATURES)} hex ids)")
    if not rows:
        raise ValueError(f"{path}: no samples")
    table = np.array(rows, dtype=bytes)  # [N, 40] fixed-width byte strings (the longest field's width)
    labels = _integers(table[:, 0], path, first_line, "the label")
    if not np.isin(labels, (0, 1)).all():
        n = int(np.flatnonzero(~np.isin(labels, (0, 1)))[0])
        _fail(path, first_line + n, "the label", f"must be 0 or 1, got {labels[n]}")
    counts = np.stack([_integers(table[:, 1 + j], path, first_line, f"integer feature I{j + 1}")
                       for j in range(NUM_DENSE)], axis=1)
    hexes = table[:, 1 + NUM_DENSE:]
    present = hexes != b""
    width = hexes.dtype.itemsize
    digits = _HEX[np.frombuffer(hexes.tobytes(), dtype=np.uint8).reshape(*hexes.shape, width)]
    lengths = np.char.str_len(hexes)
    bad = (digits < 0).any(axis=2) | (lengths > 8)
    if bad.any():
        n, f = (int(x[0]) for x in np.nonzero(bad))
        _fail(path, first_line + n, f"categorical feature C{f + 1}",
              f"{hexes[n, f].decode(errors='replace')!r} is not a hex id of at most 8 digits")
    ids = np.zeros(hexes.shape, dtype=np.int64)
    for d in range(min(8, width)):  # digit d of every field at once; the NUL padding is skipped
        has = d < lengths
        ids = np.where(has, ids * 16 + digits[:, :, d], ids)
    return ClickRows.from_numpy(dense_transform(counts), ids, present, labels)


def _integers(column: np.ndarray, path: str, first_line: int, what: str) -> np.ndarray:
    """int64 values of a byte-string column; an empty field reads as 0."""
    try:
        return np.where(column == b"", b"0", column).astype(np.int64)
    except ValueError:
        for n, v in enumerate(column):
            try:
                int(v or b"0")
            except ValueError:
                _fail(path, first_line + n, what, f"{v.decode(errors='replace')!r} is not an integer")
        raise


def read_criteo(path: str, max_rows: Optional[int] = None, chunk_rows: int = 1 << 16) -> ClickRows:
    """The first `max_rows` samples (all by default) of a Criteo TSV file."""
    parts = []
    read = 0
    with _open(path) as f:
        lines = itertools.islice(f, max_rows)
        while True:
            chunk = list(itertools.islice(lines, chunk_rows))
            if not chunk:
                break
            parts.append(parse_criteo_lines(chunk, path, read + 1))
            read += len(chunk)
    if not parts:
        raise ValueError(f"{path}: no samples")
    return ClickRows.concat(parts)
