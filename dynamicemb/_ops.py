"""Loads the extension (which registers the dynamicemb:: ops) and registers the
fake kernels that let torch.compile / torch.export trace them."""
import torch

from dynamicemb import _C  # noqa: F401  (registers the TORCH_LIBRARY ops)

ops = torch.ops.dynamicemb
_lib = "dynamicemb::"


def _dynamic_len():
    return torch.library.get_ctx().new_dynamic_size()


@torch.library.register_fake(_lib + "table_lookup")
def _lookup_fake(slot_keys, slot_digests, table_buckets, keys, table_ids, bucket_capacity):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake(_lib + "table_lookup_refresh")
def _lookup_refresh_fake(slot_keys, slot_digests, slot_scores, slot_timestamps, table_buckets,
                         keys, table_ids, key_scores, strategy, bucket_capacity, call_score):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake(_lib + "table_insert")
def _insert_fake(slot_keys, slot_digests, slot_scores, slot_timestamps, slot_epochs,
                 table_buckets, sizes, counters, keys, table_ids, key_scores, strategy,
                 bucket_capacity, call_score, epoch):
    m = _dynamic_len()
    ev = [keys.new_empty(m) for _ in range(4)]
    return (torch.empty_like(keys), torch.empty_like(keys, dtype=torch.int8), *ev)


@torch.library.register_fake(_lib + "table_erase")
def _erase_fake(slot_keys, slot_digests, table_buckets, sizes, keys, table_ids, bucket_capacity):
    return torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake(_lib + "table_export_range")
def _export_range_fake(slot_keys, slot_digests, filter_scores, table_buckets, begin, end,
                       bucket_capacity, threshold):
    m = _dynamic_len()
    return tuple(slot_keys.new_empty(m) for _ in range(3))


@torch.library.register_fake(_lib + "table_rehash")
def _rehash_fake(slot_keys, slot_digests, slot_scores, slot_timestamps, old_table_buckets,
                 new_table_buckets, bucket_capacity):
    s = _dynamic_len()
    live = _dynamic_len()
    return (
        slot_keys.new_empty(s),
        slot_digests.new_empty(s),
        slot_scores.new_empty(s),
        slot_timestamps.new_empty(s if slot_timestamps.numel() else 0),
        slot_keys.new_empty(live),
        slot_keys.new_empty(live),
    )
