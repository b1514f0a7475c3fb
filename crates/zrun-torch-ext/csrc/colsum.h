// Linear with a bias and LayerNorm as autograd nodes whose bias and weight gradients (sums
// over rows) go through zrun's column-sum kernel on CUDA (colsum.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zrun {

// x w^T + b for x (..., in), w (out, in), b (out) of one floating dtype and device. The node
// keeps x and w (what autograd's addmm keeps). The backward runs autograd's matmuls for x and
// w; b's gradient, the sum of the output's gradient over rows, is one pass of the column-sum
// kernel on CUDA in bf16 or fp32, ATen's sum elsewhere (bitwise autograd's linear on CPU).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

// gelu(x w^T + b, "tanh") as one node keeping x, w and GELU's input (what autograd's linear
// and gelu keep). Its backward takes GELU's gradient and b's (the sum of it over rows) in one
// pass of the column-sum kernel on CUDA in bf16 or fp32 (ATen's gelu_backward and sum
// elsewhere: bitwise autograd's linear and gelu on CPU), then x's and w's matmuls.
at::Tensor linear_gelu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

// LayerNorm over the last dimension of x (..., C) with w and b (C): ATen's native_layer_norm
// and its backward, keeping what autograd keeps (x, w, b and each row's mean and rstd). On
// CUDA in bf16 or fp32 the gradients of w and b come from the column-sum kernel and ATen's
// backward writes x's only; elsewhere ATen's backward writes all three (bitwise autograd's).
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps);

// The CUDA kernel behind them: device index, dtype (0 fp32, 1 bf16; plus 2 for GELU's
// backward first), dy (rows, cols) and, for LayerNorm, x (rows, cols) with fp32 mean and rstd
// (rows), else null; `part` an fp32 scratch of splits x cols (twice that for LayerNorm);
// out_b (cols) gets the sums of dy, out_g (cols, for LayerNorm) those of dy (x - mean) rstd.
// With GELU's bit x is GELU's input h, mean and rstd null, out_g (rows, cols) gets
// dy gelu'(h) in dy's dtype and out_b the sums of that. Rows are taken `per_split` at a time
// by `splits` blocks per span of columns; the stream. Returns 0 or writes a malloc'd message
// to *err.
using ColsumKernel = int (*)(int device, int dtype, const void* dy, const void* x,
                             const void* mean, const void* rstd, void* part, void* out_b,
                             void* out_g, int64_t rows, int64_t cols, int64_t splits,
                             int64_t per_split, void* stream, char** err);

// Registers (or with nullptr removes) the kernel; returns the one it replaces.
ColsumKernel set_colsum_kernel(ColsumKernel kernel);

// Without autograd: {sum of dy over rows} for dy (rows, cols), or with x, mean and rstd
// {sum of dy (x - mean) rstd, sum of dy}; `force_aten`: ATen's ops on every device (the
// kernel's reference in its check).
std::vector<at::Tensor> colsum_raw(const at::Tensor& dy, const at::Tensor* x,
                                   const at::Tensor* mean, const at::Tensor* rstd,
                                   bool force_aten);

// Without autograd: {dy gelu'(h), its sum over rows} for dy and GELU's input h (rows, cols)
// (tanh GELU); `force_aten` as for colsum_raw.
std::vector<at::Tensor> gelu_colsum_raw(const at::Tensor& dy, const at::Tensor& h,
                                        bool force_aten);

}  // namespace zrun
