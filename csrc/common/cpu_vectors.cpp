#include "common/cpu_vectors.h"

#include <torch/library.h>

namespace dynamicemb {
namespace cpu {
namespace {

bool cpu_vector_paths() { return has_avx2(); }

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CompositeExplicitAutograd, m) { m.impl("cpu_vector_paths", &cpu_vector_paths); }

}  // namespace cpu
}  // namespace dynamicemb
