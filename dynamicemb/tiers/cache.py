"""CachedStorage: a cache of each table's hot rows (a HashTableStorage of
fixed capacity, evicting by the table's score strategy) in front of a
BackingStore that holds every other row (API.md §1: caching=True).

A key is in exactly one place. A training step's keys that the cache lacks
are taken out of the store (their rows and optimizer state come with them)
or, when the store lacks them too, start from their initial value; the rows
the cache evicts to make room go back to the store with their score. The
keys of a batch between its forward and its backward, and of a prefetched
batch until its forward, are pinned: every insert call into the cache holds
their slots (ScoredHashTable.hold: the table never evicts a slot its call
holds; their scores stay as they are), as it holds the slots of the batch's
own cached keys. A prefetch makes those moves for a coming batch (its new
keys stay provisional until that forward: _settle), so that the batch's
forward only scores its keys where they are. A table without caching in the
same module keeps its usual behaviour (its evicted keys are gone).
"""
import dataclasses
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dynamicemb import rules
from dynamicemb._ops import ops
from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.positions import scatter_rows, where_true
from dynamicemb.storage import HashTableStorage, Placement
from dynamicemb.storage_protocol import PENDING_PREFETCHES, EmbeddingStorage
from dynamicemb.table import EvictedKeys, InsertOutput
from dynamicemb.tiers.cache_checkpoint import CacheCheckpoint
from dynamicemb.tiers.cache_overflow import (OverflowBlock, SpareRows, block_rows, in_blocks, insert_scores_of,
                                             pending, warn_or_raise)
from dynamicemb.tiers.access_times import AccessTimes
from dynamicemb.tiers.store import BackingStore, RowsAt, grouped
from dynamicemb.types import DynamicEmbCheckMode, InsertResult

_T = rules.TierCounter
assert (InsertResult.INSERTED, InsertResult.ASSIGNED) == (0, 1)  # _insert's results from a bool mask
_PENDING_FORWARDS = 2  # forwards whose backward may still come


def _kind_to_counters() -> torch.Tensor:
    """A forward's keys by kind (found in the cache, missed and stored, new) -> the tier counters they add to."""
    m = torch.zeros(3, len(_T), dtype=torch.int64)
    for kind, counters in enumerate(((_T.HITS,), (_T.MISSES,), (_T.MISSES, _T.NEW))):
        m[kind, list(counters)] = 1
    return m


_KIND_TO_COUNTERS = _kind_to_counters()


class _Pin(dict):
    """{group: slots of that group's cache} pinned for a forward's keys
    until its backward, or for a prefetched batch's until its forward. A
    prefetch's are its batch's keys' slots in the order the storage splits
    the keys by group, and `keys` is the tensor of those keys (its forward
    gets the same one from the module: it then scores the keys where they
    are, without finding them again); None for a forward's, or once the
    slots may no longer hold those keys."""

    def __init__(self, keys: Optional[torch.Tensor] = None):
        super().__init__()
        self.keys = keys
        self.block: Optional[OverflowBlock] = None  # a forward's overflow rows (tiers/cache_overflow.py)
        # {group: (keys, local table ids)} where self[group] holds the slots
        # of exactly those, in their order: the forward reuses the slots only
        # for the same keys (admission may keep fewer of them, and a pin
        # leaves out keys that an overflow block holds or the cache could
        # not place, so a count alone can match by chance).
        self.order: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.failures_counted = False  # a prefetch that raised (ERROR) counted its batch's failed keys

    def slots_for(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor) -> Optional[torch.Tensor]:
        """Group g's pinned slots if they are those of `keys` (of `local_tids`), in order; else None."""
        order = self.order.get(g)
        if order is None or order[0].numel() != keys.numel():
            return None
        return self[g] if torch.equal(order[0], keys) and torch.equal(order[1], local_tids) else None


class CachedStorage(CacheCheckpoint, EmbeddingStorage, Placement):
    """The tiers over a HashTableStorage of each table's cache (`tables`), which
    it holds: the table calls back `insert` and `stored` (Placement) to
    store a step's keys, so that a cached group's missing keys come from the
    store and its evicted rows go there."""

    def __init__(self, names: Sequence[str], options: Sequence[DynamicEmbTableOptions], state_widths: Sequence[int],
                 dtype: torch.dtype, device: torch.device, seed: int, streams: Optional[Sequence[int]],
                 store: BackingStore, owns_store: bool = False, state_inits: Optional[Sequence[float]] = None):
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.cached = [o.caching for o in options]
        self.table_max_rows = [-(-o.max_capacity // o.bucket_capacity) * o.bucket_capacity for o in options]
        cache_opts = []
        for n, o, w in zip(names, options, state_widths):
            if o.caching:
                rows = o.cache_rows(o.dim + w, itemsize)
                # The cache never grows (its slots stay put while evicted rows are written back).
                o = dataclasses.replace(o, max_capacity=rows, init_capacity=rows,
                                        num_embeddings=o.num_embeddings or o.max_capacity, global_hbm_for_values=0)
            cache_opts.append(o)
        self.tables = HashTableStorage(names, cache_opts, state_widths, dtype, device, seed, streams, placement=self,
                                       state_inits=state_inits)
        # The held storage's layout and state, by reference: none of them is
        # ever replaced (a growth replaces items of these lists, and a cache
        # never grows).
        tb = self.tables
        self.names, self.options, self.dims, self.num_tables = tb.names, tb.options, tb.dims, tb.num_tables
        self.device, self.dtype, self.seed = device, dtype, seed
        self.groups, self.group_of, self._weights = tb.groups, tb.group_of, tb.weights()
        self.init_params, self.eval_init_params = tb.init_params, tb.eval_init_params
        self.unstored_init_params = tb.unstored_init_params
        self.custom_scores, self.admission = tb.custom_scores, tb.admission
        self.store = store
        self.owns_store = owns_store  # made for this storage (storage_path, the default HostStore): close() closes it
        # Where rows go between the tiers: the CPU, or the cache's device for a
        # store it reads in place (a HostStore's pinned rows, on CUDA).
        self._rows_dev = store.rows_device(device)
        self._rows_at = store.puts_rows_at and device.type == "cpu"  # evicted rows handed as RowsAt
        self.widths = [d + w for d, w in zip(self.dims, state_widths)]
        # The (TIMESTAMP, LFU) pair's access times in both tiers (tiers/access_times.py).
        self.times = AccessTimes([self.strategy(t) for t in range(self.num_tables)], self.cached, self.widths, dtype,
                                 self.groups, [self.cached[tables[0]] for _, tables in self.groups])
        for t, n in enumerate(names):
            if self.cached[t]:
                store.open_table(n, self.widths[t] + self.times.cols[t], dtype, self.table_max_rows[t])
                store.reserve(n, min(options[t].init_capacity or options[t].max_capacity, self.table_max_rows[t]))
                self._resume(t)
        # Per table, columns rules.TierCounter: hits, misses, write-backs, keys the store evicted (lost),
        # new keys stored. (numpy: a step adds to it a few times, which torch's small ops would make ~10x dearer)
        self.tier_counters = np.zeros((self.num_tables, len(_T)), dtype=np.int64)
        # Per group: whether its tables are cached (a group's tables all are
        # or none is) and its tables' ids; per table, a cache's first slot
        # (the cache never grows: its slots stay put).
        self._group_cached = [self.cached[tables[0]] for _, tables in self.groups]
        self._group_tables = [torch.tensor(tables, dtype=torch.int64) for _, tables in self.groups]
        self._group_names = [[names[t] for t in tables] for _, tables in self.groups]
        self._cache_begin = [self.tables.first_slot(t) for t in range(self.num_tables)]
        self._forward_pins: List[_Pin] = []
        self._prefetch_pins: List[_Pin] = []
        self._reuse: Optional[_Pin] = None  # the prefetch pin of the running forward's batch
        self._counted: Optional[_Pin] = None  # a pin of that batch whose prefetch counted its failed keys
        self._step_slots: Dict[int, torch.Tensor] = {}  # per group, the slots of the running forward's keys
        # Per cached group, per slot: its key is provisional, made new by a
        # prefetch whose forward has not come yet (_settle).
        self._fresh = [torch.zeros(ht.slot_keys.numel(), dtype=torch.bool, device=device) if c else None
                       for (ht, _), c in zip(self.groups, self._group_cached)]
        # On the CPU a prefetch runs inline with the step: its new keys' rows
        # are left unwritten (no one reads a provisional row: find skips it,
        # _settle and eviction drop it) and get their initial values in their
        # forward's row-order pass, one pass over them instead of two. On a
        # device the prefetch writes them, off the forward's stream.
        self._init_in_forward = device.type == "cpu"
        # The overflow (tiers/cache_overflow.py): spare rows after the caches'
        # rows, the running forward's block (a pin's `block` once sealed), the
        # tables warned of it.
        self._spare = SpareRows(self._weights)
        self._step_block = OverflowBlock()
        self._warned: set = set()

    # ---- what the held storage answers ------------------------------------------------------

    @property
    def version(self) -> int:
        return self.tables.version

    @version.setter
    def version(self, v: int) -> None:
        self.tables.version = v

    def weights(self):
        return self._weights

    def find(self, keys, table_ids):
        rows = self.tables.find(keys, table_ids)
        blocks = pending(self._forward_pins)
        return block_rows(blocks, keys, table_ids, rows) if blocks else rows

    def insert_rows(self, table_id, keys, values, optimizer_state=None, step=0):
        return self.tables.insert_rows(table_id, keys, values, optimizer_state, step)

    def strategy(self, table_id: int) -> int:
        return self.tables.strategy(table_id)

    def now(self, table_id: int) -> int:
        return self.tables.now(table_id)

    def admission_counter(self, table_id: int):
        return self.tables.admission_counter(table_id)

    def capacity(self, t: int) -> int:
        return self.tables.capacity(t)

    def size(self, t: int) -> int:
        return self.tables.size(t)

    # ---- pins ------------------------------------------------------------------------------
    # A pin (_Pin) is {group: slots of that group's cache}: the slots of a
    # forward's keys until its backward, of a prefetched batch's keys until
    # its forward. A pinned key is never evicted (every insert into a cache holds
    # the pinned slots) and the cache never grows, so its slot stays its own.

    def _hold(self, g: int, slots: Optional[torch.Tensor] = None) -> None:
        """Begins an insert call into group g's cache that holds the pinned
        slots and `slots` (the call continues with same_call=True)."""
        ht, _ = self.groups[g]
        held = [p[g] for p in self._forward_pins + self._prefetch_pins if g in p]
        if slots is not None:
            held.append(slots)
        if not held:
            held.append(torch.zeros(0, dtype=torch.int64, device=ht.device))
        ht.hold(torch.cat(held) if len(held) > 1 else held[0])

    def _pinned_count(self, g: int, lt: int, keys: torch.Tensor, local_tids: torch.Tensor) -> int:
        """Distinct pinned keys of group g's table lt that are not among
        `keys` (for error messages)."""
        ht, _ = self.groups[g]
        held = torch.zeros(ht.slot_keys.numel() + 1, dtype=torch.bool, device=ht.device)  # the last: for -1
        for p in self._forward_pins + self._prefetch_pins:
            if g in p:
                held[p[g]] = True
        held[ht.lookup(keys, local_tids)[0]] = False
        begin, end = ht.table_slot_range(lt)
        return int(held[begin:end].sum())

    def batch_done(self, newest: bool = False) -> None:
        """A training batch's backward ran (the oldest pending one), or the
        last forward gets none (`newest`): its keys are no longer pinned."""
        if self._forward_pins:
            self._return_block(self._forward_pins.pop(-1 if newest else 0))

    def _return_block(self, pin: "_Pin") -> None:
        """A forward's overflow rows (updated by its backward, if it came) go
        back to the store with their scores; the spare rows are free once no
        block lives."""
        block = pin.block
        pin.block = None
        if block:
            for t, (keys, rows, scores) in block.tables.items():
                self._put(t, keys, self._weights[t].index_select(0, rows), scores, block.timestamps.get(t))
        if not pending(self._forward_pins):
            self._spare.reset()

    def live_block_rows(self, t: int):
        """Table t's rows in the live overflow blocks (a forward's keys that
        no cache slot held, taken from the store, their backward pending):
        (keys, [value | state] rows, scores, access times or None) per block,
        a key in at most one (the newest forward's)."""
        seen = None
        for block in reversed(pending(self._forward_pins)):
            if t not in block.tables:
                continue
            keys, rows, scores = block.tables[t]
            ts = block.timestamps.get(t)
            if seen is not None:
                keep = where_true(~torch.isin(keys, seen))
                keys, rows, scores = keys[keep], rows[keep], scores[keep]
                ts = None if ts is None else ts[keep]
            seen = keys if seen is None else torch.cat([seen, keys])
            if keys.numel():
                yield keys, self._weights[t].index_select(0, rows), scores, ts

    def _return_blocks(self) -> None:
        """Every live overflow block goes back to the store, before a pending
        backward (whose updates of those rows are then lost, as a flush's)."""
        if pending(self._forward_pins):
            self.version += 1  # their rows hold no key now
            for pin in list(self._forward_pins):
                self._return_block(pin)

    # ---- the two tiers -----------------------------------------------------------------------

    def _take(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor):
        """Per table of a cached group: (positions in keys, rows, scores) of
        the keys that the store holds, taken out of it (one store call for
        the group)."""
        _, tables = self.groups[g]
        if not keys.numel():
            return {}
        got = self.store.take_group(self._group_names[g], keys.cpu(), local_tids.cpu())
        dev = keys.device
        return {tables[lt]: (at.to(dev), rows.to(self.device), scores.to(self.device))
                for lt, (at, rows, scores) in sorted(got.items())}

    def _not_provisional(self, g: int, evicted: EvictedKeys) -> EvictedKeys:
        """The evicted keys less the provisional ones (_settle), which are dropped, not stored."""
        if evicted.keys.numel():
            provisional = self._fresh[g].index_select(0, evicted.indices)
            if bool(provisional.any()):
                evicted = EvictedKeys(*(x[~provisional] for x in evicted))
        return evicted

    def _write_back(self, g: int, evicted: EvictedKeys) -> None:
        """Evicted cache rows (their slots not yet rewritten) go to the store,
        in one store call for the group; a provisional key (of a prefetch
        whose forward did not come: no longer pinned) is dropped instead."""
        _, tables = self.groups[g]
        evicted = self._not_provisional(g, evicted)
        parts = {}
        for lt, keys, slots, scores in grouped(evicted.table_ids, len(tables), evicted.keys, evicted.indices,
                                               evicted.scores):
            t = tables[lt]
            w = self._weights[t]
            at = (slots - self._cache_begin[t]).to(w.device)
            if self.times.cols[t]:  # with the evicted keys' access times
                ts = self.times.evicted(g, slots)
                rows = RowsAt(w, at, self.times.columns(t, ts, at.numel(), w.dtype, 0)) if self._rows_at else \
                    self.times.join(t, w.index_select(0, at), ts, 0).to(self._rows_dev)
            else:
                rows = RowsAt(w, at) if self._rows_at else w.index_select(0, at).to(self._rows_dev)
            parts[lt] = (keys.cpu(), rows, scores.cpu())
        if parts:
            lost = self.store.put_group(self._group_names[g], parts)
            for lt, p in parts.items():
                self.tier_counters[tables[lt], [_T.WRITE_BACKS, _T.LOST]] += (p[0].numel(), lost[lt])

    def _place(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores, held: Optional[torch.Tensor],
               exact: bool, missing: Optional[torch.Tensor] = None):
        """One insert of distinct keys into the full cache: it stores those
        the cache lacks (at positions `missing`; None: all of them), and
        scores the others as accessed. Of the missing keys, those the store
        holds come out of it with their rows and scores, the others are new.
        The insert holds the pinned slots and `held` (it evicts none of them)
        and evicts other rows, which go back to the store. A fetched
        key's score is its stored one (`exact`: a prefetch; the batch's
        forward scores it) or, for LFU, its stored count added to this
        access's. Returns (slots, results: a fetched key is ASSIGNED, a new one
        INSERTED or EVICTED, its row not yet written; the evicted keys).
        Keys that find no slot (FAILED, slot -1): under ERROR every key
        placed here is taken out again (those fetched go back to the store
        with their rows) and the cache too small error is raised; else a
        forward's go to its overflow block (_overflow), a prefetch's stay
        where they were (its forward places them)."""
        ht, _ = self.groups[g]
        if missing is None:
            fetched = self._take(g, keys, local_tids)
        else:
            fetched = {t: (missing.index_select(0, pos), rows, stored) for t, (pos, rows, stored) in
                       self._take(g, keys.index_select(0, missing), local_tids.index_select(0, missing)).items()}
        if exact and fetched and isinstance(scores, torch.Tensor):
            scores = scores.clone()  # CUSTOMIZED, LFU: the stored scores are the insert's scores
            for pos, _, stored in fetched.values():
                scores.index_copy_(0, pos, stored)
        failures = ht.get_counters()["failed"]  # read, not a pass over the results
        out = self._cache_insert(g, keys, local_tids, scores, held=held)
        try:
            self._write_back(g, out.evicted)
        except Exception as e:
            self._write_back_failed(g, keys, local_tids, exact, missing, out, fetched, e)
        idx, res = out.indices, out.results
        failed = None
        if ht.get_counters()["failed"] != failures:
            failed = res == InsertResult.FAILED
            try:
                self._too_small(g, keys, local_tids, failed)
            except RuntimeError:
                # The step fails: undo its placements (the evicted rows are in the
                # store already) so that every key stays in one tier with its row.
                # The keys that found no place, counted once per batch: by the
                # prefetch that raised, else by the forward (TorchRec's
                # pipeline may run a batch's prefetch and never its forward).
                pin = self._prefetch_pins[-1] if exact else self._counted
                if pin is None or not pin.failures_counted:
                    _, tables = self.groups[g]
                    per_table = torch.bincount(local_tids[failed], minlength=len(tables)).cpu().numpy()
                    self.tier_counters[tables, _T.FAILED] += per_table
                    if exact:
                        pin.failures_counted = True
                placed = ~failed
                if missing is not None:  # the others were there before
                    placed &= torch.zeros_like(placed).index_fill_(0, missing, True)
                ht.erase(keys[placed], local_tids[placed])
                self._give_back(fetched, keys)
                raise
        for t, (pos, rows, stored) in fetched.items():
            if failed is not None:
                off = failed.index_select(0, pos)
                if bool(off.any()):
                    o = where_true(off)
                    if exact:  # a prefetch's: back to the store as they were
                        self._put(t, keys.index_select(0, pos.index_select(0, o)), rows.index_select(0, o),
                                  stored.index_select(0, o))
                    else:
                        self._overflow(g, t, keys, local_tids, scores, pos.index_select(0, o), rows.index_select(0, o),
                                       stored.index_select(0, o))
                        res.index_fill_(0, pos.index_select(0, o), InsertResult.ASSIGNED)  # fetched, slot -1
                    keep = where_true(~off)
                    pos, rows, stored = pos.index_select(0, keep), rows.index_select(0, keep), stored.index_select(0, keep)
            self._fill_fetched(g, t, idx.index_select(0, pos), rows, stored, exact)
            res.index_fill_(0, pos, InsertResult.ASSIGNED)  # not new: no initial value
        self.times.keep(g, ht, idx)
        if failed is not None and not exact:
            new = failed & (res == InsertResult.FAILED)  # failed and not fetched: new keys
            _, tables = self.groups[g]
            for lt in torch.unique(local_tids[new]).tolist():
                self._overflow(g, tables[lt], keys, local_tids, scores, where_true(new & (local_tids == lt)))
        return idx, res, out.evicted

    def _fill_fetched(self, g: int, t: int, slot: torch.Tensor, rows: torch.Tensor, stored: torch.Tensor,
                      exact: bool) -> None:
        """Table t's rows taken from the store go into their cache slots,
        with their stored scores (`exact`: a prefetch's) or, for LFU, their
        stored counts added to this access's."""
        ht, _ = self.groups[g]
        w = self._weights[t]
        rows, ts = self.times.split(t, rows)
        scatter_rows(w, (slot - self._cache_begin[t]).to(w.device), rows.to(w.dtype))
        if exact:
            ht.slot_scores.index_copy_(0, slot, stored)
            if ts is not None:  # not accessed yet: its stored access time (its forward refreshes it)
                ht.slot_timestamps.index_copy_(0, slot, ts.to(slot.device))
        elif rules.counts_accesses(ht.strategy):  # counts accumulate across tiers
            ht.slot_scores.index_add_(0, slot, stored)

    def _write_back_failed(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, exact: bool,
                           missing: Optional[torch.Tensor], out: InsertOutput, fetched, error: Exception) -> None:
        """The store raised taking the rows the cache insert evicted: their
        keys are lost (counted as the store's evictions, `evicted` in
        table_stats; a store that took some before it raised leaves those
        counted too). The keys the insert fetched keep their slots, with
        their rows; those it could not place, and the new keys it placed
        (their rows not yet initial), are taken out, so that every key left
        holds its own row. Then raises, naming the tables and the counts."""
        ht, tables = self.groups[g]
        idx, res = out.indices, out.results
        lost = torch.bincount(self._not_provisional(g, out.evicted).table_ids, minlength=len(tables)).cpu().numpy()
        new = (res == InsertResult.INSERTED) | (res == InsertResult.EVICTED)
        if missing is not None:  # the others were there before
            new &= torch.zeros_like(new).index_fill_(0, missing, True)
        for t, (pos, rows, stored) in fetched.items():
            ok = where_true(res.index_select(0, pos) != InsertResult.FAILED)
            lost[tables.index(t)] += pos.numel() - ok.numel()  # taken out of the store, no slot: gone
            pos = pos.index_select(0, ok)
            new.index_fill_(0, pos, False)
            self._fill_fetched(g, t, idx.index_select(0, pos), rows.index_select(0, ok), stored.index_select(0, ok),
                               exact)
        if bool(new.any()):
            ht.erase(keys[new], local_tids[new])
        self.tier_counters[tables, _T.LOST] += lost
        self.version += 1
        counts = ", ".join(f"{self.names[t]!r}: {int(n)}" for t, n in zip(tables, lost) if n)
        raise RuntimeError(f"dynamicemb: the backing store failed to take the rows the cache of tables "
                           f"{self._group_names[g]} evicted ({type(error).__name__}: {error}); keys lost (counted "
                           f"as evicted in table_stats): {counts or 'none'}; the step's new keys were not "
                           f"stored") from error

    def _overflow(self, g: int, t: int, keys: torch.Tensor, local_tids: torch.Tensor, scores, pos: torch.Tensor,
                  rows: Optional[torch.Tensor] = None, stored: Optional[torch.Tensor] = None) -> None:
        """Table t's keys at `pos` of a forward's insert found no cache slot:
        they get rows in the step's overflow block, with their rows from the
        store (`rows`, `stored` scores) or, new, their initial rows."""
        ht, _ = self.groups[g]
        k = keys.index_select(0, pos)
        at = self._spare.take(t, pos.numel())
        w = self._weights[t]
        sc = insert_scores_of(ht, scores, pos)
        if rows is not None:
            rows, _ = self.times.split(t, rows)  # accessed now: its time is this step's
            w.index_copy_(0, at, rows.to(device=w.device, dtype=w.dtype))
            if rules.counts_accesses(ht.strategy):
                sc = sc + stored.to(sc.device)
        else:
            tids = torch.full_like(k, t)
            ops.emb_init_rows(self._weights, at, tids.to(w.device), k.to(w.device), self.dims, self.init_params,
                              self.seed)
        self._step_block.add(t, k, at, sc, torch.full_like(sc, ht.now()) if self.times.cols[t] else None)
        self.tier_counters[t, _T.BYPASSED] += pos.numel()

    def _cache_insert(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores,
                      held: Optional[torch.Tensor] = None) -> InsertOutput:
        """HashTableStorage._insert for a cache, which never grows: one
        insert that evicts (every table of the group is at its maximum) and
        holds the pinned slots and `held`: it evicts none of them."""
        self._hold(g, held)
        out = self.groups[g][0].insert(keys, local_tids, scores=scores, evict=True, same_call=True, hold_stored=True)
        if out.evicted.keys.numel():
            self.version += 1  # the evicted keys' rows now hold other keys
        return out

    def insert(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores) -> InsertOutput:
        ht, tables = self.groups[g]
        if not self._group_cached[g]:
            return self.tables.insert_growing(g, keys, local_tids, scores)
        # The slots of the keys: those its prefetch found (every key of the
        # batch placed), else a lookup's.
        reuse = self._reuse.slots_for(g, keys, local_tids) if self._reuse is not None else None
        if reuse is not None:
            slots, missing = reuse, None
        else:
            slots, cached = ht.lookup(keys, local_tids)
            missing = where_true(~cached)
            missing = missing if missing.numel() else None
        fresh = self._fresh[g]
        # Per key: a hit (0, or taken from the store by the batch's prefetch),
        # a miss taken from the store (1), a new key (2, or made new by the
        # batch's prefetch: stored from now on). A missing key's is set below.
        made_new = fresh.index_select(0, slots.clamp(min=0))
        kind = made_new.to(torch.int64) * 2
        if missing is None:  # every key is there: scored where it is
            ht.refresh(slots, scores)
            self.times.keep(g, ht, slots)
            if self._init_in_forward:  # the keys the prefetch made new get their initial rows now
                res = (~made_new).view(torch.int8)  # ASSIGNED (1), INSERTED (0) where made new
            else:
                res = torch.full(keys.shape, InsertResult.ASSIGNED, dtype=torch.int8, device=keys.device)
            e = torch.zeros(0, dtype=torch.int64, device=keys.device)
            evicted = EvictedKeys(e, e, e, e)
        else:
            # One insert stores the missing keys and scores the others, which
            # it holds: none is evicted by the missing keys.
            held = slots.index_select(0, where_true(slots >= 0))
            slots, res, evicted = self._place(g, keys, local_tids, scores, held=held, exact=False, missing=missing)
            kind.index_copy_(0, missing,
                             torch.where(res.index_select(0, missing) == InsertResult.ASSIGNED, 1, 2))
            if self._init_in_forward:
                res.masked_fill_(kind == 2, InsertResult.INSERTED)
        pinned = slots
        if self._step_block.has(tables):  # keys in the step's overflow block, their rows written: not new, not failed
            over = slots < 0
            res.masked_fill_(over, InsertResult.ASSIGNED)
            pinned = slots.index_select(0, where_true(~over))
        # No key of the step is provisional any more (a key found unfresh stays so).
        fresh.index_fill_(0, pinned, False)
        self._step_slots[g] = pinned  # the forward's pin (find_or_insert)
        # Per table, the keys found in the cache, missed, new: one count.
        counts = torch.bincount(local_tids * 3 + kind, minlength=3 * len(tables)).view(-1, 3).cpu()
        self.tier_counters[tables] += (counts @ _KIND_TO_COUNTERS).numpy()  # a group's tables are distinct
        return InsertOutput(slots, res, evicted)

    def _give_back(self, fetched, keys: torch.Tensor) -> None:
        """Rows taken from the store by a failed step go back to it."""
        for t, (pos, rows, scores) in fetched.items():
            self._put(t, keys.index_select(0, pos), rows, scores)

    def _put(self, t: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
             timestamps: Optional[torch.Tensor] = None) -> None:
        """Puts table t's rows in the store (with their access times where
        the table keeps them: `timestamps`, unless the rows came from the
        store with theirs); the keys it evicts are counted."""
        if self.times.cols[t] and rows.shape[1] == self.widths[t]:
            rows = self.times.join(t, rows, timestamps, self.now(t))
        part = (keys.cpu(), rows.to(self._rows_dev), scores.cpu())
        self.tier_counters[t, _T.LOST] += self.store.put_group([self.names[t]], {0: part})[0]

    def _too_small(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, failed: torch.Tensor) -> None:
        """Keys of this insert found no cache slot: raises under a failing
        table's ERROR mode, else warns once per table under WARNING (its
        overflow is then served from the store: _overflow)."""
        _, tables = self.groups[g]
        lts = torch.unique(local_tids[failed]).tolist()
        lts.sort(key=lambda lt: self.options[tables[lt]].safe_check_mode != DynamicEmbCheckMode.ERROR)
        msgs = [m for m in (warn_or_raise(self.options[tables[lt]].safe_check_mode,
                                          self._too_small_message(g, lt, keys, local_tids, failed),
                                          self._warned, tables[lt]) for lt in lts) if m]
        if msgs:
            warnings.warn("; ".join(msgs), RuntimeWarning, stacklevel=2)

    def _too_small_message(self, g: int, lt: int, keys: torch.Tensor, local_tids: torch.Tensor,
                           failed: torch.Tensor) -> str:
        _, tables = self.groups[g]
        t = tables[lt]
        need = int((local_tids == lt).sum()) + self._pinned_count(g, lt, keys, local_tids)
        o = self.options[t]
        rows = -(-2 * need // o.bucket_capacity) * o.bucket_capacity  # whole buckets, as the cache is sized
        per_rank = rows * self.widths[t] * self._weights[t].element_size()
        msg = (f"dynamicemb: table {self.names[t]!r}: its cache ({self.capacity(t)} rows on this rank) cannot hold "
               f"one step's rows: {int((failed & (local_tids == lt)).sum())} of the {need} keys this step needs at "
               f"once (the batch's and those pinned for a pending backward or a prefetched batch) found no slot; "
               f"give the cache at least {rows} rows on each rank (global_hbm_for_values >= "
               f"{per_rank * o.num_shards} bytes: {per_rank} on each of its {o.num_shards} ranks) so that no bucket "
               f"overflows")
        if o.safe_check_mode == DynamicEmbCheckMode.ERROR:
            return msg
        return msg + ("; until then, each step reads and writes the keys that find no slot in the backing store "
                      "(counted as 'bypassed' in table_stats; this warning is given once per table)")

    # ---- the module's calls ------------------------------------------------------------------

    def find_or_insert(self, keys, table_ids, counts, step, inverse=None):
        self._step_slots = {}
        mine = next((i for i, p in enumerate(self._prefetch_pins) if p.keys is keys), None)
        self._reuse = None if mine is None else self._prefetch_pins[mine]
        # A prefetch of this batch that raised counted its failed keys (the
        # module deduplicates the batch again after it: known by content).
        self._counted = next((p for p in self._prefetch_pins if p.failures_counted and p.keys is not None
                              and p.keys.numel() == keys.numel() and torch.equal(p.keys, keys)), None)
        # A later forward before an earlier one's backward: the earlier
        # overflow goes back first (its keys are in one place: the store).
        self._return_blocks()
        self._step_block = OverflowBlock()
        try:
            res = self.tables.find_or_insert(keys, table_ids, counts, step, inverse)
        except RuntimeError:
            if self._step_block:
                pin = _Pin()
                pin.block = self._step_block.seal()
                self._return_block(pin)
            raise
        finally:
            self._reuse = None
        block = self._step_block.seal() if self._step_block else None
        self._step_block = OverflowBlock()
        if block is not None:
            res.rows = block_rows([block], res.keys, res.table_ids, res.rows)
        # This batch's keys are pinned from now on as a forward's: the pin of
        # its prefetch (known by its keys, else the oldest pending one) goes,
        # and those before it (their forwards are not coming); that of a later
        # batch prefetched before this forward (prefetch(i + 1) before
        # forward(i)) stays until that batch's forward.
        del self._prefetch_pins[:1 if mine is None else mine + 1]
        pin = _Pin()
        pin.update(self._step_slots)  # every key of a cached group has its slot or an overflow row
        pin.block = block
        self._forward_pins.append(pin)
        for old in self._forward_pins[:-_PENDING_FORWARDS]:
            self._return_block(old)
        del self._forward_pins[:-_PENDING_FORWARDS]
        return res

    def prefetch(self, keys: torch.Tensor, table_ids: torch.Tensor) -> None:
        """Places every key of a coming batch in the cache and pins it there
        until that forward, which then only finds and scores them: the stored
        ones come out of the store with their rows and scores, the new ones
        get their initial rows (on the CPU: in that forward) and stay
        provisional until that forward stores them (_settle)."""
        pin = _Pin(keys)
        self._prefetch_pins.append(pin)  # its cached keys are held in the moves below
        del self._prefetch_pins[:-PENDING_PREFETCHES]
        for g, mask, lt in self.tables.split(table_ids):
            if not self._group_cached[g]:
                continue
            ht, tables = self.groups[g]
            k = keys if mask is None else keys[mask]
            blocks = pending(self._forward_pins)
            if blocks:  # keys in a pending forward's overflow block stay there: their forward places them
                out = torch.zeros(k.shape, dtype=torch.bool, device=k.device)
                for i, t in enumerate(tables):
                    sel = where_true(lt == i)
                    out.index_copy_(0, sel, in_blocks(blocks, k.index_select(0, sel), t))
                if bool(out.any()):
                    k, lt = k[~out], lt[~out]
            slots, cached = ht.lookup(k, lt)
            at = where_true(~cached)
            if not at.numel():
                pin[g] = slots
                pin.order[g] = (k, lt)
                continue
            group_keys = (k, lt)
            pin[g] = slots.index_select(0, where_true(cached))
            k, lt = k.index_select(0, at), lt.index_select(0, at)
            # The insert scores of the keys it places (those fetched get their
            # stored ones): LFU counts no access yet, the others score as usual.
            scores = self.tables.insert_scores(g, lt, torch.zeros_like(k), ht.step)
            idx, res, _ = self._place(g, k, lt, scores, held=None, exact=True)
            placed = res != InsertResult.FAILED
            if not bool(placed.all()):  # the cache holds only some: the forward places the others
                keep = where_true(placed)
                idx, res, k, lt = idx[keep], res[keep], k[keep], lt[keep]
                pin[g] = torch.cat([pin[g], idx])
                slots = None
            new = res != InsertResult.ASSIGNED
            self._fresh[g].index_copy_(0, idx, new)
            if not self._init_in_forward:
                self.tables.init_rows(idx, new, k, self._group_tables[g].to(keys.device).index_select(0, lt))
            if slots is not None:
                pin[g] = slots.index_copy_(0, at, idx)  # every key's slot, in the batch's order
                pin.order[g] = group_keys

    def stored(self, g: int, slots: torch.Tensor) -> torch.Tensor:
        fresh = self._fresh[g]
        if fresh is None or not bool(fresh.any()):
            return slots
        return slots.masked_fill(fresh.index_select(0, slots.clamp(min=0)) & (slots >= 0), -1)

    def _settle(self, keep_blocks: bool = False) -> None:
        """Takes the provisional keys out of the cache: those that pending
        prefetches made new, whose rows are initial values no forward has
        used. What reads or writes the tiers as a whole (flush, export, stats,
        eval lookups, loads) then sees only keys that training forwards
        stored, as without prefetch; a settled batch's forward stores its new
        keys again, with the same initial rows. Live overflow blocks go back
        to the store first, unless `keep_blocks` (an export, which reads them
        where they are: live_block_rows): a block's backward then updates
        them as without the export."""
        if not keep_blocks:
            self._return_blocks()
        for g, fresh in enumerate(self._fresh):
            if fresh is None or not bool(fresh.any()):
                continue
            ht, _ = self.groups[g]
            slots = where_true(fresh)
            bounds = (ht.table_buckets[1:-1] * ht.bucket_capacity).to(slots.device)
            ht.erase(ht.slot_keys.index_select(0, slots), torch.bucketize(slots, bounds, right=True))
            fresh.zero_()
            for pin in self._prefetch_pins:
                pin.keys = None  # some of its slots are empty now: its forward finds its keys
            self.version += 1  # rows returned before may belong to no key now
