"""The main job of dynamicemb.

For now it demonstrates the scored hash table that every dynamic embedding
table is built on: inserts, lookups, evictions and counters, printed readably.
(Training with TorchRec's DistributedModelParallel on 2 CPU ranks, dump, load
and export join it as those layers land.)

    bash scripts/dev.sh example
"""
import argparse

import torch

from dynamicemb import DynamicEmbScoreStrategy, InsertResult, ScoredHashTable


def show(title, **cols):
    print(f"\n{title}")
    names = list(cols)
    print("  " + "".join(f"{n:>22}" for n in names))
    for row in zip(*(c.tolist() if isinstance(c, torch.Tensor) else c for c in cols.values())):
        print("  " + "".join(f"{str(v):>22}" for v in row))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    # Two logical tables in one physical table; small buckets so they fill up.
    table = ScoredHashTable(capacity=[32, 64], bucket_capacity=16, num_tables=2,
                            score_strategy=DynamicEmbScoreStrategy.STEP, table_names=["users", "items"])
    print(f"capacity per table: {table.capacities()}  (buckets of {table.bucket_capacity} slots)")

    # Every int64 is a key, the extremes included.
    keys = torch.tensor([-1, 0, 2**63 - 1, -(2**63), 42, 42])
    out = table.insert(keys, table_ids=0, scores=1)
    show("insert into 'users' at step 1 (the duplicate 42 finds its first copy):",
         key=keys, slot=out.indices, result=[InsertResult(r).name for r in out.results.tolist()])

    idx, found = table.lookup(torch.tensor([42, 7, -1]), table_ids=0)
    show("lookup 42, 7, -1 in 'users':", key=torch.tensor([42, 7, -1]), slot=idx, found=found)

    # Fill 'items' past its capacity over several steps: the lowest step is evicted.
    evicted_total = 0
    for step in range(2, 8):
        batch = torch.randint(0, 2**40, (24,))
        out = table.insert(batch, table_ids=1, scores=step)
        evicted_total += out.evicted.keys.numel()
        if out.evicted.keys.numel():
            ev = out.evicted
            show(f"step {step}: inserting 24 new keys into 'items' evicted {ev.keys.numel()}; the first few:",
                 key=ev.keys[:4], slot=ev.indices[:4], score=ev.scores[:4])
    print(f"\nsize per table: users={table.size(0)} items={table.size(1)}; "
          f"load factor items={table.load_factor(1):.2f}")
    for t, name in enumerate(table.table_names):
        print(f"counters {name:>5}: {table.get_counters(t)}")

    erased = table.erase(torch.tensor([42, 123]), table_ids=0)
    print(f"\nerase 42, 123 from 'users': {erased.tolist()}  -> size {table.size(0)}")
    old, new = table.grow([64, 128])
    print(f"grow to {table.capacities()}: {old.numel()} entries moved, all still found: "
          f"{bool(table.lookup(keys[:4], table_ids=0)[1].all())}")
    n_recent = sum(b.keys.numel() for b in table.export(threshold=6, table_id=1))
    print(f"export of 'items' keys touched at step >= 6: {n_recent}")


if __name__ == "__main__":
    main()
