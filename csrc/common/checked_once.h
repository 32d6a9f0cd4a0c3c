// Device data checked once. On CUDA a check of values (offsets that must not
// decrease, table ids in range) costs a synchronising copy of an error record.
// A training step passes the same tensors through several ops: the offsets to
// emb_unique, emb_forward and emb_backward_update; emb_unique's table ids to
// the table ops, its inverse to emb_forward and emb_backward_update. A tensor that passed a check and is unchanged since (the same
// TensorImpl, data, length and version counter) skips the check's copy.
//
// `what` names the check, `fact` what it established (the length of the
// indices the offsets cover; the bound of the ids, which holds for any larger
// bound): a tensor checked for one fact is not taken as checked for another.
// A few recent tensors of each check are kept, weakly (a freed tensor's
// address cannot be taken by a new one while its entry lives); inference
// tensors have no version counter and are never kept.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cstdint>
#include <mutex>

namespace dynamicemb {

// kOffsets: fact = the indices' count; kTableIds / kInverse: fact = a bound
// of the ids (the tables / the unique keys); kLayout (a table_buckets
// tensor): fact = the slot arrays' bucket count. kOffsetsClamped: offsets
// whose check's record is read later (emb_unique_padded), fact = the
// indices' count; the training kernels, which clamp offsets, take them as
// checked, a check that must raise now (emb_unique, eval) does not.
enum class Checked : int { kOffsets = 0, kTableIds = 1, kLayout = 2, kInverse = 3, kOffsetsClamped = 4 };

class CheckedOnce {
 public:
  // Whether `t`, as it is now, passed check `what` establishing `fact`.
  static bool holds(const at::Tensor& t, Checked what, int64_t fact) {
    if (!keepable(t)) return false;
    State& s = state();
    const std::lock_guard<std::mutex> lock(s.mu);
    for (const Entry& e : s.ring(what).entries)
      if (e.matches(t, what, fact)) return true;
    return false;
  }
  // Records that `t` passed check `what` establishing `fact`.
  static void record(const at::Tensor& t, Checked what, int64_t fact) {
    if (!keepable(t)) return;
    State& s = state();
    const std::lock_guard<std::mutex> lock(s.mu);
    Ring& r = s.ring(what);
    r.entries[r.next] = Entry{Weak(t.getIntrusivePtr()), t._version(), t.data_ptr(), t.numel(), what, fact};
    r.next = (r.next + 1) % r.entries.size();
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    Weak impl{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    int64_t version = -1;
    const void* data = nullptr;
    int64_t numel = -1;
    Checked what = Checked::kOffsets;
    int64_t fact = -1;
    bool matches(const at::Tensor& t, Checked w, int64_t f) const {
      // Ids below a bound are below every larger one; the other facts are exact.
      const bool bounded = w == Checked::kTableIds || w == Checked::kInverse;
      const bool fact_holds = bounded ? fact <= f : fact == f;
      return what == w && fact_holds && impl._unsafe_get_target() == t.unsafeGetTensorImpl() && !impl.expired() &&
             data == t.data_ptr() && numel == t.numel() && version == t._version();
    }
  };
  struct Ring {
    std::array<Entry, 8> entries;
    size_t next = 0;
  };
  // One ring per check: a step's new table ids do not push out the offsets
  // and the layout, which stay the same for many steps.
  struct State {
    std::mutex mu;  // the backward runs on autograd's threads
    std::array<Ring, 5> rings;
    Ring& ring(Checked what) { return rings[static_cast<size_t>(what)]; }
  };
  static bool keepable(const at::Tensor& t) { return t.defined() && !t.is_inference() && t.numel() > 0; }
  static State& state() {
    static State s;
    return s;
  }
};

}  // namespace dynamicemb
