"""The host part of a hybrid table: on CUDA, the rows of a table past its
share of global_hbm_for_values live in pinned host memory that the kernels
read and update in place (all of them with a 1-byte share). A module with
such a table trains exactly like the same module on the CPU with its rows
whole: outputs, rows and optimizer state bit for bit, through growth, and it
dumps and exports the same entries. Skipped without a GPU
(DYNAMICEMB_PARITY_DEVICE=cpu runs it CPU against CPU)."""
import pytest
import torch

from cuda_parity import DEV, PARITY_MARKS, same
from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EmbOptimType,
    get_table_value_bytes,
)

pytestmark = PARITY_MARKS


def module(device, budgets):
    opts = [DynamicEmbTableOptions(dim=d, init_capacity=64, max_capacity=1024, bucket_capacity=16,
                                   score_strategy=DynamicEmbScoreStrategy.STEP, global_hbm_for_values=b,
                                   initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL,
                                                                              std_dev=0.1))
            for d, b in zip((8, 4), budgets)]
    return BatchedDynamicEmbeddingTables(opts, table_names=["host_table", "device_table"],
                                         optimizer=EmbOptimType.ADAM, learning_rate=0.05, device=device, seed=3)


def batch(step, device):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 6, (2 * 16,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.randint(-50, 50 + 40 * step, (int(offsets[-1]),), generator=g)  # new keys: growth
    return indices.to(device), offsets.to(device)


ROW = get_table_value_bytes(1, 8, optimizer=EmbOptimType.ADAM)  # table 0's row: dim 8 and Adam's two moments


# 1 byte: every row in host memory; 100 rows: a hybrid table once it grows past
# them; 0: no limit (all on the device).
@pytest.mark.parametrize("budget", [1, 100 * ROW, 0])
def test_host_tier_trains_like_the_cpu(budget):
    ref, got = module("cpu", (0, 0)), module(DEV, (budget, 0))
    for step in range(6):
        outs = []
        for m, dev in ((ref, "cpu"), (got, DEV)):
            out = m(*batch(step, dev))
            (out * out).sum().backward()
            outs.append(out)
        same(outs[0], outs[1])
    parts = got.storage.rows_of(0)
    assert ref.storage.capacity(0) > 100  # grew: the rows moved into new parts
    assert parts.split == (0 if budget == 1 else 100 if budget else ref.storage.capacity(0))
    assert (parts.tail is not None) == (budget > 0)
    if parts.tail is not None:
        assert parts.tail.is_pinned() == (DEV == "cuda") and parts.tail.device.type == "cpu"
    for t in range(2):
        keys = torch.cat([b[0] for b in ref.storage.export(t)]).sort().values
        tids = torch.full_like(keys, t)
        rows_ref = ref.storage.rows_of(t).index_select(0, ref.storage.find(keys, tids))
        rows_got = got.storage.rows_of(t).index_select(0, got.storage.find(keys.to(DEV), tids.to(DEV)))
        same(rows_ref, rows_got)
        exported = {k: v for b in got.storage.export_rows(t, lazy=True) for k, v in
                    zip(b.keys.tolist(), torch.cat(list(b.values.blocks())).unbind(0))} if keys.numel() else {}
        assert sorted(exported) == keys.tolist()
        same(torch.stack([exported[k] for k in keys.tolist()]), rows_ref[:, :ref.dims[t]])
