"""bench_torchrec's ids (benchmark/torchrec_batches.py): the default stream
unchanged, --key-pool draws from exactly N keys per table, the pre-fill
covers them all, and --new-share's fresh ids lie outside every pool."""
import argparse
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import bench_torchrec  # noqa: E402
import torchrec_batches as T  # noqa: E402


def settings(**kw):
    base = dict(tables=3, batch=64, pooling=4, alpha=1.05, seed=7, new_share=0.0, key_pool=0,
                rows_per_table=4096, warmup=1, steps=5)
    base.update(kw)
    return argparse.Namespace(**base)


def per_table(values, args):
    return values.view(args.tables, args.batch * args.pooling)


def reference_values(args, rank, step):
    """The default ids as bench_torchrec drew them before --key-pool (its
    zipf_ids, written out here): Zipf over ranks [1, 2**40], salted, scrambled."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 64 + rank)
    parts = []
    for t in range(args.tables):
        u = torch.rand(args.batch * args.pooling, dtype=torch.float64, generator=g)
        one_minus = 1.0 - args.alpha
        r = (1.0 - u * (1.0 - float(2**40) ** one_minus)) ** (1.0 / one_minus)
        ranks = (r.floor().to(torch.int64) - 1).clamp_(0, 2**40 - 1)
        parts.append(T.scramble((ranks + t * 0x9E3779B1) & (2**40 - 1)))
    values = torch.cat(parts)
    if args.new_share > 0:
        values = T.with_new_ids(values, args.new_share, step, rank, g)
    return values, torch.randint(0, 2, (args.batch,), generator=g).float()


@pytest.mark.parametrize("new_share", [0.0, 0.5])
def test_default_ids_unchanged(new_share):
    args = settings(new_share=new_share)
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "key_pool"})  # profile's old args
    for a in (args, plain):
        for rank in (0, 1):
            for step, (kjt, labels) in enumerate(T.make_batches(a, rank, 3)):
                values, ref_labels = reference_values(a, rank, step)
                assert torch.equal(kjt.values(), values)
                assert torch.equal(labels, ref_labels)
                assert kjt.keys() == [f"f{t}" for t in range(a.tables)]
                assert torch.equal(kjt.lengths(), torch.full((a.tables * a.batch,), a.pooling))


def test_pool_draws_exactly_n_keys_per_table_and_prefill_holds_them():
    n, world = 200, 2
    args = settings(key_pool=n)
    drawn = [set() for _ in range(args.tables)]
    for rank in range(world):
        for kjt, _ in T.make_batches(args, rank, 30):
            for t, row in enumerate(per_table(kjt.values(), args)):
                drawn[t].update(row.tolist())
    prefilled = [set() for _ in range(args.tables)]
    counts = []
    for rank in range(world):
        batches = T.prefill_batches(args, rank, world)
        counts.append(len(batches))
        for kjt, labels in batches:
            assert kjt.values().numel() == args.tables * args.batch * args.pooling and labels.numel() == args.batch
            for t, row in enumerate(per_table(kjt.values(), args)):
                prefilled[t].update(row.tolist())
    assert counts[0] == counts[1]  # the ranks' forwards meet in collectives
    for t in range(args.tables):
        # 30 steps x 2 ranks x 256 ids: even the rarest rank (p ~ 7e-4) is drawn; all in the key range
        assert len(drawn[t]) == n and drawn[t] == prefilled[t]
        assert all(0 <= k < 2**40 for k in drawn[t])
        for u in range(t):
            assert not drawn[t] & drawn[u]  # the salts keep the tables' pools apart


def test_pool_with_new_share_fresh_ids_lie_outside_the_pool():
    n, share = 200, 0.5
    args = settings(key_pool=n, new_share=share)
    pools = set().union(*[set(T.pool_keys(n, T.table_salt(t)).tolist()) for t in range(args.tables)])
    assert len(pools) == args.tables * n
    fresh_seen = set()
    for rank in (0, 1):
        for kjt, _ in T.make_batches(args, rank, 4):
            v = kjt.values().tolist()
            fresh = [k for k in v if k not in pools]
            assert len(fresh) == round(share * len(v)) == len(set(fresh))
            assert not fresh_seen & set(fresh)  # never seen before: not in an earlier step or on another rank
            fresh_seen.update(fresh)


def test_key_pool_refused_past_the_rows():
    for argv in (["--key-pool", "5000", "--rows-per-table", "4096"], ["--key-pool", "-1"]):
        with pytest.raises(SystemExit):
            bench_torchrec.parse_args(argv)
    args = bench_torchrec.parse_args(["--key-pool", "1024", "--rows-per-table", "4096", "--models", "dynamic"])
    assert args.key_pool == 1024 and "pool of 1024 keys" in bench_torchrec.ids_mode(args)
    assert bench_torchrec.parse_args([]).key_pool == 0
