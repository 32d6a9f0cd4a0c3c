"""The hot-row cache of a served InferenceEmbeddingTable (load(...,
hbm_cache_bytes=N)): a copy of some of each table's rows on the module's
device, read by the lookup op in place of the table's rows (emb_lookup_forward's
hot_weights / hot_pos; the rule is csrc/embedding/hot_rows.h). On CUDA the
table's rows stay in the mapped file, read over the bus; the cached ones are
read from device memory. A cached row is the same bytes as the table's row,
so the cache never changes an answer.

Which rows: `hot_keys` ({table name: keys, hottest first}, e.g. a training
table's highest-scored keys or a traffic sample) where given; otherwise the
table's stored rows in slot order. The saved file holds no scores (a frozen
table's keys are inserted with score 0), and slot order is hash order: an
unbiased sample of the stored keys. The budget is shared among the tables in
proportion to their stored rows' bytes.
"""
from typing import Dict, List, Optional

import torch


def _stored_rows(module, t: int) -> torch.Tensor:
    """Table t's rows that hold a key (its live slots, table-local), in slot order."""
    cap = module.bucket_capacity
    tb = module.table_buckets.tolist()
    return module.slot_digests[tb[t] * cap:tb[t + 1] * cap].ne(0).nonzero().squeeze(1)


def _rows_of_keys(module, t: int, keys: torch.Tensor) -> torch.Tensor:
    """The table-local rows of `keys` (stored ones only, first occurrence, in the given order)."""
    cap = module.bucket_capacity
    tb = module.table_buckets.tolist()
    live = _stored_rows(module, t)
    slot_keys = module.slot_keys[tb[t] * cap:tb[t + 1] * cap][live]
    keys = keys.to(device=slot_keys.device, dtype=torch.int64).reshape(-1)
    if live.numel() == 0 or keys.numel() == 0:
        return live[:0]
    order = slot_keys.argsort()
    sorted_keys, sorted_rows = slot_keys[order], live[order]
    at = torch.searchsorted(sorted_keys, keys).clamp(max=sorted_keys.numel() - 1)
    hit = sorted_keys[at] == keys
    rows = sorted_rows[at[hit]]
    # First occurrence of each row, keeping the given order.
    uniq, inv = torch.unique(rows, return_inverse=True)
    first = torch.full((uniq.numel(),), rows.numel(), dtype=torch.int64, device=rows.device)
    first.scatter_reduce_(0, inv, torch.arange(rows.numel(), device=rows.device), reduce="amin")
    return rows[first.sort().values]


def build(module, hbm_cache_bytes: int, device: torch.device,
          hot_keys: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Registers hot_weight_<i> and hot_pos_<i> on `module` (non-persistent:
    save() never writes them) for a budget of `hbm_cache_bytes` bytes of rows
    (hot_pos adds 4 bytes a slot of a cached table)."""
    if hbm_cache_bytes < 0:
        raise ValueError(f"InferenceEmbeddingTable {module.table_names}: hbm_cache_bytes must be >= 0, got "
                         f"{hbm_cache_bytes}")
    unknown = sorted(set(hot_keys or {}) - set(module.table_names))
    if unknown:
        raise ValueError(f"hot_keys names tables {unknown} that are not among {module.table_names}")
    weights = module.weights()
    cands: List[torch.Tensor] = []
    for t, name in enumerate(module.table_names):
        given = (hot_keys or {}).get(name)
        cands.append(_rows_of_keys(module, t, given) if given is not None else _stored_rows(module, t))
    row_bytes = [w.shape[1] * w.element_size() for w in weights]
    total = sum(c.numel() * b for c, b in zip(cands, row_bytes))
    module.hot_cache = hbm_cache_bytes > 0 and total > 0
    if not module.hot_cache:
        return
    share = min(1.0, hbm_cache_bytes / total)
    for t, (w, rows) in enumerate(zip(weights, cands)):
        k = min(rows.numel(), int(rows.numel() * row_bytes[t] * share) // row_bytes[t])
        if k >= 2**31:
            raise ValueError(f"table {module.table_names[t]!r}: {k} hot rows exceed the cache's int32 positions")
        rows = rows[:k].to(w.device)
        pos = torch.full((w.shape[0],), -1, dtype=torch.int32, device=device) if k else \
            torch.empty(0, dtype=torch.int32, device=device)
        if k:
            pos[rows.to(device)] = torch.arange(k, dtype=torch.int32, device=device)
        hot = w.index_select(0, rows).to(device) if k else w.new_empty((0, w.shape[1])).to(device)
        module.register_buffer(f"hot_weight_{t}", hot, persistent=False)
        module.register_buffer(f"hot_pos_{t}", pos, persistent=False)
