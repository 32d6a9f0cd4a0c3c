// The op schemas of dynamicemb. Kernels register per dispatch key in their own
// files (table/table_lookup_cpu.cpp, ...); fake kernels are registered in Python
// (dynamicemb/_ops.py) so torch.compile and torch.export see shapes.
//
// table_insert's `evictable` (bool [num_tables], None: all) lets a table that
// can still grow fail a key instead of evicting, so its owner grows it first.
// Without list_evicted its evicted_* are empty (results still say EVICTED):
// on CUDA, listing them waits for their count. `key_count` (int64 [1] on the
// keys' device, None: all) makes the keys from that position on padding
// (emb_unique_padded's): index -1, result ASSIGNED, and nothing found,
// stored, held or counted for them (table_rules.h kPaddingResult).
//
// A table is one argument, `Tensor[] table`: its members in the order of
// table/table_checks.h's Member (mirrored by dynamicemb/_ops.py
// TABLE_MEMBERS): slot_keys int64, slot_digests uint8, slot_scores int64,
// slot_timestamps int64 (only for the (TIMESTAMP, LFU) strategy, else
// empty), slot_epochs uint8 (which insert call last held a slot),
// table_buckets int64 [num_tables + 1], sizes int64 [num_tables] and
// counters int64 [num_tables, 3]. An op that writes any member marks the
// whole list mutable (Tensor(a!)[]).
#include <torch/library.h>

TORCH_LIBRARY(dynamicemb, m) {
  m.def("table_lookup(Tensor[] table, Tensor keys, Tensor? table_ids, int bucket_capacity) "
        "-> (Tensor indices, Tensor found)");
  // table_lookup, and each key's row of values [slots, dim] copied into out
  // [keys, dim] (zeros where the key is missing).
  m.def(
      "table_lookup_gather(Tensor[] table, Tensor keys, Tensor? table_ids, int bucket_capacity, Tensor values, "
      "Tensor(a!) out) -> (Tensor indices, Tensor found)");
  m.def(
      "table_lookup_refresh(Tensor(a!)[] table, Tensor keys, Tensor? table_ids, Tensor? key_scores, int strategy, "
      "int bucket_capacity, int call_score) -> (Tensor indices, Tensor found)");
  m.def(
      "table_refresh(Tensor(a!)[] table, Tensor indices, Tensor? key_scores, int strategy, int call_score) -> ()");
  m.def(
      "table_insert(Tensor(a!)[] table, Tensor keys, Tensor? table_ids, Tensor? key_scores, int strategy, "
      "int bucket_capacity, int call_score, int epoch, Tensor? evictable=None, bool list_evicted=True, "
      "Tensor? key_count=None, bool hold_stored=False) "
      "-> (Tensor indices, Tensor results, Tensor evicted_keys, Tensor evicted_table_ids, "
      "Tensor evicted_indices, Tensor evicted_scores)");
  // What a training step reads from an insert's results: which keys got a
  // new row (table_rules.h got_row: stored in a free or an evicted slot, its
  // row to be initialised) and the failures per table id in [0, num_tables).
  // One op (on CUDA one launch and a fill) where five compared and counted.
  m.def("table_insert_outcome(Tensor results, Tensor table_ids, int num_tables) -> (Tensor got_row, Tensor failed)");
  m.def("table_erase(Tensor(a!)[] table, Tensor keys, Tensor? table_ids, int bucket_capacity) -> Tensor erased");
  // table_erase, returning what the erased keys held: their positions in keys
  // (ascending; a repeated key at its first only) and their slots' entries of
  // slot_values (int64 per slot) and slot_scores. CPU (a backing store's key
  // index); elsewhere ScoredHashTable.take looks up, then erases.
  m.def(
      "table_take(Tensor(a!)[] table, Tensor keys, Tensor? table_ids, int bucket_capacity, Tensor slot_values) "
      "-> (Tensor at, Tensor values, Tensor scores)");
  m.def(
      "table_export_range(Tensor[] table, Tensor? filter_scores, int begin, int end, int bucket_capacity, "
      "int threshold) -> (Tensor keys, Tensor table_ids, Tensor indices)");
  m.def(
      "table_rehash(Tensor[] table, Tensor new_table_buckets, int bucket_capacity) "
      "-> (Tensor slot_keys, Tensor slot_digests, Tensor slot_scores, Tensor slot_timestamps, "
      "Tensor old_indices, Tensor new_indices)");
  // The clock of the clock-scored strategies (TIMESTAMP, NO_EVICTION, the
  // pair's access time) on the device of `like`: [1] int64 ns.
  m.def("table_clock(Tensor like) -> Tensor");
  // An uninitialised CPU tensor that the kernel backs with 2 MiB pages where
  // it offers them, from 4 MiB on; own_mapping: in a fresh aligned mapping of
  // its own (common/huge_pages_cpu.h: empty_huge, empty_mapped).
  m.def("empty_huge(int[] size, ScalarType dtype, bool own_mapping=False) -> Tensor");
  // A backing store's rows at positions its key index gave (tiers/): out[i] =
  // store[positions[i]], store[positions[i]] = rows[i] (distinct positions).
  // positions: int64 on the CPU; the store on the device of out / rows or,
  // for a CUDA device, in pinned host memory that the kernels read and write
  // in place (mapped).
  m.def("store_gather(Tensor store, Tensor positions, Tensor(a!) out) -> ()");
  m.def("store_scatter(Tensor(a!) store, Tensor positions, Tensor rows) -> ()");
  // Positions (int64, ascending) of mask's true entries; positions grouped by
  // ids in [0, groups), ascending within a group, and each group's count. The
  // tiers' bookkeeping on the CPU (common/positions_cpu.cpp); other devices
  // use torch's ops (dynamicemb/positions.py).
  m.def("positions_where(Tensor mask) -> Tensor");
  m.def("positions_by_group(Tensor ids, int groups) -> (Tensor order, Tensor counts)");
  // Whether the CPU kernels take their vector paths (common/cpu_vectors.h).
  m.def("cpu_vector_paths() -> bool");
  // The rules the kernels follow (optimizers, score strategies, counter
  // columns, the packed initializer), as JSON for dynamicemb/rules.py (rules.cpp).
  m.def("rules() -> str");

  // Embedding layer (csrc/embedding): bags in TBE layout (offsets [F * B + 1]),
  // rows are table-local (-1: no row; the key reads its initial value).
  m.def(
      "emb_unique(Tensor indices, Tensor offsets, int[] feature_table, int num_tables) "
      "-> (Tensor unique_keys, Tensor unique_table_ids, Tensor inverse, Tensor counts)");
  // emb_unique padded to the indices' length n, for a step that does not
  // wait for the device: the first num_unique[0] (int64 [1], on the device)
  // entries are emb_unique's, the rest padding (unique_rules.h) that
  // table_insert's key_count leaves out; the inverse names only the former.
  // The offsets' check is not read either: its record (bag_checks.h,
  // int64 [kOffsetsRecordLen]) goes to emb_offsets_verdict once it has
  // reached the host, and until then the kernels clamp the offsets (no read
  // out of bounds). The CPU checks at once and hands back a record of no error.
  m.def(
      "emb_unique_padded(Tensor indices, Tensor offsets, int[] feature_table, int num_tables) "
      "-> (Tensor unique_keys, Tensor unique_table_ids, Tensor inverse, Tensor counts, Tensor num_unique, "
      "Tensor offsets_record)");
  // Raises emb_unique's error for the offsets whose check left this record (on the CPU).
  m.def("emb_offsets_verdict(Tensor offsets_record) -> ()");
  // skip_bad: a (table, row) pair out of range is skipped instead of raising,
  // for rows taken from the table's own slots (on CUDA, raising waits for the device).
  m.def(
      "emb_init_rows(Tensor(a!)[] weights, Tensor rows, Tensor table_ids, Tensor keys, int[] dims, "
      "Tensor init_params, int seed, bool skip_bad=False) -> ()");
  // Every key's row from its hash table slot (row_parts.h slot_row: the slot
  // less its table's slot_begin, -1 stays -1), with the rows of the new keys
  // (is_new) initialised as emb_init_rows with skip_bad: one op (on CUDA one
  // launch) where a row computation and an init call took six.
  m.def(
      "emb_slot_rows_init(Tensor(a!)[] weights, Tensor slots, Tensor slot_begin, Tensor table_ids, Tensor keys, "
      "Tensor is_new, int[] dims, Tensor init_params, int seed) -> Tensor");
  // A training step's unique keys in the order of their rows' addresses, to
  // within blocks (embedding_cpu.cpp row_order): (order, rows, keys and table
  // ids permuted by it, inverse renumbered to match), with the new keys' rows
  // (is_new) initialised in that order. Kernels that write rows at random
  // run about twice as fast in that order. A key's row is its hash table
  // slot less its table's slot_begin (-1: none). CPU only.
  m.def(
      "emb_row_order_init(Tensor(a!)[] weights, Tensor slots, Tensor slot_begin, Tensor table_ids, Tensor keys, "
      "Tensor is_new, Tensor inverse, int[] dims, Tensor init_params, int seed) "
      "-> (Tensor order, Tensor rows, Tensor keys, Tensor table_ids, Tensor inverse)");
  m.def(
      "emb_forward(Tensor[] weights, Tensor rows, Tensor unique_keys, Tensor inverse, Tensor offsets, "
      "int[] feature_table, int[] dims, Tensor? per_sample_weights, int pooling, Tensor init_params, "
      "int seed, ScalarType output_dtype) -> Tensor");
  // With skip_nonfinite, a row whose summed gradient is not finite (a NaN /
  // inf reached it, or its sum overflowed) is left as it was; the result
  // counts those rows per table (int64 [num_tables], zeros without it), on
  // the rows' device: no host synchronisation. max_gradient > 0: FBGEMM's
  // gradient_clipping, each element of grad_output clamped to
  // [-max_gradient, max_gradient] before it is summed per key.
  m.def(
      "emb_backward_update(Tensor grad_output, Tensor(a!)[] weights, Tensor rows, "
      "Tensor unique_table_ids, Tensor inverse, Tensor offsets, int[] feature_table, int[] dims, "
      "Tensor? per_sample_weights, int pooling, int optimizer, float lr, float eps, float beta1, "
      "float beta2, float weight_decay, int step, int weight_decay_mode, float max_gradient=0.0, "
      "bool skip_nonfinite=False) -> Tensor");

  // The eval forward fused with the lookup (no dedup, nothing inserted): index
  // i of feature f is found in hash table table_group[t] (logical table
  // table_local[t]) of its table t = feature_table[f]; slot - first slot of
  // that logical table is its row in weights[t]. Missing keys read their
  // initial value from init_params. Weights: float32 / float16 / bfloat16
  // [rows, >= dim], or uint8 [rows, dim + 8] (FBGEMM's fused 8-bit rowwise:
  // codes q, float32 scale, float32 bias; element = q * scale + bias).
  // Optional hot rows (embedding/hot_rows.h): row r of table t is read from
  // hot_weights[t][hot_pos[t][r]] when hot_pos[t][r] >= 0 (the same bytes,
  // e.g. cached in device memory), else from weights[t].
  m.def(
      "emb_lookup_forward(Tensor[] slot_keys, Tensor[] slot_digests, Tensor[] table_buckets, "
      "int[] bucket_capacity, int[] table_group, int[] table_local, Tensor[] weights, Tensor indices, "
      "Tensor offsets, int[] feature_table, int[] dims, Tensor? per_sample_weights, int pooling, "
      "Tensor init_params, int seed, ScalarType output_dtype, Tensor[]? hot_weights=None, "
      "Tensor[]? hot_pos=None) -> Tensor");

  // Input distribution (csrc/dist): values of a KJT split by owning rank.
  m.def(
      "route_keys(Tensor lengths, Tensor values, Tensor? weights, int[] rules, int[] params, int world) "
      "-> (Tensor lengths, Tensor values, Tensor weights, Tensor permute)");
  m.def("route_owners(Tensor keys, int rule, int param, int world) -> Tensor");
}
