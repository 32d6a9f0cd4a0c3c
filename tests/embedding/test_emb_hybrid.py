"""A hybrid table (table_rows.py): rows past a table's share of
global_hbm_for_values live in a second part (host memory on CUDA; on the CPU
a second tensor), which every kernel addresses through one rule
(csrc/embedding/row_parts.h). A module whose tables are split trains, reads,
evicts, grows, exports and loads exactly like the same module with its rows
whole: outputs, rows, optimizer state and scores bit for bit."""
import pytest
import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EmbOptimType,
    get_table_value_bytes,
)
from emb_helpers import random_batch

ROWS_WHOLE = True  # conftest.py: this module makes its own splits
DIMS = [8, 4, 12]
FEATURE_TABLE = [0, 1, 2, 0]
NUM_KEYS = [900, 400, 2000]  # table 2 evicts at its max capacity
MAX_CAP = [1024, 512, 256]


def _module(optimizer, strategy, pooling, head_rows, device):
    """head_rows[t]: rows of table t in its first part (None: whole)."""
    opts = []
    for d, cap, h in zip(DIMS, MAX_CAP, head_rows):
        row = get_table_value_bytes(1, d, optimizer=optimizer)
        opts.append(DynamicEmbTableOptions(
            dim=d, init_capacity=64, max_capacity=cap, bucket_capacity=16, score_strategy=strategy,
            global_hbm_for_values=0 if h is None else max(1, h * row),  # 1 byte: no row in the first part
            initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)))
    return BatchedDynamicEmbeddingTables(opts, table_names=["a_table", "b_table", "c_table"],
                                         feature_table_map=FEATURE_TABLE, pooling_mode=pooling, optimizer=optimizer,
                                         learning_rate=0.05, device=device, seed=5)


def _rows(module, t):
    """{key: row (values and state)} of table t, read through its parts."""
    out = {}
    for b in module.storage.export_rows(t):
        for k, v, s in zip(b.keys.tolist(), b.values.cpu(), b.optimizer_state.cpu()):
            out[k] = torch.cat([v, s])
    return out


def _same_tables(a, b, scores=True):
    """Same keys and rows; same scores unless they are wall-clock times."""
    for t in range(len(DIMS)):
        ra, rb = _rows(a, t), _rows(b, t)
        assert sorted(ra) == sorted(rb)
        if ra:
            keys = sorted(ra)
            assert torch.equal(torch.stack([ra[k] for k in keys]), torch.stack([rb[k] for k in keys]))
        if not scores:
            continue
        sa = {k: s for keys, _, sc in a.storage.export(t) for k, s in zip(keys.tolist(), sc.tolist())}
        sb = {k: s for keys, _, sc in b.storage.export(t) for k, s in zip(keys.tolist(), sc.tolist())}
        assert sa == sb


HEADS = {"all_host": [0, 0, 0], "split": [100, 37, 130], "mixed": [None, 0, 200], "all_device": [5000, 5000, 5000]}


@pytest.mark.parametrize("heads", list(HEADS), ids=str)
@pytest.mark.parametrize("optimizer,strategy,pooling", [
    (EmbOptimType.ADAM, DynamicEmbScoreStrategy.STEP, DynamicEmbPoolingMode.SUM),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, DynamicEmbScoreStrategy.LFU, DynamicEmbPoolingMode.MEAN),
    (EmbOptimType.EXACT_SGD, DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbPoolingMode.SUM),
], ids=lambda v: getattr(v, "name", None))
def test_hybrid_trains_like_whole(heads, optimizer, strategy, pooling, device):
    head_rows = HEADS[heads]
    whole = _module(optimizer, strategy, pooling, [None] * 3, device)
    hybrid = _module(optimizer, strategy, pooling, head_rows, device)
    gen = torch.Generator().manual_seed(7)
    for step in range(12):
        indices, offsets = random_batch(gen, FEATURE_TABLE, NUM_KEYS, batch=24, max_len=8, device=device)
        outs = [m(indices, offsets) for m in (whole, hybrid)]
        assert torch.equal(outs[0], outs[1])
        probe = torch.randn(outs[0].shape, generator=gen).to(device)
        for out in outs:
            (out * probe).sum().backward()
    stats = hybrid.table_stats()
    for t, (name, h) in enumerate(zip(["a_table", "b_table", "c_table"], head_rows)):
        s, cap = stats[name], stats[name]["capacity"]
        if h is None:
            assert "device_rows" not in s
            continue
        split = min(cap, h)
        assert s["device_capacity"] == split and s["device_rows"] + s["host_rows"] == s["size"]
        rows = hybrid.storage.find(torch.tensor(sorted(_rows(hybrid, t)), device=device),
                                   torch.full((s["size"],), t, device=device))
        assert s["device_rows"] == int((rows < split).sum())
        assert (hybrid.storage.rows_of(t).tail is not None) == (cap > split)
    assert whole.table_stats()["c_table"]["evicted"] > 0
    assert [s["capacity"] for s in stats.values()] == [s["capacity"] for s in whole.table_stats().values()]
    assert max(s["capacity"] for s in stats.values()) > 64  # grew: rows moved between the parts
    if any(h is not None and h < 5000 for h in head_rows):
        assert len(hybrid.storage.weights()) == 2 * len(DIMS)  # heads, then tails
    _same_tables(whole, hybrid, scores=strategy != DynamicEmbScoreStrategy.TIMESTAMP)
    # Eval: the fused lookup (emb_lookup_forward) reads both parts.
    whole.eval(), hybrid.eval()
    indices, offsets = random_batch(gen, FEATURE_TABLE, NUM_KEYS, batch=24, max_len=8, device=device)
    assert torch.equal(whole(indices, offsets), hybrid(indices, offsets))


@pytest.mark.parametrize("heads", ["all_host", "split"], ids=str)
def test_hybrid_loads_inserts_and_clears_like_whole(heads, device):
    """export_rows -> load_rows, insert_rows and clear_table write both parts."""
    opt, strat, pool = EmbOptimType.ADAM, DynamicEmbScoreStrategy.STEP, DynamicEmbPoolingMode.SUM
    src = _module(opt, strat, pool, [None] * 3, device)
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        out = src(*random_batch(gen, FEATURE_TABLE, NUM_KEYS, batch=24, max_len=8, device=device))
        out.sum().backward()
    whole, hybrid = (_module(opt, strat, pool, h, device) for h in ([None] * 3, HEADS[heads]))
    for m in (whole, hybrid):
        for t in range(len(DIMS)):
            for b in src.storage.export_rows(t):
                m.storage.load_rows(t, b)
    _same_tables(src, hybrid)
    _same_tables(whole, hybrid)
    keys = torch.arange(10_000, 10_050, device=device)
    values = torch.randn(50, DIMS[1], generator=gen).to(device)
    state = torch.randn(50, 2 * DIMS[1], generator=gen).to(device)
    for m in (whole, hybrid):
        m.storage.insert_rows(1, keys, values, state)
        m.storage.insert_rows(0, keys[:20], values[:20, :1].expand(20, DIMS[0]).contiguous())
    _same_tables(whole, hybrid)
    for m in (whole, hybrid):
        m.storage.clear_table(2)
    _same_tables(whole, hybrid)
    indices, offsets = random_batch(gen, FEATURE_TABLE, NUM_KEYS, batch=24, max_len=8, device=device)
    assert torch.equal(whole(indices, offsets), hybrid(indices, offsets))


def test_kernels_refuse_parts_that_disagree():
    """The kernels' list: T tensors or 2T (heads, then tails of the same width)."""
    from dynamicemb._ops import ops
    head, tail = torch.zeros(4, 8), torch.zeros(4, 6)
    init = _module(EmbOptimType.EXACT_SGD, DynamicEmbScoreStrategy.STEP, DynamicEmbPoolingMode.SUM,
                   [None] * 3, "cpu").storage.init_params[:1]
    rows, tids, keys = torch.tensor([5]), torch.tensor([0]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="table 0: its tail rows"):
        ops.emb_init_rows([head, tail], rows, tids, keys, [8], init, 0)
    with pytest.raises(RuntimeError, match="3 weight tensors for 1 tables"):
        ops.emb_init_rows([head, head, head], rows, tids, keys, [8], init, 0)
    with pytest.raises(RuntimeError, match="row 8 of table 0 is out of range"):
        ops.emb_init_rows([head, torch.zeros(4, 8)], torch.tensor([8]), tids, keys, [8], init, 0)
    whole = torch.zeros(8, 8)
    ops.emb_init_rows([whole], torch.tensor([1, 6]), torch.tensor([0, 0]), torch.tensor([1, 2]), [8], init, 0)
    parts = [torch.zeros(4, 8), torch.zeros(4, 8)]
    ops.emb_init_rows(parts, torch.tensor([1, 6]), torch.tensor([0, 0]), torch.tensor([1, 2]), [8], init, 0)
    assert torch.equal(torch.cat(parts), whole) and bool(whole[6].ne(0).any())
