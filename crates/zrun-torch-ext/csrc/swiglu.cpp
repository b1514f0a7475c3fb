// SwiGLU's product as one autograd node: silu(gate) * up, keeping gate and up for the
// backward (autograd's silu-then-mul also keeps silu(gate), a third tensor of the MLP's
// width per layer). The backward recomputes silu(gate): on CUDA inside the one kernel that
// writes both gradients, elsewhere as one more elementwise op.

#include "swiglu.h"
#include "stream.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <vector>

namespace zrun {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<SwigluKernel> g_kernel{nullptr};

bool use_kernel(const at::Tensor& a, bool force_aten) {
  return !force_aten && a.is_cuda() && g_kernel.load() != nullptr &&
         (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16);
}

void launch(const at::Tensor& a, const at::Tensor& b, const at::Tensor* g, at::Tensor& out0,
            at::Tensor* out1) {
  const int64_t n = a.numel();
  if (n == 0) {
    return;
  }
  char* err = nullptr;
  const int rc = g_kernel.load()(a.device().index(), a.scalar_type() == at::kBFloat16 ? 1 : 0,
                                 g != nullptr ? 1 : 0, a.data_ptr(), b.data_ptr(),
                                 g != nullptr ? g->data_ptr() : nullptr, out0.data_ptr(),
                                 out1 != nullptr ? out1->data_ptr() : nullptr, n,
                                 current_stream(a.device()), &err);
  check_launch(rc, err, "SwiGLU");
}

struct Swiglu : public torch::autograd::Function<Swiglu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return swiglu_raw(gate, up, nullptr, false)[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto d = swiglu_raw(saved[0], saved[1], &grads[0], false);
    return {d[0], d[1]};
  }
};

}  // namespace

std::vector<at::Tensor> swiglu_raw(const at::Tensor& a, const at::Tensor& b, const at::Tensor* g,
                                   bool force_aten) {
  if (use_kernel(a, force_aten)) {
    const at::Tensor ac = a.contiguous(), bc = b.contiguous();
    if (g == nullptr) {
      at::Tensor out = at::empty_like(ac);
      launch(ac, bc, nullptr, out, nullptr);
      return {out};
    }
    const at::Tensor gc = g->contiguous();
    at::Tensor da = at::empty_like(ac), db = at::empty_like(bc);
    launch(ac, bc, &gc, da, &db);
    return {da, db};
  }
  if (g == nullptr) {
    return {at::silu(a).mul_(b)};
  }
  // autograd's mul backward then silu backward, with at most three tensors of the width alive
  // (g, d(a) made in place of g * b, d(b) in place of silu(a)).
  at::Tensor da = g->mul(b);
  at::silu_backward_out(da, da, a);
  at::Tensor db = at::silu(a).mul_(*g);
  return {da, db};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return Swiglu::apply(gate, up);
}

SwigluKernel set_swiglu_kernel(SwigluKernel kernel) { return g_kernel.exchange(kernel); }

}  // namespace zrun
