"""A dump is published atomically: a dump whose process dies after writing
its first file leaves the previous dump at PATH byte for byte as it was, and
loadable; allow_overwrite=False refuses an existing PATH, True replaces it."""
import glob
import os
import subprocess
import sys

import pytest

import ckpt_helpers as H
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad


# Dumps another model over PATH, dying (os._exit: no cleanup, like a kill)
# right after the first part file is written.
DYING_DUMP = """
import os, sys
sys.path.insert(0, {here!r})
import ckpt_helpers as H
import dynamicemb.checkpoint.dump as D
real = D.write_part
def write_then_die(*args, **kwargs):
    real(*args, **kwargs)
    os._exit(17)
D.write_part = write_then_die
m = H.plain_module()
H.plain_train(m, [4, 5, 6])
D.DynamicEmbDump(sys.argv[1], m, allow_overwrite=True, chunk_rows=16)
"""


def _files(path):
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            full = os.path.join(root, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def test_killed_dump_leaves_previous_dump(tmp_path):
    m = H.plain_module()
    H.plain_train(m, [1, 2, 3])
    path = str(tmp_path / "ckpt")
    DynamicEmbDump(path, m, chunk_rows=16)
    before = _files(path)
    proc = subprocess.run([sys.executable, "-c", DYING_DUMP.format(here=os.path.dirname(__file__)), path],
                          capture_output=True, text=True)
    assert proc.returncode == 17, proc.stderr
    # The dying dump got as far as one file, in its own directory ...
    partial = glob.glob(path + ".tmp-*")
    assert len(partial) == 1 and len(_files(partial[0])) == 1 and "manifest.json" not in _files(partial[0])
    # ... and PATH is unchanged and loads.
    assert _files(path) == before
    fresh = H.plain_module()
    DynamicEmbLoad(path, fresh)
    H.assert_same_entries([H.entries(m)], [H.entries(fresh)], dist_types=H.PLAIN_DIST)


def test_allow_overwrite(tmp_path):
    path = str(tmp_path / "ckpt")
    old = H.plain_module()
    H.plain_train(old, [1])
    DynamicEmbDump(path, old)
    before = _files(path)
    new = H.plain_module()
    H.plain_train(new, [2, 3])
    with pytest.raises(FileExistsError, match="allow_overwrite"):
        DynamicEmbDump(path, new)
    assert _files(path) == before
    DynamicEmbDump(path, new, allow_overwrite=True)
    assert _files(path) != before
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary or old directory left behind
    fresh = H.plain_module()
    DynamicEmbLoad(path, fresh)
    H.assert_same_entries([H.entries(new)], [H.entries(fresh)], dist_types=H.PLAIN_DIST)
