"""A user's Counter is checkpointed like the KVCounter when it implements
export() and load(): DynamicEmbDump / DynamicEmbLoad(counter=True) bring
every count back (checked against the counts before the dump, and against
a model that keeps training without a checkpoint). One without them is
refused by name (CounterNotCheckpointable) before anything is written, and
dumps without its counts (counter=False)."""
import os

import pytest

import ckpt_helpers as H
from dynamicemb import CounterNotCheckpointable, FrequencyAdmissionStrategy
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
from user_counters import DictCounter, SavedDictCounter  # tests/ (on the path via ckpt_helpers)


def _module(counter):
    return H.plain_module(admit_strategy=FrequencyAdmissionStrategy(threshold=3), admission_counter=counter)


def _train(m, seeds):
    for s in seeds:
        m(*H.plain_batch(s)).sum().backward()


def _counts(m):
    return [dict(m.storage.admission_counter(t).counter.counts) for t in range(2)]


def _stored(m):
    return [sorted(b.keys.tolist() for b in m.storage.export_rows(t)) for t in range(2)]


def test_a_user_counter_round_trips(tmp_path):
    m, ref = _module(SavedDictCounter()), _module(SavedDictCounter())
    _train(m, range(4))
    _train(ref, range(4))
    assert any(_counts(m))
    DynamicEmbDump(str(tmp_path / "ckpt"), m, counter=True)
    loaded = _module(SavedDictCounter())
    DynamicEmbLoad(str(tmp_path / "ckpt"), loaded, counter=True)
    assert _counts(loaded) == _counts(m)
    # Trained on, it admits exactly what the model never checkpointed admits.
    _train(loaded, range(4, 8))
    _train(ref, range(4, 8))
    assert _counts(loaded) == _counts(ref) and _stored(loaded) == _stored(ref)


def test_a_counter_without_export_is_refused_by_name(tmp_path):
    m = _module(DictCounter())
    _train(m, range(3))
    path = str(tmp_path / "ckpt")
    with pytest.raises(CounterNotCheckpointable, match="table 'a': its admission counter \\(DictCounter\\)"):
        DynamicEmbDump(path, m, counter=True)
    assert not os.path.exists(path) and not any(p.startswith("ckpt") for p in os.listdir(tmp_path))
    DynamicEmbDump(path, m)  # the rows, without the counts
    other = _module(DictCounter())
    DynamicEmbLoad(path, other)
    assert _stored(other) == _stored(m)
    # Counts dumped by a counter that saves them cannot go into one that cannot load them.
    saved = _module(SavedDictCounter())
    _train(saved, range(3))
    DynamicEmbDump(str(tmp_path / "counted"), saved, counter=True)
    plain = _module(DictCounter())
    with pytest.raises(CounterNotCheckpointable, match="implement export\\(\\) and load\\(\\)"):
        DynamicEmbLoad(str(tmp_path / "counted"), plain, counter=True)
    assert _stored(plain) == [[], []]  # refused before any row was loaded
