"""Storage tiers (API.md §1: global_hbm_for_values, caching): a cache of hot
rows in front of a backing store in host memory, in a file, or behind a
user's BackingStore."""
import os
from typing import Optional, Sequence

import torch

from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.storage import EmbeddingStorage, HashTableStorage
from dynamicemb.tiers.cache import CachedStorage
from dynamicemb.tiers.file_store import FileStore
from dynamicemb.tiers.nvidia_store import NvidiaStorageStore
from dynamicemb.tiers.store import BackingStore, HostStore

__all__ = ["BackingStore", "CachedStorage", "FileStore", "HostStore", "NvidiaStorageStore", "make_storage"]


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _backing_store(names: Sequence[str], options: Sequence[DynamicEmbTableOptions]) -> BackingStore:
    """The one store of a module's cached tables, from their options (an
    NVIDIA external_storage wrapped: one adapter per storage object)."""
    given = {id(o.backing_store): o.backing_store for o in options if o.caching and o.backing_store is not None}
    for o in options:
        key = ("nvidia", id(o.external_storage))
        if o.caching and o.external_storage is not None and o.backing_store is None and key not in given:
            ext = o.external_storage
            if isinstance(ext, type):  # NVIDIA passes a Storage class: built with the table's options
                ext = ext(o, None)
            given[key] = NvidiaStorageStore(ext)
    paths = {o.storage_path for o in options if o.caching and o.storage_path is not None}
    cached = [n for n, o in zip(names, options) if o.caching]
    if len(given) + len(paths) > 1:
        raise ValueError(f"cached tables {cached} of one module name different backing stores; give them one "
                         f"backing_store or one storage_path")
    if given:
        store = next(iter(given.values()))
        if not isinstance(store, BackingStore):
            raise TypeError(f"backing_store of tables {cached} must be a dynamicemb.tiers.BackingStore, got "
                            f"{type(store).__name__}")
        return store
    if paths:
        return FileStore(os.path.join(paths.pop(), f"rank{_rank():05d}"))
    return HostStore()


def make_storage(names: Sequence[str], options: Sequence[DynamicEmbTableOptions], state_widths: Sequence[int],
                 dtype: torch.dtype, device: torch.device, seed: int,
                 streams: Optional[Sequence[int]] = None,
                 state_inits: Optional[Sequence[float]] = None) -> EmbeddingStorage:
    """The storage a module's options ask for: one tier (HashTableStorage),
    or a cache in front of a backing store when a table has caching=True.
    state_inits: per table, where a new row's optimizer state starts (0 by default)."""
    if not any(o.caching for o in options):
        return HashTableStorage(names, options, state_widths, dtype, device, seed, streams, state_inits=state_inits)
    store = _backing_store(names, options)
    made_here = all(o.backing_store is not store for o in options)
    try:
        return CachedStorage(names, options, state_widths, dtype, device, seed, streams, store, owns_store=made_here,
                             state_inits=state_inits)
    except BaseException:
        if made_here:
            store.close()  # made here (storage_path): its locks and maps go with the error
        raise
