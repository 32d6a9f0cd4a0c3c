"""ScoredHashTable: (table id, int64 key) -> (row index, score), API.md §6.

A thin Python view over slot tensors; every operation is one vectorised op of
the extension (CPU now, CUDA with the CUDA backend). The table holds no values:
the row index it returns addresses a value storage kept by the caller.
"""
import time
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from dynamicemb import memory, rules
from dynamicemb._ops import ops, table_arg
from dynamicemb.contiguous import contiguous_as
from dynamicemb.host_copy import HostCopy
from dynamicemb.positions import where_true
from dynamicemb.types import DynamicEmbScoreStrategy, canonical_device, int64_score, int_like, strategy_code

# Insert calls are numbered 1.._MAX_EPOCH in each slot's one-byte epoch (the
# call that last wrote it); on wrapping every slot's epoch is cleared.
_EPOCH_DTYPE = torch.uint8
_MAX_EPOCH = torch.iinfo(_EPOCH_DTYPE).max  # table_rules.h kMaxEpoch


class EvictedKeys(NamedTuple):
    """Rows displaced by an insert, in the input order of the keys that displaced them."""

    keys: torch.Tensor
    table_ids: torch.Tensor
    indices: torch.Tensor  # the slot, now holding the new key
    scores: torch.Tensor  # the displaced key's score


class InsertOutput(NamedTuple):
    indices: torch.Tensor  # slot of each key, -1 where it failed
    results: torch.Tensor  # int8 InsertResult per key
    evicted: EvictedKeys


class ExportBatch(NamedTuple):
    keys: torch.Tensor
    table_ids: torch.Tensor
    indices: torch.Tensor
    scores: torch.Tensor


Scores = Union[None, int, torch.Tensor]


def _is_sequence(v) -> bool:
    """A list, tuple or 1-D array / tensor (not a scalar, nor a 0-d one)."""
    return isinstance(v, Sequence) or getattr(v, "ndim", 0) > 0


def _capacities(capacity, says: str, num_tables: int) -> List[int]:
    """Slots per table from one int (every table's) or one per table."""
    if not _is_sequence(capacity):
        return [int_like(capacity, says)] * num_tables
    caps = [int_like(c, says) for c in (capacity.tolist() if hasattr(capacity, "tolist") else capacity)]
    if len(caps) != num_tables:
        raise ValueError(f"capacity has {len(caps)} entries for {num_tables} tables")
    return caps


def doubling_capacities(init_rows: int, max_rows: int, bucket_capacity: int) -> Tuple[int, int]:
    """(initial, maximum) capacity in slots for a table that grows by
    doubling (grow takes multiples only): whole buckets, the maximum rounded
    up (by less than the initial capacity) so that the initial one doubles
    exactly into it."""
    max_b = -(-max(max_rows, 1) // bucket_capacity)
    init_b = -(-min(max(init_rows, 1), max_rows) // bucket_capacity)
    k = 0
    while (max_b >> (k + 1)) >= init_b:
        k += 1
    max_b = -(-max_b // (1 << k)) << k
    return (max_b >> k) * bucket_capacity, max_b * bucket_capacity


class ScoredHashTable:
    """A bucketed hash table of int64 keys with per-slot scores.

    One physical table serves ``num_tables`` logical tables, each with its own
    capacity (a range of buckets). ``capacity`` is one int for every table or
    a sequence of per-table capacities, each a multiple of ``bucket_capacity``.

    Scores, by strategy (``scores`` argument of insert / lookup):
      TIMESTAMP, NO_EVICTION: the table's clock at the call, ``now()`` (ignored).
      STEP: the step (an int; default ``self.step``).
      CUSTOMIZED: an int for all keys or an int64 tensor per key (required).
      LFU and (TIMESTAMP, LFU): access count, incremented by ``scores`` (an int
        or a per-key tensor; default 1). The pair also keeps the access time.
    """

    def __init__(
        self,
        capacity: Union[int, Sequence[int]],
        bucket_capacity: int = 128,
        score_strategy=DynamicEmbScoreStrategy.TIMESTAMP,
        num_tables: int = 1,
        device: Union[str, torch.device] = "cpu",
        table_names: Optional[Sequence[str]] = None,
    ):
        if not isinstance(bucket_capacity, int) or bucket_capacity <= 0 or bucket_capacity % 16:
            raise ValueError(f"bucket_capacity must be a positive multiple of 16, got {bucket_capacity!r}")
        num_tables = int_like(num_tables, "num_tables must be an int >= 1")
        if num_tables < 1:
            raise ValueError(f"num_tables must be >= 1, got {num_tables}")
        caps = _capacities(capacity, "capacity must be an int (slots per table) or one per table", num_tables)
        self.table_names = list(table_names) if table_names is not None else [str(t) for t in range(num_tables)]
        if len(self.table_names) != num_tables:
            raise ValueError(f"table_names has {len(self.table_names)} entries for {num_tables} tables")
        for t, c in enumerate(caps):
            self._check_capacity(t, c, bucket_capacity)
        self.device = canonical_device(device)
        self.bucket_capacity = bucket_capacity
        self.num_tables = num_tables
        self.strategy = strategy_code(score_strategy)
        self.step = 0  # the STEP strategy's default score
        self._clock_base: Optional[Tuple[int, int]] = None  # CUDA: (GPU timer, host monotonic_ns) read together
        self._epoch = 0
        self._set_layout(self._bucket_offsets([c // bucket_capacity for c in caps]))
        self._alloc_slots(sum(caps))
        self.sizes = torch.zeros(num_tables, dtype=torch.int64, device=self.device)
        self._sizes_seen = HostCopy(self.sizes)  # after each insert: growth checks read it without waiting
        # Per table, columns rules.TableCounter: inserted (new keys stored), evicted, failed.
        self.counters = torch.zeros(num_tables, len(rules.TableCounter), dtype=torch.int64, device=self.device)

    # ---- layout --------------------------------------------------------------------

    def _check_capacity(self, t: int, c: int, bucket_capacity: int) -> None:
        if not isinstance(c, int) or c <= 0 or c % bucket_capacity:
            raise ValueError(
                f"table {self.table_names[t]!r}: capacity {c!r} must be a positive multiple "
                f"of bucket_capacity ({bucket_capacity})"
            )

    def _set_layout(self, table_buckets: torch.Tensor) -> None:
        # The layout also on the host: capacities are read every step (growth
        # checks), and reading a CUDA tensor would wait for the device.
        self._table_buckets = table_buckets
        self._buckets_host: List[int] = table_buckets.tolist()

    def _bucket_offsets(self, buckets: List[int]) -> torch.Tensor:
        # Kernels read the layout on the host (CPU) or the device (CUDA).
        offsets = torch.tensor([0] + buckets, dtype=torch.int64).cumsum(0)
        return offsets.to(self.device)

    def _alloc_slots(self, num_slots: int) -> None:
        self.slot_keys = memory.zeros(num_slots, torch.int64, self.device)
        self.slot_digests = memory.zeros(num_slots, torch.uint8, self.device)  # all kEmpty
        self.slot_scores = memory.zeros(num_slots, torch.int64, self.device)
        n_ts = num_slots if rules.keeps_timestamps(self.strategy) else 0
        self.slot_timestamps = memory.zeros(n_ts, torch.int64, self.device)
        self.slot_epochs = memory.zeros(num_slots, _EPOCH_DTYPE, self.device)

    @property
    def table_buckets(self) -> torch.Tensor:
        """int64 [num_tables + 1]: table t owns buckets [tb[t], tb[t+1])."""
        return self._table_buckets

    def _table_id(self, table_id: int) -> int:
        """A table id given to a per-table method, checked (no negative wrap-around)."""
        if isinstance(table_id, bool) or not isinstance(table_id, int) or not 0 <= table_id < self.num_tables:
            raise ValueError(f"table id {table_id!r} is out of range [0, {self.num_tables})")
        return table_id

    def table_slot_range(self, table_id: int) -> Tuple[int, int]:
        table_id = self._table_id(table_id)
        tb = self._buckets_host
        return tb[table_id] * self.bucket_capacity, tb[table_id + 1] * self.bucket_capacity

    # ---- inputs --------------------------------------------------------------------

    def _keys(self, keys: torch.Tensor) -> torch.Tensor:
        if not isinstance(keys, torch.Tensor):
            raise TypeError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
        if keys.dtype.is_floating_point or keys.dtype.is_complex or keys.dtype == torch.bool:
            raise TypeError(f"keys must be an integer tensor (int64), got {keys.dtype}")
        if keys.dim() != 1:
            raise ValueError(f"keys must be 1-D, got shape {tuple(keys.shape)}")
        if keys.device != self.device:
            raise ValueError(f"keys are on {keys.device}, the table is on {self.device}")
        return contiguous_as(keys, torch.int64)

    def _per_key(self, value, n: int, what: str) -> Optional[torch.Tensor]:
        """None, or an int64 tensor of n entries, from an int or a tensor."""
        if value is None:
            return None
        if not isinstance(value, torch.Tensor) and not isinstance(value, bool) and hasattr(value, "__index__"):
            # An int (or numpy integer) for every key, in int64's range.
            return torch.full((n,), int64_score(value, what), dtype=torch.int64, device=self.device)
        if (not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype.is_complex
                or value.dtype == torch.bool):
            raise TypeError(f"{what} must be an int or an integer tensor, got {value!r:.80}")
        if value.dim() != 1 or value.numel() != n:
            raise ValueError(f"{what} must be 1-D with one entry per key ({n}), got shape {tuple(value.shape)}")
        return contiguous_as(value, torch.int64, self.device)

    def _table_ids(self, table_ids, n: int) -> Optional[torch.Tensor]:
        if table_ids is None:
            if self.num_tables > 1:
                raise ValueError(f"table_ids are required: the table holds {self.num_tables} logical tables")
            return None
        if isinstance(table_ids, int) and not 0 <= table_ids < self.num_tables:
            raise ValueError(f"table id {table_ids} is out of range [0, {self.num_tables})")
        return self._per_key(table_ids, n, "table_ids")

    def _scores(self, scores: Scores, n: int) -> Tuple[int, Optional[torch.Tensor]]:
        """(call score, per-key scores) for the kernels, per the strategy."""
        s = self.strategy
        if rules.scored_by_step(s):
            if isinstance(scores, torch.Tensor):
                raise TypeError("STEP scores take one step number (an int) per call")
            return int64_score(self.step if scores is None else scores, "STEP insert"), None
        if rules.scored_by_caller(s):
            if scores is None:
                raise ValueError("the CUSTOMIZED score strategy needs scores (an int or a tensor per key)")
            if not isinstance(scores, torch.Tensor):
                return int64_score(scores, "CUSTOMIZED score"), None
            return 0, self._per_key(scores, n, "scores")
        if rules.counts_accesses(s):  # frequencies; the call score is the clock (the access time)
            return self.now(), self._per_key(scores, n, "scores")
        return self.now(), None  # the clock

    def now(self) -> int:
        """The table's clock in ns, which the clock strategies score with:
        time.monotonic_ns() on the CPU; on CUDA the GPU's global timer, read
        once and then advanced by the host's monotonic clock (reading it at
        every call would wait for the device)."""
        if self.device.type == "cpu":  # table_clock's clock there (tests/table/test_table_ops.py), without an op
            return time.monotonic_ns()
        if self._clock_base is None:
            self._clock_base = (int(ops.table_clock(self.slot_scores).item()), time.monotonic_ns())
        gpu, host = self._clock_base
        return gpu + time.monotonic_ns() - host

    def _next_epoch(self) -> int:
        self._epoch += 1
        if self._epoch > _MAX_EPOCH:  # wrap: forget which call held which slot
            self.slot_epochs.zero_()
            self._epoch = 1
        return self._epoch

    # ---- operations ----------------------------------------------------------------

    def hold(self, indices: torch.Tensor) -> None:
        """Begins an insert call that holds the slots at ``indices`` as if it
        had placed them (it never evicts them; their scores are untouched).
        Continue the call with ``insert(..., same_call=True)``. ``indices``
        are slots (>= 0): a -1 from ``lookup`` would hold the last slot, and
        is refused for CPU tensors (on a device the check would wait for it)."""
        if indices.device.type == "cpu" and indices.numel() and int(indices.min()) < 0:
            raise ValueError("hold: indices must be slots (>= 0); leave out the -1 of keys lookup did not find")
        epoch = self._next_epoch()
        self.slot_epochs.index_fill_(0, indices, epoch)

    def lookup(self, keys: torch.Tensor, table_ids=None, update_score: bool = False,
               scores: Scores = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(indices, found): the slot of each key, -1 where missing. With
        ``update_score`` the found keys' scores are refreshed as on access."""
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel())
        if not update_score:
            return ops.table_lookup(table_arg(self), keys, tids, self.bucket_capacity)
        call, per_key = self._scores(scores, keys.numel())
        return ops.table_lookup_refresh(table_arg(self), keys, tids, per_key, self.strategy, self.bucket_capacity,
                                        call)

    def refresh(self, indices: torch.Tensor, scores: Scores = None) -> None:
        """Scores an access of the keys at distinct slots ``indices`` (-1:
        none), as ``lookup(update_score=True)`` would, without finding them."""
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64 or indices.dim() != 1:
            raise TypeError(f"indices must be a 1-D int64 tensor, got {indices!r:.80}")
        call, per_key = self._scores(scores, indices.numel())
        ops.table_refresh(table_arg(self), indices.to(self.device).contiguous(), per_key, self.strategy, call)

    def lookup_gather(self, keys: torch.Tensor, values: torch.Tensor, table_ids=None,
                      out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, indices, found): ``lookup`` and the gather of each key's
        row of ``values`` in one op ([capacity, dim], float32 / float16 /
        bfloat16, on the table's device, indexed by slot). ``rows`` is
        [len(keys), dim] of values' dtype (``out`` when given), zeros where a
        key is missing. Scores are not refreshed."""
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel())
        if not isinstance(values, torch.Tensor) or values.dim() != 2:
            raise ValueError(f"values must be a 2-D tensor [capacity, dim], got {getattr(values, 'shape', values)!r:.80}")
        if out is None:
            out = values.new_empty((keys.numel(), values.shape[1]))
        idx, found = ops.table_lookup_gather(table_arg(self), keys, tids, self.bucket_capacity, values, out)
        return out, idx, found

    def insert(self, keys: torch.Tensor, table_ids=None, scores: Scores = None, evict=True,
               same_call: bool = False, list_evicted: bool = True, track_sizes: bool = True,
               key_count: Optional[torch.Tensor] = None, hold_stored: bool = False) -> InsertOutput:
        """Finds or stores every key (see API.md §6 for the exact rules).

        ``evict``: False (or a per-table sequence of bools) makes a key whose
        bucket is full fail instead of evicting, for a table its owner can
        still grow. ``same_call`` continues the previous insert call: the keys
        it placed or found stay held (never evicted), also across a grow in
        between. ``list_evicted=False`` leaves ``evicted`` empty (the results
        still say EVICTED): on CUDA, listing them waits for their count.
        ``track_sizes=False`` skips the copy of the sizes that
        sizes_at_most reads (it then says None), for a caller that will not
        ask: one device-to-host copy less per call on CUDA. ``key_count``
        (int64 [1] on the table's device) makes the keys from that position
        on padding: index -1, result ASSIGNED, nothing found, stored, held or
        counted (emb_unique_padded's padding; the count never leaves the device).
        ``hold_stored=True`` finds and holds the keys stored when the call
        begins before it places the others (each group in input order), so
        that no new key of the call evicts a key the call also names: what a
        training step wants, where a batch's trained rows must survive its
        new ids (with the default, a new key earlier in the input may evict a
        later one, which then comes back as new with an initial row)."""
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel())
        call, per_key = self._scores(scores, keys.numel())
        evictable = None
        if evict is not True:
            flags = [bool(evict)] * self.num_tables if isinstance(evict, bool) else [bool(e) for e in evict]
            if len(flags) != self.num_tables:
                raise ValueError(f"evict has {len(flags)} flags for {self.num_tables} tables")
            evictable = torch.tensor(flags, dtype=torch.bool, device=self.device)
        epoch = self._epoch if same_call and self._epoch > 0 else self._next_epoch()
        idx, res, ek, et, ei, es = ops.table_insert(table_arg(self), keys, tids, per_key, self.strategy,
                                                    self.bucket_capacity, call, epoch, evictable, list_evicted,
                                                    key_count, hold_stored)
        self._sizes_seen = HostCopy(self.sizes) if track_sizes else None
        return InsertOutput(idx, res, EvictedKeys(ek, et, ei, es))

    def erase(self, keys: torch.Tensor, table_ids=None) -> torch.Tensor:
        """Removes the keys; returns a bool mask of the keys that were present."""
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel())
        return ops.table_erase(table_arg(self), keys, tids, self.bucket_capacity)

    def take(self, keys: torch.Tensor, table_ids=None, slot_values: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Removes the keys (as erase); returns what the removed ones held:
        their positions in keys (ascending; a repeated key at its first),
        their slots' entries of ``slot_values`` (int64 per slot, e.g. a key
        index's row positions; default: the slots) and their scores."""
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel())
        if slot_values is None:
            slot_values = torch.arange(self.slot_keys.numel(), device=self.device)
        if self.device.type == "cpu":  # one lookup
            return ops.table_take(table_arg(self), keys, tids, self.bucket_capacity, slot_values)
        slots, _ = self.lookup(keys, tids)
        at = where_true(self.erase(keys, tids))
        held = slots.index_select(0, at)
        return at, slot_values.index_select(0, held), self.slot_scores.index_select(0, held)

    def export(self, threshold: Optional[int] = None, batch_size: int = 1 << 16,
               table_id: Optional[int] = None) -> Iterator[ExportBatch]:
        """Yields the live entries in slot order, in batches of at most
        ``batch_size`` slots scanned; with ``threshold``, only entries whose
        score is >= threshold (for (TIMESTAMP, LFU): whose access time is)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if threshold is not None:
            threshold = int64_score(threshold, "export")
        begin, end = (0, self.slot_keys.numel()) if table_id is None else self.table_slot_range(table_id)
        filt = None
        if threshold is not None:
            filt = self.slot_timestamps if rules.keeps_timestamps(self.strategy) else self.slot_scores
        for b in range(begin, end, batch_size):
            keys, tids, idx = ops.table_export_range(table_arg(self), filt, b, min(end, b + batch_size),
                                                     self.bucket_capacity, 0 if threshold is None else threshold)
            if keys.numel():
                yield ExportBatch(keys, tids, idx, self.slot_scores[idx])

    def live_in(self, begin: int, end: int, batch_size: int = 1 << 20) -> int:
        """Live entries in slots [begin, end)."""
        return sum(int(ops.table_export_range(table_arg(self), None, b, min(end, b + batch_size),
                                              self.bucket_capacity, 0)[0].numel())
                   for b in range(begin, end, batch_size))

    def grow(self, new_capacity: Union[int, Sequence[int]], table_id: Optional[int] = None
             ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rebuilds the table with larger capacities, keeping every entry and
        score. ``new_capacity`` is for ``table_id``, or for every table (an
        int or per-table list); each must be a multiple of the current one.
        Returns (old_indices, new_indices) of every entry, so that the caller
        can move its rows."""
        caps = self.capacities()
        if table_id is not None:
            if _is_sequence(new_capacity):
                raise TypeError(f"grow: with table_id, new_capacity is that table's (one int), got {new_capacity!r}")
            caps[self._table_id(table_id)] = int_like(new_capacity, "grow: capacities are ints (slots)")
        else:
            caps = _capacities(new_capacity, "grow: capacities are ints (slots)", self.num_tables)
        old = self.capacities()
        for t, (c, o) in enumerate(zip(caps, old)):
            self._check_capacity(t, c, self.bucket_capacity)
            if c < o or c % o:
                raise ValueError(f"table {self.table_names[t]!r}: new capacity {c} must be a multiple of "
                                 f"the current capacity {o}")
        new_tb = self._bucket_offsets([c // self.bucket_capacity for c in caps])
        keys, digests, scores, ts, old_idx, new_idx = ops.table_rehash(table_arg(self), new_tb, self.bucket_capacity)
        # Allocated before any member changes: a failed allocation leaves the table as it was.
        epochs = memory.zeros(keys.numel(), _EPOCH_DTYPE, self.device)
        epochs[new_idx] = self.slot_epochs[old_idx]  # slots held by the current call stay held
        self.slot_keys, self.slot_digests, self.slot_scores, self.slot_timestamps = keys, digests, scores, ts
        self.slot_epochs = epochs
        self._set_layout(new_tb)
        return old_idx, new_idx

    # ---- accounting ----------------------------------------------------------------

    def size(self, table_id: Optional[int] = None) -> int:
        """Live keys of one table, or of all tables."""
        return int(self.sizes.sum() if table_id is None else self.sizes[self._table_id(table_id)])

    def capacities(self) -> List[int]:
        tb = self._buckets_host
        return [(e - b) * self.bucket_capacity for b, e in zip(tb, tb[1:])]

    def sizes_at_most(self) -> Optional[List[int]]:
        """Per table, an upper bound of its live keys, read without waiting
        for the device: the sizes as of the last insert (keys only leave
        since), or None while the device has not yet produced them (or the
        last insert did not track them)."""
        seen = self._sizes_seen
        return seen.host.tolist() if seen is not None and seen.landed() else None

    def capacity(self, table_id: Optional[int] = None) -> int:
        caps = self.capacities()
        return sum(caps) if table_id is None else caps[self._table_id(table_id)]

    def load_factor(self, table_id: Optional[int] = None) -> float:
        return self.size(table_id) / self.capacity(table_id)

    def get_counters(self, table_id: Optional[int] = None) -> dict:
        """{"inserted", "evicted", "failed"} since the last reset, of one table or all."""
        c = self.counters.sum(0) if table_id is None else self.counters[self._table_id(table_id)]
        return dict(zip(rules.TABLE_COUNTERS, c.tolist()))

    def reset_counters(self, table_id: Optional[int] = None) -> None:
        """Zeroes the counters of one table, or of all."""
        if table_id is None:
            self.counters.zero_()
        else:
            self.counters[self._table_id(table_id)].zero_()

    def scores_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The scores at slots ``indices``; 0 where an index is -1 (a key lookup did not find)."""
        return torch.where(indices >= 0, self.slot_scores[indices.clamp(min=0)], 0)

    def timestamps_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Access times of (TIMESTAMP, LFU) tables; for other strategies the
        score already is the access time or step."""
        if not rules.keeps_timestamps(self.strategy):
            raise ValueError("timestamps are kept only by the (TIMESTAMP, LFU) strategy")
        return self.slot_timestamps[indices]
