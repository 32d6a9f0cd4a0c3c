"""With a small chunk_rows a table's shard spans several part files, each a
standard safetensors file (readable without dynamicemb) holding keys,
values, optimizer_state and scores; the dump still round-trips."""
import json
import os

import torch
from safetensors.torch import load_file

import ckpt_helpers as H
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad



def test_small_chunks_round_trip(tmp_path):
    m = H.plain_module(strategies=(H.S.STEP, (H.S.TIMESTAMP, H.S.LFU)))
    H.plain_train(m, [1, 2, 3])
    want = H.entries(m)
    path = str(tmp_path / "ckpt")
    DynamicEmbDump(path, m, chunk_rows=7)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    for t, name in enumerate(["a", "b"]):
        files = manifest["tables"][name]["files"]
        assert len(files) > 2, f"{name}: {len(files)} part files"
        keys = []
        for entry in files:
            part = load_file(os.path.join(path, entry["file"]))
            assert {"keys", "values", "optimizer_state", "scores"} <= set(part)
            n = part["keys"].numel()
            assert 0 < n <= 7 and entry["rows"] == n
            assert part["values"].shape == (n, m.dims[t]) and part["optimizer_state"].shape == (n, 2 * m.dims[t])
            assert part["scores"].shape == (n,) and part["scores"].dtype == torch.int64
            keys += part["keys"].tolist()
        # The parts partition the table: every key once.
        assert sorted(keys) == want[name]["keys"].tolist()
        assert manifest["tables"][name]["rows_per_rank"] == [len(keys)]
    fresh = H.plain_module(strategies=(H.S.STEP, (H.S.TIMESTAMP, H.S.LFU)))
    DynamicEmbLoad(path, fresh)
    # Table b's access times are clock readings, stored as ages with the
    # dump's clock reading: on the same clock they come back as saved.
    got = H.entries(fresh)
    H.assert_same_entries([want], [got], dist_types={"a": "hash_roundrobin"})
    b, wb = got["b"], want["b"]
    assert torch.equal(b["keys"], wb["keys"]) and torch.equal(b["values"], wb["values"])
    assert torch.equal(b["state"], wb["state"]) and torch.equal(b["scores"], wb["scores"])  # LFU counts
    assert torch.equal(b["ts"], wb["ts"])


def test_dump_streams_rows_in_bounded_blocks(tmp_path, monkeypatch):
    """A part's values and optimizer state are gathered and written block by
    block (RowBlocks.BLOCK_BYTES), never as the whole chunk: the dump's extra
    memory stays bounded by a block, not by chunk_rows. The file still holds
    exactly the table's rows."""
    from dynamicemb.storage import RowBlocks

    m = H.plain_module(dims=(8, 4))
    H.plain_train(m, [1, 2, 3, 4])
    want = H.entries(m)
    monkeypatch.setattr(RowBlocks, "BLOCK_BYTES", 64)  # 2 fp32 rows of dim 8, 4 of dim 4
    sizes = []
    real_blocks = RowBlocks.blocks

    def recorded(self):
        for b in real_blocks(self):
            sizes.append(b.numel() * b.element_size())
            yield b

    monkeypatch.setattr(RowBlocks, "blocks", recorded)
    path = str(tmp_path / "ckpt")
    DynamicEmbDump(path, m)  # one chunk per table (chunk_rows >> rows)
    rows = sum(want[n]["keys"].numel() for n in ("a", "b"))
    assert len(sizes) > rows // 4 and 0 < max(sizes) <= 64, sizes
    for name in ("a", "b"):
        (entry,) = json.load(open(os.path.join(path, "manifest.json")))["tables"][name]["files"]
        part = load_file(os.path.join(path, entry["file"]))
        order = part["keys"].argsort()
        assert torch.equal(part["keys"][order], want[name]["keys"])
        assert torch.equal(part["values"][order], want[name]["values"])
        assert torch.equal(part["optimizer_state"][order], want[name]["state"])
