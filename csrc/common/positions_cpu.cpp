// positions_where / positions_by_group on the CPU: the positions that the
// tiers' bookkeeping selects and splits keys by (found or missing, table by
// table). torch.nonzero branches on every element, which a mask of found
// and missing keys (about half each, at random) mispredicts half the time:
// about 4 ns an element. Here the loops do not branch on the data.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/parallel_cpu.h"

namespace dynamicemb {
namespace {

// Ascending positions of the true entries of mask.
at::Tensor where_cpu(const at::Tensor& mask) {
  check_1d(mask, at::kBool, "positions_where: mask");
  const int64_t n = mask.numel();
  const bool* m = mask.data_ptr<bool>();
  const int64_t chunks = cpu::num_chunks(n, 32768);
  const int64_t len = std::max<int64_t>(1, (n + chunks - 1) / chunks);
  std::vector<int64_t> start(chunks + 1, 0);
  cpu::parallel_claim(chunks, [&](int64_t c) {
    int64_t k = 0;
    for (int64_t i = c * len, e = std::min(n, i + len); i < e; ++i) k += m[i];
    start[c + 1] = k;
  });
  for (int64_t c = 0; c < chunks; ++c) start[c + 1] += start[c];
  // One spare entry: every position is written, and only the true ones advance.
  at::Tensor out = at::empty({start[chunks] + 1}, mask.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  cpu::parallel_claim(chunks, [&](int64_t c) {
    int64_t* w = o + start[c];
    const int64_t* const end = o + start[c + 1];
    // Stops after the chunk's last true entry: the next write would be the next chunk's.
    for (int64_t i = c * len, e = std::min(n, i + len); i < e && w != end; ++i) {
      *w = i;
      w += m[i];
    }
  });
  return out.narrow(0, 0, start[chunks]);
}

// Positions grouped by ids[i] in [0, groups), ascending within a group
// (a stable counting sort), and the number of each group.
std::tuple<at::Tensor, at::Tensor> by_group_cpu(const at::Tensor& ids, int64_t groups) {
  check_1d(ids, at::kLong, "positions_by_group: ids");
  TORCH_CHECK(groups >= 1, "dynamicemb: positions_by_group: groups must be positive, got ", groups);
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint64_t>(id[i]) >= static_cast<uint64_t>(groups);
  if (bad) {
    int64_t i = 0;
    while (0 <= id[i] && id[i] < groups) ++i;
    TORCH_CHECK(false, "dynamicemb: positions_by_group: ids[", i, "] = ", id[i], " is outside [0, ", groups, ")");
  }
  const cpu::StablePartition part(n, groups, [id](int64_t i) { return id[i]; });
  at::Tensor order = at::empty({n}, ids.options()), counts = at::empty({groups}, ids.options());
  int64_t *o = order.data_ptr<int64_t>(), *cnt = counts.data_ptr<int64_t>();
  cpu::parallel_ranges(n, 16384, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) o[j] = part.pos(j);
  });
  for (int64_t g = 0; g < groups; ++g) cnt[g] = part.end(g) - part.begin(g);
  return {order, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("positions_where", &where_cpu);
  m.impl("positions_by_group", &by_group_cpu);
}

}  // namespace dynamicemb
