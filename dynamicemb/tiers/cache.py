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
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from dynamicemb import rules
from dynamicemb._ops import ops
from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.positions import scatter_rows, where_true
from dynamicemb.storage import HashTableStorage, Placement
from dynamicemb.storage_protocol import PENDING_PREFETCHES, EmbeddingStorage, RowBatch
from dynamicemb.table import EvictedKeys, InsertOutput
from dynamicemb.tiers.store import BackingStore, RowsAt, grouped
from dynamicemb.types import InsertResult

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


class CachedStorage(EmbeddingStorage, Placement):
    """The tiers over a HashTableStorage of each table's cache (`tables`), which
    it holds: the table calls back `insert` and `stored` (Placement) to
    store a step's keys, so that a cached group's missing keys come from the
    store and its evicted rows go there."""

    def __init__(self, names: Sequence[str], options: Sequence[DynamicEmbTableOptions], state_widths: Sequence[int],
                 dtype: torch.dtype, device: torch.device, seed: int, streams: Optional[Sequence[int]],
                 store: BackingStore, owns_store: bool = False):
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.cached = [o.caching for o in options]
        self.table_max_rows = [-(-o.max_capacity // o.bucket_capacity) * o.bucket_capacity for o in options]
        cache_opts = []
        for n, o, w in zip(names, options, state_widths):
            if o.caching:
                if o.admit_strategy is not None:
                    raise ValueError(f"table {n!r}: admission with caching=True is not supported (keys in the "
                                     f"backing store would be refused again)")
                rows = o.cache_rows(o.dim + w, itemsize)
                # The cache never grows (its slots stay put while evicted rows are written back).
                o = dataclasses.replace(o, max_capacity=rows, init_capacity=rows,
                                        num_embeddings=o.num_embeddings or o.max_capacity, global_hbm_for_values=0)
            cache_opts.append(o)
        self.tables = HashTableStorage(names, cache_opts, state_widths, dtype, device, seed, streams, placement=self)
        # The held storage's layout and state, by reference: none of them is
        # ever replaced (a growth replaces items of these lists, and a cache
        # never grows).
        tb = self.tables
        self.names, self.options, self.dims, self.num_tables = tb.names, tb.options, tb.dims, tb.num_tables
        self.device, self.dtype, self.seed = device, dtype, seed
        self.groups, self.group_of, self._weights = tb.groups, tb.group_of, tb.weights()
        self.init_params, self.eval_init_params = tb.init_params, tb.eval_init_params
        self.custom_scores, self.admission = tb.custom_scores, tb.admission
        for t, (n, o) in enumerate(zip(names, options)):
            if o.caching and rules.keeps_timestamps(self.strategy(t)):
                raise ValueError(f"table {n!r}: the (TIMESTAMP, LFU) strategy with caching=True is not supported "
                                 f"(the backing store keeps one score per key)")
        self.store = store
        self.owns_store = owns_store  # made for this storage (storage_path, the default HostStore): close() closes it
        # Where rows go between the tiers: the CPU, or the cache's device for a
        # store it reads in place (a HostStore's pinned rows, on CUDA).
        self._rows_dev = store.rows_device(device)
        self._rows_at = store.puts_rows_at and device.type == "cpu"  # evicted rows handed as RowsAt
        self.widths = [d + w for d, w in zip(self.dims, state_widths)]
        for t, n in enumerate(names):
            if self.cached[t]:
                store.open_table(n, self.widths[t], dtype, self.table_max_rows[t])
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
        return self.tables.find(keys, table_ids)

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
            self._forward_pins.pop(-1 if newest else 0)

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

    def _write_back(self, g: int, evicted: EvictedKeys) -> None:
        """Evicted cache rows (their slots not yet rewritten) go to the store,
        in one store call for the group; a provisional key (of a prefetch
        whose forward did not come: no longer pinned) is dropped instead."""
        _, tables = self.groups[g]
        if evicted.keys.numel():
            provisional = self._fresh[g].index_select(0, evicted.indices)
            if bool(provisional.any()):
                evicted = EvictedKeys(*(x[~provisional] for x in evicted))
        parts = {}
        for lt, keys, slots, scores in grouped(evicted.table_ids, len(tables), evicted.keys, evicted.indices,
                                               evicted.scores):
            t = tables[lt]
            w = self._weights[t]
            at = (slots - self._cache_begin[t]).to(w.device)
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
        When a key finds no slot, every key placed here is taken out again
        (those fetched go back to the store with their rows) and the cache
        too small error is raised."""
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
        self._write_back(g, out.evicted)
        idx, res = out.indices, out.results
        if ht.get_counters()["failed"] != failures:
            failed = res == InsertResult.FAILED
            # The step fails: undo its placements (the evicted rows are in the
            # store already) so that every key stays in one tier with its row.
            placed = ~failed
            if missing is not None:  # the others were there before
                placed &= torch.zeros_like(placed).index_fill_(0, missing, True)
            ht.erase(keys[placed], local_tids[placed])
            self._give_back(fetched, keys)
            self._too_small(g, keys, local_tids, failed)
        for t, (pos, rows, stored) in fetched.items():
            slot = idx.index_select(0, pos)
            w = self._weights[t]
            scatter_rows(w, (slot - self._cache_begin[t]).to(w.device), rows.to(w.dtype))
            if exact:
                ht.slot_scores.index_copy_(0, slot, stored)
            elif rules.counts_accesses(ht.strategy):  # counts accumulate across tiers
                ht.slot_scores.index_add_(0, slot, stored)
            res.index_fill_(0, pos, InsertResult.ASSIGNED)  # not new: no initial value
        return idx, res, out.evicted

    def _cache_insert(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores,
                      held: Optional[torch.Tensor] = None) -> InsertOutput:
        """HashTableStorage._insert for a cache, which never grows: one
        insert that evicts (every table of the group is at its maximum) and
        holds the pinned slots and `held`: it evicts none of them."""
        self._hold(g, held)
        out = self.groups[g][0].insert(keys, local_tids, scores=scores, evict=True, same_call=True)
        if out.evicted.keys.numel():
            self.version += 1  # the evicted keys' rows now hold other keys
        return out

    def insert(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores) -> InsertOutput:
        ht, tables = self.groups[g]
        if not self._group_cached[g]:
            return self.tables.insert_growing(g, keys, local_tids, scores)
        # The slots of the keys: those its prefetch found (every key of the
        # batch placed), else a lookup's.
        reuse = self._reuse.get(g) if self._reuse is not None else None
        if reuse is not None and reuse.numel() == keys.numel():
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
        # No key of the step is provisional any more (a key found unfresh stays so).
        fresh.index_fill_(0, slots, False)
        self._step_slots[g] = slots  # the forward's pin (find_or_insert)
        # Per table, the keys found in the cache, missed, new: one count.
        counts = torch.bincount(local_tids * 3 + kind, minlength=3 * len(tables)).view(-1, 3).cpu()
        self.tier_counters[tables] += (counts @ _KIND_TO_COUNTERS).numpy()  # a group's tables are distinct
        return InsertOutput(slots, res, evicted)

    def _give_back(self, fetched, keys: torch.Tensor) -> None:
        """Rows taken from the store by a failed step go back to it."""
        for t, (pos, rows, scores) in fetched.items():
            self._put(t, keys.index_select(0, pos), rows, scores)

    def _put(self, t: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Puts table t's rows in the store; the keys it evicts are counted."""
        part = (keys.cpu(), rows.to(self._rows_dev), scores.cpu())
        self.tier_counters[t, _T.LOST] += self.store.put_group([self.names[t]], {0: part})[0]

    def _too_small(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, failed: torch.Tensor) -> None:
        _, tables = self.groups[g]
        lt = int(local_tids[failed][0])
        t = tables[lt]
        need = int((local_tids == lt).sum()) + self._pinned_count(g, lt, keys, local_tids)
        o = self.options[t]
        rows = -(-2 * need // o.bucket_capacity) * o.bucket_capacity  # whole buckets, as the cache is sized
        per_rank = rows * self.widths[t] * self._weights[t].element_size()
        raise RuntimeError(
            f"dynamicemb: table {self.names[t]!r}: its cache ({self.capacity(t)} rows on this rank) cannot hold "
            f"one step's rows: {int((failed & (local_tids == lt)).sum())} of the {need} keys this step needs at "
            f"once (the batch's and those pinned for a pending backward or a prefetched batch) found no slot; "
            f"give the cache at least {rows} rows on each rank (global_hbm_for_values >= "
            f"{per_rank * o.num_shards} bytes: {per_rank} on each of its {o.num_shards} ranks) so that no bucket "
            f"overflows")

    # ---- the module's calls ------------------------------------------------------------------

    def find_or_insert(self, keys, table_ids, counts, step, inverse=None):
        self._step_slots = {}
        mine = next((i for i, p in enumerate(self._prefetch_pins) if p.keys is keys), None)
        self._reuse = None if mine is None else self._prefetch_pins[mine]
        try:
            res = self.tables.find_or_insert(keys, table_ids, counts, step, inverse)
        finally:
            self._reuse = None
        # This batch's keys are pinned from now on as a forward's: the pin of
        # its prefetch (known by its keys, else the oldest pending one) goes,
        # and those before it (their forwards are not coming); that of a later
        # batch prefetched before this forward (prefetch(i + 1) before
        # forward(i)) stays until that batch's forward.
        del self._prefetch_pins[:1 if mine is None else mine + 1]
        pin = _Pin()
        pin.update(self._step_slots)  # every key of a cached group has its slot (else the step raised)
        self._forward_pins.append(pin)
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
            ht, _ = self.groups[g]
            k = keys if mask is None else keys[mask]
            slots, cached = ht.lookup(k, lt)
            at = where_true(~cached)
            if not at.numel():
                pin[g] = slots
                continue
            pin[g] = slots.index_select(0, where_true(cached))
            k, lt = k.index_select(0, at), lt.index_select(0, at)
            # The insert scores of the keys it places (those fetched get their
            # stored ones): LFU counts no access yet, the others score as usual.
            scores = self.tables.insert_scores(g, lt, torch.zeros_like(k), ht.step)
            idx, res, _ = self._place(g, k, lt, scores, held=None, exact=True)
            new = res != InsertResult.ASSIGNED
            self._fresh[g].index_copy_(0, idx, new)
            if not self._init_in_forward:
                self.tables.init_rows(idx, new, k, self._group_tables[g].to(keys.device).index_select(0, lt))
            pin[g] = slots.index_copy_(0, at, idx)  # every key's slot, in the batch's order

    def stored(self, g: int, slots: torch.Tensor) -> torch.Tensor:
        fresh = self._fresh[g]
        if fresh is None or not bool(fresh.any()):
            return slots
        return slots.masked_fill(fresh.index_select(0, slots.clamp(min=0)) & (slots >= 0), -1)

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
            block[have.to(w.device)] = w[r[have].to(w.device)]
            if self.cached[t] and bool((~have).any()):
                miss = where_true(~have)
                found, rows, _ = self.store.read(self.names[t], ukeys[sel][miss].cpu())
                block[miss[found].to(w.device)] = rows[found].to(device=w.device, dtype=w.dtype)
                have[miss[found]] = True
            local[sel] = torch.where(have, torch.arange(sel.numel(), device=ukeys.device), -1)
            blocks.append(block)
        return ops.emb_forward(blocks, local, ukeys, inverse, offsets, feature_table, self.dims, per_sample_weights,
                               pooling, self.eval_init_params, self.seed, output_dtype)

    def _settle(self) -> None:
        """Takes the provisional keys out of the cache: those that pending
        prefetches made new, whose rows are initial values no forward has
        used. What reads or writes the tiers as a whole (flush, export, stats,
        eval lookups, loads) then sees only keys that training forwards
        stored, as without prefetch; a settled batch's forward stores its new
        keys again, with the same initial rows."""
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

    # ---- checkpoints, export, accounting ------------------------------------------------------

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
        self.custom_scores[t] = int(state.get("custom_score", 0))
        if rules.score_is_clock(self.strategy(t)) and "clock" in state:
            self.store.shift_scores(self.names[t], self.now(t) - int(state["clock"]))

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
        for t in range(self.num_tables):
            if not self.cached[t]:
                continue
            g, lt = self.group_of[t]
            w = self._weights[t]
            for b in self.groups[g][0].export(table_id=lt):
                self._put(t, b.keys, w.index_select(0, (b.indices - self._cache_begin[t]).to(w.device)), b.scores)
            self.tables.clear_table(t)
            self.store.save_state(self.names[t], {"module": state or {}, "custom_score": self.custom_scores[t],
                                                  "clock": self.now(t), "layout": self._layout(t)})
        self.store.flush()

    def close(self) -> None:
        if self.owns_store:
            self.store.close()

    def export_rows(self, table_id, batch_size=1 << 16, lazy=False):
        self._settle()
        yield from self.tables.export_rows(table_id, batch_size, lazy)
        if self.cached[table_id]:
            dim = self.dims[table_id]
            for keys, rows, scores in self.store.items(self.names[table_id], batch_size):
                yield RowBatch(keys.to(self.device), rows[:, :dim], rows[:, dim:], scores.to(self.device), None)

    def export(self, table_id, batch_size=1 << 16, threshold=None):
        self._settle()
        yield from self.tables.export(table_id, batch_size, threshold)
        if self.cached[table_id]:
            for keys, rows, scores in self.store.items(self.names[table_id], batch_size):
                if threshold is not None:
                    keep = scores >= threshold
                    keys, rows, scores = keys[keep], rows[keep], scores[keep]
                if keys.numel():
                    yield keys.to(self.device), rows.to(self.device), scores.to(self.device)

    def load_rows(self, table_id, batch: RowBatch) -> None:
        self._settle()
        if not self.cached[table_id]:
            return self.tables.load_rows(table_id, batch)
        dim = self.dims[table_id]
        state = batch.optimizer_state
        if state is None or state.shape[1] == 0:
            state = torch.zeros(batch.keys.numel(), self.widths[table_id] - dim, dtype=batch.values.dtype)
        rows = torch.cat([batch.values.cpu(), state.cpu().to(batch.values.dtype)], 1)
        lost = self.store.put(self.names[table_id], batch.keys.cpu(), rows, batch.scores.cpu().to(torch.int64))
        if lost:
            raise RuntimeError(f"dynamicemb: table {self.names[table_id]!r}: {lost} of the loaded keys do not fit "
                               f"(at most {self.table_max_rows[table_id]} rows on this rank)")

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
        return self.table_max_rows[table_id] if self.cached[table_id] else self.tables.max_rows(table_id)

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
                 write_backs=c[_T.WRITE_BACKS], cache_rows=cache_rows, store_rows=store_rows,
                 cache_capacity=self.capacity(table_id))
        return s
