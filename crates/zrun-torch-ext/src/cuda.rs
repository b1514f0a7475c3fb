//! Figures of libtorch's CUDA caching allocator (`torch.cuda.memory_allocated`,
//! `max_memory_allocated`, `memory_reserved`, `reset_peak_memory_stats`), and the calling
//! thread's current CUDA device (`torch.cuda.set_device`, `current_device`).
//!
//! Read through c10's device-generic `DeviceAllocator` and guard interfaces, so the shim needs
//! no CUDA toolkit headers and builds on machines without CUDA; where libtorch's CUDA part is
//! not loaded or there is no GPU, the calls report `None` / do nothing / refuse.

use crate::{ffi, Error};
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

/// Free and total bytes of CUDA device `device` (`torch.cuda.mem_get_info`), or `None` where
/// CUDA is absent or the device does not exist.
pub fn cuda_mem_info(device: usize) -> Option<(i64, i64)> {
    let device = i64::try_from(device).ok()?;
    let (mut available, mut free, mut total): (c_int, i64, i64) = (0, 0, 0);
    let mut err = ptr::null_mut();
    // SAFETY: as in `cuda_memory`.
    let status = unsafe {
        ffi::zrun_ext_cuda_mem_info(device, &mut available, &mut free, &mut total, &mut err)
    };
    ffi::check(status, err, String::new).ok()?;
    (available != 0).then_some((free, total))
}

/// Sets the caching allocators' options in `PYTORCH_CUDA_ALLOC_CONF` syntax (for example
/// `expandable_segments:True,per_process_memory_fraction:0.5`), as
/// `torch._C._accelerator_setAllocatorSettings` does; call it before the first CUDA
/// allocation. Harmless where CUDA is absent.
pub fn set_allocator_settings(settings: &str) -> Result<(), Error> {
    let c = std::ffi::CString::new(settings).map_err(|_| Error::Refused {
        op: format!("set_allocator_settings({settings:?})"),
        reason: "a NUL byte in the settings".into(),
    })?;
    let mut err = ptr::null_mut();
    // SAFETY: `c` is a valid NUL-terminated string for the call; `err` a valid out-pointer;
    // the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_set_allocator_settings(c.as_ptr(), &mut err) };
    ffi::check(status, err, || {
        format!("set_allocator_settings({settings:?})")
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

/// Makes CUDA device `index` current on the calling thread, as `torch.cuda.set_device` does:
/// libtorch then allocates there and launches there, unless told otherwise. Call it before
/// the thread allocates anything on CUDA.
///
/// Where CUDA is absent (a build without the `cuda` feature, a CPU libtorch, no GPU) or
/// `index` is not a visible device, it changes nothing and returns [`Error::Refused`].
pub fn set_cuda_device(index: usize) -> Result<(), Error> {
    let op = || format!("set_cuda_device(cuda:{index})");
    let Ok(i) = i64::try_from(index) else {
        return Err(Error::Refused {
            op: op(),
            reason: "index out of range".into(),
        });
    };
    let mut err = ptr::null_mut();
    // SAFETY: `err` is a valid out-pointer for the call; the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_set_cuda_device(i, &mut err) };
    ffi::check(status, err, op)
}

/// The calling thread's current CUDA device (`torch.cuda.current_device`), or `None` where
/// CUDA is absent.
pub fn current_cuda_device() -> Option<usize> {
    let mut out = -1i64;
    let mut err = ptr::null_mut();
    // SAFETY: as in `set_cuda_device`, with `out` a valid out-pointer.
    let status = unsafe { ffi::zrun_ext_current_cuda_device(&mut out, &mut err) };
    ffi::check(status, err, String::new).ok()?;
    usize::try_from(out).ok()
}

/// A 1-D tensor of `numel` elements of `kind` in pinned host memory, allocated pinned by
/// libtorch's caching host allocator (`torch.empty(n, pin_memory=True)`), for copies to and
/// from CUDA that need not block the host. That allocator keeps the block from being reused
/// until the copies queued with it have run, which suits short-lived staging; it rounds each
/// block up to a power of two bytes ([`pinned_bytes`]), so long-lived buffers take
/// [`crate::empty_pinned_exact`] instead. Refused where CUDA is absent.
pub fn empty_pinned(numel: i64, kind: tch::Kind) -> Result<tch::Tensor, Error> {
    let op = || format!("empty_pinned({numel} elements)");
    let like = tch::Tensor::f_empty([0], (kind, tch::Device::Cpu)).map_err(|e| Error::Torch {
        op: op(),
        message: e.to_string(),
    })?;
    // SAFETY: `like` is a live tensor borrowed for the call, the other pointers are
    // `tensor_out`'s; the shim catches every C++ exception and writes a fresh tensor on
    // success.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_empty_pinned(like.as_ptr().cast(), numel, out, err)
        })
    }
}

/// Bytes libtorch's caching host allocator holds for a pinned block of `bytes` from
/// [`empty_pinned`]: the next power of two (`c10::llvm::PowerOf2Ceil`; no setting turns it
/// off). [`crate::empty_pinned_exact`] holds `bytes`.
pub fn pinned_bytes(bytes: i64) -> i64 {
    if bytes <= 0 {
        return 0;
    }
    (bytes as u64).next_power_of_two() as i64
}

/// A CUDA event (`torch.cuda.Event`) recorded after a copy ([`CudaEvent::copy_to_host`]).
pub struct CudaEvent(*mut std::ffi::c_void);

// SAFETY: a CUDA event may be waited on and destroyed from any thread.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// Copies CUDA tensor `src` into pinned host tensor `dst` on a side stream of its device,
    /// after the work queued so far on the current stream (what made `src`): the copy
    /// overlaps the kernels queued after it. The returned event completes with the copy;
    /// `src` must not be written before then. Refused unless `src` is on CUDA and `dst` not.
    pub fn copy_to_host(dst: &tch::Tensor, src: &tch::Tensor) -> Result<CudaEvent, Error> {
        let mut out: *mut std::ffi::c_void = ptr::null_mut();
        let mut err = ptr::null_mut();
        // SAFETY: both tensors are live and borrowed for the call; valid out-pointers; the
        // shim catches every C++ exception.
        let status = unsafe {
            ffi::zrun_ext_copy_to_host_on_side_stream(
                dst.as_ptr().cast(),
                src.as_ptr().cast(),
                &mut out,
                &mut err,
            )
        };
        ffi::check(status, err, || {
            format!("copy {} elements to the host on a side stream", src.numel())
        })?;
        Ok(CudaEvent(out))
    }

    /// An event recorded on CUDA device `device`'s current stream: it completes with the work
    /// queued there so far. Refused where that device is not available.
    pub fn record_current(device: usize) -> Result<CudaEvent, Error> {
        let mut out: *mut std::ffi::c_void = ptr::null_mut();
        let mut err = ptr::null_mut();
        let index = i64::try_from(device).unwrap_or(i64::MAX);
        // SAFETY: valid out-pointers; the shim catches every C++ exception.
        let status = unsafe { ffi::zrun_ext_event_record_current(index, &mut out, &mut err) };
        ffi::check(status, err, || {
            format!("record a CUDA event on cuda:{device}")
        })?;
        Ok(CudaEvent(out))
    }

    /// Blocks the calling thread until the work before the event is done.
    pub fn synchronize(&self) -> Result<(), Error> {
        let mut err = ptr::null_mut();
        // SAFETY: a live event made by `record`; the shim catches every C++ exception.
        let status = unsafe { ffi::zrun_ext_event_synchronize(self.0, &mut err) };
        ffi::check(status, err, || "synchronize a CUDA event".into())
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: made by `record`, freed once here.
        unsafe { ffi::zrun_ext_event_free(self.0) }
    }
}

/// `dst.copy_(src, non_blocking=True)`: between pinned host memory and CUDA the copy is
/// queued on the current stream and the host goes on; elsewhere it is an ordinary copy.
pub fn copy_async(dst: &tch::Tensor, src: &tch::Tensor) -> Result<(), Error> {
    let mut err = ptr::null_mut();
    // SAFETY: both tensors are live and borrowed for the call; `err` is a valid out-pointer;
    // the shim catches every C++ exception.
    let status =
        unsafe { ffi::zrun_ext_copy_async(dst.as_ptr().cast(), src.as_ptr().cast(), &mut err) };
    ffi::check(status, err, || {
        format!("copy_async({} elements)", src.numel())
    })
}

/// Copies host tensor `src` into CUDA tensor `dst` on an upload stream of `dst`'s device, once
/// the work queued so far on the current stream is done: the copy overlaps the kernels queued
/// after it, which must neither read nor write `dst` until [`join_uploads`] (from pinned
/// memory the host goes on at once; `src` must stay unchanged until the copy has run).
/// Elsewhere (`dst` not on CUDA) an ordinary copy.
pub fn copy_to_device_on_side_stream(dst: &tch::Tensor, src: &tch::Tensor) -> Result<(), Error> {
    let mut err = ptr::null_mut();
    // SAFETY: both tensors are live and borrowed for the call; `err` is a valid out-pointer;
    // the shim catches every C++ exception.
    let status = unsafe {
        ffi::zrun_ext_copy_to_device_on_side_stream(
            dst.as_ptr().cast(),
            src.as_ptr().cast(),
            &mut err,
        )
    };
    ffi::check(status, err, || {
        format!(
            "copy {} elements to the device on a side stream",
            src.numel()
        )
    })
}

/// Makes CUDA device `device`'s current stream wait, on the device, for every copy queued so
/// far by [`copy_to_device_on_side_stream`] there: the kernels queued after this see them
/// done. Refused where that device is not available.
pub fn join_uploads(device: usize) -> Result<(), Error> {
    let mut err = ptr::null_mut();
    let index = i64::try_from(device).unwrap_or(i64::MAX);
    // SAFETY: `err` is a valid out-pointer; the shim catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_join_uploads(index, &mut err) };
    ffi::check(status, err, || {
        format!("wait for the copies to cuda:{device}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{resize_storage, storage_nbytes};
    use tch::{Cuda, Device, Kind, Tensor};

    /// Where the GPU checks run these tests (`ZRUN_EXPECT_CUDA=1`, benches/gpu check u),
    /// libtorch must see the GPU: else every CUDA test here would take its CPU branch and
    /// pass without having run.
    #[test]
    fn cuda_is_seen_where_it_is_expected() {
        if std::env::var("ZRUN_EXPECT_CUDA").as_deref() == Ok("1") {
            assert!(
                Cuda::is_available(),
                "ZRUN_EXPECT_CUDA=1 but libtorch sees no GPU"
            );
        }
    }

    #[test]
    fn pinned_blocks_round_to_powers_of_two_and_events_need_cuda() {
        assert_eq!(pinned_bytes(0), 0);
        assert_eq!(pinned_bytes(1), 1);
        assert_eq!(pinned_bytes(1000), 1024);
        assert_eq!(pinned_bytes(1 << 30), 1 << 30);
        assert_eq!(pinned_bytes((1 << 30) + 1), 1 << 31);
        if !Cuda::is_available() {
            let host = Tensor::zeros([2], (Kind::Float, Device::Cpu));
            let e = CudaEvent::copy_to_host(&host, &host)
                .err()
                .expect("refused");
            assert!(e.to_string().contains("must be a CUDA tensor"), "{e}");
            assert!(empty_pinned(4, Kind::Float).is_err());
            let e = CudaEvent::record_current(0).err().expect("refused");
            assert!(e.to_string().contains("cuda:0 is not available"), "{e}");
            let e = join_uploads(0).expect_err("refused");
            assert!(e.to_string().contains("cuda:0 is not available"), "{e}");
        }
    }

    #[test]
    fn async_copy_copies_and_refuses_a_size_mismatch() -> anyhow::Result<()> {
        let src = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let dst = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        copy_async(&dst, &src)?;
        assert!(dst.equal(&src));
        let bad = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        assert!(copy_async(&bad, &src).is_err());
        Ok(())
    }

    #[test]
    fn a_side_stream_upload_follows_the_work_before_it_and_is_joined() -> anyhow::Result<()> {
        let src = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        if !Cuda::is_available() {
            // Without CUDA: an ordinary copy.
            let dst = Tensor::zeros([3], (Kind::Float, Device::Cpu));
            copy_to_device_on_side_stream(&dst, &src)?;
            assert!(dst.equal(&src));
            return Ok(());
        }
        let n = 1 << 24;
        let mut host = empty_pinned(n, Kind::Float)?;
        host.f_copy_(&Tensor::f_arange(n, (Kind::Float, Device::Cpu))?)?;
        let dev = Device::Cuda(0);
        let mut dst = Tensor::f_zeros([n], (Kind::Float, dev))?;
        // Work queued before the copy that writes `dst` late: the copy must come after it.
        let a = Tensor::f_ones([4096, 4096], (Kind::Float, dev))?;
        let slow = (0..8).try_fold(a.shallow_clone(), |x, _| x.f_matmul(&a))?;
        dst.f_copy_(&slow.f_sum(Kind::Float)?.f_expand([n], false)?)?;
        copy_to_device_on_side_stream(&dst, &host)?;
        join_uploads(0)?;
        let back = dst.f_to(Device::Cpu)?;
        assert!(
            back.equal(&host),
            "the upload raced the work queued before it"
        );
        assert!(copy_to_device_on_side_stream(&dst, &dst).is_err());
        Ok(())
    }

    #[test]
    fn setting_the_current_device_refuses_cleanly_without_cuda() -> anyhow::Result<()> {
        if !Cuda::is_available() {
            match set_cuda_device(0) {
                Err(Error::Refused { op, reason }) => {
                    assert!(
                        op.contains("cuda:0") && reason.contains("not available"),
                        "{reason}"
                    );
                }
                other => panic!("expected a refusal without CUDA, got {other:?}"),
            }
            assert_eq!(current_cuda_device(), None);
            return Ok(());
        }
        let n = Cuda::device_count() as usize;
        let e = set_cuda_device(n).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        // on a fresh thread, so the test's own thread keeps its device
        std::thread::spawn(move || -> anyhow::Result<()> {
            let last = n - 1;
            set_cuda_device(last)?;
            assert_eq!(current_cuda_device(), Some(last));
            let t = tch::Tensor::f_zeros([4], (tch::Kind::Float, Device::Cuda(last)))?;
            assert_eq!(t.device(), Device::Cuda(last));
            Ok(())
        })
        .join()
        .map_err(|_| anyhow::anyhow!("thread panicked"))??;
        Ok(())
    }

    #[test]
    fn allocator_settings_parse_and_mem_info_is_none_without_cuda() {
        // c10's parser takes the options on every build; CUDA's allocator reads them.
        set_allocator_settings("expandable_segments:True").unwrap();
        let nul = set_allocator_settings("a\0b").unwrap_err().to_string();
        assert!(nul.contains("NUL"), "{nul}");
        if !Cuda::is_available() {
            assert_eq!(cuda_mem_info(0), None);
        } else {
            let (free, total) = cuda_mem_info(0).unwrap();
            assert!(0 < free && free <= total, "{free} {total}");
        }
    }

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
