"""The Criteo TSV reader against a line-by-line Python reading of small files
the test writes (missing values, negative counts, upper-case hex, .gz, chunks)."""
import gzip
import math
import random

import numpy as np
import pytest
import torch

from example_data import NATIVE_FEATURES, NATIVE_ROWS, NUM_DENSE, SPARSE_FEATURES, from_rows
from example_data.criteo import read_criteo


def _lines(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = str(rng.randrange(2))
        dense = ["" if rng.random() < 0.2 else str(rng.randrange(-3, 5000)) for _ in range(NUM_DENSE)]
        cats = ["" if rng.random() < 0.15 else
                (f"{rng.randrange(2**32):08x}" if rng.random() < 0.5 else f"{rng.randrange(2**32):08X}")
                for _ in SPARSE_FEATURES]
        out.append("\t".join([label] + dense + cats))
    return out


def _reference(line):
    """(dense, {feature: id}, label) of one line, the obvious way."""
    f = line.split("\t")
    dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in f[1:1 + NUM_DENSE]]
    ids = {}
    for name, v in zip(SPARSE_FEATURES, f[1 + NUM_DENSE:]):
        if v:
            ids[name] = int(v, 16) % NATIVE_ROWS if name in NATIVE_FEATURES else int(v, 16)
    return dense, ids, float(f[0])


def _check(rows, lines):
    assert len(rows) == len(lines)
    for i, line in enumerate(lines):
        dense, ids, label = _reference(line)
        np.testing.assert_allclose(rows.dense[i].numpy(), dense, rtol=1e-6)
        assert rows.labels[i].item() == label
        got = {f: rows.ids[i, j].item() for j, f in enumerate(SPARSE_FEATURES) if rows.present[i, j]}
        assert got == ids, f"line {i + 1}"


@pytest.mark.parametrize("gz", [False, True])
def test_reads_what_each_line_holds(tmp_path, gz):
    lines = _lines(300)
    path = tmp_path / ("day_0.gz" if gz else "train.txt")
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    _check(read_criteo(str(path), chunk_rows=64), lines)  # several chunks, a partial last one
    _check(read_criteo(str(path), max_rows=77), lines[:77])


def test_batch_is_feature_major_with_empty_bags(tmp_path):
    lines = _lines(5, seed=1)
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    rows = read_criteo(str(tmp_path / "t.txt"))
    kjt = rows.batch().sparse_features
    assert kjt.keys() == SPARSE_FEATURES
    per_feature = kjt.to_dict()
    for i, line in enumerate(lines):
        _, ids, _ = _reference(line)
        for f in SPARSE_FEATURES:
            bag = per_feature[f].to_dense()[i].tolist()
            assert bag == ([ids[f]] if f in ids else [])


def test_held_out_split_is_the_latest_rows_and_training_wraps(tmp_path):
    lines = _lines(50, seed=2)
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    log = from_rows("t", read_criteo(str(tmp_path / "t.txt")), 0.1, {})
    assert log.train_size == 45 and len(log.eval) == 5
    _check(log.eval, lines[45:])
    _check(log.train(40, 10), lines[40:45] + lines[:5])  # a second epoch starts over


@pytest.mark.parametrize("bad, message", [
    ("1\t2\t3", "line 2, the line: has 3 tab-separated fields"),
    ("\t".join(["1"] + ["1"] * NUM_DENSE + ["zz"] + ["0a"] * 25), "line 2, categorical feature C1: 'zz'"),
    ("\t".join(["1"] + ["1"] * NUM_DENSE + ["0a"] * 3 + ["123456789"] + ["0a"] * 22),
     "line 2, categorical feature C4: '123456789' is not a hex id of at most 8 digits"),
    ("\t".join(["1"] + ["x1"] + ["1"] * 12 + ["0a"] * 26), "line 2, integer feature I1: 'x1'"),
    ("\t".join(["2"] + ["1"] * NUM_DENSE + ["0a"] * 26), "line 2, the label: must be 0 or 1, got 2"),
])
def test_bad_lines_are_named(tmp_path, bad, message):
    (tmp_path / "t.txt").write_text(_lines(1)[0] + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_criteo(str(tmp_path / "t.txt"))


def test_empty_file(tmp_path):
    (tmp_path / "t.txt").write_text("")
    with pytest.raises(ValueError, match="no samples"):
        read_criteo(str(tmp_path / "t.txt"))


def test_ids_are_int64_and_native_ids_fit_their_tables(tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(_lines(200, seed=3)) + "\n")
    rows = read_criteo(str(tmp_path / "t.txt"))
    assert rows.ids.dtype == torch.int64
    native = [SPARSE_FEATURES.index(f) for f in NATIVE_FEATURES]
    assert int(rows.ids[:, native].max()) < NATIVE_ROWS
    assert int(rows.ids.max()) >= 2**31  # the full 32-bit hashes are kept
