"""No silent loss: every path that cannot carry the dynamic tables says so,
naming them (issue 34).

- dcp.load + load_state_dict into a model whose table has another dim, or
  another optimizer, is refused by name on every rank, the model unchanged;
  so is a state dict with slots missing, or saved with another slot count;
- torch.save / pickle of model.state_dict() refuse, naming the tables and
  pointing to DynamicEmbDump; copy.deepcopy of it is a snapshot that loads;
- a state dict without the tables: load_state_dict reports them missing;
- more ranks than slots, or a storage without the checkpoint protocol:
  state_dict() warns (the latter) and dcp.save refuses, naming the tables;
- state_dict() of an unsharded BatchedDynamicEmbeddingTables warns.
"""
import copy
import io
import os
import pickle
import re
import sys

import pytest
import torch
import torch.distributed as dist

import ckpt_helpers as H
import dcp_helpers as D
from dynamicemb.checkpoint.state_dict import SLOTS_ENV

ADAM, SGD = D.OPTIMIZERS["adam"], D.OPTIMIZERS["sgd"]


def _refused(fn, *args, **kwargs) -> str:
    """The message of the error fn raises ("" if it returns)."""
    try:
        fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the message is the result (DCP raises a BaseException)
        return f"{type(e).__name__}: {e}"
    return ""


def _load_refused(model, path, pg, load=None) -> dict:
    """A refused load (D.load of path, or `load`) leaves the model as it was."""
    before = H.entries(model)
    msg = _refused(D.load, model, path, pg) if load is None else _refused(load)
    after = H.entries(model)
    unchanged = all(torch.equal(before[t][c], after[t][c]) for t in H.TABLES for c in ("keys", "values", "state"))
    return dict(msg=msg, unchanged=unchanged and before["_modules"] == after["_modules"])


def _scenarios(rank, world, root):
    pg = dist.GroupMember.WORLD
    path = os.path.join(root, "ckpt")
    res = {}
    a = D.build(pg, ADAM)
    H.train(a, pg, [1, 2, 3])
    D.save(a, path, pg)
    want = H.gathered_entries(a, pg)
    res["copied_ns"] = H.now_ns()
    snapshot = copy.deepcopy(a.state_dict())  # this rank's slots, now

    other_dim = D.build(pg, ADAM, dims={"t_hash": 16})
    H.train(other_dim, pg, [9])
    res["dim"] = _load_refused(other_dim, path, pg)
    other_opt = D.build(pg, SGD)
    H.train(other_opt, pg, [9])
    res["optimizer"] = _load_refused(other_opt, path, pg)

    # Keys that pass the capacity check but not one bucket of 16 slots: the
    # last phase's error, a CheckpointError naming the table on every rank.
    big = D.build(pg, ADAM)
    H.train(big, pg, range(10, 40))
    D.save(big, os.path.join(root, "big"), pg)
    n = torch.tensor(H.entries(big)["t_hash"]["keys"].numel())
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=pg)
    tight = D.build(pg, ADAM, t_hash=dict(bucket_capacity=16, max_capacity=-(-int(n) // 16) * 16))
    res["bucket_overflow"] = dict(msg=_refused(D.load, tight, os.path.join(root, "big"), pg), keys=int(n))

    # A key given twice (one slot on rank 0 tampered with): refused on every
    # rank, naming the table and the key, before any row is loaded.
    import torch.distributed.checkpoint as dcp
    dup = D.build(pg, ADAM)
    H.train(dup, pg, [9])
    sd = dup.state_dict()
    dcp.load(sd, checkpoint_id=path, process_group=pg)
    if rank == 0:
        k = next(k for k, v in sd.items() if k.startswith("ebc.embedding_bags.t_hash.dynamicemb.") and
                 v["keys"].numel())
        res["twice_key"] = int(sd[k]["keys"][0])
        for c in ("keys", "values", "optimizer_state", "scores"):
            sd[k][c] = torch.cat([sd[k][c], sd[k][c][:1]])
    res["twice"] = _load_refused(dup, path, pg, load=lambda: dup.load_state_dict(sd))

    os.environ[SLOTS_ENV] = "64"  # the save used the default (128)
    res["slots"] = _load_refused(D.build(pg, ADAM), path, pg)
    del os.environ[SLOTS_ENV]

    b = D.build(pg, ADAM)
    H.train(b, pg, [9])
    sd = b.state_dict()
    import torch.distributed.checkpoint as dcp
    dcp.load(sd, checkpoint_id=path, process_group=pg)
    if rank == 0:
        del sd[next(k for k in sd if k.startswith("ebc.embedding_bags.t_rr.dynamicemb."))]
    before = H.entries(b)
    res["partial"] = dict(msg=_refused(b.load_state_dict, sd),
                          unchanged=torch.equal(before["t_rr"]["values"], H.entries(b)["t_rr"]["values"]))

    res["torch.save"] = _refused(torch.save, a.state_dict(), io.BytesIO())
    res["pickle"] = _refused(pickle.dumps, a.state_dict())
    saved = a.state_dict()  # saved by DCP first: its entries still refuse torch.save after
    dcp.save(saved, checkpoint_id=os.path.join(root, "again"), process_group=pg)
    res["torch.save after dcp.save"] = _refused(torch.save, saved, io.BytesIO())
    # Without the tables' entries: missing keys (strict=False), an error (strict=True).
    dense_only = {k: v for k, v in b.state_dict().items() if ".dynamicemb." not in k}
    res["missing"] = [k for k in b.load_state_dict(dense_only, strict=False).missing_keys if "dynamicemb" in k]
    res["strict"] = _refused(b.load_state_dict, dense_only)

    H.train(a, pg, [4])  # the deep copy keeps the rows of before
    c = D.build(pg, ADAM)
    res["deepcopy"] = repr(c.load_state_dict(snapshot))
    res["loaded_ns"] = H.now_ns()
    res["deepcopy_entries"] = H.gathered_entries(c, pg)
    res["want"] = want

    os.environ[SLOTS_ENV] = "1"  # fewer slots than ranks
    res["few_slots"] = _refused(D.save, a, os.path.join(root, "few"), pg)
    del os.environ[SLOTS_ENV]

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "storage"))
    from dense_storage import TrainingOnlyStorage
    m = next(m for m in H.dynamic_modules(a) if "t_seq" in m.table_names)
    widths = [w.shape[1] - o.dim for w, o in zip(m.storage.weights(), m.table_options)]
    m.storage = TrainingOnlyStorage(m.table_names, m.table_options, widths, m.embedding_dtype, seed=m.seed)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a.state_dict()
    res["user_storage_warning"] = [str(w.message) for w in caught if "checkpoint protocol" in str(w.message)]
    res["user_storage"] = _refused(D.save, a, os.path.join(root, "user"), pg)
    return res


@pytest.fixture(scope="module")
def ranks():
    return H.run_in_scratch("dynamicemb-dcp-refusals-", _scenarios, 2)


def test_a_key_given_twice_is_refused_on_every_rank(ranks):
    key = ranks[0]["twice_key"]
    for r in ranks:
        assert r["twice"]["unchanged"]
        assert re.search(rf"CheckpointError: table 't_hash': 1 of the \d+ keys of the state dict .*\(key {key}, "
                         rf"2 times\)", r["twice"]["msg"]), r["twice"]["msg"]


def test_a_table_of_another_dim_is_refused_by_name(ranks):
    for r in ranks:  # on every rank, the model unchanged
        assert "table 't_hash'" in r["dim"]["msg"] and "dim is 8" in r["dim"]["msg"], r["dim"]["msg"]
        assert r["dim"]["unchanged"]


def test_a_table_of_another_optimizer_is_refused_by_name(ranks):
    for r in ranks:
        msg = r["optimizer"]["msg"]
        assert "CheckpointError" in msg and "table 't_" in msg and "optimizer" in msg, msg
        assert r["optimizer"]["unchanged"]


def test_keys_that_overflow_a_bucket_at_load_raise_a_checkpoint_error_by_name(ranks):
    """What the checks before any change cannot see raises in the last phase:
    a CheckpointError naming the table on every rank, saying the tables are
    partly loaded (it was the storage's bare RuntimeError)."""
    for r in ranks:
        msg = r["bucket_overflow"]["msg"]
        assert r["bucket_overflow"]["keys"] > 64, r["bucket_overflow"]  # enough keys to overflow a bucket of 16
        assert msg.startswith("CheckpointError: ") and "table 't_hash'" in msg and "partly loaded" in msg, msg


def test_another_slot_count_is_refused(ranks):
    for r in ranks:
        msg = r["slots"]["msg"]
        assert "table 't_" in msg and "of 128" in msg and SLOTS_ENV in msg, msg


def test_a_state_dict_missing_slots_is_refused_on_every_rank(ranks):
    for r in ranks:
        msg = r["partial"]["msg"]
        assert "CheckpointError" in msg and "table 't_rr'" in msg and "absent" in msg, msg
        assert r["partial"]["unchanged"]


@pytest.mark.parametrize("how", ["torch.save", "pickle", "torch.save after dcp.save"])
def test_torch_save_of_the_state_dict_refuses_naming_the_tables(ranks, how):
    msg = ranks[0][how]  # (the first entry pickled is of the EBC: its tables)
    assert msg.startswith("TypeError") and all(f"'{t}'" in msg for t in H.BAG_TABLES), msg
    assert "DynamicEmbDump" in msg and "torch.distributed.checkpoint" in msg, msg


def test_a_state_dict_without_the_tables_reports_them_missing(ranks):
    for r in ranks:
        assert sorted(r["missing"]) == sorted(f"{'embedding_bags' if t in H.BAG_TABLES else 'embeddings'}."
                                              f"{t}.dynamicemb" for t in H.TABLES), r["missing"]
        assert "Missing key(s)" in r["strict"] and "t_hash.dynamicemb" in r["strict"], r["strict"]


def test_a_deep_copy_of_the_state_dict_is_a_snapshot_that_loads(ranks):
    r = ranks[0]
    assert r["deepcopy"] == "<All keys matched successfully>"
    H.assert_same_entries(r["want"], r["deepcopy_entries"], min(x["copied_ns"] for x in ranks),
                          max(x["loaded_ns"] for x in ranks))  # each rank copies and loads its own rows


def test_more_ranks_than_slots_is_refused_at_save(ranks):
    for r in ranks:
        msg = r["few_slots"]
        assert "2 ranks, more than the 1 state-dict slots" in msg and SLOTS_ENV in msg and "DynamicEmbDump" in msg, msg


def test_a_storage_without_the_checkpoint_protocol_warns_and_is_refused_at_save(ranks):
    for r in ranks:
        assert r["user_storage_warning"] and "'t_seq'" in r["user_storage_warning"][0]
        msg = r["user_storage"]
        assert "'t_seq'" in msg and "checkpoint protocol" in msg and "export_rows" in msg, msg


def test_state_dict_of_an_unsharded_module_warns_naming_its_tables():
    m = H.plain_module()
    with pytest.warns(RuntimeWarning, match=r"\['a', 'b'\].*DynamicEmbDump"):
        sd = m.state_dict()
    assert not any("dynamicemb" in k for k in sd)
