// RMSNorm as one autograd node that saves its input and each row's rstd, on every device.
//
// On CUDA the forward and backward are ATen's fused kernels (_fused_rms_norm and its backward:
// one read of x, one write of y; the backward one pass over x and the gradient). Elsewhere the
// same arithmetic in a few ATen ops, in fp32: what ATen's own composite would save for its
// backward (an fp32 copy of x and the fp32 normalised x) is not kept, so the memory a step
// holds is the same on every device.

#include "rms_norm.h"
#include "acc_type.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace zrun {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RmsNorm : public torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    const int64_t c = x.size(-1);
    at::Tensor y, rstd;
    if (x.is_cuda()) {
      std::tie(y, rstd) = at::_fused_rms_norm(x.contiguous(), {c}, w, eps);
    } else {
      const auto acc = acc_type(x);
      at::Tensor xf = x.to(acc);
      rstd = at::rsqrt(xf.square().mean({-1}, /*keepdim=*/true).add_(eps));
      y = (xf * rstd).mul_(w.to(acc)).to(x.scalar_type());
    }
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor& g = grads[0];
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const int64_t c = x.size(-1);
    at::Tensor gx, gw;
    if (x.is_cuda()) {
      std::tie(gx, gw) = at::_fused_rms_norm_backward(g.contiguous(), x.contiguous(), {c}, rstd,
                                                      w, {want_x, want_w});
    } else {
      const auto acc = acc_type(x);
      // Out of place: `to` returns the tensor itself when it has the dtype already.
      at::Tensor xhat = x.to(acc) * rstd;  // (..., C)
      at::Tensor gf = g.to(acc);
      if (want_w) {
        gw = (gf * xhat).reshape({-1, c}).sum(0).to(w.scalar_type());
      }
      if (want_x) {
        // d/dx of x * rstd * w: rstd * (g w - xhat * mean(g w xhat)).
        at::Tensor gy = gf * w.to(acc);
        at::Tensor dot = (gy * xhat).mean({-1}, /*keepdim=*/true);
        gx = gy.sub_(xhat.mul_(dot)).mul_(rstd).to(x.scalar_type());
      }
    }
    return {want_x ? gx : at::Tensor(), want_w ? gw : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return RmsNorm::apply(x, w, eps);
}

}  // namespace zrun
