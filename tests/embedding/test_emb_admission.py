"""Frequency admission against a dictionary model of SGD: a key is stored
once seen `threshold` times; until then it reads its initial value, gets no
update and is counted as rejected."""
from collections import Counter

import pytest
import torch

from dynamicemb import FrequencyAdmissionStrategy, KVCounter
from emb_helpers import DEBUG_INIT, debug_rows, make_module, random_batch, stored, stored_keys

D, LR = 4, 0.5


class AdmissionModel:
    """One table, SUM pooling, SGD with lr LR, DEBUG initial values."""

    def __init__(self, threshold):
        self.threshold = threshold
        self.rows = {}  # stored key -> row
        self.pending = Counter()  # sightings of keys not stored yet
        self.seen = Counter()
        self.rejected = 0

    def step(self, bag_keys, grad):
        """bag_keys: list of bags; grad: [B, D] gradient of the output."""
        counts = Counter(k for b in bag_keys for k in b)
        self.seen.update(counts)
        for k, c in counts.items():
            if k in self.rows:
                continue
            self.pending[k] += c
            if self.pending[k] >= self.threshold:
                del self.pending[k]
                self.rows[k] = debug_rows([k], D)[0]
            else:
                self.rejected += 1
        out = torch.stack([sum((self.rows.get(k, debug_rows([k], D)[0]) for k in b), torch.zeros(D))
                           for b in bag_keys])
        for bi, b in enumerate(bag_keys):
            for k in b:
                if k in self.rows:
                    self.rows[k] = self.rows[k] - LR * grad[bi]
        return out


@pytest.mark.parametrize("threshold", [1, 3])
def test_admission_matches_model(threshold, device):
    m = make_module([D], initializer_args=DEBUG_INIT, admit_strategy=FrequencyAdmissionStrategy(threshold),
                    admission_counter=KVCounter(1024), module_kwargs=dict(learning_rate=LR), device=device)
    ref = AdmissionModel(threshold)
    gen = torch.Generator().manual_seed(11)
    B = 6
    for _ in range(12):
        indices, offsets = random_batch(gen, [0], [60], batch=B, max_len=4)
        bag_keys = [indices[offsets[j]:offsets[j + 1]].tolist() for j in range(B)]
        grad = torch.randn(B, D, generator=gen)
        out_ref = ref.step(bag_keys, grad)
        out = m(indices.to(device), offsets.to(device))
        torch.testing.assert_close(out.detach().cpu(), out_ref, atol=1e-5, rtol=0)
        (out * grad.to(device)).sum().backward()
    assert stored_keys(m, 0) == set(ref.rows)
    assert all(ref.seen[k] >= threshold for k in stored_keys(m, 0))
    keys = sorted(ref.rows)
    _, rows = stored(m, 0, keys)
    torch.testing.assert_close(rows[:, :D], torch.stack([ref.rows[k] for k in keys]), atol=1e-5, rtol=0)
    stats = m.table_stats()["t0"]
    assert stats["admission_rejected"] == ref.rejected
    assert (ref.rejected > 0) == (threshold > 1)
    assert len(ref.pending) > 0 or threshold == 1  # some keys are still waiting


def test_rejected_key_gets_no_update_and_reads_initial_value():
    m = make_module([D], initializer_args=DEBUG_INIT, admit_strategy=FrequencyAdmissionStrategy(2),
                    admission_counter=KVCounter(64), module_kwargs=dict(learning_rate=LR))
    idx, off = torch.tensor([7, 9, 9]), torch.tensor([0, 1, 3])
    out = m(idx, off)  # 7 seen once: refused; 9 seen twice: stored
    out.sum().backward()
    assert stored_keys(m, 0) == {9}
    assert m.table_stats()["t0"]["admission_rejected"] == 1
    out = m(torch.tensor([7]), torch.tensor([0, 1]))  # second sighting: now stored with its initial value
    torch.testing.assert_close(out.detach()[0], debug_rows([7], D)[0], atol=0, rtol=0)
    assert stored_keys(m, 0) == {7, 9}


def test_admission_on_one_table_of_a_shared_hash_table():
    # Both tables live in one physical hash table; only t0 has admission.
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
    opts = [DynamicEmbTableOptions(dim=D, max_capacity=256, bucket_capacity=16, initializer_args=DEBUG_INIT,
                                   admit_strategy=FrequencyAdmissionStrategy(2), admission_counter=KVCounter(64)),
            DynamicEmbTableOptions(dim=D, max_capacity=256, bucket_capacity=16, initializer_args=DEBUG_INIT)]
    m = BatchedDynamicEmbeddingTables(opts)
    assert len(m.storage.groups) == 1
    m(torch.tensor([1, 2, 2, 1, 3]), torch.tensor([0, 3, 5]))  # t0: 1, 2 (x2); t1: 1, 3
    assert stored_keys(m, 0) == {2} and stored_keys(m, 1) == {1, 3}
    stats = m.table_stats()
    assert stats["t0"]["admission_rejected"] == 1 and stats["t1"]["admission_rejected"] == 0


def test_counter_memory_is_bounded():
    m = make_module([D], admit_strategy=FrequencyAdmissionStrategy(5), admission_counter=KVCounter(16, 16))
    for start in range(0, 200, 20):
        m(torch.arange(start, start + 20), torch.tensor([0, 20]))
    counter = m.storage.admission[0].counts
    assert counter.capacity() == 16 and counter.size() <= 16
    assert stored_keys(m, 0) == set()
    assert m.table_stats()["t0"]["admission_rejected"] == 200


def test_admitted_key_that_cannot_be_stored_keeps_its_count():
    # One full bucket that cannot evict (NO_EVICTION at max capacity): key 100
    # reaches the threshold but fails to be stored; its count is kept, so it
    # is not counted from zero again.
    from dynamicemb import DynamicEmbCheckMode, DynamicEmbScoreStrategy
    m = make_module([D], max_capacity=16, admit_strategy=FrequencyAdmissionStrategy(2),
                    admission_counter=KVCounter(64), score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                    safe_check_mode=DynamicEmbCheckMode.IGNORE)
    fill = torch.arange(16).repeat(2)
    m(fill, torch.tensor([0, fill.numel()]))
    assert stored_keys(m, 0) == set(range(16))
    m(torch.tensor([100, 100]), torch.tensor([0, 2]))  # admitted, not stored
    assert m.table_stats()["t0"]["failed"] == 1 and 100 not in stored_keys(m, 0)
    counter = m.storage.admission[0].counts
    idx, found = counter.lookup(torch.tensor([100]))
    assert bool(found[0]) and int(counter.slot_scores[idx[0]]) == 2
    assert counter.lookup(torch.arange(16))[1].sum() == 0  # stored keys were forgotten
