// SwiGLU's product silu(gate) * up as one autograd node (swiglu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zrun {

// silu(gate) * up for `gate` and `up` of one shape, floating dtype and device. In grad mode
// the node keeps `gate` and `up` only (autograd's ops also keep silu(gate)) and recomputes
// silu in the backward. On CUDA in bf16 or fp32 the forward and the backward are one pass
// each through the registered kernel; elsewhere ATen's ops, the same ones autograd's
// silu-then-mul runs (bitwise the same results).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// The CUDA kernel behind swiglu: device index, dtype (0 fp32, 1 bf16), backward (0: out0 =
// silu(a) * b; 1: out0 = d(a), out1 = d(b) from g), a, b, g, out0, out1 (device pointers, n
// contiguous elements each), the stream; returns 0 or writes a malloc'd message to *err.
using SwigluKernel = int (*)(int device, int dtype, int backward, const void* a, const void* b,
                             const void* g, void* out0, void* out1, int64_t n, void* stream,
                             char** err);

// Registers (or with nullptr removes) the kernel; returns the one it replaces.
SwigluKernel set_swiglu_kernel(SwigluKernel kernel);

// `force_aten`: ATen's ops on every device (the kernel's reference in its check). Returns
// silu(a) * b, or with `g` (backward) {d(a), d(b)}; no autograd.
std::vector<at::Tensor> swiglu_raw(const at::Tensor& a, const at::Tensor& b, const at::Tensor* g,
                                   bool force_aten);

}  // namespace zrun
