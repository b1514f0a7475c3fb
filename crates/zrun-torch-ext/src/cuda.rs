//! Figures of libtorch's CUDA caching allocator (`torch.cuda.memory_allocated`,
//! `max_memory_allocated`, `memory_reserved`, `reset_peak_memory_stats`).
//!
//! Read through c10's device-generic `DeviceAllocator` interface, so the shim needs no CUDA
//! toolkit headers and builds on machines without CUDA; where libtorch's CUDA part is not
//! loaded or there is no GPU, the calls report `None` / do nothing.

use crate::ffi;
use std::ffi::c_int;
use std::ptr;

/// The caching allocator's figures for one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaMemory {
    /// Bytes held by live tensors now (`torch.cuda.memory_allocated`).
    pub allocated: u64,
    /// Most bytes held by live tensors since the last [`reset_cuda_peak`]
    /// (`torch.cuda.max_memory_allocated`).
    pub peak_allocated: u64,
    /// Bytes the allocator holds from the driver, cached ones included
    /// (`torch.cuda.memory_reserved`).
    pub reserved: u64,
    /// Most bytes reserved since the last [`reset_cuda_peak`] (`max_memory_reserved`).
    pub peak_reserved: u64,
}

/// CUDA caching-allocator figures of `device` (bytes allocated now, peak since last reset),
/// or None where CUDA is absent / not compiled.
///
/// Also `None` for a device index the machine does not have, and where the allocator
/// raised (which the shim catches).
pub fn cuda_memory(device: usize) -> Option<CudaMemory> {
    let device = i64::try_from(device).ok()?;
    let mut available: c_int = 0;
    let (mut allocated, mut peak, mut reserved, mut peak_reserved) = (0i64, 0i64, 0i64, 0i64);
    let mut err = ptr::null_mut();
    // SAFETY: every out-pointer is a valid, exclusive place of its type for the call; the
    // shim catches every C++ exception and reports it through `err`.
    let status = unsafe {
        ffi::zrun_ext_cuda_memory(
            device,
            &mut available,
            &mut allocated,
            &mut peak,
            &mut reserved,
            &mut peak_reserved,
            &mut err,
        )
    };
    ffi::check(status, err, String::new).ok()?;
    (available != 0).then(|| CudaMemory {
        allocated: allocated.max(0) as u64,
        peak_allocated: peak.max(0) as u64,
        reserved: reserved.max(0) as u64,
        peak_reserved: peak_reserved.max(0) as u64,
    })
}

/// Resets the peak that [`cuda_memory`] reports for `device` to the bytes allocated now.
/// Does nothing where CUDA is absent.
pub fn reset_cuda_peak(device: usize) {
    let Ok(device) = i64::try_from(device) else {
        return;
    };
    let mut err = ptr::null_mut();
    // SAFETY: as in `cuda_memory`.
    let status = unsafe { ffi::zrun_ext_reset_cuda_peak(device, &mut err) };
    // Nothing to report: without CUDA there is no peak to reset.
    let _ = ffi::check(status, err, String::new);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{resize_storage, storage_nbytes};
    use tch::{Cuda, Device, Kind, Tensor};

    #[test]
    fn none_without_cuda_else_counts_a_buffer_and_its_release() -> anyhow::Result<()> {
        if !Cuda::is_available() {
            assert_eq!(cuda_memory(0), None);
            reset_cuda_peak(0); // must not panic
            return Ok(());
        }
        assert_eq!(cuda_memory(10_000), None, "no such device");
        let dev = Device::Cuda(0);
        let bytes: u64 = 64 << 20;
        let warm = Tensor::f_zeros([1], (Kind::Float, dev))?;
        let before = cuda_memory(0).ok_or_else(|| anyhow::anyhow!("no figures"))?;
        let buf = Tensor::f_ones([(bytes / 4) as i64], (Kind::Float, dev))?;
        let with = cuda_memory(0).ok_or_else(|| anyhow::anyhow!("no figures"))?;
        assert_eq!(with.allocated - before.allocated, bytes);
        assert!(with.peak_allocated >= with.allocated);
        assert!(with.reserved >= with.allocated);

        resize_storage(&buf, 0)?;
        assert_eq!(storage_nbytes(&buf)?, 0);
        let freed = cuda_memory(0).ok_or_else(|| anyhow::anyhow!("no figures"))?;
        assert_eq!(
            freed.allocated, before.allocated,
            "resize to 0 gives the bytes back"
        );
        assert!(
            freed.peak_allocated >= with.allocated,
            "peak remembers the buffer"
        );
        reset_cuda_peak(0);
        let reset = cuda_memory(0).ok_or_else(|| anyhow::anyhow!("no figures"))?;
        assert_eq!(reset.peak_allocated, reset.allocated);

        resize_storage(&buf, bytes as usize)?;
        let _ = buf.data().f_fill_(2.0)?;
        assert_eq!(buf.sum(Kind::Double).double_value(&[]), (bytes / 2) as f64);
        drop(warm);
        Ok(())
    }
}
