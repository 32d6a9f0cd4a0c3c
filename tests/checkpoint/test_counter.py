"""counter=True dumps and loads the admission counters: with a frequency
threshold of 2, a key seen once before the dump and once after the load is
admitted; without the counters (or in a model never dumped) it is not."""
import torch

import ckpt_helpers as H
from dynamicemb import FrequencyAdmissionStrategy, KVCounter
from dynamicemb.checkpoint import CheckpointError, DynamicEmbDump, DynamicEmbLoad

ONCE = [101, 102, 103]  # seen once before the dump


def _module():
    return H.plain_module(admit_strategy=FrequencyAdmissionStrategy(threshold=2),
                          admission_counter=KVCounter(capacity=64, bucket_capacity=16))


def _see(m, keys_a, keys_b=()):
    """One training step: table a sees keys_a, table b keys_b (one bag each)."""
    indices = torch.tensor(list(keys_a) + list(keys_b), dtype=torch.int64)
    offsets = torch.tensor([0, len(keys_a), len(keys_a) + len(keys_b)], dtype=torch.int64)
    m.train()
    m(indices, offsets).sum().backward()


def _stored(m, t, keys):
    keys = torch.tensor(keys, dtype=torch.int64)
    return (m.storage.find(keys, torch.full_like(keys, t)) >= 0).tolist()


def test_counters_round_trip(tmp_path):
    m = _module()
    _see(m, [1, 1], [2, 2])  # twice in one step: admitted at once
    _see(m, ONCE, ONCE)
    assert _stored(m, 0, [1] + ONCE) == [True, False, False, False]
    path = str(tmp_path / "ckpt")
    DynamicEmbDump(path, m, counter=True)

    loaded = _module()
    DynamicEmbLoad(path, loaded, counter=True)
    assert _stored(loaded, 0, [1]) == [True] and _stored(loaded, 1, [2]) == [True]
    _see(loaded, ONCE, ONCE)  # the second sighting: threshold reached
    assert _stored(loaded, 0, ONCE) == [True] * 3 and _stored(loaded, 1, ONCE) == [True] * 3

    # Reference: the counts did not come back without counter=True.
    no_counts = _module()
    DynamicEmbLoad(path, no_counts)
    _see(no_counts, ONCE, ONCE)
    assert _stored(no_counts, 0, ONCE) == [False] * 3


def test_counter_load_needs_a_counter_dump(tmp_path):
    m = _module()
    _see(m, ONCE)
    DynamicEmbDump(str(tmp_path / "ckpt"), m)
    try:
        DynamicEmbLoad(str(tmp_path / "ckpt"), _module(), counter=True)
    except CheckpointError as e:
        assert "table 'a'" in str(e) and "admission counters" in str(e)
    else:
        raise AssertionError("a dump without counters loaded with counter=True")


def test_counts_that_do_not_fit_their_buckets_are_counted():
    """AdmissionCounter.build (a load builds the counts aside): the keys that
    do not fit are counted, the highest counts are kept, the counter in use
    is untouched until replace()."""
    from dynamicemb.admission import AdmissionCounter
    adm = AdmissionCounter(FrequencyAdmissionStrategy(threshold=100), KVCounter(capacity=32, bucket_capacity=16),
                           "a", "cpu")
    keys = torch.arange(48, dtype=torch.int64)
    counts = keys + 1
    table, dropped = adm.build(keys, counts)
    assert dropped == 48 - table.size() and dropped >= 16 and adm.counts.size() == 0
    idx, found = table.lookup(keys)
    assert torch.equal(table.slot_scores[idx[found]], counts[found])  # kept with their exact counts
    # Placed in descending order of count: the 16 highest counts are all kept.
    assert bool(found[-16:].all())
    adm.replace(table)
    assert adm.counts is table


def test_counter_true_into_a_model_without_counters(tmp_path):
    m = _module()
    _see(m, ONCE)
    DynamicEmbDump(str(tmp_path / "ckpt"), m, counter=True)
    plain = H.plain_module()
    try:
        DynamicEmbLoad(str(tmp_path / "ckpt"), plain, counter=True)
    except CheckpointError as e:
        assert str(e).startswith("table 'a': ") and "no admission counter" in str(e)
    else:
        raise AssertionError("counters loaded into a model without admission counters")
    assert all(plain.storage.size(t) == 0 for t in range(2))


def _counter_slots(m, t):
    """{key: (slot, count)} of table t's admission counter."""
    return {k: (s, c) for b in m.storage.admission_counter(t).counts.export()
            for k, s, c in zip(b.keys.tolist(), b.indices.tolist(), b.scores.tolist())}


def test_a_resumed_counter_drops_what_the_uninterrupted_one_drops(tmp_path):
    """Counts that fit load in their dump's order, each key in its slot
    again: a full counter then drops the same key among equal lowest counts
    (ties go to the lowest slot) as the counter that was never dumped."""
    small = dict(admit_strategy=FrequencyAdmissionStrategy(threshold=3),
                 admission_counter=KVCounter(capacity=16, bucket_capacity=16))
    g = torch.Generator().manual_seed(4)
    steps = [torch.randint(0, 60, (2, 5), generator=g).tolist() for _ in range(12)]
    a = H.plain_module(**small)
    for keys_a, keys_b in steps[:6]:
        _see(a, keys_a, keys_b)
    DynamicEmbDump(str(tmp_path / "ckpt"), a, counter=True)
    b = H.plain_module(**small)
    DynamicEmbLoad(str(tmp_path / "ckpt"), b, counter=True)
    assert all(_counter_slots(b, t) == _counter_slots(a, t) for t in range(2))
    for keys_a, keys_b in steps[6:]:
        _see(a, keys_a, keys_b)
        _see(b, keys_a, keys_b)
        assert all(_counter_slots(b, t) == _counter_slots(a, t) for t in range(2))
