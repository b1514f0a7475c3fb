// Rotary position embedding as one autograd node: x * cos + roll(x, hd/2) * sin (the sign of
// rotate_half folded into sin). Its backward is g * cos + roll(g * sin, -hd/2). On CUDA each
// is one kernel pass over the heads (ATen's ops make four: mul, roll, mul, add; and as many
// in the backward); elsewhere those same ATen ops.

#include "rope.h"
#include "stream.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

namespace zrun {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<RopeKernel> g_kernel{nullptr};

struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rope_raw(x, cos, sin, false, false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    return {rope_raw(grads[0], saved[0], saved[1], true, false), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rope_raw(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                    bool backward, bool force_aten) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(1) && cos.size(1) == x.size(3) && x.size(3) % 2 == 0 &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.device() == x.device() && sin.device() == x.device(),
              "rope: x must be (B, T, H, hd) with hd even, cos and sin (T, hd) of its dtype and "
              "device");
  const int64_t hd = x.size(3);
  const RopeKernel kernel = g_kernel.load();
  if (!force_aten && x.is_cuda() && kernel != nullptr &&
      (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)) {
    const at::Tensor xc = x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
    at::Tensor y = at::empty_like(xc);
    if (xc.numel() == 0) {
      return y;
    }
    char* err = nullptr;
    const int rc = kernel(x.device().index(), x.scalar_type() == at::kBFloat16 ? 1 : 0,
                          backward ? 1 : 0, xc.data_ptr(), c.data_ptr(), s.data_ptr(),
                          y.data_ptr(), xc.numel(), xc.size(1), xc.size(2), hd,
                          current_stream(x.device()), &err);
    check_launch(rc, err, "rope");
    return y;
  }
  // (T, 1, hd): over the heads of each position.
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  if (!backward) {
    return x.mul(c).add_(at::roll(x, {hd / 2}, {-1}).mul_(s));
  }
  return x.mul(c).add_(at::roll(x.mul(s), {-hd / 2}, {-1}));
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return Rope::apply(x, cos, sin);
}

RopeKernel set_rope_kernel(RopeKernel kernel) { return g_kernel.exchange(kernel); }

}  // namespace zrun
