"""Frozen tables and TBE-layout batches that the mapped-table and hot-cache
tests share: table "a" (random int64 keys, dim 16, features fa and fb) and
table "b" (keys 0, 3, 6, ..., feature fc)."""
import torch

from dynamicemb.inference import FrozenTable


def random_tables(seed=0, a_keys=3000, b_keys=1000, dim_b=8):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-2**62, 2**62, (a_keys,), generator=g).unique()
    return [FrozenTable("a", a, torch.randn(a.numel(), 16, generator=g), ["fa", "fb"]),
            FrozenTable("b", torch.arange(b_keys) * 3, torch.randn(b_keys, dim_b, generator=g), ["fc"])]


def tbe_batch(tables, F, B, L, seed, weighted):
    """TBE-layout ids, 3 in 4 stored keys, the rest missing (their eval initial value)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.cat([t.keys for t in tables])
    n = F * B * L
    stored = keys[torch.randint(0, keys.numel(), (n,), generator=g)]
    values = torch.where(torch.rand(n, generator=g) < 0.75, stored, torch.randint(0, 2**40, (n,), generator=g))
    return (values, torch.arange(0, n + 1, L)) + ((torch.rand(n, generator=g),) if weighted else ())
