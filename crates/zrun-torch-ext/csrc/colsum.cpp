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

// Whether the kernel takes GELU's backward at h with the sums: dy's conditions, and h of dy's
// shape and dtype, contiguous and aligned.
bool use_gelu_kernel(const at::Tensor& dy, const at::Tensor& h, bool force_aten) {
  return use_kernel(dy, nullptr, nullptr, nullptr, force_aten) && h.sizes() == dy.sizes() &&
         h.scalar_type() == dy.scalar_type() && h.is_contiguous() && aligned(h);
}

// The bit of the kernel's dtype that asks for GELU's backward first (colsum.h).
constexpr int kGelu = 2;

// The kernel's sums of dy: {out_b}; with x, mean and rstd {out_g, out_b}; with `gelu` (x is
// GELU's input h) {dy gelu'(h), the sums of it}.
std::vector<at::Tensor> launch(const at::Tensor& dy, const at::Tensor* x, const at::Tensor* mean,
                               const at::Tensor* rstd, bool gelu = false) {
  const int64_t rows = dy.size(0), cols = dy.size(1);
  const int64_t span = 32 * vec(dy), spans = (cols + span - 1) / span;
  // About 512 blocks (a few per SM), each warp taking at least 8 rows of its split: fewer
  // splits leave less for the second pass to add.
  int64_t splits = std::clamp<int64_t>(512 / spans, 1, std::max<int64_t>(1, rows / 64));
  const int64_t per_split = (rows + splits - 1) / splits;
  splits = (rows + per_split - 1) / per_split;
  const bool ln = x != nullptr && !gelu;
  const int64_t halves = ln ? 2 : 1;
  at::Tensor part = at::empty({halves * splits * cols}, dy.options().dtype(at::kFloat));
  at::Tensor out_b = at::empty({cols}, dy.options());
  at::Tensor out_g = ln ? at::empty({cols}, dy.options())
                        : (gelu ? at::empty({rows, cols}, dy.options()) : at::Tensor());
  const int dtype = (dy.scalar_type() == at::kBFloat16 ? 1 : 0) | (gelu ? kGelu : 0);
  char* err = nullptr;
  const int rc = g_kernel.load()(
      dy.device().index(), dtype, dy.data_ptr(), x != nullptr ? x->data_ptr() : nullptr,
      ln ? mean->data_ptr() : nullptr, ln ? rstd->data_ptr() : nullptr, part.data_ptr(),
      out_b.data_ptr(), out_g.defined() ? out_g.data_ptr() : nullptr, rows, cols, splits,
      per_split, current_stream(dy.device()), &err);
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

// GELU (tanh) of a Linear with a bias as one node: the Linear's forward, then ATen's GELU.
// It keeps x, w and GELU's input h, what autograd's two nodes keep. Backward: GELU's
// gradient and the bias's (its sum over rows) in one pass of the kernel where it runs, else
// ATen's gelu_backward and the bias's sum as `Linear`'s; then the Linear's matmuls.
struct LinearGelu : public torch::autograd::Function<LinearGelu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b) {
    at::Tensor h = at::linear(x, w, b);
    ctx->save_for_backward({x, w, h});
    return at::gelu(h, "tanh");
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &h = saved[2];
    const int64_t out = w.size(0);
    at::Tensor dh, gb;
    if (ctx->needs_input_grad(2)) {
      auto r = gelu_colsum_raw(grads[0].reshape({-1, out}), h.reshape({-1, out}), false);
      dh = r[0];
      gb = r[1];
    } else {
      dh = at::gelu_backward(grads[0], h, "tanh").reshape({-1, out});
    }
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      gx = dh.mm(w).view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      gw = dh.t().mm(x.reshape({-1, w.size(1)}));
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

std::vector<at::Tensor> gelu_colsum_raw(const at::Tensor& dy, const at::Tensor& h,
                                        bool force_aten) {
  TORCH_CHECK(dy.dim() == 2 && h.sizes() == dy.sizes(), "gelu colsum: dy and h must be (rows, cols)");
  if (dy.is_cuda()) {
    const at::Tensor dyc = dy.contiguous(), hc = h.contiguous();
    if (use_gelu_kernel(dyc, hc, force_aten)) {
      return launch(dyc, &hc, nullptr, nullptr, true);
    }
  }
  at::Tensor dh = at::gelu_backward(dy, h, "tanh");
  return {dh, colsum_raw(dh, nullptr, nullptr, nullptr, force_aten)[0]};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return Linear::apply(x, w, b);
}

at::Tensor linear_gelu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return LinearGelu::apply(x, w, b);
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  return LayerNorm::apply(x, w, b, eps);
}

ColsumKernel set_colsum_kernel(ColsumKernel kernel) { return g_kernel.exchange(kernel); }

}  // namespace zrun
