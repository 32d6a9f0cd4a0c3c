"""Serving from a torch.distributed.checkpoint of model.state_dict(): the
checkpoint's dynamic tables frozen in one process (from_dump given the DCP
directory, no process group) hold exactly what a DynamicEmbDump of the same
trained 2-rank model holds (keys, rows, features, pooling, eval initializer,
seed), and answer a batch of stored and never-seen keys as the frozen dump
does. Refused with the table named: a table the checkpoint lacks, a slot
missing, and a checkpoint without dynamic tables."""
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

import ckpt_helpers as H
import dcp_helpers as D
from dynamicemb import DynamicEmbDump
from dynamicemb.checkpoint import CheckpointError
from dynamicemb.inference import InferenceEmbeddingTable
from dynamicemb.inference.sources import dcp_tables, dump_tables


def _save_both(rank, world, root):
    import torch.distributed.checkpoint as dcp

    pg = dist.GroupMember.WORLD
    model = D.build(pg, D.OPTIMIZERS["adam"])
    H.train(model, pg, [1, 2, 3])
    dcp.save({"model": model.state_dict(), "extra": torch.ones(3)}, checkpoint_id=os.path.join(root, "dcp"),
             process_group=pg)
    DynamicEmbDump(os.path.join(root, "dump"), model, pg=pg)
    dcp.save({"dense": torch.ones(2)}, checkpoint_id=os.path.join(root, "dense_only"), process_group=pg)
    return True


@pytest.fixture(scope="module")
def saved():
    with H.scratch_dir("dynamicemb-from-dcp-") as root:
        H.run_ranks(_save_both, 2, root)
        yield root


def _sorted(frozen):
    order = frozen.keys.argsort()
    return frozen.keys[order], frozen.values[order]


def test_a_dcp_checkpoint_freezes_as_the_dump_of_the_same_model(saved):
    from_dcp = dcp_tables(os.path.join(saved, "dcp"))
    from_dump = dump_tables(os.path.join(saved, "dump"))
    assert sorted(from_dcp) == sorted(from_dump) == sorted(H.TABLES)
    for name, want in from_dump.items():
        got = from_dcp[name]
        assert (got["pooling"], got["seed"]) == (want["pooling"], want["seed"])
        g, w = got["table"], want["table"]
        assert (g.feature_names, g.eval_init) == (w.feature_names, w.eval_init)
        gk, gv = _sorted(g)
        wk, wv = _sorted(w)
        assert gk.numel() > 0 and torch.equal(gk, wk) and torch.equal(gv, wv), name


def test_from_dump_serves_a_dcp_checkpoint(saved):
    names = list(H.BAG_TABLES)  # pooled tables, one feature each
    a = InferenceEmbeddingTable.from_dump(os.path.join(saved, "dcp"), table_names=names)
    b = InferenceEmbeddingTable.from_dump(os.path.join(saved, "dump"), table_names=names)
    stored = {n: _sorted(dump_tables(os.path.join(saved, "dump"), [n])[n]["table"])[0] for n in names}
    ids, offsets = [], [0]
    for n in names:  # per feature 4 bags: stored keys, never-seen keys, both, none
        k = stored[n]
        for bag in (k[:3], torch.tensor([-5, 10**12]), torch.cat([k[3:5], torch.tensor([77777])]), k[:0]):
            ids.append(bag)
            offsets.append(offsets[-1] + bag.numel())
    ids, offsets = torch.cat(ids), torch.tensor(offsets)
    assert torch.equal(a(ids, offsets), b(ids, offsets))


def test_dcp_sources_are_refused_by_table(saved, tmp_path):
    with pytest.raises(CheckpointError, match="table 'nope'.*has no such table"):
        dcp_tables(os.path.join(saved, "dcp"), ["nope"])
    with pytest.raises(CheckpointError, match="no dynamic table"):
        InferenceEmbeddingTable.from_dump(os.path.join(saved, "dense_only"))
    # A slot's entry dropped from the checkpoint's metadata: that table is refused, naming the slot.
    partial = str(tmp_path / "partial")
    shutil.copytree(os.path.join(saved, "dcp"), partial)
    md = FileSystemReader(partial).read_metadata()
    name = next(iter(H.BAG_TABLES))
    gone = next(k for k in md.state_dict_metadata if k.endswith(f".{name}.dynamicemb.slot5"))
    del md.state_dict_metadata[gone]
    with open(os.path.join(partial, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match=rf"table '{name}'.*slots \[5\] of 128 are absent"):
        dcp_tables(partial, [name])
