"""CachedStorage's checkpoint, export and accounting methods (a mixin of
tiers/cache.py's CachedStorage, whose state they read): flush and reopen a
persistent store, export and load both tiers' rows, clear, stats, the
eval forward over both tiers, and which keys either tier stores (admission)."""
import itertools
import warnings
from typing import Optional

import torch

from dynamicemb import rules
from dynamicemb._ops import ops
from dynamicemb.positions import where_true
from dynamicemb.storage_protocol import RowBatch
from dynamicemb.types import strategy_name

_T = rules.TierCounter


class CacheCheckpoint:
    """Both tiers as a whole: what eval lookups, admission, checkpoints, exports and stats see."""

    def lookup_forward(self, indices, offsets, feature_table, per_sample_weights, pooling, output_dtype):
        """The eval forward over both tiers, nothing moved: each table's rows
        of the batch's distinct keys (from the cache or read from the store)
        gathered into a small block, then the forward over the blocks."""
        ukeys, utids, inverse, _ = ops.emb_unique(indices, offsets, feature_table, self.num_tables)
        slots = self.find(ukeys, utids)
        local = torch.full_like(ukeys, -1)
        blocks = []
        for t in range(self.num_tables):
            sel = where_true(utids == t)
            w = self._weights[t]
            block = torch.zeros(sel.numel(), w.shape[1], dtype=w.dtype, device=w.device)
            r = slots[sel]
            have = r >= 0
            # A table beside the cached ones may be hybrid: its rows past the head are in its host tail.
            rows = w if self.cached[t] else self.tables.rows_of(t)
            block[have.to(w.device)] = rows.index_select(0, r[have].to(w.device))
            if self.cached[t] and bool((~have).any()):
                miss = where_true(~have)
                found, rows, _ = self.store.read(self.names[t], ukeys[sel][miss].cpu())
                block[miss[found].to(w.device)] = rows[found][:, :w.shape[1]].to(device=w.device, dtype=w.dtype)
                have[miss[found]] = True
            local[sel] = torch.where(have, torch.arange(sel.numel(), device=ukeys.device), -1)
            blocks.append(block)
        return ops.emb_forward(blocks, local, ukeys, inverse, offsets, feature_table, self.dims, per_sample_weights,
                               pooling, self.eval_init_params, self.seed, output_dtype)

    def stored_anywhere(self, g, keys, local_tids, slots):
        """A cached group's keys are stored in its cache or its store (a
        forward's own overflow block is not made yet; those of earlier
        forwards went back to the store before it)."""
        found = self.stored(g, slots) >= 0
        if not self._group_cached[g]:
            return found
        _, tables = self.groups[g]
        for lt, t in enumerate(tables):
            sel = where_true(~found & (local_tids == lt))
            if sel.numel():
                found.index_copy_(0, sel, self.store.contains(self.names[t], keys.index_select(0, sel).cpu())
                                  .to(found.device))
        return found

    def _resume(self, t: int) -> None:
        """A reopened persistent store: the table's CUSTOMIZED score as at its
        last flush, and its clock scores carried to this table's clock (ages
        as at the flush, as a checkpoint load does)."""
        state = self.store.load_state(self.names[t])
        if not state:
            return
        saved, layout = state.get("layout"), self._layout(t)
        if saved is not None and saved != layout:
            raise ValueError(
                f"table {self.names[t]!r}: its backing store holds this rank's rows of the table sharded over "
                f"{saved['num_shards']} ranks by {saved['dist_type']!r}; the table is now sharded over "
                f"{layout['num_shards']} by {layout['dist_type']!r}, so keys would be looked up on ranks that do "
                f"not hold them. Reopen it sharded as before, or move its rows with DynamicEmbDump and "
                f"DynamicEmbLoad (any world size)")
        saved_dim = state.get("dim")
        if saved_dim is not None and int(saved_dim) != self.dims[t]:
            # The row width alone is checked by the store: dim 8 with SGD reads as dim 4 with Adagrad.
            raise ValueError(
                f"table {self.names[t]!r}: its backing store holds rows of dim {saved_dim} (values, then "
                f"optimizer state); the table now has dim {self.dims[t]}, which would read part of each value as "
                f"optimizer state. Reopen it with the same dim and optimizer")
        saved_strategy = state.get("score_strategy")
        if saved_strategy is not None and int(saved_strategy) != self.strategy(t):
            # Scores mean what the strategy says (a clock reading, a step, a count): read under
            # another, every stored row would be evicted too early or never.
            raise ValueError(
                f"table {self.names[t]!r}: its backing store holds rows scored by "
                f"{strategy_name(int(saved_strategy))}; the table is now scored by {strategy_name(self.strategy(t))}, "
                f"which would read those scores as something else (a count as a clock reading, say) and evict "
                f"the wrong rows. Reopen it with the same score_strategy (DynamicEmbLoad refuses the change too)")
        self.custom_scores[t] = int(state.get("custom_score", 0))
        if rules.score_is_clock(self.strategy(t)) and "clock" in state:
            self.store.shift_scores(self.names[t], self.now(t) - int(state["clock"]))
        if self.times.cols[t] and "timestamp_clock" in state:  # access times read against the old clock
            self.times.shift[t] = self.now(t) - int(state["timestamp_clock"])

    def _layout(self, t: int) -> dict:
        """Which of a table's keys this rank's store holds."""
        return {"num_shards": self.options[t].num_shards, "dist_type": self.options[t].dist_type}

    def saved_state(self) -> Optional[dict]:
        for t in range(self.num_tables):
            state = self.store.load_state(self.names[t]) if self.cached[t] else None
            if state:
                return state.get("module")
        return None

    def flush(self, state: Optional[dict] = None) -> None:
        """Writes every cached row back to the store (the cache is then empty)
        and makes the store durable, with `state` (the module's counters) and
        each table's CUSTOMIZED score and clock."""
        self._settle()
        if self._forward_pins:
            cached = [n for n, c in zip(self.names, self.cached) if c]
            warnings.warn(f"dynamicemb: flush() of tables {cached} between a training forward and its backward: "
                          f"the backward's updates of that batch's rows are lost (they leave the cache now); "
                          f"flush between steps", RuntimeWarning, stacklevel=3)
        self._forward_pins.clear()
        self._prefetch_pins.clear()
        lost = {}
        for t in range(self.num_tables):
            if not self.cached[t]:
                continue
            g, lt = self.group_of[t]
            w = self._weights[t]
            ht = self.groups[g][0]
            before = int(self.tier_counters[t, _T.LOST])
            for b in ht.export(table_id=lt):
                ts = ht.slot_timestamps.index_select(0, b.indices) if self.times.cols[t] else None
                self._put(t, b.keys, w.index_select(0, (b.indices - self._cache_begin[t]).to(w.device)), b.scores, ts)
            if int(self.tier_counters[t, _T.LOST]) > before:
                lost[self.names[t]] = int(self.tier_counters[t, _T.LOST]) - before
            self.tables.clear_table(t)
            saved = {"module": state or {}, "custom_score": self.custom_scores[t], "clock": self.now(t),
                     "layout": self._layout(t), "score_strategy": self.strategy(t), "dim": self.dims[t]}
            if self.times.cols[t]:  # the clock the stored access times are readings of
                saved["timestamp_clock"] = self.now(t) - self.times.shift[t]
            self.store.save_state(self.names[t], saved)
        self.store.flush()
        if lost:
            # A table holds up to its store's room plus its cache's rows; a flush leaves only the store.
            warnings.warn(f"dynamicemb: flush() of tables {sorted(lost)}: their stores were full, so the cache's "
                          f"rows written back evicted the lowest-scored stored ones ({lost}, counted in 'evicted'): "
                          f"a cached table holds its store's rows plus its cache's, and a flush keeps only what "
                          f"the store holds; give the store room (max_capacity) for the cache's rows too, or "
                          f"checkpoint with DynamicEmbDump / DCP, which keep both tiers", RuntimeWarning,
                          stacklevel=3)

    def close(self) -> None:
        if self.owns_store:
            self.store.close()

    def export_rows(self, table_id, batch_size=1 << 16, lazy=False):
        """A cached table's store rows, then its cache's: a load in this order
        places each key where it was (load_rows), so that a full table's
        checkpoint fits it again. Between a forward and its backward, the
        forward's overflow rows (keys taken from the store) go with the
        store's, as they are now: the backward still updates them."""
        self._settle(keep_blocks=True)
        if self.cached[table_id]:
            dim = self.dims[table_id]
            width = self.widths[table_id]
            for keys, rows, scores in self.store.items(self.names[table_id], batch_size):
                rows, ts = self.times.split(table_id, rows)
                yield RowBatch(keys.to(self.device), rows[:, :dim], rows[:, dim:width], scores.to(self.device),
                               None if ts is None else ts.to(self.device))
            for keys, rows, scores, ts in self.live_block_rows(table_id):
                yield RowBatch(keys.to(self.device), rows[:, :dim], rows[:, dim:width], scores.to(self.device),
                               None if ts is None else ts.to(self.device))
        yield from self.tables.export_rows(table_id, batch_size, lazy)

    def export(self, table_id, batch_size=1 << 16, threshold=None):
        self._settle(keep_blocks=True)  # (as export_rows: a pending backward's overflow rows read in place)
        yield from self.tables.export(table_id, batch_size, threshold)
        if self.cached[table_id]:
            width = self.widths[table_id]
            store = ((keys, *self.times.split(table_id, rows), scores)
                     for keys, rows, scores in self.store.items(self.names[table_id], batch_size))
            blocks = ((keys, rows, ts, scores) for keys, rows, scores, ts in self.live_block_rows(table_id))
            for keys, rows, ts, scores in itertools.chain(store, blocks):
                if threshold is not None:  # by access time where the table keeps one (as ScoredHashTable.export)
                    keep = (scores if ts is None else ts) >= threshold
                    keys, rows, scores = keys[keep], rows[keep], scores[keep]
                if keys.numel():
                    yield keys.to(self.device), rows[:, :width].to(self.device), scores.to(self.device)

    def load_rows(self, table_id, batch: RowBatch) -> None:
        self._settle()
        if not self.cached[table_id]:
            return self.tables.load_rows(table_id, batch)
        dim = self.dims[table_id]
        state = batch.optimizer_state
        if state is None or state.shape[1] == 0:
            state = torch.full((batch.keys.numel(), self.widths[table_id] - dim), self.tables.state_init(table_id),
                               dtype=batch.values.dtype)  # rows without state start fresh
        rows = torch.cat([batch.values.cpu(), state.cpu().to(batch.values.dtype)], 1)
        if self.times.cols[table_id]:  # with their access times (none given: now)
            rows = self.times.join(table_id, rows.to(self.dtype), batch.timestamps, self.now(table_id))
        # Into the store while it has room, then the rest into the cache: in
        # export_rows' order (the store's rows first), a full table's own
        # checkpoint puts every key back in the tier it came from.
        left_out, lost = self.store.put_if_room(self.names[table_id], batch.keys.cpu(), rows,
                                                batch.scores.cpu().to(torch.int64))
        if lost:
            raise RuntimeError(f"dynamicemb: table {self.names[table_id]!r}: {lost} of the loaded keys do not fit "
                               f"(at most {self.max_rows(table_id)} rows on this rank)")
        if bool(left_out.any()):
            at = where_true(left_out)
            pick = (lambda x: None if x is None else x.index_select(0, at.to(x.device)))
            try:
                self.tables.load_rows(table_id, RowBatch(*(pick(x) for x in batch)), own_slots=True)
            except RuntimeError as e:
                raise RuntimeError(f"dynamicemb: table {self.names[table_id]!r}: {int(at.numel())} of the loaded "
                                   f"keys fit neither its store nor its cache (at most {self.max_rows(table_id)} rows "
                                   f"on this rank, both tiers full): {e}") from None
            finally:  # the loaded rows' access times, for when the cache evicts them to the store
                g = self.group_of[table_id][0]
                self.times.keep_all(g, self.groups[g][0])

    def clear_table(self, table_id: int) -> int:
        self._settle()
        self._forward_pins.clear()  # pins are slots: of keys no longer there
        self._prefetch_pins.clear()
        removed = self.tables.clear_table(table_id)
        if self.cached[table_id]:
            removed += self.store.size(self.names[table_id])
            self.store.clear(self.names[table_id])
        return removed

    def max_rows(self, table_id: int) -> int:
        """A cached table's: its store's room and its cache's rows."""
        if not self.cached[table_id]:
            return self.tables.max_rows(table_id)
        room = self.store.room(self.names[table_id])
        return max(room or 0, self.table_max_rows[table_id]) + self.tables.max_rows(table_id)

    def budget_reached(self, table_id: int):
        """A cache never grows: only an uncached table can reach its budget."""
        return None if self.cached[table_id] else self.tables.budget_reached(table_id)

    def stats(self, table_id):
        s = self.tables.stats(table_id)
        if not self.cached[table_id]:
            return s
        c = self.tier_counters[table_id].tolist()
        store_rows = self.store.size(self.names[table_id])
        g, lt = self.group_of[table_id]
        begin, end = self.groups[g][0].table_slot_range(lt)
        cache_rows = self.size(table_id) - int(self._fresh[g][begin:end].sum())  # stored keys only
        s.update(size=cache_rows + store_rows, capacity=self.table_max_rows[table_id],
                 inserted=c[_T.NEW], evicted=c[_T.LOST], hits=c[_T.HITS], misses=c[_T.MISSES],
                 write_backs=c[_T.WRITE_BACKS], bypassed=c[_T.BYPASSED], failed=c[_T.FAILED],
                 cache_rows=cache_rows, store_rows=store_rows,
                 cache_capacity=self.capacity(table_id))
        return s
