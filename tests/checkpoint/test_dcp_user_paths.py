"""Other ways TorchRec users checkpoint with torch.distributed.checkpoint
(DCP) carry the dynamic tables too (test_dcp_state_dict.py: dcp.save of
model.state_dict()):

- dcp.async_save(model.state_dict()) keeps the tables as they were at the
  call while training goes on, with DCP's checkpoint thread and with its
  checkpoint process (which receives the staged state dict pickled). Each
  save gets a gloo process group of its own, as DCP asks of an asynchronous
  save beside training: the training's collectives on the same group would
  interleave with the save's (a hang, for native tables too). The saved
  model trains two more steps before the save is awaited.
- torch's distributed state-dict API: get_model_state_dict of the model DMP
  wraps (that of DMP itself fails for native tables too: its keys name no
  attribute of DMP), dcp.save / dcp.load, then set_model_state_dict.
- DCP's dcp_to_torch_save: the 2-rank checkpoint made one file (every
  slot of every table), torch.load(weights_only=True) and load_state_dict
  on 1 and on 3 ranks, each rank given the whole file.

Each loaded model must hold exactly the entries read from the hash tables
of the saved one (not through the export that saves use).
"""
import os

import pytest
import torch
import torch.distributed as dist

import ckpt_helpers as H
import dcp_helpers as D

KINDS = ("THREAD", "PROCESS")


def _saves(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    pg = dist.GroupMember.WORLD
    a = D.build(pg, D.OPTIMIZERS["adam"])
    H.train(a, pg, [1, 2, 3])
    res = {}
    for i, kind in enumerate(KINDS):
        path = os.path.join(root, kind)
        want = H.gathered_entries(a, pg)
        saved_ns = H.now_ns()
        fut = dcp.async_save(a.state_dict(), checkpoint_id=path, process_group=dist.new_group(backend="gloo"),
                             async_checkpointer_type=AsyncCheckpointerType[kind])
        H.train(a, pg, [4 + 2 * i, 5 + 2 * i])  # before the save is awaited
        fut.result()
        b = D.build(pg, D.OPTIMIZERS["adam"])
        H.train(b, pg, [9])  # something to replace
        res[kind] = dict(want=want, saved_ns=saved_ns, moved_on=H.gathered_entries(a, pg),
                         incompatible=repr(D.load(b, path, pg)), loaded_ns=H.now_ns(),
                         loaded=H.gathered_entries(b, pg))
    res["dsd"] = _distributed_state_dict(a, pg, os.path.join(root, "dsd"))
    return res


def _distributed_state_dict(a, pg, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    want, saved_ns = H.gathered_entries(a, pg), H.now_ns()
    sd = get_model_state_dict(a.module)
    dynamic = sorted(k for k in sd if ".dynamicemb." in k)
    dcp.save({"model": sd}, checkpoint_id=path, process_group=pg)
    b = D.build(pg, D.OPTIMIZERS["adam"])
    H.train(b, pg, [9])
    state = {"model": get_model_state_dict(b.module)}
    dcp.load(state, checkpoint_id=path, process_group=pg)
    return dict(want=want, saved_ns=saved_ns, dynamic=dynamic,
                of_state_dict=sorted(k for k in a.module.state_dict() if ".dynamicemb." in k),
                incompatible=repr(set_model_state_dict(b.module, state["model"])), loaded_ns=H.now_ns(),
                loaded=H.gathered_entries(b, pg))


@pytest.fixture(scope="module")
def ranks():
    return H.run_in_scratch("dynamicemb-dcp-async-", _saves, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_async_save_keeps_the_tables_of_the_call(ranks, kind):
    runs = [r[kind] for r in ranks]
    r = runs[0]
    assert all(x["incompatible"] == "<All keys matched successfully>" for x in runs)
    # The tables moved on while the save was written ...
    assert any(not torch.equal(r["want"][k][t]["values"], r["moved_on"][k][t]["values"])
               for k in range(len(r["want"])) for t in H.TABLES)
    # ... and the checkpoint holds them as they were at the call.
    H.assert_same_entries(r["want"], r["loaded"], min(x["saved_ns"] for x in runs),
                          max(x["loaded_ns"] for x in runs))


def test_get_and_set_model_state_dict_carry_the_tables(ranks):
    runs = [r["dsd"] for r in ranks]
    r = runs[0]
    for x in runs:  # every rank's entries of every table, as state_dict() names them
        assert x["dynamic"] and x["dynamic"] == x["of_state_dict"]
        assert x["incompatible"] == "<All keys matched successfully>"
    assert {k.split(".")[-3] for k in r["dynamic"]} == set(H.TABLES)
    H.assert_same_entries(r["want"], r["loaded"], min(x["saved_ns"] for x in runs),
                          max(x["loaded_ns"] for x in runs))


def _save_two_ranks(rank, world, path):
    pg = dist.GroupMember.WORLD
    a = D.build(pg, D.OPTIMIZERS["adam"])
    H.train(a, pg, [1, 2, 3])
    want = H.gathered_entries(a, pg)
    saved_ns = H.now_ns()
    D.save(a, path, pg)
    return dict(want=want, saved_ns=saved_ns)


def _load_whole_file(rank, world, path):
    pg = dist.GroupMember.WORLD
    b = D.build(pg, D.OPTIMIZERS["adam"])
    H.train(b, pg, [9])
    state = torch.load(path, weights_only=True)
    return dict(incompatible=repr(b.load_state_dict(state)), loaded_ns=H.now_ns(), loaded=H.gathered_entries(b, pg))


@pytest.fixture(scope="module")
def consolidated():
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with H.scratch_dir("dynamicemb-dcp-whole-") as root:
        saved = H.run_ranks(_save_two_ranks, 2, os.path.join(root, "ckpt"))
        dcp_to_torch_save(os.path.join(root, "ckpt"), os.path.join(root, "whole.pt"))
        return saved, {w: H.run_ranks(_load_whole_file, w, os.path.join(root, "whole.pt")) for w in (1, 3)}


@pytest.mark.parametrize("world", [1, 3])
def test_a_checkpoint_made_one_file_loads_on_any_world_size(consolidated, world):
    saved, loads = consolidated
    runs = loads[world]
    assert all(x["incompatible"] == "<All keys matched successfully>" for x in runs)
    H.assert_same_entries(saved[0]["want"], runs[0]["loaded"], min(x["saved_ns"] for x in saved),
                          max(x["loaded_ns"] for x in runs))
