"""Loads the ops library (which registers the dynamicemb:: ops) and registers
the fake kernels that let torch.compile / torch.export trace them."""
import json
import os

import torch

# csrc/ built by setup.py: TORCH_LIBRARY registrations and kernels only, no
# Python module, so a C++ server loads the same file (examples/serve_cpp).
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libdynamicemb_ops.so")
if not os.path.exists(LIBRARY):
    raise ImportError(f"dynamicemb's ops library {LIBRARY} is not built: run `python setup.py build_ext --inplace` "
                      f"in {os.path.dirname(os.path.dirname(LIBRARY))} (scripts/dev.sh does it)")
torch.ops.load_library(LIBRARY)

ops = torch.ops.dynamicemb
_lib = "dynamicemb::"
# The kernels' rules as JSON (csrc/rules.cpp), which dynamicemb/rules.py presents.
RULES = json.loads(ops.rules())


def _dynamic_len():
    return torch.library.get_ctx().new_dynamic_size()


# A table as the table ops take it: one `Tensor[] table` argument holding
# these members in this order (csrc/table/table_checks.h, Member).
TABLE_MEMBERS = ("slot_keys", "slot_digests", "slot_scores", "slot_timestamps", "slot_epochs", "table_buckets",
                 "sizes", "counters")


def table_arg(table, **replace):
    """The ``Tensor[] table`` argument of the table ops for ``table`` (an
    object with the TABLE_MEMBERS as attributes, a ScoredHashTable), with
    members swapped by ``replace`` (member name -> tensor)."""
    return [replace[m] if m in replace else getattr(table, m) for m in TABLE_MEMBERS]


def _member(table, name):
    return table[TABLE_MEMBERS.index(name)]


@torch.library.register_fake(_lib + "table_lookup")
def _lookup_fake(table, keys, table_ids, bucket_capacity):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake(_lib + "table_lookup_gather")
def _lookup_gather_fake(table, keys, table_ids, bucket_capacity, values, out):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake(_lib + "table_lookup_refresh")
def _lookup_refresh_fake(table, keys, table_ids, key_scores, strategy, bucket_capacity, call_score):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake(_lib + "table_refresh")
def _refresh_fake(table, indices, key_scores, strategy, call_score):
    return None


@torch.library.register_fake(_lib + "table_insert")
def _insert_fake(table, keys, table_ids, key_scores, strategy, bucket_capacity, call_score, epoch, evictable=None,
                 list_evicted=True, key_count=None, hold_stored=False):
    m = _dynamic_len() if list_evicted else 0
    ev = [keys.new_empty(m) for _ in range(4)]
    return (torch.empty_like(keys), torch.empty_like(keys, dtype=torch.int8), *ev)


@torch.library.register_fake(_lib + "table_insert_outcome")
def _insert_outcome_fake(results, table_ids, num_tables):
    return torch.empty_like(results, dtype=torch.bool), table_ids.new_empty(num_tables)


@torch.library.register_fake(_lib + "table_erase")
def _erase_fake(table, keys, table_ids, bucket_capacity):
    return torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake(_lib + "table_take")
def _take_fake(table, keys, table_ids, bucket_capacity, slot_values):
    m = _dynamic_len()
    return tuple(keys.new_empty(m) for _ in range(3))


@torch.library.register_fake(_lib + "table_export_range")
def _export_range_fake(table, filter_scores, begin, end, bucket_capacity, threshold):
    m = _dynamic_len()
    return tuple(_member(table, "slot_keys").new_empty(m) for _ in range(3))


@torch.library.register_fake(_lib + "store_gather")
def _store_gather_fake(store, positions, out):
    return None


@torch.library.register_fake(_lib + "store_scatter")
def _store_scatter_fake(store, positions, rows):
    return None


@torch.library.register_fake(_lib + "positions_where")
def _positions_where_fake(mask):
    return mask.new_empty(_dynamic_len(), dtype=torch.int64)


@torch.library.register_fake(_lib + "positions_by_group")
def _positions_by_group_fake(ids, groups):
    return torch.empty_like(ids), ids.new_empty(groups)


@torch.library.register_fake(_lib + "table_clock")
def _table_clock_fake(like):
    return like.new_empty(1, dtype=torch.int64)


@torch.library.register_fake(_lib + "empty_huge")
def _empty_huge_fake(size, dtype, own_mapping=False):
    return torch.empty(size, dtype=dtype)


@torch.library.register_fake(_lib + "table_rehash")
def _rehash_fake(table, new_table_buckets, bucket_capacity):
    slot_keys, slot_digests, slot_scores, slot_timestamps = (
        _member(table, m) for m in ("slot_keys", "slot_digests", "slot_scores", "slot_timestamps"))
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


# ---- embedding layer (csrc/embedding) ----------------------------------------------------


@torch.library.register_fake(_lib + "emb_unique")
def _emb_unique_fake(indices, offsets, feature_table, num_tables):
    u = _dynamic_len()  # the number of distinct (table, key) pairs
    return indices.new_empty(u), indices.new_empty(u), torch.empty_like(indices), indices.new_empty(u)


@torch.library.register_fake(_lib + "emb_unique_padded")
def _emb_unique_padded_fake(indices, offsets, feature_table, num_tables):
    n = indices.numel()
    return (indices.new_empty(n), indices.new_empty(n), torch.empty_like(indices), indices.new_empty(n),
            indices.new_empty(1), indices.new_empty(RULES["offsets_record_len"]))


@torch.library.register_fake(_lib + "emb_offsets_verdict")
def _emb_offsets_verdict_fake(offsets_record):
    return None


@torch.library.register_fake(_lib + "emb_init_rows")
def _emb_init_rows_fake(weights, rows, table_ids, keys, dims, init_params, seed, skip_bad=False):
    return None


@torch.library.register_fake(_lib + "emb_slot_rows_init")
def _emb_slot_rows_init_fake(weights, slots, slot_begin, table_ids, keys, is_new, dims, init_params, seed):
    return torch.empty_like(slots)


@torch.library.register_fake(_lib + "emb_row_order_init")
def _emb_row_order_init_fake(weights, slots, slot_begin, table_ids, keys, is_new, inverse, dims, init_params, seed):
    return (torch.empty_like(slots), torch.empty_like(slots), torch.empty_like(keys), torch.empty_like(table_ids),
            torch.empty_like(inverse))


@torch.library.register_fake(_lib + "emb_forward")
def _emb_forward_fake(weights, rows, unique_keys, inverse, offsets, feature_table, dims, per_sample_weights,
                      pooling, init_params, seed, output_dtype):
    if pooling == 2:  # NONE: one row per index
        return inverse.new_empty((inverse.shape[0], dims[feature_table[0]]), dtype=output_dtype)
    batch = (offsets.shape[0] - 1) // len(feature_table)
    return inverse.new_empty((batch, sum(dims[t] for t in feature_table)), dtype=output_dtype)


@torch.library.register_fake(_lib + "emb_lookup_forward")
def _emb_lookup_forward_fake(slot_keys, slot_digests, table_buckets, bucket_capacity, table_group, table_local,
                             weights, indices, offsets, feature_table, dims, per_sample_weights, pooling, init_params,
                             seed, output_dtype, hot_weights=None, hot_pos=None):
    return _emb_forward_fake(weights, None, None, indices, offsets, feature_table, dims, per_sample_weights,
                             pooling, init_params, seed, output_dtype)


@torch.library.register_fake(_lib + "emb_backward_update")
def _emb_backward_update_fake(grad_output, weights, rows, unique_table_ids, inverse, offsets, feature_table, dims,
                              per_sample_weights, pooling, optimizer, lr, eps, beta1, beta2, weight_decay, step,
                              weight_decay_mode, max_gradient=0.0, skip_nonfinite=False):
    return rows.new_empty(len(weights), dtype=torch.int64)  # rows per table skipped as not finite


# ---- input distribution (csrc/dist) ------------------------------------------------------


@torch.library.register_fake(_lib + "route_keys")
def _route_keys_fake(lengths, values, weights, rules, params, world):
    # Every value goes to exactly one rank, so only the lengths grow (one per
    # rank and bag); no weights: an empty float32 tensor.
    out_w = values.new_empty(values.shape[0] if weights is not None else 0, dtype=torch.float32)
    return lengths.new_empty(world * lengths.shape[0]), torch.empty_like(values), out_w, torch.empty_like(values)


@torch.library.register_fake(_lib + "route_owners")
def _route_owners_fake(keys, rule, param, world):
    return torch.empty_like(keys)


# A fixed flag of the host (read once in C++); read here before any fake
# kernel exists, since calling the op from its own fake kernel would recurse.
_HOST_VECTOR_PATHS = ops.cpu_vector_paths()


@torch.library.register_fake(_lib + "cpu_vector_paths")
def _cpu_vector_paths_fake():
    return _HOST_VECTOR_PATHS

