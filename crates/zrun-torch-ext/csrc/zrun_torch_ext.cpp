// C shim over the few libtorch calls tch does not expose.
//
// Conventions (shared with src/ffi.rs):
// - a tensor handle is a `torch::Tensor*`, exactly what tch's `Tensor::as_ptr()` returns;
// - every function returns a status code (ZR_OK, ZR_TORCH, ZR_REFUSED) and, on failure,
//   stores a malloc'd, NUL-terminated message in `*err` that the caller frees with
//   `zrun_ext_free_err`;
// - no C++ exception ever crosses this boundary: every body runs inside GUARD.

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/stack.h>
#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "fused_loss.h"
#include "linear_loss.h"
#include "rms_norm.h"
#include "rope.h"
#include "swiglu.h"
#include "colsum.h"
#include "stream.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#ifdef ZRUN_LINK_TORCH_CUDA
// Declared here rather than through ATen/cuda/CUDAContextLight.h, which needs the CUDA
// toolkit's headers. Exported by libtorch_cuda.so as _ZN2at4cuda9warp_sizeEv.
namespace at::cuda {
int warp_size();
}  // namespace at::cuda
#endif

namespace {

#ifdef ZRUN_LINK_TORCH_CUDA
// The linker's --as-needed (rustc's default) drops libtorch_cuda.so from a binary that takes
// no symbol from it, and libtorch then sees no CUDA at all (tch::Cuda::is_available() is
// false on a GPU machine; tch-rs issues #329, #980). Taking the address of one of its
// functions, read on every call below, keeps it loaded in every binary that uses this crate.
// The function is never called.
void* volatile torch_cuda_anchor = reinterpret_cast<void*>(&at::cuda::warp_size);
#endif

constexpr int ZR_OK = 0;
constexpr int ZR_TORCH = 1;    // libtorch raised an exception
constexpr int ZR_REFUSED = 2;  // the shim refused the request (message says why)

// Counts the allocations libtorch's allocators report for the profiler's memory events (the
// CPU allocator and CUDA's caching allocator call this hook for every block they hand out,
// and for every request they fail), on the threads that carry this debug info: the one that
// pushed it, and those that inherit it (autograd's, at::launch's).
class AllocationCounter final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device /*device*/) override {
    if (alloc_size > 0) {
      count_.fetch_add(1);
      bytes_.fetch_add(alloc_size);
    }
  }
  void reportOutOfMemory(int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device /*device*/) override {
    count_.fetch_add(1);
    bytes_.fetch_add(alloc_size);
  }
  bool memoryProfilingEnabled() const override { return true; }
  int64_t count() const { return count_.load(); }
  int64_t bytes() const { return bytes_.load(); }

 private:
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> bytes_{0};
};

char* dup_message(const std::string& msg) {
  char* out = static_cast<char*>(std::malloc(msg.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, msg.data(), msg.size());
    out[msg.size()] = '\0';
  }
  return out;
}

int refuse(char** err, const std::string& msg) {
  *err = dup_message(msg);
  return ZR_REFUSED;
}

// Runs `body` (which returns a status code) and turns every exception into ZR_TORCH.
template <typename F>
int guard(char** err, F&& body) {
  *err = nullptr;
#ifdef ZRUN_LINK_TORCH_CUDA
  (void)torch_cuda_anchor;
#endif
  try {
    return body();
  } catch (const c10::Error& e) {
    *err = dup_message(e.what_without_backtrace());
  } catch (const std::exception& e) {
    *err = dup_message(e.what());
  } catch (...) {
    *err = dup_message("unknown C++ exception");
  }
  return ZR_TORCH;
}

// Bytes of storage that `t` itself reads: (offset + last element reached + 1) * itemsize.
size_t extent_bytes(const at::Tensor& t) {
  if (t.numel() == 0) {
    return 0;
  }
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  return static_cast<size_t>(last + 1) * t.element_size();
}

// Whether CUDA device `device` exists (libtorch_cuda loaded, a GPU, the index in range);
// initialises the device's CUDA state when it does.
bool cuda_device_ready(int64_t device) {
  if (!at::globalContext().hasCUDA()) {
    return false;
  }
  if (device < 0 || device >= at::detail::getCUDAHooks().deviceCount()) {
    return false;
  }
  at::globalContext().lazyInitDevice(c10::kCUDA);
  return true;
}

// The generators' devices as src/rng.rs passes them.
constexpr int ZR_DEVICE_CPU = 0;
constexpr int ZR_DEVICE_CUDA = 1;

// Resolves (kind, index) to a device whose default generator exists here, or refuses with a
// message naming the device. Needs no CUDA header: CUDA is asked through ATen's hooks, which
// answer "absent" where libtorch_cuda is not loaded.
int rng_device(int kind, int64_t index, c10::Device* device, char** err) {
  if (kind == ZR_DEVICE_CPU) {
    *device = c10::Device(c10::kCPU);
    return ZR_OK;
  }
  if (kind != ZR_DEVICE_CUDA) {
    return refuse(err, "unknown device kind " + std::to_string(kind) +
                           "; only the cpu and cuda:N default generators are supported");
  }
  const std::string name = "cuda:" + std::to_string(index);
  if (!at::globalContext().hasCUDA()) {
    return refuse(err, name +
                           " has no generator here: CUDA is not available (libtorch's CUDA "
                           "part is not linked, i.e. not built with feature `cuda` against a "
                           "CUDA libtorch, or the machine has no GPU); use Device::Cpu");
  }
  const int64_t count = at::detail::getCUDAHooks().deviceCount();
  if (index < 0 || index >= count) {
    return refuse(err, name + " does not exist: this machine has " + std::to_string(count) +
                           " CUDA devices (cuda:0 to cuda:" + std::to_string(count - 1) + ")");
  }
  *device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  return ZR_OK;
}

// What is wrong with a Linear's inputs x (..., in), w (out, in), b (out), or nullptr.
const char* linear_inputs_problem(const at::Tensor* x, const at::Tensor* w, const at::Tensor* b) {
  if (!x->defined() || !w->defined() || !b->defined()) {
    return "an input is undefined";
  }
  if (x->dim() < 1 || w->dim() != 2 || b->dim() != 1 || x->size(-1) != w->size(1) ||
      b->size(0) != w->size(0) || !x->is_floating_point() ||
      x->scalar_type() != w->scalar_type() || x->scalar_type() != b->scalar_type() ||
      x->device() != w->device() || x->device() != b->device()) {
    return "x (..., in), w (out, in) and b (out) must be floating point of one dtype and device";
  }
  return nullptr;
}

}  // namespace

extern "C" {

void zrun_ext_free_err(char* err) { std::free(err); }

int zrun_ext_storage_nbytes(const at::Tensor* t, size_t* out, char** err) {
  return guard(err, [&] {
    if (t == nullptr || !t->defined()) {
      return refuse(err, "the tensor is undefined");
    }
    if (!t->has_storage()) {
      return refuse(err, "the tensor has no storage (sparse, nested or opaque layout)");
    }
    *out = t->storage().nbytes();
    return ZR_OK;
  });
}

int zrun_ext_resize_storage(const at::Tensor* t, size_t nbytes, char** err) {
  return guard(err, [&] {
    if (t == nullptr || !t->defined()) {
      return refuse(err, "the tensor is undefined");
    }
    if (!t->has_storage()) {
      return refuse(err, "the tensor has no storage (sparse, nested or opaque layout)");
    }
    c10::StorageImpl* s = t->storage().unsafeGetStorageImpl();
    if (!s->resizable() || s->allocator() == nullptr) {
      return refuse(err,
                    "the storage is not resizable (it wraps memory libtorch does not own, "
                    "e.g. from_blob); resize only storages libtorch allocated");
    }
    if (s->received_cuda()) {
      return refuse(err, "the storage was received from another process (CUDA IPC)");
    }
    const size_t need = extent_bytes(*t);
    if (nbytes != 0 && nbytes < need) {
      return refuse(err, "new size " + std::to_string(nbytes) + " bytes is smaller than the " +
                             std::to_string(need) +
                             " bytes this tensor reaches; resize to 0 or to at least that");
    }
    if (nbytes == s->nbytes()) {
      return ZR_OK;
    }
    // Allocate on the storage's own device: the CUDA caching allocator allocates on the
    // current device, which need not be this storage's.
    const c10::Device device = s->device();
    c10::OptionalDeviceGuard device_guard;
    if (!device.is_cpu()) {
      device_guard.reset_device(device);
    }
    c10::DataPtr fresh = s->allocator()->allocate(nbytes);
    // Dropping the old DataPtr (inside set_data_ptr_noswap) returns its memory to the
    // allocator; every view, autograd's saved ones included, shares this StorageImpl.
    s->set_data_ptr_noswap(std::move(fresh));
    s->set_nbytes(nbytes);
    return ZR_OK;
  });
}

// torch::autograd::grad(outputs, inputs, grad_outputs, retain_graph=false,
// create_graph=false, allow_unused=false); results[i] receives a new torch::Tensor*.
int zrun_ext_grad(const at::Tensor* const* outputs, const at::Tensor* const* grad_outputs,
                  size_t n_outputs, const at::Tensor* const* inputs, size_t n_inputs,
                  at::Tensor** results, char** err) {
  return guard(err, [&] {
    torch::autograd::variable_list outs, gouts, ins;
    outs.reserve(n_outputs);
    gouts.reserve(n_outputs);
    ins.reserve(n_inputs);
    for (size_t i = 0; i < n_outputs; ++i) {
      outs.push_back(*outputs[i]);
      gouts.push_back(*grad_outputs[i]);
    }
    for (size_t i = 0; i < n_inputs; ++i) {
      ins.push_back(*inputs[i]);
    }
    torch::autograd::variable_list grads =
        torch::autograd::grad(outs, ins, gouts, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/false);
    if (grads.size() != n_inputs) {
      return refuse(err, "autograd returned " + std::to_string(grads.size()) +
                             " gradients for " + std::to_string(n_inputs) + " inputs");
    }
    for (size_t i = 0; i < n_inputs; ++i) {
      results[i] = new at::Tensor(std::move(grads[i]));
    }
    return ZR_OK;
  });
}

// Sets *available to 0 where CUDA is absent (libtorch_cuda not loaded, no GPU, or a device
// index out of range); otherwise fills the caching allocator's aggregate figures.
int zrun_ext_cuda_memory(int64_t device, int* available, int64_t* allocated, int64_t* peak,
                         int64_t* reserved, int64_t* peak_reserved, char** err) {
  return guard(err, [&] {
    *available = 0;
    if (!cuda_device_ready(device)) {
      return ZR_OK;
    }
    c10::DeviceAllocator* alloc = c10::getDeviceAllocator(c10::kCUDA);
    const auto stats = alloc->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *allocated = stats.allocated_bytes[agg].current;
    *peak = stats.allocated_bytes[agg].peak;
    *reserved = stats.reserved_bytes[agg].current;
    *peak_reserved = stats.reserved_bytes[agg].peak;
    *available = 1;
    return ZR_OK;
  });
}

// Free and total bytes of CUDA device `device` (cudaMemGetInfo, through the device-generic
// allocator interface); *available = 0 where CUDA is absent or the index is out of range.
int zrun_ext_cuda_mem_info(int64_t device, int* available, int64_t* free_bytes,
                           int64_t* total_bytes, char** err) {
  return guard(err, [&] {
    *available = 0;
    if (!cuda_device_ready(device)) {
      return ZR_OK;
    }
    const auto info =
        c10::getDeviceAllocator(c10::kCUDA)->getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    *free_bytes = static_cast<int64_t>(info.first);
    *total_bytes = static_cast<int64_t>(info.second);
    *available = 1;
    return ZR_OK;
  });
}

// Sets the device caching allocators' options (the PYTORCH_CUDA_ALLOC_CONF syntax), as
// torch._C._accelerator_setAllocatorSettings does.
int zrun_ext_set_allocator_settings(const char* settings, char** err) {
  return guard(err, [&] {
    const std::string text(settings);
    // The CUDA allocator takes per_process_memory_fraction when it is initialised, with
    // CUDA; set later, the fraction would be silently ignored.
    if (text.find("per_process_memory_fraction") != std::string::npos &&
        at::globalContext().hasCUDA() && c10::getDeviceAllocator(c10::kCUDA)->initialized()) {
      return refuse(err,
                    "CUDA's caching allocator is already initialised: a memory fraction set now "
                    "would not apply; set it before anything touches CUDA");
    }
    c10::CachingAllocator::setAllocatorSettings(text);
    return ZR_OK;
  });
}

int zrun_ext_reset_cuda_peak(int64_t device, char** err) {
  return guard(err, [&] {
    if (!cuda_device_ready(device)) {
      return ZR_OK;
    }
    c10::getDeviceAllocator(c10::kCUDA)->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return ZR_OK;
  });
}

// Makes CUDA device `index` current on the calling thread (torch.cuda.set_device), through
// c10's device-generic guard interface, so no CUDA header is needed. Refuses where CUDA is
// absent (libtorch_cuda not loaded, no GPU) or the index is not a visible device.
int zrun_ext_set_cuda_device(int64_t index, char** err) {
  return guard(err, [&] {
    if (!at::globalContext().hasCUDA()) {
      return refuse(err, "cannot make cuda:" + std::to_string(index) +
                             " current: CUDA is not available (libtorch's CUDA part is not "
                             "linked, i.e. not built with feature `cuda` against a CUDA "
                             "libtorch, or the machine has no GPU)");
    }
    const int64_t count = at::detail::getCUDAHooks().deviceCount();
    if (index < 0 || index >= count) {
      return refuse(err, "cuda:" + std::to_string(index) + " does not exist: this process sees " +
                             std::to_string(count) + " CUDA device(s) (CUDA_VISIBLE_DEVICES)");
    }
    c10::impl::getDeviceGuardImpl(c10::kCUDA)
        ->setDevice(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)));
    return ZR_OK;
  });
}

// The calling thread's current CUDA device in *out, or -1 where CUDA is absent.
int zrun_ext_current_cuda_device(int64_t* out, char** err) {
  return guard(err, [&] {
    *out = -1;
    if (!at::globalContext().hasCUDA()) {
      return ZR_OK;
    }
    *out = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index();
    return ZR_OK;
  });
}

// The default generator's state of (kind, index) (see rng_device), as torch.get_rng_state()
// / torch.cuda.get_rng_state(i) return it: *out receives a new torch::Tensor*, a contiguous
// uint8 CPU tensor.
int zrun_ext_rng_state(int kind, int64_t index, at::Tensor** out, char** err) {
  return guard(err, [&] {
    c10::Device device(c10::kCPU);
    if (const int status = rng_device(kind, index, &device, err); status != ZR_OK) {
      return status;
    }
    at::Generator gen = at::globalContext().defaultGenerator(device);
    at::Tensor state;
    {
      // As PyTorch does: see its Note [Acquire lock when using random generators].
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    if (!state.defined() || state.scalar_type() != at::kByte || !state.device().is_cpu()) {
      return refuse(err, "the " + device.str() +
                             " generator's state is not a uint8 CPU tensor; this libtorch "
                             "is not one this shim knows");
    }
    *out = new at::Tensor(state.contiguous());
    return ZR_OK;
  });
}

// Restores the default generator of (kind, index) from `n` bytes that zrun_ext_rng_state
// returned (torch.set_rng_state / torch.cuda.set_rng_state(state, i)). A state libtorch
// rejects (wrong size or content) comes back as ZR_TORCH with a message naming the device,
// the generator put back as it was.
int zrun_ext_rng_set_state(int kind, int64_t index, const uint8_t* bytes, size_t n,
                           char** err) {
  return guard(err, [&] {
    c10::Device device(c10::kCPU);
    if (const int status = rng_device(kind, index, &device, err); status != ZR_OK) {
      return status;
    }
    at::Tensor state = at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
    if (n != 0) {
      std::memcpy(state.data_ptr<uint8_t>(), bytes, n);
    }
    at::Generator gen = at::globalContext().defaultGenerator(device);
    // As PyTorch does: see its Note [Acquire lock when using random generators].
    std::lock_guard<std::mutex> lock(gen.mutex());
    // CUDA's set_state sets the seed before it checks the offset: put a rejected state's
    // partial change back.
    const at::Tensor before = gen.get_state();
    try {
      gen.set_state(state);
    } catch (const c10::Error& e) {
      std::string rollback;
      try {
        gen.set_state(before);
      } catch (const c10::Error& again) {
        rollback = "; putting the previous state back failed too, so the generator may have "
                   "changed (" + std::string(again.what_without_backtrace()) + ")";
      }
      *err = dup_message("the " + device.str() + " generator rejected a state of " +
                         std::to_string(n) + " bytes (its own state is " +
                         std::to_string(before.numel()) +
                         " bytes): the state is from another libtorch version or another "
                         "generator (device), or corrupt; restore it with the libtorch and on "
                         "the device kind it was saved with (libtorch: " +
                         e.what_without_backtrace() + ")" + rollback);
      return ZR_TORCH;
    }
    return ZR_OK;
  });
}

// at::_fused_adamw_ over n (param, grad, exp_avg, exp_avg_sq) quadruples with one decoupled
// weight decay and one step count for all, the gradients divided by `grad_scale` first when it
// is not null (one fp32 element on their device): what torch.optim.AdamW(fused=True) runs, a
// few kernels for every tensor at once.
int zrun_ext_fused_adam(const at::Tensor* const* params, const at::Tensor* const* grads,
                        const at::Tensor* const* exp_avgs, const at::Tensor* const* exp_avg_sqs,
                        size_t n, const at::Tensor* step, const at::Tensor* grad_scale, double lr,
                        double beta1, double beta2, double eps, double weight_decay, char** err) {
  return guard(err, [&] {
    std::vector<at::Tensor> p, g, m, v, steps;
    for (size_t i = 0; i < n; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
      steps.push_back(*step);
    }
    std::optional<at::Tensor> scale;
    if (grad_scale != nullptr) {
      scale = *grad_scale;
    }
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2, weight_decay,
                      eps, /*amsgrad=*/false, /*maximize=*/false, scale, /*found_inf=*/std::nullopt);
    return ZR_OK;
  });
}

// The sum of squares of n tensors as a 0-d fp64 tensor on their device: one multi-tensor
// norm kernel (at::_foreach_norm, fp32 accumulation) and a few kernels to combine the
// norms; nothing is read back to the host.
int zrun_ext_sum_of_squares(const at::Tensor* const* tensors, size_t n, at::Tensor** out,
                            char** err) {
  return guard(err, [&] {
    if (n == 0) {
      return refuse(err, "no tensors");
    }
    std::vector<at::Tensor> ts;
    for (size_t i = 0; i < n; ++i) {
      ts.push_back(*tensors[i]);
    }
    // fp32 norms whatever the dtype: a bf16 norm would round the sum to 2^-8.
    at::Tensor norms = at::stack(at::_foreach_norm(ts, 2, at::kFloat)).to(at::kDouble);
    *out = new at::Tensor(norms.square().sum());
    return ZR_OK;
  });
}

// In place on *t with the scalar v: 0 t *= v, 1 t /= v, 2 t += v, 3 t.fill_(v),
// 4 t.lerp_(*other, v), 5 t.masked_fill_(*other, v). For callers that must get an error
// and not a panic: tch frees the Scalar it makes for f_mul_scalar_ and the like before it
// reads the call's error, and that free unwraps the pending error. Here the scalar is C++'s.
int zrun_ext_scalar_op_(const at::Tensor* t, const at::Tensor* other, int32_t op, double v,
                        char** err) {
  return guard(err, [&] {
    at::Tensor x = *t;
    switch (op) {
      case 0: x.mul_(v); break;
      case 1: x.div_(v); break;
      case 2: x.add_(v); break;
      case 3: x.fill_(v); break;
      case 4: x.lerp_(*other, v); break;
      case 5: x.masked_fill_(*other, v); break;
      default: return refuse(err, "unknown scalar op " + std::to_string(op));
    }
    return ZR_OK;
  });
}

// *t += v * *a * *b (div = 0) or v * *a / *b (div = 1), in place, with ATen's type
// promotion: a bf16 *t with fp32 operands is computed in fp32 and rounded once.
int zrun_ext_addc_(const at::Tensor* t, const at::Tensor* a, const at::Tensor* b, int32_t div,
                   double v, char** err) {
  return guard(err, [&] {
    at::Tensor x = *t;
    if (div) {
      x.addcdiv_(*a, *b, v);
    } else {
      x.addcmul_(*a, *b, v);
    }
    return ZR_OK;
  });
}

// The 2-norm of *t as a 0-d fp32 tensor on its device (fp32 accumulation whatever the
// dtype): one reduction, nothing read back.
int zrun_ext_norm_f32(const at::Tensor* t, at::Tensor** out, char** err) {
  return guard(err, [&] {
    *out = new at::Tensor(
        at::linalg_vector_norm(*t, 2, at::OptionalIntArrayRef{}, false, at::kFloat));
    return ZR_OK;
  });
}

// A 1-D tensor of `like`'s dtype and `numel` elements in pinned (page-locked) host memory
// from libtorch's caching host allocator, allocated pinned (not pinned after the fact);
// copies between it and a CUDA tensor can run without blocking the host.
int zrun_ext_empty_pinned(const at::Tensor* like, int64_t numel, at::Tensor** out, char** err) {
  return guard(err, [&] {
    *out = new at::Tensor(
        at::empty({numel}, like->options().device(at::kCPU).pinned_memory(true)));
    return ZR_OK;
  });
}

// dst.copy_(src, non_blocking=true): between pinned host memory and CUDA, queued on the
// current stream without blocking the host (the caching host allocator keeps a pinned
// source alive until the copy has run).
int zrun_ext_copy_async(const at::Tensor* dst, const at::Tensor* src, char** err) {
  return guard(err, [&] {
    at::Tensor d = *dst;
    d.copy_(*src, /*non_blocking=*/true);
    return ZR_OK;
  });
}

// Blocks the calling thread until the event's work is done (torch.cuda.Event.synchronize()).
int zrun_ext_event_synchronize(void* event, char** err) {
  return guard(err, [&] {
    static_cast<c10::Event*>(event)->synchronize();
    return ZR_OK;
  });
}

void zrun_ext_event_free(void* event) {
  try {
    delete static_cast<c10::Event*>(event);
  } catch (...) {
  }
}

// *out receives a c10::Event* recorded on CUDA device `device`'s current stream: it completes
// with the work queued there so far (zrun_ext_event_free deletes it).
int zrun_ext_event_record_current(int64_t device, void** out, char** err) {
  return guard(err, [&] {
    if (!cuda_device_ready(device)) {
      return refuse(err, "cuda:" + std::to_string(device) + " is not available");
    }
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    auto done = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    done->record(impl->getStream(c10::Device(c10::DeviceType::CUDA,
                                             static_cast<c10::DeviceIndex>(device))));
    *out = done.release();
    return ZR_OK;
  });
}

// Two side streams per CUDA device, from libtorch's pool, for copies that overlap compute:
// kind 0 to the host, kind 1 to the device (apart, so that the two directions' copy engines
// run at once).
c10::Stream side_stream(const c10::impl::DeviceGuardImplInterface* impl, c10::Device dev,
                        size_t kind = 0) {
  static std::mutex lock;
  static std::vector<std::optional<c10::Stream>> streams;
  std::lock_guard<std::mutex> held(lock);
  size_t i = static_cast<size_t>(dev.index()) * 2 + kind;
  if (streams.size() <= i) {
    streams.resize(i + 1);
  }
  if (!streams[i]) {
    streams[i] = impl->getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
  }
  return *streams[i];
}

// Queues `dst.copy_(src, non_blocking)` on `side` once the work queued so far on `dev`'s
// current stream is done; `cuda` (the copy's CUDA tensor) stays reserved for `side` until
// the copy has run.
void copy_on_side_stream(const c10::impl::DeviceGuardImplInterface* impl, c10::Device dev,
                         c10::Stream side, at::Tensor dst, const at::Tensor& src,
                         const at::Tensor& cuda) {
  c10::Event before(c10::DeviceType::CUDA);
  before.record(impl->getStream(dev));
  before.block(side);
  impl->recordDataPtrOnStream(cuda.storage().data_ptr(), side);
  c10::Stream previous = impl->exchangeStream(side);
  try {
    dst.copy_(src, /*non_blocking=*/true);
  } catch (...) {
    impl->exchangeStream(previous);
    throw;
  }
  impl->exchangeStream(previous);
}

// Copies host tensor `src` into CUDA tensor `dst` on the device's upload stream, once the work
// queued so far on the current stream is done, so the copy overlaps the kernels queued after
// it (which must neither read nor write `dst`); zrun_ext_join_uploads makes the current stream
// wait for it. Not CUDA: an ordinary copy.
int zrun_ext_copy_to_device_on_side_stream(const at::Tensor* dst, const at::Tensor* src,
                                           char** err) {
  return guard(err, [&] {
    at::Tensor d = *dst;
    if (!dst->is_cuda()) {
      d.copy_(*src);
      return ZR_OK;
    }
    if (src->is_cuda()) {
      return refuse(err, "the source must be host memory");
    }
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::Device dev = dst->device();
    copy_on_side_stream(impl, dev, side_stream(impl, dev, 1), d, *src, *dst);
    return ZR_OK;
  });
}

// Makes CUDA device `device`'s current stream wait (on the device, not the host) for every
// copy queued so far on its upload stream.
int zrun_ext_join_uploads(int64_t device, char** err) {
  return guard(err, [&] {
    if (!cuda_device_ready(device)) {
      return refuse(err, "cuda:" + std::to_string(device) + " is not available");
    }
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
    c10::Event copied(c10::DeviceType::CUDA);
    copied.record(side_stream(impl, dev, 1));
    copied.block(impl->getStream(dev));
    return ZR_OK;
  });
}

// Copies CUDA tensor `src` into pinned host tensor `dst` on the device's side stream, once
// the work queued so far on the current stream (what made `src`) is done, so the copy
// overlaps the kernels queued after it; *out receives a c10::Event* recorded after the copy
// (zrun_ext_event_free deletes it). `src` stays reserved for the side stream until then.
int zrun_ext_copy_to_host_on_side_stream(const at::Tensor* dst, const at::Tensor* src,
                                         void** out, char** err) {
  return guard(err, [&] {
    if (!src->is_cuda() || dst->is_cuda()) {
      return refuse(err, "the source must be a CUDA tensor and the destination host memory");
    }
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::Device dev = src->device();
    c10::Stream side = side_stream(impl, dev);
    copy_on_side_stream(impl, dev, side, *dst, *src, *src);
    auto done = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    done->record(side);
    *out = done.release();
    return ZR_OK;
  });
}

// Starts counting the calling thread's libtorch allocations (see AllocationCounter); ends
// with zrun_ext_count_allocations_end on the same thread. A profiler recording memory on
// this thread does not see the allocations made meanwhile.
int zrun_ext_count_allocations_begin(char** err) {
  return guard(err, [&] {
    c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE,
                                     std::make_shared<AllocationCounter>());
    return ZR_OK;
  });
}

// Stops the count begun last on this thread: *count allocations (failed requests included)
// of *bytes in all. Refuses when the thread's innermost profiler state is not that count.
int zrun_ext_count_allocations_end(int64_t* count, int64_t* bytes, char** err) {
  return guard(err, [&] {
    auto* top = c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE);
    auto* counter = dynamic_cast<AllocationCounter*>(top);
    if (counter == nullptr) {
      return refuse(err, "no allocation count was begun on this thread");
    }
    *count = counter->count();
    *bytes = counter->bytes();
    c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
    return ZR_OK;
  });
}

// zrun::linear_cross_entropy after checking its inputs (see linear_loss.h).
int zrun_ext_linear_cross_entropy(const at::Tensor* h, const at::Tensor* w,
                                  const at::Tensor* targets, int64_t ignore_index, int64_t chunk,
                                  at::Tensor** out, char** err) {
  return guard(err, [&] {
    if (!h->defined() || !w->defined() || !targets->defined()) {
      return refuse(err, "an input is undefined");
    }
    if (h->dim() != 2 || w->dim() != 2 || h->size(1) != w->size(1) ||
        !h->is_floating_point() || h->scalar_type() != w->scalar_type() ||
        h->device() != w->device()) {
      return refuse(err, "h (N, C) and w (V, C) must be floating point of one dtype and device");
    }
    if (targets->dim() != 1 || targets->size(0) != h->size(0) ||
        targets->scalar_type() != at::kLong || targets->device() != h->device()) {
      return refuse(err, "targets must be int64 (N) on the device of h (N, C)");
    }
    if (chunk < 1) {
      return refuse(err, "the chunk must hold at least one logit");
    }
    *out = new at::Tensor(zrun::linear_cross_entropy(*h, *w, *targets, ignore_index, chunk));
    return ZR_OK;
  });
}

// zrun::fused_linear_cross_entropy after checking its inputs (see fused_loss.h).
int zrun_ext_fused_linear_cross_entropy(const at::Tensor* h, const at::Tensor* w,
                                        const at::Tensor* targets, int64_t ignore_index,
                                        at::Tensor** out, char** err) {
  return guard(err, [&] {
    if (!h->defined() || !w->defined() || !targets->defined()) {
      return refuse(err, "an input is undefined");
    }
    if (h->dim() != 2 || w->dim() != 2 || h->size(1) != w->size(1) ||
        (h->scalar_type() != at::kFloat && h->scalar_type() != at::kBFloat16) ||
        h->scalar_type() != w->scalar_type() || h->device() != w->device()) {
      return refuse(err, "h (N, C) and w (V, C) must be bf16 or fp32 of one dtype and device");
    }
    if (targets->dim() != 1 || targets->size(0) != h->size(0) ||
        targets->scalar_type() != at::kLong || targets->device() != h->device()) {
      return refuse(err, "targets must be int64 (N) on the device of h (N, C)");
    }
    *out = new at::Tensor(zrun::fused_linear_cross_entropy(*h, *w, *targets, ignore_index));
    return ZR_OK;
  });
}

// zrun::ce_rows (see fused_loss.h): *out gets the rows' losses; `logits` is written in place
// with `grad`. The checks are ce_rows' own.
int zrun_ext_ce_rows(const at::Tensor* logits, const at::Tensor* targets, const at::Tensor* coef,
                     int grad, int force_aten, at::Tensor** out, char** err) {
  return guard(err, [&] {
    if (!logits->defined() || !targets->defined() || !coef->defined()) {
      return refuse(err, "an input is undefined");
    }
    *out = new at::Tensor(zrun::ce_rows(*logits, *targets, *coef, grad != 0, force_aten != 0));
    return ZR_OK;
  });
}

// Registers the CUDA kernel behind zrun::ce_rows (nullptr: none); returns the one it replaces. Cannot fail.
zrun::CeRowsKernel zrun_ext_set_ce_rows_kernel(zrun::CeRowsKernel kernel) {
  return zrun::set_ce_rows_kernel(kernel);
}

// zrun::swiglu (raw: zrun::swiglu_raw, with `g` null for the forward; *out1 only with `g`)
// after checking its inputs (see swiglu.h).
int zrun_ext_swiglu(const at::Tensor* a, const at::Tensor* b, const at::Tensor* g, int raw,
                    int force_aten, at::Tensor** out0, at::Tensor** out1, char** err) {
  return guard(err, [&] {
    if (!a->defined() || !b->defined() || (g != nullptr && !g->defined())) {
      return refuse(err, "an input is undefined");
    }
    if (a->sizes() != b->sizes() || !a->is_floating_point() ||
        a->scalar_type() != b->scalar_type() || a->device() != b->device() ||
        (g != nullptr && (g->sizes() != a->sizes() || g->scalar_type() != a->scalar_type() ||
                          g->device() != a->device()))) {
      return refuse(err, "gate and up (and the gradient) must be floating point of one shape, dtype and device");
    }
    if (!raw) {
      *out0 = new at::Tensor(zrun::swiglu(*a, *b));
      return ZR_OK;
    }
    auto r = zrun::swiglu_raw(*a, *b, g, force_aten != 0);
    *out0 = new at::Tensor(r[0]);
    if (g != nullptr) {
      *out1 = new at::Tensor(r[1]);
    }
    return ZR_OK;
  });
}

// Registers the CUDA kernel behind zrun::swiglu (nullptr: none); returns the one it replaces. Cannot fail.
zrun::SwigluKernel zrun_ext_set_swiglu_kernel(zrun::SwigluKernel kernel) {
  return zrun::set_swiglu_kernel(kernel);
}

// zrun::rope (raw: zrun::rope_raw with `backward`, `force_aten`); rope_raw checks the inputs.
int zrun_ext_rope(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* sin, int raw,
                  int backward, int force_aten, at::Tensor** out, char** err) {
  return guard(err, [&] {
    if (!x->defined() || !cos->defined() || !sin->defined()) {
      return refuse(err, "an input is undefined");
    }
    *out = new at::Tensor(raw ? zrun::rope_raw(*x, *cos, *sin, backward != 0, force_aten != 0)
                              : zrun::rope(*x, *cos, *sin));
    return ZR_OK;
  });
}

// Registers the CUDA kernel behind zrun::rope (nullptr: none); returns the one it replaces. Cannot fail.
zrun::RopeKernel zrun_ext_set_rope_kernel(zrun::RopeKernel kernel) {
  return zrun::set_rope_kernel(kernel);
}

// zrun::linear after checking its inputs (see colsum.h).
int zrun_ext_linear(const at::Tensor* x, const at::Tensor* w, const at::Tensor* b,
                    at::Tensor** out, char** err) {
  return guard(err, [&] {
    if (const char* problem = linear_inputs_problem(x, w, b)) {
      return refuse(err, problem);
    }
    *out = new at::Tensor(zrun::linear(*x, *w, *b));
    return ZR_OK;
  });
}

// zrun::linear_gelu after checking its inputs (see colsum.h).
int zrun_ext_linear_gelu(const at::Tensor* x, const at::Tensor* w, const at::Tensor* b,
                         at::Tensor** out, char** err) {
  return guard(err, [&] {
    if (const char* problem = linear_inputs_problem(x, w, b)) {
      return refuse(err, problem);
    }
    *out = new at::Tensor(zrun::linear_gelu(*x, *w, *b));
    return ZR_OK;
  });
}

// zrun::gelu_colsum_raw after checking its inputs: {dy gelu'(h), its sum over rows}.
int zrun_ext_gelu_colsum(const at::Tensor* dy, const at::Tensor* h, int force_aten,
                         at::Tensor** out0, at::Tensor** out1, char** err) {
  return guard(err, [&] {
    if (!dy->defined() || !h->defined()) {
      return refuse(err, "an input is undefined");
    }
    if (dy->dim() != 2 || !dy->is_floating_point() || h->sizes() != dy->sizes() ||
        h->scalar_type() != dy->scalar_type() || h->device() != dy->device()) {
      return refuse(err, "dy and h must be floating point (rows, cols) of one dtype and device");
    }
    auto r = zrun::gelu_colsum_raw(*dy, *h, force_aten != 0);
    *out0 = new at::Tensor(r[0]);
    *out1 = new at::Tensor(r[1]);
    return ZR_OK;
  });
}

// zrun::layer_norm after checking its inputs (see colsum.h).
int zrun_ext_layer_norm(const at::Tensor* x, const at::Tensor* w, const at::Tensor* b,
                        double eps, at::Tensor** out, char** err) {
  return guard(err, [&] {
    if (!x->defined() || !w->defined() || !b->defined()) {
      return refuse(err, "an input is undefined");
    }
    if (x->dim() < 1 || w->dim() != 1 || w->sizes() != b->sizes() ||
        x->size(-1) != w->size(0) || !x->is_floating_point() ||
        x->scalar_type() != w->scalar_type() || x->scalar_type() != b->scalar_type() ||
        x->device() != w->device() || x->device() != b->device()) {
      return refuse(err, "x (..., C), w (C) and b (C) must be floating point of one dtype and device");
    }
    if (!(eps >= 0.0)) {
      return refuse(err, "eps must be a number >= 0");
    }
    *out = new at::Tensor(zrun::layer_norm(*x, *w, *b, eps));
    return ZR_OK;
  });
}

// zrun::colsum_raw (x, mean and rstd all null or all given; *out1 only with x).
int zrun_ext_colsum(const at::Tensor* dy, const at::Tensor* x, const at::Tensor* mean,
                    const at::Tensor* rstd, int force_aten, at::Tensor** out0,
                    at::Tensor** out1, char** err) {
  return guard(err, [&] {
    if (!dy->defined() || (x != nullptr && (!x->defined() || mean == nullptr ||
                                            rstd == nullptr || !mean->defined() ||
                                            !rstd->defined()))) {
      return refuse(err, "an input is undefined");
    }
    if (dy->dim() != 2 || !dy->is_floating_point()) {
      return refuse(err, "dy must be floating point (rows, cols)");
    }
    auto r = zrun::colsum_raw(*dy, x, mean, rstd, force_aten != 0);
    *out0 = new at::Tensor(r[0]);
    if (x != nullptr) {
      *out1 = new at::Tensor(r[1]);
    }
    return ZR_OK;
  });
}

// Registers the CUDA kernel behind zrun::linear and zrun::layer_norm's sums (nullptr: none);
// returns the one it replaces. Cannot fail.
zrun::ColsumKernel zrun_ext_set_colsum_kernel(zrun::ColsumKernel kernel) {
  return zrun::set_colsum_kernel(kernel);
}

// The current stream of CUDA device `device` on this thread as a raw handle, for a kernel
// launched from Rust (kernels/optim.rs); null is the legacy default stream.
int zrun_ext_current_cuda_stream(int64_t device, void** out, char** err) {
  return guard(err, [&] {
    *out = zrun::current_stream(c10::Device(c10::DeviceType::CUDA, device));
    return ZR_OK;
  });
}

// zrun::rms_norm after checking its inputs (see rms_norm.h).
int zrun_ext_rms_norm(const at::Tensor* x, const at::Tensor* w, double eps, at::Tensor** out,
                      char** err) {
  return guard(err, [&] {
    if (!x->defined() || !w->defined()) {
      return refuse(err, "an input is undefined");
    }
    if (x->dim() < 1 || w->dim() != 1 || x->size(-1) != w->size(0) || !x->is_floating_point() ||
        x->scalar_type() != w->scalar_type() || x->device() != w->device()) {
      return refuse(err, "x (..., C) and w (C) must be floating point of one dtype and device");
    }
    if (!(eps >= 0.0)) {
      return refuse(err, "eps must be a number >= 0");
    }
    *out = new at::Tensor(zrun::rms_norm(*x, *w, eps));
    return ZR_OK;
  });
}

// Starts libtorch's profiler (Kineto) on the calling thread, and on the threads that inherit
// its state (autograd's): operators with their input shapes, and with `cuda` CUDA kernels,
// copies and memsets. Refused while a profiler is on.
int zrun_ext_profiler_start(int cuda, char** err) {
  return guard(err, [&] {
    namespace impl = torch::profiler::impl;
    if (impl::profilerEnabled()) {
      return refuse(err, "a profiler is already on in this thread");
    }
    impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
    std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
    if (cuda != 0) {
      activities.insert(impl::ActivityType::CUDA);
    }
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    return ZR_OK;
  });
}

// Stops the profiler started on this thread and writes what it recorded to `path` as a
// Chrome trace (JSON; chrome://tracing, Perfetto, benches/profile_table.py).
int zrun_ext_profiler_stop(const char* path, char** err) {
  return guard(err, [&] {
    if (!torch::profiler::impl::profilerEnabled()) {
      return refuse(err, "no profiler is on in this thread");
    }
    torch::autograd::profiler::disableProfiler()->save(path);
    return ZR_OK;
  });
}

}  // extern "C"
