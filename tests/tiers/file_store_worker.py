"""A process training a module whose cached tables live in a FileStore
(storage_path), for test_file_store_durability.py:

    python file_store_worker.py DIR A B [--save-open F] [--save F] [--then WHAT] [--more C]

opens DIR (resuming what it holds), saves what it holds (--save-open),
trains on batches A..B, flushes, saves (--save), then (--then):
  exit              closes the store and exits;
  forever           keeps training, printing "step i" after each step, until killed;
  die-in-compaction trains on batches B..C and flushes (compacting), killing itself
                    (SIGKILL) while that flush copies rows into a new generation;
  die-after-commit  the same, killed right after the manifest names the new snapshots.
The module (Adam, STEP scores, a cache of about 10% of the rows) and the
batches are the ones reference() trains in memory."""
import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamicemb import DynamicEmbScoreStrategy, EmbOptimType  # noqa: E402
from dynamicemb.tiers import file_store  # noqa: E402
from tier_helpers import BATCH, all_rows, module, step  # noqa: E402

KEYS = 2500  # ids in [0, KEYS): after a few steps most misses are keys in the store (churn, not growth)


def _batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(2 * BATCH, generator=g) ** 2 * KEYS).long(), torch.arange(0, 2 * BATCH + 1, 4))
            for _ in range(n)]


DATA = _batches(120, seed=5)


def build(path=None):
    """The module, its cached tables in a FileStore at path (None: all in memory)."""
    return module(EmbOptimType.ADAM, strategy=DynamicEmbScoreStrategy.STEP, storage_path=path)


def train(m, start: int, end: int, log: bool = False) -> None:
    for i in range(start, end):
        step(m, DATA[i % len(DATA)])
        if log:
            print(f"step {i}", flush=True)


def content(m) -> dict:
    """Every row (value and optimizer state) and score of both tables, and the module's counters."""
    scores = [{k: s for b in m.storage.export_rows(t) for k, s in zip(b.keys.tolist(), b.scores.tolist())}
              for t in range(2)]
    return {"rows": [all_rows(m, t) for t in range(2)], "scores": scores, "step": m.step,
            "optimizer_step": m.optimizer_step, "stats": m.table_stats()}


def reference(steps: int) -> dict:
    m = build()
    train(m, 0, steps)
    return content(m)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingRowsFile(file_store._RowsFile):
    """Dies at the second block a compaction copies into a new generation."""

    def __init__(self, path, width, dtype, min_rows, fresh, table=""):
        super().__init__(path, width, dtype, min_rows, fresh, table)
        self.fresh = fresh

    def write(self, start, rows):
        if self.fresh and start > 0:
            _die()
        super().write(start, rows)


def _arm(what: str) -> None:
    # The next flush compacts (puts overwrite garbage rows, so churn alone
    # leaves too little of it).
    file_store._GARBAGE_SHARE = 0.0
    if what == "die-in-compaction":
        file_store._COPY_BYTES = 4096  # several blocks
        file_store._RowsFile = _DyingRowsFile
    else:
        replace = os.replace

        def replace_then_die(src, dst):
            replace(src, dst)
            if str(dst).endswith(file_store.MANIFEST):
                _die()
        os.replace = replace_then_die


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("start", type=int)
    p.add_argument("end", type=int)
    p.add_argument("--save-open")
    p.add_argument("--save")
    p.add_argument("--then", default="exit", choices=["exit", "forever", "die-in-compaction", "die-after-commit"])
    p.add_argument("--more", type=int)
    args = p.parse_args()
    torch.set_num_threads(1)
    m = build(args.path)
    if args.save_open:
        torch.save(content(m), args.save_open)
    train(m, args.start, args.end)
    m.flush()
    if args.save:
        torch.save(content(m), args.save)
    print("flushed", flush=True)
    if args.then == "forever":
        train(m, args.end, 10**9, log=True)
    elif args.then != "exit":
        train(m, args.end, args.more)
        _arm(args.then)
        m.flush()
        sys.exit(f"the flush at step {args.more} did not reach its {args.then} point")
    m.storage.store.close()


if __name__ == "__main__":
    main()
