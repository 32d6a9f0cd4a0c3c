"""python -m dynamicemb.checkpoint PATH prints the tables with their rows
and dims and verifies every checksum (exit 0); a corrupted file makes it
exit 1 naming the file."""
import json
import os
import subprocess
import sys

import ckpt_helpers as H
from dynamicemb.checkpoint import DynamicEmbDump


def _inspect(path):
    return subprocess.run([sys.executable, "-m", "dynamicemb.checkpoint", path], capture_output=True, text=True)


def test_inspector(tmp_path):
    m = H.plain_module(dims=(8, 4))
    H.plain_train(m, [1, 2, 3])
    path = str(tmp_path / "ckpt")
    DynamicEmbDump(path, m, chunk_rows=64)
    ok = _inspect(path)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    for t, name in enumerate(["a", "b"]):
        row = next(line.split() for line in lines if line.split()[:1] == [name])
        # table, rows, rows per rank, dim, dtype, optimizer, ...
        assert row[1:4] == [str(m.storage.size(t)), str(m.storage.size(t)), str(m.dims[t])], row
        assert "float32" in row and "ADAM" in row
    assert "checksums ok" in lines[-1]

    with open(os.path.join(path, "manifest.json")) as f:
        rel = json.load(f)["tables"]["a"]["files"][-1]["file"]
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    bad = _inspect(path)
    assert bad.returncode == 1
    assert rel in bad.stderr and "checksum" in bad.stderr and "'a'" in bad.stderr
