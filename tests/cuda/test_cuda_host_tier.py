"""The host tier: on CUDA, a table whose values do not fit its share of
global_hbm_for_values keeps its rows in pinned host memory that the kernels
read and update in place. A module with one table there trains exactly like
the same module on the CPU: outputs, rows and optimizer state bit for bit,
through growth, and it dumps and exports the same entries. Skipped without a
GPU (DYNAMICEMB_PARITY_DEVICE=cpu runs it CPU against CPU)."""
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


@pytest.mark.parametrize("budget", [1, 0])  # 1 byte: the host tier; 0: no limit (all on the device)
def test_host_tier_trains_like_the_cpu(budget):
    ref, got = module("cpu", (budget, 0)), module(DEV, (budget, 0))
    on_host = DEV == "cuda" and budget > 0
    assert got.storage.host_tier == [on_host, False]
    for step in range(6):
        outs = []
        for m, dev in ((ref, "cpu"), (got, DEV)):
            out = m(*batch(step, dev))
            (out * out).sum().backward()
            outs.append(out)
        same(outs[0], outs[1])
    w = got.storage.weights()[0]
    assert w.is_pinned() == on_host and (w.device.type == "cpu") == (on_host or DEV == "cpu")
    assert ref.storage.capacity(0) > 64  # grew: the host tier's rows moved into new pinned memory
    for t in range(2):
        keys = torch.cat([b[0] for b in ref.storage.export(t)]).sort().values
        tids = torch.full_like(keys, t)
        rows_ref = ref.storage.weights()[t][ref.storage.find(keys, tids)]
        rows_got = got.storage.weights()[t][got.storage.find(keys.to(DEV), tids.to(DEV)).to(got.storage.weights()[t].device)]
        same(rows_ref, rows_got)
        exported = {k: v for b in got.storage.export_rows(t, lazy=True) for k, v in
                    zip(b.keys.tolist(), torch.cat(list(b.values.blocks())).unbind(0))} if keys.numel() else {}
        assert sorted(exported) == keys.tolist()
        same(torch.stack([exported[k] for k in keys.tolist()]), rows_ref[:, :ref.dims[t]])
