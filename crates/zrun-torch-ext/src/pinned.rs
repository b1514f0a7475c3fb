//! Pinned host memory of exactly the size asked, for long-lived buffers: allocated through the
//! CUDA driver (`cuMemHostAlloc`, portable: page-locked for every context, libtorch's primary
//! contexts included) and wrapped as a CPU tensor whose storage frees it (`cuMemFreeHost`)
//! when its last reference goes. libtorch's caching host allocator ([`crate::empty_pinned`])
//! rounds each block up to a power of two bytes ([`crate::pinned_bytes`]): a 9 GiB buffer
//! takes 16 GiB.
//!
//! Copies between such a tensor and CUDA with `non_blocking` ([`crate::copy_async`]) are
//! real asynchronous DMA. libtorch's caching host allocator, which copies report to, finds no
//! block of its own for the memory and keeps nothing alive: the caller does (see
//! [`empty_pinned_exact`]).

use crate::{ffi, Error};
use cudarc::driver::{result as cu, sys as cusys};
use std::ffi::c_void;
use std::sync::Mutex;

/// The primary context of each device used here, retained for the process (never released),
/// by device index.
static CONTEXTS: Mutex<Vec<(i32, usize)>> = Mutex::new(Vec::new());

/// CUDA device `device`'s primary context (the one libtorch runs in), retained once.
fn primary_context(device: i32) -> Result<cusys::CUcontext, String> {
    let mut held = CONTEXTS
        .lock()
        .map_err(|_| "the context table is poisoned".to_string())?;
    if let Some(&(_, ctx)) = held.iter().find(|(d, _)| *d == device) {
        return Ok(ctx as cusys::CUcontext);
    }
    cu::init().map_err(|e| format!("cuInit: {e:?}"))?;
    let dev = cu::device::get(device).map_err(|e| format!("cuDeviceGet({device}): {e:?}"))?;
    // SAFETY: `dev` came from cuDeviceGet; the reference is kept for the process.
    let ctx = unsafe { cu::primary_ctx::retain(dev) }
        .map_err(|e| format!("cuDevicePrimaryCtxRetain(cuda:{device}): {e:?}"))?;
    held.push((device, ctx as usize));
    Ok(ctx)
}

/// Runs `f` with `ctx` current on the calling thread, then makes the thread's previous
/// context current again.
///
/// # Safety
/// `ctx` must be a live context (a retained primary context).
unsafe fn in_context<T>(
    ctx: cusys::CUcontext,
    f: impl FnOnce() -> Result<T, String>,
) -> Result<T, String> {
    // SAFETY: `ctx` is live (the caller's promise); the push is undone below.
    unsafe { cusys::cuCtxPushCurrent_v2(ctx) }
        .result()
        .map_err(|e| format!("cuCtxPushCurrent: {e:?}"))?;
    let out = f();
    let mut popped: cusys::CUcontext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above; `popped` is a valid out-pointer.
    let _ = unsafe { cusys::cuCtxPopCurrent_v2(&mut popped) };
    out
}

/// The storage's deleter (csrc/pinned.cpp calls it once): waits for the work queued in the
/// context, then frees the memory. Nothing can be reported from a deleter: where the driver
/// refuses, the memory stays allocated.
extern "C" fn free_pinned(ptr: *mut c_void, ctx: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: `ctx` is the retained primary context the memory was allocated in, `ptr`
        // the memory cuMemHostAlloc returned there; freed once (the shim sees to it).
        unsafe {
            in_context(ctx as cusys::CUcontext, || {
                // cuMemFreeHost does not say it waits for copies still reading or writing the
                // memory: wait for the context's work first.
                let _ = cusys::cuCtxSynchronize().result();
                cu::free_host(ptr).map_err(|e| format!("{e:?}"))
            })
        }
    });
}

/// A 1-D tensor of exactly `numel` elements of `kind` in pinned (page-locked) host memory,
/// allocated through the CUDA driver (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE`, in
/// the primary context of the calling thread's current CUDA device) and freed with
/// `cuMemFreeHost` when the tensor's storage goes. Unlike [`crate::empty_pinned`], nothing is
/// rounded up: the host holds `numel` elements' bytes (at least one byte), no more. The
/// memory is not zeroed.
///
/// Copies between it and CUDA with `non_blocking` ([`crate::copy_async`],
/// [`crate::CudaEvent::copy_to_host`]) do not block the host, and nothing keeps the memory
/// alive for them: keep the tensor (or a view of it) alive until every copy queued from or
/// into it has run, as the optimizer's long-lived buffers are. Dropping the last reference
/// waits for all the work queued on that device (`cuCtxSynchronize`) before freeing, so it
/// belongs at the end of a buffer's life, not in a step. Allocating page-locked memory also
/// serialises work of different streams around it: allocate at setup.
///
/// Refused ([`Error::Refused`]) where CUDA is absent (a build without the `cuda` feature, a
/// CPU libtorch, no GPU) or the NVIDIA driver library is not found, and where the driver
/// refuses the allocation (the reason names its error, e.g. out of memory).
pub fn empty_pinned_exact(numel: i64, kind: tch::Kind) -> Result<tch::Tensor, Error> {
    let op = || format!("empty_pinned_exact({numel} elements of {kind:?})");
    let refuse = |reason: String| Error::Refused { op: op(), reason };
    let bytes = usize::try_from(numel)
        .ok()
        .and_then(|n| n.checked_mul(kind.elt_size_in_bytes()))
        .ok_or_else(|| {
            refuse(format!(
                "{numel} elements of {kind:?} is not a size in bytes"
            ))
        })?;
    if !tch::Cuda::is_available() {
        return Err(refuse(
            "CUDA is not available (a build without the `cuda` feature, a CPU libtorch, or no \
             GPU): pinned memory is only for copies to and from a GPU; use ordinary host memory"
                .into(),
        ));
    }
    // SAFETY: probing the loader; no symbol of the library is called here.
    if !unsafe { cusys::is_culib_present() } {
        return Err(refuse(
            "the NVIDIA driver library (libcuda.so) was not found on the library path".into(),
        ));
    }
    let like = tch::Tensor::f_empty([0], (kind, tch::Device::Cpu)).map_err(|e| Error::Torch {
        op: op(),
        message: e.to_string(),
    })?;
    let device = crate::current_cuda_device().unwrap_or(0);
    let index = i32::try_from(device).map_err(|e| refuse(e.to_string()))?;
    let ctx = primary_context(index).map_err(&refuse)?;
    // SAFETY: `ctx` is a retained primary context; cuMemHostAlloc writes the pointer it
    // returns only on success.
    let data = unsafe {
        in_context(ctx, || {
            cu::malloc_host(bytes.max(1), cusys::CU_MEMHOSTALLOC_PORTABLE).map_err(|e| {
                format!("cuMemHostAlloc of {bytes} bytes on cuda:{device} failed: {e:?}")
            })
        })
    }
    .map_err(&refuse)?;
    // SAFETY: `like` is a live tensor borrowed for the call; `data` holds `bytes` bytes of
    // page-locked memory, `numel` elements of `kind`, which the shim owns from the call on
    // and hands to `free_pinned` with `ctx` exactly once (at once on failure); the other
    // pointers are `tensor_out`'s.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_pinned_from_blob(
                like.as_ptr().cast(),
                data,
                numel,
                free_pinned,
                ctx.cast(),
                out,
                err,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{copy_async, storage_nbytes};
    use tch::{Cuda, Device, Kind, Tensor};

    /// Refused without CUDA; with it, an exact pinned buffer of a size that is no power of
    /// two carries values to the GPU and back through asynchronous copies, and is freed.
    #[test]
    fn exact_pinned_is_refused_without_cuda_else_round_trips_through_the_gpu() -> anyhow::Result<()>
    {
        let bad = empty_pinned_exact(-1, Kind::Float).unwrap_err().to_string();
        assert!(bad.contains("is not a size"), "{bad}");
        if !Cuda::is_available() {
            match empty_pinned_exact(1000, Kind::Float) {
                Err(Error::Refused { op, reason }) => {
                    assert!(op.contains("empty_pinned_exact(1000 elements"), "{op}");
                    assert!(reason.contains("CUDA is not available"), "{reason}");
                }
                other => panic!("expected a refusal without CUDA, got {other:?}"),
            }
            return Ok(());
        }
        let n: i64 = (3 << 20) + 5; // 12 MiB and 20 bytes: the caching allocator's 16 MiB
        let index = crate::current_cuda_device().unwrap_or(0);
        let dev = Device::Cuda(index);
        let host = empty_pinned_exact(n, Kind::Float)?;
        assert!(host.is_pinned(dev), "cuMemHostAlloc's memory is pinned");
        assert_eq!(host.size(), vec![n]);
        assert_eq!(storage_nbytes(&host)?, 4 * n as usize);
        let want = Tensor::f_arange(n, (Kind::Float, Device::Cpu))?;
        host.shallow_clone().f_copy_(&want)?;

        let on_gpu = Tensor::f_empty([n], (Kind::Float, dev))?;
        copy_async(&on_gpu, &host)?;
        let doubled = on_gpu.f_mul_scalar(2.0)?;
        let back = empty_pinned_exact(n, Kind::Float)?;
        copy_async(&back, &doubled)?;
        Cuda::synchronize(index as i64);
        assert!(back.equal(&(want * 2.0)));

        // 16-bit kinds and an empty buffer too.
        let half = empty_pinned_exact(7, Kind::BFloat16)?;
        assert_eq!(storage_nbytes(&half)?, 14);
        assert!(half.is_pinned(dev));
        let empty = empty_pinned_exact(0, Kind::Float)?;
        assert_eq!(empty.numel(), 0);
        // The views outlive the tensor they came from; the memory goes with the last.
        let view = back.narrow(0, 1, 2);
        drop((host, back, half, empty));
        assert_eq!(view.double_value(&[0]), 2.0);
        drop(view);
        Ok(())
    }
}
