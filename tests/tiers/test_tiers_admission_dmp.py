"""Through DMP (our planner and sharders, CPU, gloo, 1 and 2 ranks), cached
tables with frequency admission and the (TIMESTAMP, LFU) score, and tables
with a user's AdmissionStrategy and Counter, train bit for bit as the same
options without a cache: the same outputs at every step, the same rows,
optimizer state, LFU counts and admission counts on every rank at the end.
dcp.save(state_dict()) of the cached model loads into a fresh model without
a cache with every count back (the user counter's through its export/load)."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tiered_dmp as td
from dynamicemb import (AdmissionStrategy, CounterNotCheckpointable, DynamicEmbInitializerArgs,
                        DynamicEmbInitializerMode, FrequencyAdmissionStrategy, KVCounter)
from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb.stats import dynamic_modules
from tiered_dmp import run_ranks
from user_counters import DictCounter, SavedDictCounter  # tests/ (on the path via tiered_dmp)


class UnsavedCounter(DictCounter):
    """A counter without export / load: it trains, it cannot be checkpointed."""


class EvenFirst(AdmissionStrategy):
    """A user's strategy: even ids at once, odd ids at their third sighting."""

    def admit(self, keys, counts):
        return (keys % 2 == 0) | (counts >= 3)


CASES = {
    "frequency+pair": dict(admit_strategy=FrequencyAdmissionStrategy(
        2, initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.05)),
        admission_counter=KVCounter(1 << 14),
                           score_strategy=(S.TIMESTAMP, S.LFU)),
    "user": dict(admit_strategy=EvenFirst(), admission_counter=SavedDictCounter(), score_strategy=S.LFU),
}


def _gathered(model, table, pg):
    """({key: score}, {key: admission count}) of a table over every rank of pg, every tier."""
    m = next(m for m in dynamic_modules(model) if table in m.table_names)
    t = m.table_names.index(table)
    scores = {k: s for b in m.storage.export_rows(t) for k, s in zip(b.keys.tolist(), b.scores.tolist())}
    counts = {k: c for keys, cs in m.storage.admission_counter(t).export() for k, c in zip(keys.tolist(), cs.tolist())}
    out = [None] * pg.size()
    dist.all_gather_object(out, (scores, counts), group=pg)
    merged = ({}, {})
    for part in out:
        for mine, theirs in zip(merged, part):
            assert not mine.keys() & theirs.keys(), f"{table}: a key on two ranks"
            mine.update(theirs)
    return merged


def _run(rank, world, path):
    fused = td.OPTIMIZERS["adam"]
    batches = td.zipf_batches(steps=50)
    checked = []
    for pg in td.process_groups():
        for what, opts in CASES.items():
            label = f"{what}/{pg.size()} ranks"
            ref = td.build("ebc", pg, fused, **opts)
            cached = td.build("ebc", pg, fused, cache_rows=td.CACHE_ROWS // 2, **opts)
            for step, (a, b) in enumerate(zip(td.train(cached, batches, pg), td.train(ref, batches, pg))):
                assert torch.equal(a, b), f"{label}: step {step} outputs differ"
            td.assert_same_rows(cached, ref, pg, label)
            for t in td.TABLES:
                got, want = _gathered(cached, t, pg), _gathered(ref, t, pg)
                assert got == want and want[1], f"{label} {t}: scores or admission counts differ"
            # Through DCP into a fresh model without a cache: every count back.
            ckpt = f"{path}/{what}-{pg.size()}"
            dcp.save(cached.state_dict(), checkpoint_id=ckpt, process_group=pg)
            fresh = td.build("ebc", pg, fused, **opts)
            sd = fresh.state_dict()
            dcp.load(sd, checkpoint_id=ckpt, process_group=pg)
            fresh.load_state_dict(sd)
            td.assert_same_rows(fresh, ref, pg, label + " loaded")
            for t in td.TABLES:
                assert _gathered(fresh, t, pg)[1] == _gathered(ref, t, pg)[1], f"{label} {t}: counts not loaded"
            checked.append(label)
        if pg.size() == 1:  # a counter without export / load: state_dict() warns, saving it is refused by name
            plain = dict(CASES["user"], admission_counter=UnsavedCounter())
            model = td.build("ebc", pg, fused, **plain)
            td.train(model, batches[:2], pg)
            with pytest.warns(RuntimeWarning, match="admission counter \\(UnsavedCounter\\) implements no export"):
                sd = model.state_dict()
            try:  # DCP re-raises a rank's error inside its own (a BaseException)
                dcp.save(sd, checkpoint_id=f"{path}/unsaved", process_group=pg)
                raise AssertionError("a counter without export() was saved")
            except BaseException as e:  # noqa: BLE001
                msg = str(e)
            assert CounterNotCheckpointable.__name__ in msg and "table 'a_table'" in msg, msg
            checked.append("refused")
    return checked


def test_cached_admission_and_pair_score_through_dmp(tmp_path):
    checked = run_ranks(_run, 2, str(tmp_path), timeout=600)
    assert len(checked[0]) == 5 and checked[1] == checked[0][:2]  # rank 0 also ran the 1-rank models
