// Pinned host memory that zrun allocated itself, exactly the size asked (src/pinned.rs calls
// the CUDA driver's cuMemHostAlloc), as a CPU tensor whose storage frees it: libtorch's
// caching host allocator would round the block up to a power of two bytes. Needs no CUDA
// header: the memory and the function that frees it come from the caller.

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

namespace {

// Frees the memory at `ptr`; `ctx` is what the caller handed in with it.
using HostFree = void (*)(void* ptr, void* ctx);

char* dup(const std::string& msg) {
  char* out = static_cast<char*>(std::malloc(msg.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, msg.data(), msg.size());
    out[msg.size()] = '\0';
  }
  return out;
}

}  // namespace

extern "C" {

// *out receives a new 1-D CPU tensor of `like`'s dtype over the `numel` elements at `data`
// (page-locked memory the caller allocated), whose storage calls free_fn(data, ctx) once, when
// its last reference goes. Returns 0, or 1 with a malloc'd message in *err. Either way the
// memory belongs here from the call on: on failure it has already gone to free_fn.
int zrun_ext_pinned_from_blob(const at::Tensor* like, void* data, int64_t numel,
                              HostFree free_fn, void* ctx, at::Tensor** out, char** err) {
  *err = nullptr;
  // Frees once, whichever comes first: the storage's deleter or a failure below.
  auto freed = std::make_shared<std::atomic<bool>>(false);
  auto release = [free_fn, ctx, freed](void* p) {
    if (!freed->exchange(true)) {
      free_fn(p, ctx);
    }
  };
  try {
    *out = new at::Tensor(
        at::from_blob(data, {numel}, release, like->options().device(at::kCPU)));
    return 0;
  } catch (const c10::Error& e) {
    *err = dup(e.what_without_backtrace());
  } catch (const std::exception& e) {
    *err = dup(e.what());
  } catch (...) {
    *err = dup("unknown C++ exception");
  }
  release(data);
  return 1;
}

}  // extern "C"
