"""Pluggable admission: a user's AdmissionStrategy and Counter (one subclass
each) train as a Python model of them says; the built-in frequency pair is
one such pair; the strategy's initializer_args is what a key not admitted
reads in training (checked against a table without admission that uses that
initializer, whose first sighting of a key reads exactly its initial row)."""
import os
import sys
from collections import Counter as Tally

import pytest
import torch

import dynamicemb
from dynamicemb import (AdmissionStrategy, BatchedDynamicEmbeddingTables, Counter, DynamicEmbInitializerArgs,
                        DynamicEmbInitializerMode, DynamicEmbTableOptions, FrequencyAdmissionStrategy, KVCounter)
from emb_helpers import DEBUG_INIT, debug_rows, random_batch, stored, stored_keys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: user_counters
from user_counters import DictCounter  # noqa: E402

D, LR = 4, 0.5


class WeightedStrategy(AdmissionStrategy):
    """A user's strategy: keys below `vip` need one sighting, the others `threshold`."""

    def __init__(self, vip, threshold, initializer_args=None):
        self.vip, self.threshold, self.initializer_args = vip, threshold, initializer_args

    def admit(self, keys, counts):
        return (keys < self.vip) | (counts >= self.threshold)


class Model:
    """One table, SUM pooling, SGD with lr LR, DEBUG initial rows; `admits(key, count)` the strategy."""

    def __init__(self, admits, unstored_row):
        self.admits, self.unstored_row = admits, unstored_row
        self.rows, self.pending, self.rejected = {}, Tally(), 0

    def step(self, bags, grad):
        for k, c in Tally(k for b in bags for k in b).items():
            if k in self.rows:
                continue
            self.pending[k] += c
            if self.admits(k, self.pending[k]):
                del self.pending[k]
                self.rows[k] = debug_rows([k], D)[0]
            else:
                self.rejected += 1
        out = torch.stack([sum((self.rows[k] if k in self.rows else self.unstored_row(k) for k in b), torch.zeros(D))
                           for b in bags])
        for i, b in enumerate(bags):
            for k in b:
                if k in self.rows:
                    self.rows[k] = self.rows[k] - LR * grad[i]
        return out


def _module(strategy, counter, **kw):
    opts = DynamicEmbTableOptions(dim=D, max_capacity=1024, bucket_capacity=16, initializer_args=DEBUG_INIT,
                                  admit_strategy=strategy, admission_counter=counter, **kw)
    return BatchedDynamicEmbeddingTables([opts], learning_rate=LR)


def _train(m, ref, steps=12, seed=5):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        indices, offsets = random_batch(gen, [0], [60], batch=6, max_len=4)
        bags = [indices[offsets[j]:offsets[j + 1]].tolist() for j in range(6)]
        grad = torch.randn(6, D, generator=gen)
        out = m(indices, offsets)
        torch.testing.assert_close(out.detach(), ref.step(bags, grad), atol=1e-5, rtol=0)
        (out * grad).sum().backward()


def test_the_built_in_pair_is_one_subclass_each():
    assert isinstance(FrequencyAdmissionStrategy(2), AdmissionStrategy) and isinstance(KVCounter(64), Counter)
    assert {"AdmissionStrategy", "Counter", "CounterNotCheckpointable"} <= set(dynamicemb.__all__)
    from dynamicemb.options import FrequencyAdmissionStrategy as F, KVCounter as K  # the old import path
    assert F is FrequencyAdmissionStrategy and K is KVCounter


def test_user_strategy_and_counter_match_their_model():
    m = _module(WeightedStrategy(vip=10, threshold=3), DictCounter())
    ref = Model(lambda k, c: k < 10 or c >= 3, lambda k: debug_rows([k], D)[0])
    _train(m, ref)
    assert stored_keys(m, 0) == set(ref.rows) and ref.rejected > 0
    keys = sorted(ref.rows)
    torch.testing.assert_close(stored(m, 0, keys)[1][:, :D], torch.stack([ref.rows[k] for k in keys]), atol=1e-5,
                               rtol=0)
    assert m.table_stats()["t0"]["admission_rejected"] == ref.rejected
    # The table's own counter instance (made by create: a copy of the options' template) holds the pending counts.
    counter = m.storage.admission_counter(0).counter
    assert counter is not m.table_options[0].admission_counter
    assert counter.counts == dict(ref.pending)


@pytest.mark.parametrize("init", [
    DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.25),
    DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, lower=-0.5, upper=0.5),
    DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, mean=1.0, std_dev=0.1),
])
def test_keys_not_admitted_read_the_strategys_initializer(init, device):
    """Reference: a table without admission whose initializer is the
    strategy's: a key's first training read there is its initial row."""
    strategy = FrequencyAdmissionStrategy(threshold=1000, initializer_args=init)  # nothing is admitted
    opts = dict(dim=D, max_capacity=1024, bucket_capacity=16, initializer_args=DEBUG_INIT)
    admitting = DynamicEmbTableOptions(admit_strategy=strategy, admission_counter=KVCounter(4096), **opts)
    m = BatchedDynamicEmbeddingTables([admitting], device=device, seed=7)
    ref = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(**dict(opts, initializer_args=init))], device=device,
                                        seed=7)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        indices, offsets = random_batch(gen, [0], [300], batch=8, max_len=4)
        indices, offsets = indices.to(device), offsets.to(device)
        ref_out = ref(indices, offsets)
        out = m(indices, offsets)
        assert torch.equal(out, ref_out)  # bit for bit: the same rule, the same (seed, table, key)
        out.sum().backward()
        ref.storage.clear_table(0)  # every key stays new for the reference
    assert stored_keys(m, 0) == set()
    if init.mode == DynamicEmbInitializerMode.CONSTANT:  # and against the plain rule
        assert bool((out == 0.25 * torch.diff(offsets).unsqueeze(1).to(out.dtype)).all())
    m.eval()  # eval reads of a missing key are unchanged: eval_initializer_args (zeros)
    assert bool((m(indices, offsets) == 0).all())


def test_without_an_initializer_a_key_not_admitted_reads_the_tables():
    m = _module(FrequencyAdmissionStrategy(5), KVCounter(64))
    out = m(torch.tensor([3, 4]), torch.tensor([0, 1, 2]))
    assert torch.equal(out.detach(), debug_rows([3, 4], D))


def test_a_strategy_must_return_a_bool_mask_per_key():
    class Bad(AdmissionStrategy):
        def admit(self, keys, counts):
            return counts  # not a mask
    m = _module(Bad(), KVCounter(64))
    with pytest.raises(TypeError, match="table 't0': Bad.admit must return a bool tensor"):
        m(torch.tensor([1, 2]), torch.tensor([0, 2]))


@pytest.mark.parametrize("kw, msg", [
    (dict(admit_strategy=FrequencyAdmissionStrategy(2, initializer_args="zeros"), admission_counter=KVCounter(64)),
     "initializer_args must be a DynamicEmbInitializerArgs"),
    (dict(admit_strategy=FrequencyAdmissionStrategy(2), admission_counter={}),
     "admission_counter must be a KVCounter or another dynamicemb.Counter"),
])
def test_bad_admission_options_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DynamicEmbTableOptions(dim=D, **kw)
