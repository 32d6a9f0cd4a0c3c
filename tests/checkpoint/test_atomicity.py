"""A dump is published atomically and durably: a dump whose process dies
after writing its first file leaves the previous dump at PATH byte for byte as
it was, and loadable; every file and directory is fsynced before the publish,
the parent after it; allow_overwrite=False refuses an existing PATH, True
replaces it by an atomic exchange (two renames where that is unavailable)."""
import glob
import os
import subprocess
import sys

import pytest

import ckpt_helpers as H
import dynamicemb.checkpoint.dump as D
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


def test_everything_is_fsynced_before_the_publish(tmp_path, monkeypatch):
    """Each file once, then the directories (the tmp one last) before the
    rename, then the parent after it."""
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", src))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    m = H.plain_module()
    H.plain_train(m, [1, 2, 3])
    path = str(tmp_path / "ckpt")
    DynamicEmbDump(path, m, chunk_rows=16)
    (_, tmp), = [e for e in events if e[0] == "rename"]
    synced = [p for kind, p in events if kind == "fsync"]
    files = sorted(os.path.join(tmp, rel) for rel in _files(path))
    assert len(files) > 4 and sorted(synced[:len(files)]) == files  # each file once, the manifest last
    assert synced[len(files) - 1] == os.path.join(tmp, "manifest.json")
    assert synced[len(files):] == [os.path.join(tmp, "a"), os.path.join(tmp, "b"), tmp, str(tmp_path)]
    assert events[-2:] == [("rename", tmp), ("fsync", str(tmp_path))]


def _overwrite(tmp_path, monkeypatch):
    """Dumps `old`, then `new` over it (allow_overwrite); returns the renames
    the second dump made."""
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
    renames, real_rename = [], os.rename
    monkeypatch.setattr(os, "rename", lambda src, dst: renames.append(src) or real_rename(src, dst))
    DynamicEmbDump(path, new, allow_overwrite=True)
    assert _files(path) != before
    fresh = H.plain_module()
    DynamicEmbLoad(path, fresh)
    H.assert_same_entries([H.entries(new)], [H.entries(fresh)], dist_types=H.PLAIN_DIST)
    return path, renames


@pytest.mark.skipif(D._RENAMEAT2 is None, reason="no renameat2")
def test_allow_overwrite_exchanges(tmp_path, monkeypatch):
    path, renames = _overwrite(tmp_path, monkeypatch)
    assert renames == []  # swapped in one step: PATH never went away
    assert os.listdir(tmp_path) == ["ckpt"]  # the old dump (swapped to PATH.tmp-*) removed


def test_allow_overwrite_without_renameat2(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_RENAMEAT2", None)
    path, renames = _overwrite(tmp_path, monkeypatch)
    assert len(renames) == 2 and renames[0] == path and ".tmp-" in renames[1]
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary or old directory left behind


@pytest.mark.skipif(D._RENAMEAT2 is None, reason="no renameat2")
def test_crash_after_the_exchange(tmp_path, monkeypatch):
    """Dying after the swap, before removing the old dump: PATH holds the new
    dump, and the inspector lists the old one (complete) as stale."""
    monkeypatch.setattr(D.shutil, "rmtree", lambda *a, **k: None)
    path, _ = _overwrite(tmp_path, monkeypatch)
    stale, = glob.glob(path + ".tmp-*")
    out = subprocess.run([sys.executable, "-m", "dynamicemb.checkpoint", "--no-verify", path],
                         capture_output=True, text=True)
    assert out.returncode == 0 and f"stale: {stale} (a complete dump" in out.stdout
