// Which rank owns a key, per feature: the routing rules of row-wise sharded
// tables, shared by the CPU and CUDA backends and mirrored in Python
// (dynamicemb/routing.py) for checkpoint resharding.
#pragma once
#include <cstdint>

#include "common/hd.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace route {

// Values match dynamicemb.routing.ROUTE_* codes.
enum Rule : int64_t {
  kBlock = 0,          // TorchRec's native row-wise rule; the key becomes a local row
  kHashRoundRobin = 1, // fmix64(key) % world
  kRoundRobin = 2,     // key mod world (non-negative remainder)
  kContinuous = 3,     // blocks of ceil(num_embeddings / world) over key mod num_embeddings
};

DE_HD int64_t floor_mod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return r < 0 ? r + b : r;
}

// The owner of `key`; for kBlock also rewrites *key to the owner's local row
// (as fbgemm's block_bucketize_sparse_features: keys are unsigned, a key past
// block * world goes round-robin). `param`: the block size (kBlock) or the
// table's num_embeddings (kContinuous).
DE_HD int64_t owner(int64_t rule, int64_t param, int64_t world, int64_t* key) {
  switch (rule) {
    case kBlock: {
      const uint64_t k = static_cast<uint64_t>(*key), bs = static_cast<uint64_t>(param);
      const uint64_t w = static_cast<uint64_t>(world);
      if (k < bs * w) {
        *key = static_cast<int64_t>(k % bs);
        return static_cast<int64_t>(k / bs);
      }
      *key = static_cast<int64_t>(k / w);
      return static_cast<int64_t>(k % w);
    }
    case kHashRoundRobin: {
      const uint64_t h = table::key_hash(*key), w = static_cast<uint64_t>(world);
      return static_cast<int64_t>((w & (w - 1)) == 0 ? h & (w - 1) : h % w);  // the same; no 64-bit divide
    }
    case kRoundRobin:
      return floor_mod(*key, world);
    case kContinuous: {
      const int64_t block = (param + world - 1) / world;
      return floor_mod(*key, param) / block;
    }
    default:
      return 0;
  }
}

}  // namespace route
}  // namespace dynamicemb
