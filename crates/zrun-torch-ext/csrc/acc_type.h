// The dtype the shim's own kernels compute in (linear_loss.cpp, rms_norm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace zrun {

// fp64 for fp64 tensors, else fp32 (16-bit inputs are upcast, as ATen's opmath type).
inline at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace zrun
