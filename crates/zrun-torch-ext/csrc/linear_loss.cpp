// The head's matmul and the cross-entropy, in chunks: the full logits (N, V) are never held.
//
// Forward, over chunks of rows: logits of the chunk, their logsumexp and the target's logit;
// only the logsumexp (N floats) is kept. Backward, over chunks of the vocabulary: the chunk's
// logits are recomputed against every row, turned into (softmax - one-hot) x the row's weight,
// and give that slice of the weight's gradient in one matmul (as the unchunked backward's)
// and a part of the input's gradient, summed in fp32.
//
// Arithmetic follows the unchunked path: logits in the compute dtype, softmax in fp32, the
// logits' gradient rounded to the compute dtype before its two matmuls.

#include "linear_loss.h"
#include "acc_type.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace zrun {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// `t` in `dtype`: itself when it already is (the caller may then write in place).
at::Tensor as(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// Chunk length along a dimension of `len` for `chunk` logits against `other` of the other
// dimension: whole multiples of 64 once there is room for them, at least 1.
int64_t piece(int64_t chunk, int64_t other, int64_t len) {
  int64_t n = std::max<int64_t>(1, chunk / std::max<int64_t>(1, other));
  if (n >= 64) {
    n -= n % 64;
  }
  return std::min(n, std::max<int64_t>(1, len));
}

struct LinearCrossEntropy : public torch::autograd::Function<LinearCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& targets, int64_t ignore_index, int64_t chunk) {
    const int64_t n = h.size(0);
    const int64_t v = w.size(0);
    const auto acc = acc_type(h);
    at::Tensor valid = targets.ne(ignore_index);
    at::Tensor safe = targets.masked_fill(valid.logical_not(), 0);
    at::Tensor lse = at::empty({n}, h.options().dtype(acc));
    at::Tensor total = at::zeros({}, h.options().dtype(acc));
    const int64_t rows = piece(chunk, v, n);
    for (int64_t s = 0; s < n; s += rows) {
      const int64_t k = std::min(rows, n - s);
      at::Tensor p = as(at::mm(h.narrow(0, s, k), w.t()), acc);  // (k, V), fresh
      at::Tensor target = p.gather(1, safe.narrow(0, s, k).unsqueeze(1)).squeeze(1);
      at::Tensor m = at::amax(p, {1}, true);
      p.sub_(m).exp_();
      at::Tensor l = lse.narrow(0, s, k);
      at::sum_out(l, p, {1});
      p.reset();
      l.log_().add_(m.squeeze(1));
      total.add_(((l - target) * valid.narrow(0, s, k)).sum());
    }
    at::Tensor count = valid.sum().to(acc);
    ctx->save_for_backward({h, w, safe, valid, lse, count});
    ctx->saved_data["chunk"] = chunk;
    return total / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &w = saved[1], &safe = saved[2], &valid = saved[3],
                     &lse = saved[4], &count = saved[5];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const int64_t n = h.size(0);
    const int64_t v = w.size(0);
    const auto acc = acc_type(h);
    const auto kind = h.scalar_type();
    // Each row's weight in the mean, times the upstream gradient.
    at::Tensor coef = (valid.to(acc) * (grads[0].to(acc) / count)).unsqueeze(1);
    at::Tensor lse_col = lse.unsqueeze(1);
    // The gradients are made before the chunks' temporaries, so those leave one free region
    // behind them (with 16-bit inputs, the input's gradient and its fp32 sum).
    at::Tensor grad_w = want_w ? at::empty_like(w, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor grad_h = want_h ? at::empty({n, h.size(1)}, h.options()) : at::Tensor();
    at::Tensor sum_h = !want_h       ? at::Tensor()
                       : kind == acc ? grad_h.zero_()
                                     : at::zeros({n, h.size(1)}, h.options().dtype(acc));
    const int64_t cols = piece(chunk, n, v);
    for (int64_t s = 0; s < v; s += cols) {
      const int64_t k = std::min(cols, v - s);
      at::Tensor wj = w.narrow(0, s, k);
      at::Tensor p = as(at::mm(h, wj.t()), acc);  // (N, k), fresh
      p.sub_(lse_col).exp_();
      // Minus one at each row's target when it falls in this chunk.
      at::Tensor hit = safe.ge(s).logical_and_(safe.lt(s + k));
      at::Tensor at_col = (safe - s).clamp_(0, k - 1).unsqueeze(1);
      p.scatter_add_(1, at_col, hit.to(acc).neg_().unsqueeze(1));
      p.mul_(coef);
      at::Tensor d = as(p, kind);
      if (d.data_ptr() != p.data_ptr()) {
        p.reset();
      }
      if (want_w) {
        at::Tensor gw = grad_w.narrow(0, s, k);
        at::mm_out(gw, d.t(), h);
      }
      if (want_h) {
        if (kind == acc) {
          sum_h.addmm_(d, wj);
        } else {
          sum_h.add_(at::mm(d, wj));
        }
      }
    }
    if (want_h && kind != acc) {
      grad_h.copy_(sum_h);
    }
    return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets,
                                int64_t ignore_index, int64_t chunk) {
  return LinearCrossEntropy::apply(h, w, targets, ignore_index, chunk);
}

}  // namespace zrun
