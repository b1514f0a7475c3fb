// Rotary position embedding as one autograd node (rope.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zrun {

// x * cos + roll(x, hd/2) * sin over heads x (B, T, H, hd), with cos and the signed sin
// (T, hd) of x's dtype and device (sin's first half negated: rotate_half's sign). The node
// keeps cos and sin only. On CUDA in bf16 or fp32 one kernel pass each way (fp32 arithmetic,
// one rounding); elsewhere ATen's mul, roll and add, the ops autograd would run.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The CUDA kernel behind rope: device index, dtype (0 fp32, 1 bf16), backward (0: y = rope(x);
// 1: y = the gradient of x for the gradient x), x, cos, sin, y (device pointers; x and y
// contiguous (B, T, H, hd), n elements), T, H, hd, the stream; returns 0 or writes a malloc'd
// message to *err.
using RopeKernel = int (*)(int device, int dtype, int backward, const void* x, const void* cos,
                           const void* sin, void* y, int64_t n, int64_t t, int64_t heads,
                           int64_t hd, void* stream, char** err);

// Registers (or with nullptr removes) the kernel; returns the one it replaces.
RopeKernel set_rope_kernel(RopeKernel kernel);

// Without autograd: rope(x), or with `backward` the gradient of x for the gradient `x`;
// `force_aten`: ATen's ops on every device (the kernel's reference in its check).
at::Tensor rope_raw(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                    bool backward, bool force_aten);

}  // namespace zrun
