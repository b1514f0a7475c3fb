// Linear with a bias and LayerNorm as autograd nodes (colsum.h). Their forward is ATen's, and
// so is their backward except for the sums over rows: on CUDA ATen's column reductions (the
// bias's sum, LayerNorm's gamma/beta kernel) read the gradient at a fraction of the memory
// bandwidth; zrun's kernel reads it once at full width, in a fixed order.

#include "colsum.h"
#include "stream.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace zrun {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<ColsumKernel> g_kernel{nullptr};

// Columns a thread of the kernel loads at once: 16 bytes.
int64_t vec(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 8 : 4; }

bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Whether the kernel takes dy (rows, cols) (and x, mean, rstd): contiguous, rows of whole
// 16-byte loads.
bool use_kernel(const at::Tensor& dy, const at::Tensor* x, const at::Tensor* mean,
                const at::Tensor* rstd, bool force_aten) {
  if (force_aten || !dy.is_cuda() || g_kernel.load() == nullptr || dy.dim() != 2 ||
      (dy.scalar_type() != at::kFloat && dy.scalar_type() != at::kBFloat16) ||
      !dy.is_contiguous() || dy.size(0) == 0 || dy.size(1) % vec(dy) != 0 || !aligned(dy)) {
    return false;
  }
  if (x == nullptr) {
    return true;
  }
  const int64_t rows = dy.size(0);
  return x->sizes() == dy.sizes() && x->scalar_type() == dy.scalar_type() &&
         x->is_contiguous() && aligned(*x) && mean->scalar_type() == at::kFloat &&
         rstd->scalar_type() == at::kFloat && mean->is_contiguous() && rstd->is_contiguous() &&
         mean->numel() == rows && rstd->numel() == rows;
}

std::vector<at::Tensor> launch(const at::Tensor& dy, const at::Tensor* x, const at::Tensor* mean,
                               const at::Tensor* rstd) {
  const int64_t rows = dy.size(0), cols = dy.size(1);
  const int64_t span = 32 * vec(dy), spans = (cols + span - 1) / span;
  // About 512 blocks (a few per SM), each warp taking at least 8 rows of its split: fewer
  // splits leave less for the second pass to add.
  int64_t splits = std::clamp<int64_t>(512 / spans, 1, std::max<int64_t>(1, rows / 64));
  const int64_t per_split = (rows + splits - 1) / splits;
  splits = (rows + per_split - 1) / per_split;
  const int64_t halves = x != nullptr ? 2 : 1;
  at::Tensor part = at::empty({halves * splits * cols}, dy.options().dtype(at::kFloat));
  at::Tensor out_b = at::empty({cols}, dy.options());
  at::Tensor out_g = x != nullptr ? at::empty({cols}, dy.options()) : at::Tensor();
  char* err = nullptr;
  const int rc = g_kernel.load()(
      dy.device().index(), dy.scalar_type() == at::kBFloat16 ? 1 : 0, dy.data_ptr(),
      x != nullptr ? x->data_ptr() : nullptr, x != nullptr ? mean->data_ptr() : nullptr,
      x != nullptr ? rstd->data_ptr() : nullptr, part.data_ptr(), out_b.data_ptr(),
      x != nullptr ? out_g.data_ptr() : nullptr, rows, cols, splits, per_split,
      current_stream(dy.device()), &err);
  check_launch(rc, err, "column-sum");
  if (x == nullptr) {
    return {out_b};
  }
  return {out_g, out_b};
}

struct Linear : public torch::autograd::Function<Linear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b) {
    ctx->save_for_backward({x, w});
    return at::linear(x, w, b);
  }

  // autograd's addmm backward on the rows of x: x's gradient g w, w's g^T x, b's the sum of
  // g over rows.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor g = grads[0].reshape({-1, w.size(0)});
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) {
      gx = g.mm(w).view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      gw = g.t().mm(x.reshape({-1, w.size(1)}));
    }
    if (ctx->needs_input_grad(2)) {
      gb = colsum_raw(g, nullptr, nullptr, nullptr, false)[0];
    }
    return {gx, gw, gb};
  }
};

struct LayerNorm : public torch::autograd::Function<LayerNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, double eps) {
    auto [y, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, w, b, eps);
    ctx->save_for_backward({x, w, b, mean, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &b = saved[2], &mean = saved[3],
                     &rstd = saved[4];
    const at::Tensor& g = grads[0];
    const int64_t c = x.size(-1);
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1),
               want_b = ctx->needs_input_grad(2);
    const at::Tensor g2 = g.reshape({-1, c}), x2 = x.reshape({-1, c});
    const at::Tensor m = mean.reshape({-1}), r = rstd.reshape({-1});
    if ((want_w || want_b) && use_kernel(g2, &x2, &m, &r, false)) {
      at::Tensor gx;
      if (want_x) {
        gx = std::get<0>(
            at::native_layer_norm_backward(g, x, {c}, mean, rstd, w, b, {true, false, false}));
      }
      auto sums = launch(g2, &x2, &m, &r);
      return {gx, want_w ? sums[0] : at::Tensor(), want_b ? sums[1] : at::Tensor(),
              at::Tensor()};
    }
    auto [gx, gw, gb] =
        at::native_layer_norm_backward(g, x, {c}, mean, rstd, w, b, {want_x, want_w, want_b});
    return {gx, gw, gb, at::Tensor()};
  }
};

}  // namespace

std::vector<at::Tensor> colsum_raw(const at::Tensor& dy, const at::Tensor* x,
                                   const at::Tensor* mean, const at::Tensor* rstd,
                                   bool force_aten) {
  TORCH_CHECK(dy.dim() == 2, "colsum: dy must be (rows, cols)");
  TORCH_CHECK(x == nullptr || (mean != nullptr && rstd != nullptr),
              "colsum: x needs mean and rstd");
  if (x == nullptr) {
    const at::Tensor dyc = dy.is_cuda() ? dy.contiguous() : dy;
    if (use_kernel(dyc, nullptr, nullptr, nullptr, force_aten)) {
      return launch(dyc, nullptr, nullptr, nullptr);
    }
    return {dy.sum(0)};
  }
  TORCH_CHECK(x->sizes() == dy.sizes() && mean->numel() == dy.size(0) &&
                  rstd->numel() == dy.size(0),
              "colsum: x must be dy's shape, mean and rstd one value per row");
  const at::Tensor dyc = dy.contiguous(), xc = x->contiguous();
  const at::Tensor m = mean->reshape({-1}).contiguous(), r = rstd->reshape({-1}).contiguous();
  if (use_kernel(dyc, &xc, &m, &r, force_aten)) {
    return launch(dyc, &xc, &m, &r);
  }
  const at::Tensor df = dyc.to(at::kFloat);
  const at::Tensor xhat = (xc.to(at::kFloat) - m.unsqueeze(1)) * r.unsqueeze(1);
  return {(df * xhat).sum(0).to(dy.scalar_type()), df.sum(0).to(dy.scalar_type())};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return Linear::apply(x, w, b);
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  return LayerNorm::apply(x, w, b, eps);
}

ColsumKernel set_colsum_kernel(ColsumKernel kernel) { return g_kernel.exchange(kernel); }

}  // namespace zrun
