// What the shim's calls into zrun's own kernels share: libtorch's stream as a raw handle,
// and a failed launch turned into a C++ exception.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace zrun {

// The current stream of `device` on this thread: the legacy default stream (null) unless a
// stream guard set another.
inline void* current_stream(const c10::Device& device) {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  return stream.id() == 0 ? nullptr : stream.native_handle();
}

// Throws, naming `what`, when a kernel's launcher returned `rc` != 0 with the malloc'd
// message `err` (freed here).
inline void check_launch(int rc, char* err, const char* what) {
  if (rc == 0) {
    return;
  }
  std::string msg = err != nullptr ? err : "no message";
  std::free(err);
  TORCH_CHECK(false, "the ", what, " kernel failed: ", msg);
}

}  // namespace zrun
