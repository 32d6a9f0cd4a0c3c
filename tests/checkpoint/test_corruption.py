"""Damaged checkpoints and checkpoints of another model are refused with a
CheckpointError naming the table and the file, before any row is loaded (a
damaged *last* file leaves the model unchanged); optim=False loads values
into a model with another optimizer."""
import json
import os
import shutil

import pytest
import torch

import ckpt_helpers as H
from dynamicemb import EmbOptimType
from dynamicemb.checkpoint import CheckpointError, DynamicEmbDump, DynamicEmbLoad
from dynamicemb.checkpoint.format import write_manifest


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """(path, entries) of a trained Adam module dumped in several parts."""
    m = H.plain_module()
    H.plain_train(m, [1, 2, 3])
    path = str(tmp_path_factory.mktemp("corruption") / "ckpt")
    DynamicEmbDump(path, m, chunk_rows=64)
    return path, H.entries(m)


@pytest.fixture
def copy(dumped, tmp_path):
    path = str(tmp_path / "copy")
    shutil.copytree(dumped[0], path)
    return path


def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _last_file(path):
    """The last file a load reads (table 'b' is loaded last), and its absolute path."""
    entries = _manifest(path)["tables"]["b"]["files"]
    assert len(entries) >= 2
    return entries[-1]["file"], os.path.join(path, entries[-1]["file"])


def _refused_unchanged(path, match):
    """The load is refused before any row changes: a trained model stays as it was."""
    m = H.plain_module()
    H.plain_train(m, [7, 8])
    before = H.entries(m)
    with pytest.raises(CheckpointError, match=match):
        DynamicEmbLoad(path, m)
    after = H.entries(m)
    assert before["_modules"] == after["_modules"]
    for t in ("a", "b"):
        for k, v in before[t].items():
            assert v is None and after[t][k] is None or torch.equal(v, after[t][k]), f"{t}.{k} changed"


def test_truncated_file(copy):
    rel, full = _last_file(copy)
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) - 5)
    _refused_unchanged(copy, r"table 'b'.*" + rel + ".*(truncated|bytes)")


def test_flipped_byte(copy):
    rel, full = _last_file(copy)
    with open(full, "r+b") as f:
        f.seek(os.path.getsize(full) - 3)  # in the tensor data: the header still parses
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    _refused_unchanged(copy, r"table 'b'.*" + rel + ".*checksum")


def test_missing_file(copy):
    rel, full = _last_file(copy)
    os.remove(full)
    _refused_unchanged(copy, r"table 'b'.*" + rel + ".*missing")


def test_missing_or_invalid_manifest(copy):
    with open(os.path.join(copy, "manifest.json"), "a") as f:
        f.write("}")
    with pytest.raises(CheckpointError, match="manifest.json.*not valid JSON"):
        DynamicEmbLoad(copy, H.plain_module())
    os.remove(os.path.join(copy, "manifest.json"))
    with pytest.raises(CheckpointError, match="no manifest.json"):
        DynamicEmbLoad(copy, H.plain_module())


@pytest.mark.parametrize("old, new", [('"optimizer_step": 3', '"optimizer_step": 7'), ('"step": 3', '"step": 2')])
def test_a_changed_manifest_is_refused(copy, old, new):
    """One digit of the manifest changed (a flipped bit turns 3 into 7): the
    load would restore another step; its checksum refuses it."""
    path = os.path.join(copy, "manifest.json")
    text = open(path).read()
    assert text.count(old) >= 1, text[:400]
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))
    _refused_unchanged(copy, r"manifest.json: checksum mismatch")



@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("tables"), r"the manifest field 'tables' is missing"),
    (lambda m: m["tables"]["a"].pop("files"), r"table 'a' field 'files' is missing"),
    (lambda m: m["tables"]["b"]["files"][0].__setitem__("bytes", "12"), r"table 'b' file 0 field 'bytes' is str"),
])
def test_a_manifest_without_its_checksum_is_still_checked_for_its_fields(copy, edit, message):
    """A manifest of a dump written before the checksum loads unchecked: one
    missing a field the loader reads is refused by name, not by a KeyError."""
    import json
    path = os.path.join(copy, "manifest.json")
    manifest = json.load(open(path))
    manifest.pop("manifest_crc32")
    edit(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)
    _refused_unchanged(copy, r"manifest.json: " + message)


@pytest.mark.parametrize("model, message", [
    (lambda: H.plain_module(dims=(8, 6)), r"table 'b' in .*manifest.json: dim is 4, the model's is 6"),
    (lambda: H.plain_module(optimizer=EmbOptimType.EXACT_ADAGRAD), r"table 'a' in .*manifest.json: optimizer ADAM "
                                                                   r"\(state width 16\) does not match the model's "
                                                                   r"EXACT_ADAGRAD \(state width 8\)"),
    (lambda: H.plain_module(training=False), r"table 'a' in .*manifest.json: the model's table keeps no optimizer "
                                             r"state \(training=False\); load with optim=False"),
    (lambda: H.plain_module(optimizer=EmbOptimType.EXACT_SGD), r"table 'a' in .*manifest.json: optimizer ADAM "
                                                               r"\(state width 16\) does not match the model's "
                                                               r"EXACT_SGD \(state width 0\)"),
    (lambda: H.plain_module(dist_type="roundrobin"), r"table 'a' in .*manifest.json: dist_type is 'hash_roundrobin'"),
    (lambda: H.plain_module(strategies=(H.S.STEP, H.S.TIMESTAMP)), r"table 'b' in .*manifest.json: score strategy LFU does not match the model's TIMESTAMP"),
    (lambda: H.plain_module(names=("a", "c")), r"table 'c': .*manifest.json has no table 'c'"),
    (lambda: H.plain_module(embedding_dtype=torch.float16), r"table 'a' in .*manifest.json: dtype is 'float32', "
                                                             r"the model's is 'float16'"),
], ids=["dim", "optimizer", "training_false", "sgd", "dist_type", "score_strategy", "missing_table", "dtype"])
def test_manifest_of_another_model(dumped, model, message):
    m = model()
    with pytest.raises(CheckpointError, match=message):
        DynamicEmbLoad(dumped[0], m)
    # Refused before any row is loaded: the model is as it was (empty).
    assert all(m.storage.size(t) == 0 for t in range(m.num_tables))


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD])
def test_optim_false_loads_values_into_another_optimizer(dumped, optimizer):
    path, want = dumped
    m = H.plain_module(optimizer=optimizer)
    DynamicEmbLoad(path, m, optim=False)
    # Values and scores as dumped, optimizer state zero, Adam's step count not carried over.
    H.assert_same_entries([want], [H.entries(m)], optim=False, dist_types=H.PLAIN_DIST)
    assert (m.step, m.optimizer_step) == (3, 0)


def test_dump_without_optimizer_state(dumped, tmp_path):
    """optim=False dumps values only: loading them with optim=True is refused."""
    m = H.plain_module()
    H.plain_train(m, [1, 2, 3])
    DynamicEmbDump(str(tmp_path / "values"), m, optim=False)
    with pytest.raises(CheckpointError, match=r"table 'a'.*no optimizer state.*optim=False"):
        DynamicEmbLoad(str(tmp_path / "values"), H.plain_module())
    fresh = H.plain_module(optimizer=EmbOptimType.EXACT_SGD)
    DynamicEmbLoad(str(tmp_path / "values"), fresh, optim=False)
    H.assert_same_entries([H.entries(m)], [H.entries(fresh)], optim=False, dist_types=H.PLAIN_DIST)


def _rewrite(path, rel, change):
    """Rewrites one file of the dump with change(tensors) and fixes its size
    and checksum in the manifest: only the tensors disagree with it."""
    from dynamicemb.checkpoint.format import read_part, write_part
    m = _manifest(path)
    entry = next(e for t in m["tables"].values() for e in t["files"] if e["file"] == rel)
    tensors = change({k: v.clone() for k, v in read_part(path, entry, "b").items()})  # not the mmapped file
    new = write_part(path, rel, tensors)
    entry.update(bytes=new["bytes"], crc32=new["crc32"])
    write_manifest(path, m)  # (its own checksum updated too)


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "values": t["values"].double()}, r"tensor 'values' is F64 of shape \[\d+, 4\], the manifest "
                                                      r"implies F32"),
    (lambda t: {**t, "values": t["values"][:, :3].contiguous()}, r"tensor 'values' is F32 of shape \[\d+, 3\]"),
    (lambda t: {k: v[:-1] for k, v in t.items()}, r"tensor 'keys' is I64 of shape \[\d+\], the manifest implies "
                                                  r"I64 of shape"),
    (lambda t: {k: v for k, v in t.items() if k != "optimizer_state"}, r"holds tensors .* the manifest implies"),
], ids=["values_dtype", "values_width", "rows", "no_optimizer_state"])
def test_files_that_do_not_match_the_manifest(copy, change, message):
    rel, _ = _last_file(copy)
    _rewrite(copy, rel, change)
    _refused_unchanged(copy, r"table 'b': file .*" + rel + ".*" + message)


def test_rows_per_rank_that_do_not_match_the_files(copy):
    m = _manifest(copy)
    m["tables"]["b"]["rows_per_rank"][0] += 1
    write_manifest(copy, m)
    _refused_unchanged(copy, r"table 'b' in .*manifest.json: the part files hold \[\d+\] rows per rank, "
                             r"rows_per_rank says")


def test_a_dumped_table_the_model_lacks_is_refused_unless_left_out_by_name(dumped):
    """A dump of tables a and b loaded into a model of table a alone: b's rows
    would be dropped unsaid. Refused by name; table_names=["a"] loads a."""
    path, want = dumped
    m = H.plain_module(dims=(8,), strategies=(H.S.STEP,), names=("a",))
    with pytest.raises(CheckpointError, match=r"holds tables \['b'\] that the model has no dynamic table for; "
                                              r"name the tables to load \(table_names=\['a'\]\)"):
        DynamicEmbLoad(path, m)
    assert m.storage.size(0) == 0
    DynamicEmbLoad(path, m, table_names=["a"])
    got = H.entries(m)
    assert sorted(got["a"]["keys"].tolist()) == sorted(want["a"]["keys"].tolist())


def test_a_load_of_some_tables_keeps_the_step_counters_of_the_others(dumped):
    """The module's step counters serve all its tables. Loading table a of a
    3-step dump into a module trained 5 steps would set them back for table b,
    which holds keys: refused, the model unchanged. Into a module whose b is
    empty, the counters are the dump's."""
    path, _ = dumped
    trained = H.plain_module()
    H.plain_train(trained, [4, 5, 6, 7, 8])
    before = H.entries(trained)
    with pytest.raises(CheckpointError, match=r"tables \['a'\] share their step counters .* with tables \['b'\] .* "
                                              r"from \(5, 5\) to \(3, 3\)"):
        DynamicEmbLoad(path, trained, table_names=["a"])
    assert (trained.step, trained.optimizer_step) == (5, 5)
    assert torch.equal(H.entries(trained)["a"]["values"], before["a"]["values"])
    fresh = H.plain_module()
    DynamicEmbLoad(path, fresh, table_names=["a"])
    assert (fresh.step, fresh.optimizer_step) == (3, 3)


def test_optim_false_restarts_the_update_count_of_a_trained_model(dumped):
    """optim=False zeroes the optimizer state, so Adam's update count restarts
    with it, whatever the model held before: the next step equals that of a
    fresh model loaded the same way (it kept the trained model's count)."""
    path, _ = dumped
    trained, fresh = H.plain_module(), H.plain_module()
    H.plain_train(trained, [4, 5, 6, 7, 8])
    for m in (trained, fresh):
        DynamicEmbLoad(path, m, optim=False)
        assert (m.step, m.optimizer_step) == (3, 0)
        H.plain_train(m, [9])
    a, b = H.entries(trained), H.entries(fresh)
    for t in ("a", "b"):
        rows = [dict(zip(e[t]["keys"].tolist(), e[t]["values"])) for e in (a, b)]
        assert rows[0].keys() == rows[1].keys() and all(torch.equal(rows[0][k], rows[1][k]) for k in rows[0])
