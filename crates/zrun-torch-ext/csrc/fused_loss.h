// The language-model head's matmul and cross-entropy on the full logits, the logits' gradient
// made in the forward and written over them (fused_loss.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zrun {

// Per row of `logits` (N, V), bf16 or fp32, contiguous: its softmax cross-entropy against
// `targets` (N, int64, each in [0, V)) weighted by `coef` (N, fp32), returned as fp32 (N).
// With `grad`, each row is overwritten by coef x (softmax - one-hot(target)), rounded once to
// the logits' dtype. A row whose coef is 0 has loss 0 (and, with `grad`, a zero gradient).
// On CUDA through the registered kernel when there is one, else ATen's ops `block` rows at a
// time (`force_aten` takes ATen's path everywhere: the kernel's reference).
at::Tensor ce_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& coef,
                   bool grad, bool force_aten);

// Mean cross-entropy of the logits h @ w^T (held whole, in the inputs' dtype: bf16 or fp32)
// against `targets`; `ignore_index` leaves a row out. When h or w requires grad (and grad mode
// is on) the forward writes the logits' gradient over them and keeps only that; the backward
// is the head's two matmuls times the upstream gradient. Returns an fp32 scalar.
at::Tensor fused_linear_cross_entropy(const at::Tensor& h, const at::Tensor& w,
                                      const at::Tensor& targets, int64_t ignore_index);

// The CUDA kernel behind ce_rows: device index, dtype (0 fp32, 1 bf16), logits, targets,
// coef, loss (device pointers), rows, columns, grad, the stream; returns 0 or writes a
// malloc'd message to *err.
using CeRowsKernel = int (*)(int device, int dtype, void* logits, const void* targets,
                             const void* coef, void* loss, int64_t n, int64_t v, int grad,
                             void* stream, char** err);

// Registers (or with nullptr removes) the kernel; returns the one it replaces.
CeRowsKernel set_ce_rows_kernel(CeRowsKernel kernel);

}  // namespace zrun
