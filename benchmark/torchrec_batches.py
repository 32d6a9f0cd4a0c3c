"""The ids of bench_torchrec.py and profile_torchrec.py: per step, rank and
table, Zipf(alpha) ranks (inverse CDF of a truncated power law), shifted by
a per-table salt, then a fixed bijective scramble of [0, 2**40).

  default          ranks over [1, 2**40]: most of a step's unique ids are new
                   to the dynamic tables (insert + row init every step).
  --key-pool N     ranks over [1, N] only: each table draws from exactly N
                   keys (scramble((rank + salt) mod 2**40), rank < N), and
                   prefill_batches covers all of them, so a pre-filled
                   dynamic table meets no new id in the timed steps.
  --new-share S    a share S of each step's ids replaced by ids never used
                   before (pre-images >= 2**39, above every pool's).

Also the pre-fill (forwards over every pool key before timing) and the
counters that show how many of the timed steps' unique ids were new to
the dynamic tables.
"""
import math
import time
import warnings

import torch


def mode_label(key_pool: int, new_share: float, rows_per_table: int = 0) -> str:
    """What a run's ids are, as the report names its id mode. A pool of at
    least rows_per_table keys fills the tables in the pre-fill, so that the
    timed steps' new ids evict."""
    if not key_pool:
        return "mostly new ids"
    if not new_share:
        return "existing ids"
    label = "half the ids new" if new_share == 0.5 else f"{100 * new_share:g}% of the ids new"
    return label + (", evicting" if rows_per_table and key_pool >= rows_per_table else "")


def fused_target(key_pool: int, new_share: float) -> str:
    """The target of dynamic / FUSED step time for an id mode: issue 39's
    for existing ids (<= 1.0) and for half of them new (<= 1.1), issue 4's
    for the default mostly new ids (<= 1.3)."""
    if key_pool:
        return "<= 1.1" if new_share else "<= 1.0"
    return "<= 1.3"

KEY_RANGE = 2**40
_MASK = KEY_RANGE - 1
# Odd multipliers below 2**23: k * m stays below 2**63 for k < 2**40 (no overflow).
_MULS = (0x5BD1E9, 0x6F4F2B, 0x7A3C6D)
_SALT = 0x9E3779B1  # table t's ranks start at t * _SALT (pools of different tables do not meet)
_FRESH = 2**39  # with_new_ids' counters start here: above every salted pool rank


def scramble(k: torch.Tensor) -> torch.Tensor:
    """A fixed bijection of [0, 2**40): odd multiplies and xor-shifts mod 2**40,
    so that hot ranks are spread over the key range (and over the ranks)."""
    for m in _MULS:
        k = (k * m) & _MASK
        k = k ^ (k >> 19)
    return k


def table_salt(t: int) -> int:
    return t * _SALT


def zipf_ids(n: int, alpha: float, g: torch.Generator, salt: int, pool: int = 0) -> torch.Tensor:
    """n Zipf(alpha)-like keys in [0, 2**40): ranks from the inverse CDF of a
    power law truncated to [1, 2**40], or to [1, pool + 1] with a pool (so
    that floor(r) - 1 takes all of [0, pool), each with the power law's mass
    over [k + 1, k + 2)), shifted by `salt` (a different id stream per
    table), then scrambled."""
    top = pool if pool else KEY_RANGE
    u = torch.rand(n, dtype=torch.float64, generator=g)
    one_minus = 1.0 - alpha
    c = 1.0 - float(pool + 1 if pool else KEY_RANGE) ** one_minus
    r = (1.0 - u * c) ** (1.0 / one_minus)  # in [1, 2**40] or [1, pool + 1]
    ranks = (r.floor().to(torch.int64) - 1).clamp_(0, top - 1)
    return scramble((ranks + salt) & _MASK)


def pool_keys(pool: int, salt: int) -> torch.Tensor:
    """The `pool` keys zipf_ids(..., salt, pool) draws from, by rank."""
    return scramble((torch.arange(pool, dtype=torch.int64) + salt) & _MASK)


def with_new_ids(values: torch.Tensor, share: float, step: int, rank: int, g: torch.Generator) -> torch.Tensor:
    """`values` with a `share` of its positions (chosen at random) replaced
    by ids never used before: a counter unique to (step, rank, position),
    scrambled into the key range (a Zipf id meeting one by chance is
    negligible; a pool id never meets one, see check_key_pool): every step
    stores new rows, in free slots while the tables have room, evicting
    once they are full."""
    n = values.numel()
    pick = torch.randperm(n, generator=g)[:round(share * n)]
    fresh = (_FRESH + ((step * 64 + rank) << 24)) + torch.arange(pick.numel(), dtype=torch.int64)
    out = values.clone()
    out[pick] = scramble(fresh & _MASK)
    return out


def check_key_pool(args, world: int) -> str:
    """Why --key-pool cannot be used with these settings ('' when it can)."""
    n = args.key_pool
    if n < 0:
        return f"--key-pool must be >= 0, got {n}"
    if n == 0:
        return ""
    if n > args.rows_per_table:
        return (f"--key-pool {n} > --rows-per-table {args.rows_per_table}: the pool must fit the tables "
                f"(use well under it, e.g. rows // 4 = {args.rows_per_table // 4})")
    if table_salt(args.tables - 1) + n > _FRESH:
        return f"--key-pool {n} with {args.tables} tables reaches the new ids' range (2**39)"
    per_step = args.tables * args.batch * args.pooling
    if args.new_share > 0 and ((args.warmup + args.steps) * 64 > 2**15 or world > 64 or per_step >= 2**24):
        return "--new-share with --key-pool: at most 512 steps, 64 ranks and 2**24 ids per rank and step"
    return ""


def make_batches(args, rank, n_steps):
    """(features, labels) per step for this rank: raw keys in one KJT of
    `tables` features (values grouped by table)."""
    pool = getattr(args, "key_pool", 0)
    new_share = getattr(args, "new_share", 0.0)
    out = []
    for step in range(n_steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 64 + rank)
        per = args.batch * args.pooling
        values = torch.cat([zipf_ids(per, args.alpha, g, salt=table_salt(t), pool=pool)
                            for t in range(args.tables)])
        if new_share > 0:
            values = with_new_ids(values, new_share, step, rank, g)
        labels = torch.randint(0, 2, (args.batch,), generator=g).float()
        out.append((values, labels))
    return [(kjt(args, v), lab) for v, lab in out]


def prefill_batches(args, rank, world):
    """This rank's batches (normal shape) that, over all ranks, hold every
    pool key of every table: batch i of rank r takes pool ranks
    (i * world + r) * per + [0, per) mod N, where per = batch x pooling.
    The same count on every rank (their forwards meet in collectives)."""
    n = args.key_pool
    per = args.batch * args.pooling
    out = []
    for i in range(math.ceil(n / (world * per))):
        ranks = ((i * world + rank) * per + torch.arange(per, dtype=torch.int64)) % n
        values = torch.cat([scramble((ranks + table_salt(t)) & _MASK) for t in range(args.tables)])
        out.append((kjt(args, values), torch.zeros(args.batch)))
    return out


def kjt(args, values):
    import torchrec

    lengths = torch.full((args.tables * args.batch,), args.pooling, dtype=torch.int64)
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=[f"f{t}" for t in range(args.tables)],
                                                        values=values, lengths=lengths)


def folded(batches, rows):
    """The batches with their ids folded into the row range (TorchRec's FUSED tables)."""
    return [(k.__class__.from_lengths_sync(keys=k.keys(), values=k.values() % rows, lengths=k.lengths()), lab)
            for k, lab in batches]


# ---- the pre-fill and the new-id counts -----------------------------------------------------


def prefill(name, model, args, rank, world):
    """--key-pool: forwards (training mode, no backward, no optimizer step)
    over every pool key of every table, before the timed steps, on every
    model alike. A dynamic table's training forward stores its new keys even
    under no_grad, so each pool key then has a row. Returns the seconds
    between two barriers (0.0 without a pool)."""
    import torch.distributed as dist

    if not args.key_pool:
        return 0.0
    batches = prefill_batches(args, rank, world)
    if name == "native":
        batches = folded(batches, args.rows_per_table)
    model.train()
    dist.barrier()
    s = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "dynamicemb: .*under torch.no_grad", RuntimeWarning)  # the point here
        for features, labels in batches:
            model(features, labels)
    dist.barrier()
    return time.perf_counter() - s


def dynamic_counts(name, model):
    """This rank's dynamic-table counters summed over its tables (None for the other models)."""
    if name != "dynamic":
        return None
    from dynamicemb import table_stats

    s = table_stats(model)
    return {k: sum(v[k] for v in s.values()) for k in ("size", "capacity", "inserted", "evicted", "failed")}


def timed_counts(counts, batches, args, world) -> dict:
    """A rank's dynamic_counts after the pre-fill, before the timed steps and
    at the end, with the timed batches' unique ids (over all ranks): what
    id_counts sums over the ranks."""
    after_prefill, before_timed, end = counts
    return {"after_prefill": after_prefill, "before_timed": before_timed, "end": end,
            "unique_ids_timed": unique_ids(batches[args.warmup:], world)}


def unique_ids(batches, world):
    """Distinct (table, id) pairs of each batch over all ranks, summed over
    the batches: the keys the sharded tables see (each on one rank)."""
    import torch.distributed as dist

    total = 0
    for features, _ in batches:
        table = torch.repeat_interleave(torch.arange(len(features.keys()), dtype=torch.int64),
                                        torch.tensor(features.length_per_key()))
        tagged = features.values() | (table << 40)
        parts = [torch.empty_like(tagged) for _ in range(world)]
        dist.all_gather(parts, tagged)
        total += int(torch.cat(parts).unique().numel())
    return total


def id_counts(ranks, args):
    """One round's dynamic-table counters, summed over the ranks: how many
    of the timed steps' unique ids were new (inserted) and how many of them
    evicted a key (none until the tables are full), the tables' load before
    and after the timed steps, and what the pre-fill stored."""
    def total(when, k):
        return sum(c[when][k] for c in ranks)

    unique = ranks[0]["unique_ids_timed"]
    new = total("end", "inserted") - total("before_timed", "inserted")
    return {"unique_ids_timed": unique, "new_ids_timed": new, "new_share_timed": new / unique if unique else 0.0,
            "new_ids_warmup": total("before_timed", "inserted") - total("after_prefill", "inserted"),
            "evicted_timed": total("end", "evicted") - total("before_timed", "evicted"),
            # Whether the timed steps' new ids evicted: only once the tables are full.
            "load_factor_timed": [total(w, "size") / max(1, total(w, "capacity")) for w in ("before_timed", "end")],
            "failed_timed": total("end", "failed") - total("before_timed", "failed"),
            "pool_keys": args.tables * args.key_pool, "stored_after_prefill": total("after_prefill", "size"),
            "evicted_in_prefill": total("after_prefill", "evicted"),
            "failed_in_prefill": total("after_prefill", "failed")}
