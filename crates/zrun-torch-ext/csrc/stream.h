// The stream libtorch runs on for a device, as a raw handle for zrun's own kernels.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace zrun {

// The current stream of `device` on this thread: the legacy default stream (null) unless a
// stream guard set another.
inline void* current_stream(const c10::Device& device) {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  return stream.id() == 0 ? nullptr : stream.native_handle();
}

}  // namespace zrun
