// The head's matmul and the cross-entropy on the full logits, as llm.c's fused classifier:
// the forward computes each row's loss and, when a gradient is wanted, writes the logits'
// gradient over the logits in the same kernel (the gradient of a mean cross-entropy is known
// before the backward, up to the upstream factor). Nothing in fp32 the size of the logits
// ever exists: the logits, in the compute dtype, are the only (N, V) tensor, where PyTorch's
// cross_entropy on fp32 logits makes an fp32 copy, keeps fp32 log-probabilities and builds two
// fp32 gradients in the backward. The backward is the head's two matmuls, scaled by the
// upstream gradient after them (bf16 and fp32 only: fp16 needs the scale before rounding).

#include "fused_loss.h"
#include "stream.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>

namespace zrun {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<CeRowsKernel> g_kernel{nullptr};

// ATen's path: `block` logits at a time in fp32, the same arithmetic as the kernel (max,
// sum of exponentials, logsumexp; softmax minus the one-hot times coef, rounded once).
at::Tensor ce_rows_aten(const at::Tensor& logits, const at::Tensor& targets,
                        const at::Tensor& coef, bool grad) {
  const int64_t n = logits.size(0);
  const int64_t v = logits.size(1);
  at::Tensor loss = at::empty({n}, logits.options().dtype(at::kFloat));
  const int64_t rows = std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, v));
  for (int64_t s = 0; s < n; s += rows) {
    const int64_t k = std::min(rows, n - s);
    at::Tensor x = logits.narrow(0, s, k);
    at::Tensor t = targets.narrow(0, s, k).unsqueeze(1);
    at::Tensor c = coef.narrow(0, s, k);
    at::Tensor p = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    at::Tensor xt = p.gather(1, t).squeeze(1);
    at::Tensor m = at::amax(p, {1}, true);
    p.sub_(m).exp_();
    at::Tensor sum = p.sum({1}, true);
    at::Tensor lse = sum.log().add_(m).squeeze(1);
    at::Tensor drop = c.eq(0);
    loss.narrow(0, s, k).copy_((lse - xt).masked_fill_(drop, 0));
    if (grad) {
      p.div_(sum);
      p.scatter_add_(1, t, at::full({k, 1}, -1.0, p.options()));
      p.mul_(c.unsqueeze(1)).masked_fill_(drop.unsqueeze(1), 0);
      x.copy_(p);
    }
  }
  return loss;
}

struct FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& targets, int64_t ignore_index, bool grad) {
    at::Tensor valid = targets.ne(ignore_index);
    at::Tensor safe = targets.masked_fill(valid.logical_not(), 0);
    at::Tensor count = valid.sum().to(at::kFloat);
    // Each row's weight in the mean (0 for ignored rows; NaN for all when none is valid,
    // whose mean PyTorch makes NaN too).
    at::Tensor coef = valid.to(at::kFloat).div_(count);
    at::Tensor logits = at::mm(h, w.t());
    at::Tensor loss = ce_rows(logits, safe, coef, grad, /*force_aten=*/false);
    if (grad) {
      ctx->save_for_backward({h, w, logits});
    }
    // Rows with coef 0 hold 0; the others' mean (PyTorch's own reduction, in fp32).
    return loss.dot(coef);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &w = saved[1], &d = saved[2];
    const at::Tensor g = grads[0].to(at::kFloat);
    at::Tensor grad_h, grad_w;
    if (ctx->needs_input_grad(1)) {
      grad_w = at::mm(d.t(), h);
      grad_w.mul_(g);
    }
    if (ctx->needs_input_grad(0)) {
      grad_h = at::mm(d, w);
      grad_h.mul_(g);
    }
    return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ce_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& coef,
                   bool grad, bool force_aten) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "ce_rows: logits must be contiguous bf16 or fp32 (N, V)");
  const int64_t n = logits.size(0);
  const int64_t v = logits.size(1);
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == n && targets.scalar_type() == at::kLong &&
                  targets.device() == logits.device(),
              "ce_rows: targets must be int64 (N) on the logits' device");
  TORCH_CHECK(coef.dim() == 1 && coef.size(0) == n && coef.scalar_type() == at::kFloat &&
                  coef.device() == logits.device(),
              "ce_rows: coef must be fp32 (N) on the logits' device");
  const CeRowsKernel kernel = g_kernel.load();
  if (force_aten || !logits.is_cuda() || kernel == nullptr) {
    return ce_rows_aten(logits, targets, coef, grad);
  }
  at::Tensor t = targets.contiguous();
  at::Tensor c = coef.contiguous();
  at::Tensor loss = at::empty({n}, logits.options().dtype(at::kFloat));
  if (n == 0 || v == 0) {
    return loss.zero_();
  }
  char* err = nullptr;
  const int rc = kernel(logits.device().index(), logits.scalar_type() == at::kBFloat16 ? 1 : 0,
                        logits.data_ptr(), t.data_ptr(), c.data_ptr(), loss.data_ptr(), n, v,
                        grad ? 1 : 0, current_stream(logits.device()), &err);
  check_launch(rc, err, "fused cross-entropy");
  return loss;
}

at::Tensor fused_linear_cross_entropy(const at::Tensor& h, const at::Tensor& w,
                                      const at::Tensor& targets, int64_t ignore_index) {
  // Decided here: the forward runs with grad mode off.
  const bool grad = at::GradMode::is_enabled() && (h.requires_grad() || w.requires_grad());
  return FusedLinearCrossEntropy::apply(h, w, targets, ignore_index, grad);
}

CeRowsKernel set_ce_rows_kernel(CeRowsKernel kernel) { return g_kernel.exchange(kernel); }

}  // namespace zrun
