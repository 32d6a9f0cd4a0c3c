// Input checks shared by the CPU and CUDA kernels (host code).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

namespace dynamicemb {

// t is a contiguous 1-D tensor of `dtype` on `device` (default: the CPU);
// `name` names it in the error.
inline void check_1d(const at::Tensor& t, at::ScalarType dtype, const char* name,
                     at::Device device = at::Device(at::kCPU)) {
  TORCH_CHECK(t.device() == device, "dynamicemb: ", name, " must be on ",
              device.is_cpu() ? std::string("the CPU") : device.str(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "dynamicemb: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "dynamicemb: ", name,
              " must be a contiguous 1-D tensor, got shape ", t.sizes());
}

// positions_count's arguments, on either backend.
inline void check_count_args(const at::Tensor& ids, const at::Tensor& mask, int64_t groups, at::Device device) {
  check_1d(ids, at::kLong, "positions_count: ids", device);
  check_1d(mask, at::kBool, "positions_count: mask", device);
  TORCH_CHECK(ids.numel() == mask.numel(), "dynamicemb: positions_count: ids has ", ids.numel(),
              " entries, mask ", mask.numel());
  TORCH_CHECK(groups >= 1, "dynamicemb: positions_count: groups must be positive, got ", groups);
}

}  // namespace dynamicemb
