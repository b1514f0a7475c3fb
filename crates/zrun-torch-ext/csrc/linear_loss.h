// The language-model head's matmul and cross-entropy in chunks (linear_loss.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zrun {

// Mean cross-entropy of the logits h @ w^T against `targets`, never holding more than about
// `chunk` logits at once, with an autograd graph back to `h` and `w` when grad mode is on and
// either requires grad. h (N, C) and w (V, C) share a floating dtype and device; targets (N)
// int64, where `ignore_index` leaves a row out of the mean. Returns an fp32 scalar.
at::Tensor linear_cross_entropy(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets,
                                int64_t ignore_index, int64_t chunk);

}  // namespace zrun
