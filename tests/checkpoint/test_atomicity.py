"""A dump is published atomically and durably: a dump whose process dies
after writing its first file leaves the previous dump at PATH byte for byte as
it was, and loadable; every file and directory is fsynced before the publish,
the parent after it; allow_overwrite=False refuses an existing PATH, True
replaces it by an atomic exchange (two renames where that is unavailable:
an error between them restores PATH, and a load of a missing PATH names the
PATH.old-* a crash between them leaves). On 2 ranks, a rank killed in the
middle of a part file leaves the previous dump intact, and the other rank
raises instead of waiting."""
import glob
import json
import os
import struct
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pytest

import ckpt_helpers as H
import dynamicemb.checkpoint.dump as D
import dynamicemb.checkpoint.format as F
from dynamicemb.checkpoint import CheckpointError, DynamicEmbDump, DynamicEmbLoad
from multiprocess import free_port


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


def test_two_renames_an_error_between_restores_path(tmp_path, monkeypatch):
    """Without renameat2, an error in the second rename moves the old dump back."""
    path = str(tmp_path / "ckpt")
    m = H.plain_module()
    H.plain_train(m, [1])
    DynamicEmbDump(path, m)
    before = _files(path)
    monkeypatch.setattr(D, "_RENAMEAT2", None)
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in src:
            raise OSError(5, "injected")
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    H.plain_train(m, [2])
    with pytest.raises(OSError, match="injected"):
        DynamicEmbDump(path, m, allow_overwrite=True)
    assert _files(path) == before and os.listdir(tmp_path) == ["ckpt"]


def test_no_checkpoint_names_the_old_sibling(tmp_path):
    """A crash between the two renames leaves PATH missing and the old dump in
    PATH.old-<id>: the load's error says where it is."""
    path = str(tmp_path / "ckpt")
    m = H.plain_module()
    H.plain_train(m, [1])
    DynamicEmbDump(path, m)
    os.rename(path, path + ".old-0123abcd")
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*ckpt; .*ckpt\.old-0123abcd holds a complete "
                                              r"earlier dump.*rename it to"):
        DynamicEmbLoad(path, H.plain_module())
    os.rename(path + ".old-0123abcd", path)
    DynamicEmbLoad(path, H.plain_module())


# ---- a rank killed in the middle of a part file, on 2 ranks ---------------------------------


def _disjoint_train(m, rank, seeds):
    """Training on keys of this rank alone (offset by rank), so that the two
    ranks' shards hold distinct keys and load together in one process."""
    m.train()
    for s in seeds:
        indices, offsets = H.plain_batch(s, m.num_tables)
        out = m(indices + 1000 * rank, offsets)
        (out * out).sum().backward()


def _kill_worker(rank, port, path, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A short timeout: the surviving rank must not wait forever for the dead one.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    m = H.plain_module()
    _disjoint_train(m, rank, [1, 2, 3])
    DynamicEmbDump(path, m, chunk_rows=16)
    dist.barrier()
    queue.put((rank, "first dump", None))
    _disjoint_train(m, rank, [4, 5])
    if rank == 1:
        # Unbuffered writes, so that the bytes written before the kill reach
        # the file; the second file dies after its header and first block.
        F.open = lambda p, mode: open(p, mode, buffering=0)
        real_write_part, real_blocks, files = D.write_part, F._blocks, [0]

        def counting_write_part(*args, **kwargs):
            files[0] += 1
            return real_write_part(*args, **kwargs)

        def dying_blocks(v):
            for b in real_blocks(v):
                yield b
                if files[0] == 2:
                    os._exit(17)  # after the second file's header and first block
        D.write_part, F._blocks = counting_write_part, dying_blocks
    start = time.monotonic()
    try:
        DynamicEmbDump(path, m, allow_overwrite=True, chunk_rows=16)
        queue.put((rank, "returned", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - the test looks at it
        queue.put((rank, f"raised {type(e).__name__}: {str(e)[:200]}", time.monotonic() - start))


def test_rank_killed_mid_file_in_a_two_rank_dump(tmp_path):
    path = str(tmp_path / "ckpt")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_kill_worker, args=(r, port, path, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                rank, what, secs = queue.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            if what == "first dump":
                if rank == 0:
                    got["before"] = _files(path)  # both ranks are past the first dump's barrier
                got.setdefault(f"first{rank}", True)
            else:
                got[rank] = (what, secs)
            if 0 in got and "before" in got:
                break
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == 17, "rank 1 was not killed mid-dump"
    assert 0 in got, f"the surviving rank hung or died (exit code {procs[0].exitcode})"
    assert got[0][0].startswith("raised") and got[0][1] < 60, got[0]  # an error, not a wait of 20+ s
    # The dead rank left a partial file: fewer bytes than its header announces.
    partial, = glob.glob(path + ".tmp-*")
    short = []
    for rel, data in _files(partial).items():
        n = struct.unpack("<Q", data[:8])[0]
        end = max(t["data_offsets"][1] for t in json.loads(data[8:8 + n]).values())
        if len(data) < 8 + n + end:
            short.append(rel)
    assert short and all("rank00001" in r for r in short), short
    # PATH is the first dump, byte for byte, and loads.
    assert _files(path) == got["before"]
    DynamicEmbLoad(path, H.plain_module())


@pytest.mark.parametrize("kind", ["user_dir", "file", "empty_path"])
def test_a_dump_replaces_nothing_but_an_earlier_dump(tmp_path, monkeypatch, kind):
    """allow_overwrite replaces an earlier dump only: a directory of the
    user's files, a plain file, or "" (the working directory) is refused and
    left as it was (the dump used to swap itself in and delete them)."""
    m = H.plain_module()
    H.plain_train(m, [1])
    if kind == "user_dir":
        path = tmp_path / "work"
        path.mkdir()
        (path / "train.py").write_text("print('mine')")
    elif kind == "file":
        path = tmp_path / "notes.txt"
        path.write_text("mine")
    else:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "keep.txt").write_text("mine")
        path = ""
    before = sorted(os.listdir(tmp_path))
    match = {"user_dir": r"not a dynamicemb dump \(no manifest.json; it holds \['train.py'\]\)",
             "file": "is not a directory", "empty_path": "path must name a directory"}[kind]
    with pytest.raises((FileExistsError, ValueError), match=match):
        DynamicEmbDump(str(path), m, allow_overwrite=True)
    assert sorted(os.listdir(tmp_path)) == before
    if kind == "user_dir":
        assert (path / "train.py").read_text() == "print('mine')"
    # An empty directory is a fine place for a dump.
    (tmp_path / "empty").mkdir()
    DynamicEmbDump(str(tmp_path / "empty"), m, allow_overwrite=True)
    assert os.path.isfile(tmp_path / "empty" / "manifest.json")


def test_dump_arguments_are_checked_by_name(tmp_path):
    """One table name given as a string was read letter by letter ("no
    dynamic tables named ['a']..."), and chunk_rows=0 was reported as
    batch_size; both are refused before anything is written."""
    m = H.plain_module()
    with pytest.raises(TypeError, match=r"table_names must be a list of table names, got the string 'a'; write \['a'\]"):
        DynamicEmbDump(str(tmp_path / "a"), m, table_names="a")
    # None named ("the model has no dynamic tables"), or one twice (collapsed unsaid): refused.
    with pytest.raises(ValueError, match=r"DynamicEmbDump: table_names is empty"):
        DynamicEmbDump(str(tmp_path / "a"), m, table_names=[])
    with pytest.raises(ValueError, match=r"DynamicEmbDump: table_names names \['a'\] more than once"):
        DynamicEmbDump(str(tmp_path / "a"), m, table_names=["a", "a"])
    with pytest.raises(ValueError, match="chunk_rows must be a positive int, got 0"):
        DynamicEmbDump(str(tmp_path / "b"), m, chunk_rows=0)
    assert os.listdir(tmp_path) == []


def test_a_model_without_dynamic_tables_is_not_dumped_empty(tmp_path):
    with pytest.raises(ValueError, match="DynamicEmbDump: the model has no dynamic tables"):
        DynamicEmbDump(str(tmp_path / "ckpt"), torch.nn.Linear(2, 2))
    assert os.listdir(tmp_path) == []
