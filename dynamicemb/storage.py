"""Where the rows of a module's tables live.

`EmbeddingStorage` (storage_protocol.py) is the interface the embedding
module and the checkpoints use: the module asks for the rows of unique keys
(finding, inserting and initialising them), and its kernels read and update
those rows in place through `weights()`. A row is [value (dim) | optimizer
state], in the table's storage dtype.
`HashTableStorage` keeps every row in one tier (host memory on CPU, device
memory on CUDA); host-memory and cache tiers implement the same interface.
"""
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from dynamicemb import memory, rules
from dynamicemb._ops import ops
from dynamicemb.admission import AdmissionCounter
from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.positions import where_true
from dynamicemb.storage_protocol import (EmbeddingStorage, FindOrInsertResult, RowBatch,  # noqa: F401 - RowBlocks: re-exported
                                         RowBlocks)
from dynamicemb.table import InsertOutput, ScoredHashTable, doubling_capacities
from dynamicemb.table_rows import TableRows, kernel_weights, new_parts
from dynamicemb.types import InsertResult, strategy_code, strategy_of

_STATE_COLUMN = rules.INIT_ARGS.index("state")  # of the packed initializer

# FAILED as a plain int: a tensor compared with an IntEnum member pays ~1 us
# more in the argument parser.
_FAILED = int(InsertResult.FAILED)


def _slot_rows(slots: torch.Tensor, begin: torch.Tensor) -> torch.Tensor:
    """A key's row: its hash table slot less its table's first slot (begin); -1 stays -1
    (row_parts.h slot_row's rule, for find's rows; a step's come from emb_slot_rows_init)."""
    return torch.where(slots >= 0, slots - begin, slots)


class Placement:
    """Where a HashTableStorage's step stores keys it lacks, for a storage
    that holds it (a tiered storage: the key's row may come from another
    tier, and the evicted rows go there). The table calls these instead of
    its own rules when built with `placement=`."""

    def insert(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores) -> InsertOutput:
        """Stores distinct keys of group g (HashTableStorage.insert_growing's contract)."""
        raise NotImplementedError

    def stored(self, g: int, slots: torch.Tensor) -> torch.Tensor:
        """find's slots of group g, -1 for a key that is there but not stored yet."""
        return slots

    def stored_anywhere(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        """Whether each key of group g is stored in some tier (`slots`: its
        slot in the table, -1 where missing): admission counts only the others."""
        return self.stored(g, slots) >= 0


def capacities_of(o: DynamicEmbTableOptions) -> Tuple[int, int]:
    """A table's (initial, maximum) capacity in slots: its init_capacity and
    max_capacity as it allocates them (doubling_capacities; the planner
    charges the maximum)."""
    return doubling_capacities(o.init_capacity or o.max_capacity, o.max_capacity, o.bucket_capacity)


class HashTableStorage(EmbeddingStorage):
    """Rows addressed by a ScoredHashTable slot: one physical hash table per
    (score strategy, bucket capacity) group of tables (usually one for all)."""

    def __init__(self, names: Sequence[str], options: Sequence[DynamicEmbTableOptions], state_widths: Sequence[int],
                 dtype: torch.dtype, device: torch.device, seed: int, streams: Optional[Sequence[int]] = None,
                 placement: Optional["Placement"] = None, state_inits: Optional[Sequence[float]] = None):
        self.names = list(names)
        # Who stores a step's new keys (find_or_insert, insert_rows, load_rows): this table itself
        # (insert_growing) or, for a tiered storage that holds this one, that storage (Placement).
        self.placement = placement
        self.options = list(options)
        self.dims = [o.dim for o in options]
        self.num_tables = len(options)
        self.device = device
        self.dtype = dtype
        self.seed = seed
        # Random stream of each table's initializer (default: its index).
        self.streams = list(streams) if streams is not None else list(range(len(options)))
        if len(self.streams) != len(options) or any(not 0 <= s < 2**31 for s in self.streams):
            raise ValueError(f"init streams must be {len(options)} ints in [0, 2**31), got {streams}")
        # Where a new row's optimizer state starts (0, or the optimizer's
        # initial_accumulator_value): the init kernels read it from init_params.
        states = list(state_inits) if state_inits is not None else [0.0] * len(options)
        self.init_params = self._packed([o.initializer_args for o in options], states)
        # What a training read of a key with no row gets (not admitted yet, or
        # failed): the admission strategy's initializer where it names one.
        self.unstored_init_params = self._packed([
            (o.admit_strategy.get_initializer_args() if o.admit_strategy is not None else None) or o.initializer_args
            for o in options], states)
        self.eval_init_params = self._packed([o.eval_initializer_args for o in options])
        init_caps, self.max_caps = zip(*(capacities_of(o) for o in options))
        # Groups of tables sharing one physical hash table.
        groups: Dict[tuple, List[int]] = {}
        for t, o in enumerate(options):
            # A cached table's cache never grows: it does not share a hash table with tables that do.
            groups.setdefault((strategy_code(o.score_strategy), o.bucket_capacity, o.caching), []).append(t)
        self.groups = []  # (ScoredHashTable, global table ids)
        self._group_tids = {}  # (group, device) -> its global table ids as a tensor there
        self.group_of = [None] * self.num_tables  # t -> (group index, table id in the group)
        for gi, ((code, bc, _), tables) in enumerate(groups.items()):
            ht = ScoredHashTable([init_caps[t] for t in tables], bucket_capacity=bc, score_strategy=strategy_of(code),
                                 num_tables=len(tables), device=device, table_names=[names[t] for t in tables])
            self.groups.append((ht, tables))
            for lt, t in enumerate(tables):
                self.group_of[t] = (gi, lt)
        self._table_group = [g for g, _ in self.group_of]
        self._table_local = [lt for _, lt in self.group_of]
        # A hybrid table (table_rows.py): the rows past its share of
        # global_hbm_for_values live in host memory, read and updated in
        # place by the kernels (mapped, no copies). None: every row on the device.
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.head_rows = [o.hbm_rows((self.dims[t] + state_widths[t]) * itemsize) for t, o in enumerate(options)]
        # How far each table may grow (memory_budget): growth is checked here, before allocating.
        self.budgets = [memory.TableBudget(names[t], (self.dims[t] + state_widths[t]) * itemsize, self.max_caps[t],
                                           o.memory_budget, o.grows_past_max_capacity) for t, o in enumerate(options)]
        self.limit_caps = [b.limit for b in self.budgets]
        parts = [self._new_rows(t, init_caps[t], self.dims[t] + state_widths[t]) for t in range(self.num_tables)]
        # Each table's head (its rows when whole) and tail (None: none). A
        # tiered storage's cache holds _weights by reference and grows a table
        # by replacing its entry.
        # One group holding every table in order: a step's keys need no split by group.
        self._one_group = len(self.groups) == 1 and self.groups[0][1] == list(range(self.num_tables))
        self._weights = [r.head for r in parts]
        self._tails = [r.tail for r in parts]
        self._slot_begin = [self._group_slot_begin(g) for g in range(len(self.groups))]
        self._table_slot_begin = self._per_table_slot_begin()
        self.admission = [AdmissionCounter(o.admit_strategy, o.admission_counter, n, device) if o.admit_strategy
                          else None for n, o in zip(names, options)]
        self.rejected = torch.zeros(self.num_tables, dtype=torch.int64)
        self.custom_scores = [0] * self.num_tables  # CUSTOMIZED: the score set by set_score
        self._custom_on_device = {}  # group -> (its tables' custom scores, the same on self.device)
        self.version = 0  # EmbeddingStorage.version: bumped by growth and eviction

    # ---- layout ----------------------------------------------------------------------

    def _packed(self, args, states=None) -> torch.Tensor:
        states = states or [0.0] * len(args)
        rows = []
        for name, a, o, s, st in zip(self.names, args, self.options, self.streams, states):
            try:
                rows.append(a.packed(o.num_embeddings or o.max_capacity, s, st))
            except ValueError as e:
                raise ValueError(f"table {name!r}: {e}") from None
        return torch.tensor(rows, dtype=torch.float64)

    def state_init(self, table_id: int) -> float:
        """Where a new row's optimizer state starts (init_params' state column)."""
        return float(self.init_params[table_id, _STATE_COLUMN])

    def _new_rows(self, t: int, rows: int, width: int) -> TableRows:
        """Zero-filled rows of table t, split at its head rows."""
        return new_parts(rows, width, self.head_rows[t], self.dtype, self.device)

    def rows_of(self, t: int) -> TableRows:
        """Table t's rows (both parts of a hybrid table)."""
        return TableRows(self._weights[t], self._tails[t])

    def _group_slot_begin(self, g: int) -> torch.Tensor:
        ht, _ = self.groups[g]
        return (ht.table_buckets[:-1] * ht.bucket_capacity).to(self.device)

    def _per_table_slot_begin(self) -> torch.Tensor:
        """Each table's first slot in its group's hash table (its row 0)."""
        return torch.stack([self._slot_begin[g][lt] for g, lt in self.group_of]) if self.num_tables else \
            torch.zeros(0, dtype=torch.int64, device=self.device)

    def weights(self) -> List[torch.Tensor]:
        """The kernels' rows (table_rows.kernel_weights). For a module
        without a hybrid table, the storage's own list of each table's rows."""
        if all(tail is None for tail in self._tails):
            return self._weights
        return kernel_weights([self.rows_of(t) for t in range(self.num_tables)])

    def max_rows(self, t: int) -> int:
        """The most keys table t may hold on this rank (a NO_EVICTION table:
        as many as its memory budget allows)."""
        return self.limit_caps[t]

    def budget_reached(self, t: int) -> Optional[str]:
        """Why table t stores no more keys, when its memory budget is the
        reason (EmbeddingStorage.budget_reached)."""
        g, lt = self.group_of[t]
        ht = self.groups[g][0]
        return self.budgets[t].reached(lambda: ht.size(lt), ht.capacity(lt))

    def first_slot(self, t: int) -> int:
        """Table t's first slot in its group's hash table (the slot of its row 0)."""
        g, lt = self.group_of[t]
        return int(self._slot_begin[g][lt])

    def capacity(self, t: int) -> int:
        g, lt = self.group_of[t]
        return self.groups[g][0].capacity(lt)

    def size(self, t: int) -> int:
        g, lt = self.group_of[t]
        return self.groups[g][0].size(lt)

    # ---- lookups ----------------------------------------------------------------------

    def split(self, table_ids: torch.Tensor):
        """Per group: (mask of its keys or None when it has them all, local table ids)."""
        if self._one_group:
            yield 0, None, table_ids
            return
        local = torch.tensor([self.group_of[t][1] for t in range(self.num_tables)], device=self.device)
        group = torch.tensor([self.group_of[t][0] for t in range(self.num_tables)], device=self.device)
        gid = group[table_ids]
        for g in range(len(self.groups)):
            mask = gid == g
            yield g, mask, local[table_ids[mask]]

    def _rows(self, g: int, slots: torch.Tensor, local_tids: torch.Tensor) -> torch.Tensor:
        return _slot_rows(slots, self._slot_begin[g][local_tids])

    def find(self, keys: torch.Tensor, table_ids: torch.Tensor) -> torch.Tensor:
        rows = torch.full_like(keys, -1)
        for g, mask, lt in self.split(table_ids):
            ht = self.groups[g][0]
            k = keys if mask is None else keys[mask]
            slots, _ = ht.lookup(k, lt)
            if self.placement is not None:
                slots = self.placement.stored(g, slots)
            r = self._rows(g, slots, lt)
            if mask is None:
                rows = r
            else:
                rows[mask] = r
        return rows

    def lookup_forward(self, indices, offsets, feature_table, per_sample_weights, pooling, output_dtype):
        hts = [ht for ht, _ in self.groups]
        return ops.emb_lookup_forward([h.slot_keys for h in hts], [h.slot_digests for h in hts],
                                      [h.table_buckets for h in hts], [h.bucket_capacity for h in hts],
                                      self._table_group, self._table_local, self.weights(), indices, offsets,
                                      feature_table, self.dims, per_sample_weights, pooling, self.eval_init_params,
                                      self.seed, output_dtype)

    def insert_scores(self, g: int, local_tids: torch.Tensor, counts: torch.Tensor, step: int):
        """The scores an insert into group g gives its keys (ScoredHashTable.insert's `scores`)."""
        ht, tables = self.groups[g]
        if rules.scored_by_step(ht.strategy):
            return step
        if rules.scored_by_caller(ht.strategy):
            # Uploaded when they change (set_score), not every step: on CUDA the copy waits.
            scores = tuple(self.custom_scores[t] for t in tables)
            kept = self._custom_on_device.get(g)
            if kept is None or kept[0] != scores:
                kept = self._custom_on_device[g] = (scores, torch.tensor(scores, dtype=torch.int64, device=self.device))
            return kept[1][local_tids]
        if rules.counts_accesses(ht.strategy):
            return counts
        return None  # the table's clock

    def takes_padded_keys(self) -> bool:
        """One group of every table, no admission, no tiers, and every table
        at its maximum: the insert then reads no count on the host (no
        growth to decide), and table_insert's key_count leaves the padding out."""
        return self._whole_step_group() and all(self._at_max(0))

    def _whole_step_group(self) -> bool:
        """One group holds every table in order, none admits keys and no tier
        places them: a step's insert is that group's, whose outputs are the step's own."""
        return self._one_group and not any(self.admission) and self.placement is None

    def _at_max(self, g: int) -> List[bool]:
        """Per table of group g, whether it is at its maximum capacity (it evicts rather than grows)."""
        ht, tables = self.groups[g]
        return [c >= self.limit_caps[t] for c, t in zip(ht.capacities(), tables)]

    def _padding_refused(self) -> ValueError:
        return ValueError(f"dynamicemb: tables {self.names}: find_or_insert got padded keys (key_count), which only "
                          f"one group of tables at their maximum capacity, without admission or tiers, takes "
                          f"(takes_padded_keys)")

    def find_or_insert(self, keys, table_ids, counts, step, inverse=None, key_count=None) -> FindOrInsertResult:
        rejected = torch.zeros(self.num_tables, dtype=torch.int64)
        if key_count is not None and not self._whole_step_group():  # (capacities: in insert_growing)
            raise self._padding_refused()
        if self._one_group and not any(self.admission):
            # The usual step: one group holds every table and none admits keys
            # by counting, so its insert's outputs are the step's own (no
            # masks, copies or merges).
            slots, is_new, failed = self._find_or_insert_group(0, keys, table_ids, counts, step, rejected, key_count)
        else:
            slots = torch.full_like(keys, -1)  # in the key's group; its row is the slot less its table's first slot
            is_new = torch.zeros(keys.shape, dtype=torch.bool, device=keys.device)  # the key got a new row
            failed = torch.zeros(self.num_tables, dtype=torch.int64, device=keys.device)  # read later on CUDA
            try:
                self._find_or_insert_groups(keys, table_ids, counts, step, slots, is_new, failed, rejected)
            except RuntimeError:
                # A group failed (a cache too small for the step) after earlier
                # groups placed new keys: those get their initial rows, so that
                # every key stored holds a proper row when the step raises.
                self.init_rows(slots, is_new, keys, table_ids)
                raise
            self.rejected += rejected  # (the whole group has no admission: nothing to add)
        if keys.device.type == "cpu":  # new keys' initial rows written, and the keys returned, in row order
            given = keys.new_empty(0) if inverse is None else inverse
            _, rows, keys, table_ids, renumbered = ops.emb_row_order_init(
                self.weights(), slots, self._table_slot_begin, table_ids, keys, is_new, given, self.dims,
                self.init_params, self.seed)
            inverse = None if inverse is None else renumbered
        else:
            rows = self.init_rows(slots, is_new, keys, table_ids)
        return FindOrInsertResult(keys, table_ids, rows, inverse, failed, rejected)

    def init_rows(self, slots, is_new, keys, table_ids) -> torch.Tensor:
        """Writes the initial rows of the new keys; returns every key's row.
        (A CPU step initialises its new rows in find_or_insert's row-order
        pass; this serves other devices, and a step that fails.) One op:
        the rows are the table's own slots, so a bad one is skipped, and
        nothing waits for the device."""
        return ops.emb_slot_rows_init(self.weights(), slots, self._table_slot_begin, table_ids, keys, is_new,
                                      self.dims, self.init_params, self.seed)

    def _find_or_insert_groups(self, keys, table_ids, counts, step, slots, is_new, failed, rejected) -> None:
        """find_or_insert's inserts, group by group: fills slots, is_new,
        failed and rejected in place."""
        for g, mask, lt in self.split(table_ids):
            k = keys if mask is None else keys[mask]
            c = counts if mask is None else counts[mask]
            at = None if mask is None else where_true(mask)  # the group's keys' positions; None: all
            g_slots, g_new, g_failed = self._find_or_insert_group(g, k, lt, c, step, rejected)
            failed.index_add_(0, self._group_table_ids(g, failed.device), g_failed)
            if at is None:
                slots.copy_(g_slots)
                is_new.copy_(g_new)
            else:
                slots[at] = g_slots
                is_new[at] = g_new

    def _find_or_insert_group(self, g, keys, local_tids, counts, step, rejected, key_count=None):
        """Group g's keys found or stored: (their slots, -1 where not stored
        or not admitted; whether each got a new row; the failures per table
        of the group). Adds the keys admission turned away to `rejected`.
        key_count: the keys from key_count[0] on are padding (takes_padded_keys)."""
        _, tables = self.groups[g]
        keep, counted = self._admit(g, keys, local_tids, counts, rejected)
        if keep is None:
            out = self._store(g, keys, local_tids, self.insert_scores(g, local_tids, counts, step), key_count)
            return (out.indices, *ops.table_insert_outcome(out.results, local_tids, len(tables)))
        k, c, lt, counted = keys[keep], counts[keep], local_tids[keep], counted[keep]
        out = self._store(g, k, lt, self.insert_scores(g, lt, c, step))
        got_row, failed = ops.table_insert_outcome(out.results, lt, len(tables))
        # Admitted keys now stored (in any tier) leave the admission counters.
        gone = counted & (out.results != _FAILED)
        for t_local, t in enumerate(tables):
            if self.admission[t] is not None:
                self.admission[t].forget(k[gone & (lt == t_local)])
        at = where_true(keep)
        slots = torch.full_like(keys, -1)
        slots[at] = out.indices
        is_new = torch.zeros(keys.shape, dtype=torch.bool, device=keys.device)
        is_new[at] = got_row
        return slots, is_new, failed

    def _group_table_ids(self, g: int, device: torch.device) -> torch.Tensor:
        """Group g's table ids as a tensor on `device` (made once)."""
        if (g, device) not in self._group_tids:
            self._group_tids[(g, device)] = torch.tensor(self.groups[g][1], dtype=torch.int64, device=device)
        return self._group_tids[(g, device)]

    def _admit(self, g, keys, local_tids, counts, rejected):
        """(mask of the keys to insert, mask of those admitted by a counter),
        or (None, None) when no table of the group has admission."""
        _, tables = self.groups[g]
        if not any(self.admission[t] for t in tables):
            return None, None
        ht = self.groups[g][0]
        slots, found = ht.lookup(keys, local_tids)
        if self.placement is not None:  # a tiered storage: the keys it stores in any tier are found
            found = self.placement.stored_anywhere(g, keys, local_tids, slots)
        keep = found.clone()
        counted = torch.zeros_like(found)
        for lt, t in enumerate(tables):
            sel = (local_tids == lt) & ~found
            if self.admission[t] is None:
                keep |= sel
            elif bool(sel.any()):
                admitted = self.admission[t].admit(keys[sel], counts[sel])
                idx = sel.nonzero().squeeze(1)
                keep[idx[admitted]] = True
                counted[idx[admitted]] = True
                rejected[t] += int((~admitted).sum())
        return keep, counted

    # ---- growth ---------------------------------------------------------------------------

    def _grow_for(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor) -> None:
        """Doubles tables (up to their maximum) whose load factor would pass
        max_load_factor if this call's new keys were stored."""
        ht, tables = self.groups[g]
        caps = ht.capacities()
        lf = [self.options[t].max_load_factor for t in tables]
        growable = [lt for lt in range(len(tables)) if caps[lt] < self.limit_caps[tables[lt]]]
        # Without waiting for the device where the answer is sure: no table can grow, or
        # none would pass its load factor even if every key of the call were new in it.
        seen = ht.sizes_at_most() if growable else None
        if not growable or (seen is not None and
                            all(seen[lt] + keys.numel() <= lf[lt] * caps[lt] for lt in growable)):
            return
        self._grow_exact(g, keys, local_tids, caps, lf)

    def _grow_exact(self, g, keys, local_tids, caps, lf) -> None:
        """_grow_for's decision from the device's counts (waits for them)."""
        ht, tables = self.groups[g]
        upper = torch.bincount(local_tids, minlength=len(tables)).tolist()
        sizes = ht.sizes.tolist()
        suspects = [lt for lt in range(len(tables))
                    if sizes[lt] + upper[lt] > lf[lt] * caps[lt] and caps[lt] < self.limit_caps[tables[lt]]]
        if not suspects:
            return
        _, found = ht.lookup(keys, local_tids)
        missing = torch.bincount(local_tids[~found], minlength=len(tables)).tolist()
        new_caps = list(caps)
        for lt in suspects:
            while sizes[lt] + missing[lt] > lf[lt] * new_caps[lt] and new_caps[lt] < self.limit_caps[tables[lt]]:
                new_caps[lt] *= 2
        if new_caps != caps:
            self._grow_or_stop(g, new_caps)

    def _grow_or_stop(self, g: int, new_caps: List[int]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """_grow; when the memory is not there after all (the device's
        allocator refuses), smaller growths (halved targets), and None when
        not even one doubling fits: a table that cannot double stops at its
        capacity, as at its budget (its new keys fail, counted)."""
        ht, tables = self.groups[g]
        caps = ht.capacities()
        while True:
            try:
                return self._grow(g, new_caps)
            except RuntimeError as e:
                if not memory.allocation_failed(e):
                    raise
                smaller = [n // 2 if n > c else c for n, c in zip(new_caps, caps)]
                for lt, t in enumerate(tables):
                    if new_caps[lt] == 2 * caps[lt]:  # not even one doubling
                        self.limit_caps[t] = caps[lt]
                        self.budgets[t].refused(caps[lt], str(e))
                if smaller == caps:
                    return None
                new_caps = smaller

    def _grow(self, g: int, new_caps: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rebuilds group g's hash table at new_caps and moves every table's
        rows; returns the slot moves (old indices, new indices)."""
        ht, tables = self.groups[g]
        caps = ht.capacities()
        old_begin = [b * ht.bucket_capacity for b in ht.table_buckets.tolist()]
        # The new rows first, then the rehash: an allocation that fails changes nothing.
        grown = {lt: self._new_rows(t, new_caps[lt], self._weights[t].shape[1])
                 for lt, t in enumerate(tables) if new_caps[lt] != caps[lt]}
        old_idx, new_idx = ht.grow(new_caps)
        new_begin = [b * ht.bucket_capacity for b in ht.table_buckets.tolist()]
        for lt, t in enumerate(tables):
            sel = (old_idx >= old_begin[lt]) & (old_idx < old_begin[lt + 1])
            src, dst = old_idx[sel] - old_begin[lt], new_idx[sel] - new_begin[lt]
            if lt not in grown and torch.equal(src, dst):
                continue  # rows did not move
            w = self.rows_of(t)
            moved = grown[lt] if lt in grown else self._new_rows(t, new_caps[lt], w.shape[1])
            moved.write(dst, w.index_select(0, src))
            self._weights[t], self._tails[t] = moved.head, moved.tail
        self._slot_begin[g] = self._group_slot_begin(g)
        self._table_slot_begin = self._per_table_slot_begin()
        self.version += 1
        return old_idx, new_idx

    def _store(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores, key_count=None) -> InsertOutput:
        if self.placement is not None:
            return self.placement.insert(g, keys, local_tids, scores)
        return self.insert_growing(g, keys, local_tids, scores, key_count)

    def insert_growing(self, g: int, keys: torch.Tensor, local_tids: torch.Tensor, scores,
                       key_count=None) -> InsertOutput:
        """Inserts into group g, growing rather than evicting: first by load
        factor, then a table below its maximum fails a key whose bucket is
        full instead of evicting; such tables double and their failed keys are
        retried within the same call (keys placed so far stay held). Only a
        table at its maximum evicts; the keys it evicts are not listed (the
        output's evicted is empty, its results say EVICTED)."""
        ht, tables = self.groups[g]
        full = self._at_max(g)
        if not all(full):  # (a group at its maximum has nothing to grow)
            if key_count is not None:  # growth decisions read counts on the host
                raise self._padding_refused()
            self._grow_for(g, keys, local_tids)
            full = self._at_max(g)
        # The evicted keys are not listed (that would wait for the device):
        # a call in which a table may evict counts as having evicted.
        # A group whose tables are all at their maximum never grows: nothing reads its sizes before an insert.
        out = ht.insert(keys, local_tids, scores=scores, evict=True if all(full) else full, list_evicted=False,
                        track_sizes=not all(full), key_count=key_count, hold_stored=True)
        idx, res = out.indices, out.results
        may_have_evicted = any(full)
        while True:
            retry = []  # every table evicts: nothing to grow and retry (no count: no wait for the device)
            if not all(full):
                failed = res == InsertResult.FAILED
                per_table = torch.bincount(local_tids[failed], minlength=len(tables)).tolist()
                retry = [lt for lt, n in enumerate(per_table) if n and not full[lt]]
            if not retry:
                if may_have_evicted:
                    self.version += 1  # the evicted keys' rows now hold other keys
                return InsertOutput(idx, res, out.evicted)
            for lt in retry:  # the retry counts its own failures
                ht.counters[lt, rules.TableCounter.FAILED] -= per_table[lt]
            caps = ht.capacities()
            old_slots = ht.slot_keys.numel()
            moved = self._grow_or_stop(g, [min(2 * c, self.limit_caps[t]) if lt in retry else c
                                           for lt, (c, t) in enumerate(zip(caps, tables))])
            if moved is None:  # no memory for it: those keys stay failed
                for lt in retry:
                    ht.counters[lt, rules.TableCounter.FAILED] += per_table[lt]
                full = self._at_max(g)
                continue
            moved_from, moved_to = moved
            # The slots this call already returned moved with the rehash.
            remap = torch.full((old_slots,), -1, dtype=torch.int64, device=idx.device)
            remap[moved_from] = moved_to
            idx = torch.where(idx >= 0, remap[idx.clamp(min=0)], idx)
            full = self._at_max(g)
            sel = failed & torch.isin(local_tids, torch.tensor(retry, device=local_tids.device))
            sub_scores = scores[sel] if isinstance(scores, torch.Tensor) else scores
            again = ht.insert(keys[sel], local_tids[sel], scores=sub_scores, evict=True if all(full) else full,
                              same_call=True, list_evicted=False, hold_stored=True)
            may_have_evicted |= any(full)
            res = res.clone()
            idx[sel], res[sel] = again.indices, again.results

    def insert_rows(self, table_id, keys, values, optimizer_state=None, step=0):
        g, lt = self.group_of[table_id]
        ht, _ = self.groups[g]
        keys = keys.to(device=self.device, dtype=torch.int64).contiguous()
        dim = self.dims[table_id]
        if values.shape != (keys.numel(), dim):
            raise ValueError(f"table {self.names[table_id]!r}: values must have shape ({keys.numel()}, {dim}), "
                             f"got {tuple(values.shape)}")
        lts = torch.full_like(keys, lt)
        out = self._store(g, keys, lts, self.insert_scores(g, lts, torch.ones_like(keys), step))
        rows = self._rows(g, out.indices, lts)
        ok = where_true(rows >= 0)
        w = self.rows_of(table_id)
        w.columns(0, dim).write(rows[ok], values.to(w.device).index_select(0, ok))
        if optimizer_state is None:
            w.columns(dim).write(rows[ok], self.state_init(table_id))
        else:
            w.columns(dim).write(rows[ok], optimizer_state.to(w.device).reshape(keys.numel(), -1).index_select(0, ok))
        return rows

    # ---- checkpoint state ------------------------------------------------------------------------

    def now(self, table_id: int) -> int:
        """The clock of a table's hash table (ScoredHashTable.now)."""
        return self.groups[self.group_of[table_id][0]][0].now()

    def strategy(self, table_id: int) -> int:
        """The score strategy code (types.strategy_code) of a table."""
        g, _ = self.group_of[table_id]
        return self.groups[g][0].strategy

    def admission_counter(self, table_id: int) -> Optional[AdmissionCounter]:
        return self.admission[table_id]

    def export_rows(self, table_id: int, batch_size: int = 1 << 16, lazy: bool = False) -> Iterator[RowBatch]:
        """Every entry of one table, in slot order: keys, values, optimizer
        state, scores (and the (TIMESTAMP, LFU) access times), each batch
        read in one pass over the same slots. With lazy, values and optimizer
        state are RowBlocks read block by block when consumed (a dump streams
        them to disk without holding a batch's rows in memory)."""
        g, lt = self.group_of[table_id]
        ht = self.groups[g][0]
        begin, dim = int(self._slot_begin[g][lt]), self.dims[table_id]
        w = self.rows_of(table_id)
        for b in ht.export(batch_size=batch_size, table_id=lt):
            rows = b.indices - begin
            ts = ht.slot_timestamps[b.indices] if ht.slot_timestamps.numel() else None
            values, state = RowBlocks(w.columns(0, dim), rows), RowBlocks(w.columns(dim), rows)
            if not lazy:  # each gathered apart: each comes out contiguous, once
                values, state = values.materialize(), state.materialize()
            yield RowBatch(b.keys, values, state, b.scores, ts)

    def load_rows(self, table_id: int, batch: RowBatch, own_slots: bool = False) -> None:
        """Stores entries exactly as exported (values, optimizer state or a
        fresh one when None (state_init), scores), growing the table as needed. Raises, naming the
        table, when a key cannot be stored or displaces another: a load never
        drops keys silently. own_slots: in this storage's slots as they are,
        not through its placement and never evicting (a cache's share of a
        cached table's load)."""
        g, lt = self.group_of[table_id]
        ht, _ = self.groups[g]
        keys = batch.keys.to(device=self.device, dtype=torch.int64).contiguous()
        lts = torch.full_like(keys, lt)
        scores = self.insert_scores(g, lts, torch.ones_like(keys), 0)
        out = (ht.insert(keys, lts, scores=scores, evict=False, list_evicted=False) if own_slots
               else self._store(g, keys, lts, scores))
        failed = int((out.results == InsertResult.FAILED).sum())
        displaced = int((out.results == InsertResult.EVICTED).sum())  # (insert_growing lists no evicted keys)
        if failed or displaced:
            msg = (f"dynamicemb: table {self.names[table_id]!r}: {failed + displaced} of the loaded "
                   f"keys do not fit (capacity {ht.capacity(lt)} of at most {self.limit_caps[table_id]} rows on this "
                   f"rank)")
            why = self.budget_reached(table_id)
            raise RuntimeError(msg) if why is None else memory.DynamicEmbBudgetError(f"{msg}: {why}")
        idx = out.indices
        ht.slot_scores[idx] = batch.scores.to(device=self.device, dtype=torch.int64)
        if batch.timestamps is not None and ht.slot_timestamps.numel():
            ht.slot_timestamps[idx] = batch.timestamps.to(device=self.device, dtype=torch.int64)
        w, dim = self.rows_of(table_id), self.dims[table_id]
        rows = self._rows(g, idx, lts)
        w.columns(0, dim).write(rows, batch.values)
        if batch.optimizer_state is None or batch.optimizer_state.shape[1] == 0:
            w.columns(dim).write(rows, self.state_init(table_id))  # rows without state start fresh
        else:
            w.columns(dim).write(rows, batch.optimizer_state)

    # ---- export and accounting -----------------------------------------------------------------

    def export(self, table_id, batch_size=1 << 16, threshold=None):
        g, lt = self.group_of[table_id]
        ht = self.groups[g][0]
        begin = int(self._slot_begin[g][lt])
        for b in ht.export(threshold=threshold, batch_size=batch_size, table_id=lt):
            yield b.keys, self.rows_of(table_id).index_select(0, b.indices - begin), b.scores

    def stats(self, table_id):
        g, lt = self.group_of[table_id]
        ht = self.groups[g][0]
        out = dict(size=ht.size(lt), capacity=ht.capacity(lt), **ht.get_counters(lt),
                   admission_rejected=int(self.rejected[table_id]))
        if self.head_rows[table_id] is not None:  # a table with an HBM share: its keys in each part
            split = self.rows_of(table_id).split
            begin = self.first_slot(table_id)
            out["device_rows"] = ht.live_in(begin, begin + split)
            out.update(host_rows=out["size"] - out["device_rows"], device_capacity=split)
        return out

    def clear_table(self, table_id: int) -> int:
        """Removes every entry of one table (keys, scores, values and
        optimizer state; its capacity stays); other tables of the same
        physical hash table are untouched. Returns the number removed."""
        g, lt = self.group_of[table_id]
        ht = self.groups[g][0]
        keys = [b.keys for b in ht.export(table_id=lt)]
        removed = 0
        if keys:
            keys = torch.cat(keys)
            removed = int(ht.erase(keys, torch.full_like(keys, lt)).sum())
        self.rows_of(table_id).zero_()
        self.version += 1  # rows returned before belong to no key now
        return removed
