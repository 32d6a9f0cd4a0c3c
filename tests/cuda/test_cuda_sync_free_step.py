"""A CUDA training step does not wait for the device (issue 32;
docs/gpu/sync_free_step.md): with a long sleep queued on the stream first, the
module's forward and backward return while the sleep still runs. Any host
synchronisation inside the step (a count read back, an .item(), a blocking
copy) would have waited for the sleep. The exact step (emb_unique's count
read on the host) is the control: it must wait. CUDA only."""
import warnings

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbCheckMode, DynamicEmbScoreStrategy,
                        DynamicEmbTableOptions, EmbOptimType)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_CYCLES = 1_000_000_000  # 0.5-0.7 s at 1.5-2 GHz: a hundred times a warm step's host time


def _module(strategy, capacity=4096, mode=DynamicEmbCheckMode.WARNING):
    opts = [DynamicEmbTableOptions(dim=16, max_capacity=capacity, bucket_capacity=128, score_strategy=strategy,
                                   safe_check_mode=mode) for _ in range(2)]
    m = BatchedDynamicEmbeddingTables(opts, optimizer=EmbOptimType.ADAM, device="cuda")
    if strategy == DynamicEmbScoreStrategy.CUSTOMIZED:
        m.set_score(5, 0)  # uploaded once, not every step
        m.set_score(7, 1)
    return m


def _batch(gen, lo, hi):
    idx = torch.randint(lo, hi, (2 * 64 * 4,), generator=gen).cuda()
    return idx, torch.arange(0, idx.numel() + 1, 4, device="cuda")


def _step_waited(m, batch) -> bool:
    """Whether a training step (forward and backward) on `batch` waited for
    the sleep queued before it. The offsets are a new tensor, as TorchRec's
    are every step: their check's record goes to the host too."""
    indices, offsets = batch[0], batch[1].clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    m(indices, offsets).sum().backward()
    waited = torch.cuda.current_stream().query()  # True: the queue drained, so the step waited
    torch.cuda.synchronize()
    return waited


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU,
                                      DynamicEmbScoreStrategy.CUSTOMIZED], ids=lambda s: s.name)
def test_a_training_step_does_not_wait_for_the_device(strategy):
    gen = torch.Generator().manual_seed(0)
    m = _module(strategy)
    stored, new = _batch(gen, 0, 1000), _batch(gen, 10**6, 2 * 10**6)
    for _ in range(3):  # warm: the allocators' blocks, the offsets' and layout checks of first calls
        m(*stored).sum().backward()
    assert not _step_waited(m, stored)
    assert not _step_waited(m, new)  # new keys: inserts and new rows
    m._pads_unique = lambda indices: False  # the control: the exact step reads its unique count
    assert _step_waited(m, stored)
    del m._pads_unique
    assert m.table_stats()["t0"]["failed"] == 0


@pytest.mark.parametrize("mode", [DynamicEmbCheckMode.WARNING, DynamicEmbCheckMode.IGNORE], ids=lambda m: m.name)
def test_steps_that_evict_and_fail_keys_do_not_wait(mode):
    # One bucket per table and 256 new keys a step: every step evicts, and
    # fails the keys that find the bucket held by the batch. The steps after
    # report those counts (WARNING: a warning, and no budget to explain it)
    # as they land, without waiting.
    gen = torch.Generator().manual_seed(1)
    m = _module(DynamicEmbScoreStrategy.TIMESTAMP, capacity=128, mode=mode)
    batches = [_batch(gen, 10**6 * (s + 1), 10**6 * (s + 2)) for s in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for b in batches[:3]:
            m(*b).sum().backward()
        torch.cuda.synchronize()  # the counts have landed: the next step reports them
        assert not _step_waited(m, batches[3])
        assert not _step_waited(m, batches[4])
    stats = m.table_stats()["t0"]
    assert stats["failed"] > 0 and stats["evicted"] > 0
