"""A module whose cached tables live in a FileStore (storage_path), in real
processes (file_store_worker.py): closed and reopened in a new process it
holds the rows, optimizer state, scores and counters of its last flush, and
goes on training exactly as the all-in-memory reference; killed (SIGKILL)
while training after a flush, while a flush compacts, or right after a
flush commits, its directory reopens exactly at the last completed flush."""
import os
import random
import subprocess
import sys
import time

import pytest
import torch

import file_store_worker as worker

WORKER = os.path.abspath(worker.__file__)


def _run(*args, check=True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=120,
                         **kw)
    if check and out.returncode:
        raise AssertionError(f"worker {args} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


_REFERENCES = {}


def _reference(steps: int) -> dict:
    if steps not in _REFERENCES:
        _REFERENCES[steps] = worker.reference(steps)
    return _REFERENCES[steps]


def _assert_same(got: dict, want: dict) -> None:
    """Same keys, rows (values and Adam state), scores (STEP) and counters."""
    assert (got["step"], got["optimizer_step"]) == (want["step"], want["optimizer_step"])
    for t in range(2):
        g, w = got["rows"][t], want["rows"][t]
        assert g.keys() == w.keys(), f"t{t}"
        assert all(torch.equal(g[k], w[k]) for k in w), f"t{t}"
        assert got["scores"][t] == want["scores"][t], f"t{t}"


def _reopened(path) -> dict:
    """What a module opening `path` in this process holds (then it lets go)."""
    m = worker.build(str(path))
    try:
        return worker.content(m)
    finally:
        m.storage.store.close()


def test_reopened_in_a_new_process_it_resumes_training(tmp_path):
    m = worker.build(str(tmp_path))  # trained and flushed here, closed, reopened by the worker
    worker.train(m, 0, 30)
    m.flush()
    m.storage.store.close()
    del m
    _run(tmp_path, 30, 60, "--save-open", tmp_path / "open.pt", "--save", tmp_path / "end.pt")
    at_open = torch.load(tmp_path / "open.pt", weights_only=False)
    _assert_same(at_open, _reference(30))
    stats = at_open["stats"]["t0"]
    assert stats["cache_rows"] == 0 and stats["store_rows"] > 4 * stats["cache_capacity"]
    _assert_same(torch.load(tmp_path / "end.pt", weights_only=False), _reference(60))


@pytest.mark.parametrize("seed", [1, 2])
def test_killed_while_training_it_reopens_at_its_last_flush(tmp_path, seed):
    """Killed at a random point a few steps after a flush (rows taken from
    and written back to the store since): the flush's state."""
    rng = random.Random(seed)
    proc = subprocess.Popen([sys.executable, WORKER, str(tmp_path), "0", "30", "--then", "forever"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        last = 29 + rng.randint(2, 12)
        for line in proc.stdout:
            if line.strip() == f"step {last}":
                break
        time.sleep(rng.uniform(0, 0.02))  # into the next step
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -9, proc.stderr.read()
    _assert_same(_reopened(tmp_path), _reference(30))


@pytest.mark.parametrize("then,at", [("die-in-compaction", 30), ("die-after-commit", 100)])
def test_killed_during_a_flush_it_reopens_at_the_last_completed_one(tmp_path, then, at):
    """A second flush (at step 100, made to compact) killed while it
    copies rows into a new generation leaves
    the first; killed right after its commit, the second. Either way the
    reopen removes what the dead flush left (no stale generation)."""
    out = _run(tmp_path, 0, 30, "--then", then, "--more", 100, check=False)
    assert out.returncode == -9, f"{out.returncode}\n{out.stdout}\n{out.stderr}"
    rank_dir = tmp_path / "rank00000"
    before = sorted(os.listdir(rank_dir))
    assert any(f.startswith("t0.rows.1") for f in before), before  # the new generation was written
    _assert_same(_reopened(tmp_path), _reference(at))
    rows_files = sorted(f for f in os.listdir(rank_dir) if ".rows." in f and not f.endswith(".lock"))
    assert rows_files == (["t0.rows.0", "t1.rows.0"] if at == 30 else ["t0.rows.1", "t1.rows.1"]), rows_files
