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

}  // namespace dynamicemb
