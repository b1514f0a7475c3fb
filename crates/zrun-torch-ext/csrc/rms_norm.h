// RMSNorm with its own backward, which keeps only its input and each row's rstd (rms_norm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace zrun {

// y = x * rsqrt(mean(x^2 over the last dimension) + eps) * w, computed in fp32 (fp64 for fp64
// inputs) and rounded once to x's dtype; x (..., C) and w (C) share a floating dtype and
// device. With an autograd graph back to x and w when grad mode is on and either requires
// grad; the graph holds x, w and one fp32 rstd per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

}  // namespace zrun
