//! Declarations of the C shim in csrc/zrun_torch_ext.cpp and the glue that turns its status
//! codes and message strings into [`Error`]s.

use crate::Error;
use std::ffi::{c_char, c_int, c_void, CStr};

/// `kind` of the CPU generator in the `zrun_ext_rng_*` calls.
pub(crate) const ZR_DEVICE_CPU: c_int = 0;
/// `kind` of a CUDA generator in the `zrun_ext_rng_*` calls (with the device index).
pub(crate) const ZR_DEVICE_CUDA: c_int = 1;

/// Success.
const ZR_OK: c_int = 0;
/// libtorch raised an exception.
const ZR_TORCH: c_int = 1;

extern "C" {
    pub(crate) fn zrun_ext_free_err(err: *mut c_char);
    pub(crate) fn zrun_ext_storage_nbytes(
        t: *const c_void,
        out: *mut usize,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_resize_storage(
        t: *const c_void,
        nbytes: usize,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_grad(
        outputs: *const *const c_void,
        grad_outputs: *const *const c_void,
        n_outputs: usize,
        inputs: *const *const c_void,
        n_inputs: usize,
        results: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_cuda_memory(
        device: i64,
        available: *mut c_int,
        allocated: *mut i64,
        peak: *mut i64,
        reserved: *mut i64,
        peak_reserved: *mut i64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_reset_cuda_peak(device: i64, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_cuda_mem_info(
        device: i64,
        available: *mut c_int,
        free_bytes: *mut i64,
        total_bytes: *mut i64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_set_allocator_settings(
        settings: *const c_char,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_set_cuda_device(index: i64, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_current_cuda_device(out: *mut i64, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_rng_state(
        kind: c_int,
        index: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_rng_set_state(
        kind: c_int,
        index: i64,
        bytes: *const u8,
        n: usize,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_fused_adam(
        params: *const *const c_void,
        grads: *const *const c_void,
        exp_avgs: *const *const c_void,
        exp_avg_sqs: *const *const c_void,
        n: usize,
        step: *const c_void,
        grad_scale: *const c_void,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_sum_of_squares(
        tensors: *const *const c_void,
        n: usize,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_scalar_op_(
        t: *const c_void,
        other: *const c_void,
        op: i32,
        v: f64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_addc_(
        t: *const c_void,
        a: *const c_void,
        b: *const c_void,
        div: i32,
        v: f64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_norm_f32(
        t: *const c_void,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_empty_pinned(
        like: *const c_void,
        numel: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_pinned_from_blob(
        like: *const c_void,
        data: *mut c_void,
        numel: i64,
        free_fn: HostFree,
        ctx: *mut c_void,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_copy_async(
        dst: *const c_void,
        src: *const c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_event_synchronize(event: *mut c_void, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_profiler_start(cuda: c_int, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_profiler_stop(path: *const c_char, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_event_free(event: *mut c_void);
    pub(crate) fn zrun_ext_copy_to_host_on_side_stream(
        dst: *const c_void,
        src: *const c_void,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_copy_to_device_on_side_stream(
        dst: *const c_void,
        src: *const c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_join_uploads(device: i64, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_count_allocations_begin(err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_count_allocations_end(
        count: *mut i64,
        bytes: *mut i64,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_linear_cross_entropy(
        h: *const c_void,
        w: *const c_void,
        targets: *const c_void,
        ignore_index: i64,
        chunk: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_rms_norm(
        x: *const c_void,
        w: *const c_void,
        eps: f64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_fused_linear_cross_entropy(
        h: *const c_void,
        w: *const c_void,
        targets: *const c_void,
        ignore_index: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_ce_rows(
        logits: *const c_void,
        targets: *const c_void,
        coef: *const c_void,
        grad: c_int,
        force_aten: c_int,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn zrun_ext_set_ce_rows_kernel(kernel: Option<CeRowsKernel>) -> Option<CeRowsKernel>;
    pub(crate) fn zrun_ext_swiglu(
        a: *const c_void,
        b: *const c_void,
        g: *const c_void,
        raw: c_int,
        force_aten: c_int,
        out0: *mut *mut c_void,
        out1: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn zrun_ext_set_swiglu_kernel(kernel: Option<SwigluKernel>) -> Option<SwigluKernel>;
    pub(crate) fn zrun_ext_rope(
        x: *const c_void,
        cos: *const c_void,
        sin: *const c_void,
        raw: c_int,
        backward: c_int,
        force_aten: c_int,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn zrun_ext_set_rope_kernel(kernel: Option<RopeKernel>) -> Option<RopeKernel>;
    pub(crate) fn zrun_ext_linear(
        x: *const c_void,
        w: *const c_void,
        b: *const c_void,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_layer_norm(
        x: *const c_void,
        w: *const c_void,
        b: *const c_void,
        eps: f64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_colsum(
        dy: *const c_void,
        x: *const c_void,
        mean: *const c_void,
        rstd: *const c_void,
        force_aten: c_int,
        out0: *mut *mut c_void,
        out1: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_linear_gelu(
        x: *const c_void,
        w: *const c_void,
        b: *const c_void,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_gelu_colsum(
        dy: *const c_void,
        h: *const c_void,
        force_aten: c_int,
        out0: *mut *mut c_void,
        out1: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn zrun_ext_set_colsum_kernel(kernel: Option<ColsumKernel>) -> Option<ColsumKernel>;
    pub(crate) fn zrun_ext_event_record_current(
        device: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn zrun_ext_cpu_alloc_install(limit: u64, err: *mut *mut c_char) -> c_int;
    pub(crate) fn zrun_ext_cpu_alloc_stats(out: *mut i64) -> c_int;
    pub(crate) fn zrun_ext_cpu_alloc_reset_peak();
    pub(crate) fn zrun_ext_cpu_alloc_empty_cache();
    pub(crate) fn zrun_ext_current_cuda_stream(
        device: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
}

/// The shim's `zrun::CeRowsKernel` (csrc/fused_loss.h).
pub(crate) type CeRowsKernel = extern "C" fn(
    c_int,
    c_int,
    *mut c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    i64,
    i64,
    c_int,
    *mut c_void,
    *mut *mut c_char,
) -> c_int;

/// Registers `kernel` behind the shim's `ce_rows` (`None`: ATen's ops); returns the one it
/// replaces.
pub(crate) fn set_ce_rows_kernel(kernel: Option<CeRowsKernel>) -> Option<CeRowsKernel> {
    // SAFETY: the shim swaps the pointer atomically; `kernel` is a Rust `extern "C"` function
    // of the shim's signature, valid for the process.
    unsafe { zrun_ext_set_ce_rows_kernel(kernel) }
}

/// The function csrc/pinned.cpp calls to free the memory under a tensor it made (the memory
/// and the context handed in with it).
pub(crate) type HostFree = extern "C" fn(*mut c_void, *mut c_void);

/// The shim's `zrun::SwigluKernel` (csrc/swiglu.h).
pub(crate) type SwigluKernel = extern "C" fn(
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    *mut c_void,
    i64,
    *mut c_void,
    *mut *mut c_char,
) -> c_int;

/// Registers `kernel` behind the shim's `swiglu` (`None`: ATen's ops); returns the one it
/// replaces.
pub(crate) fn set_swiglu_kernel(kernel: Option<SwigluKernel>) -> Option<SwigluKernel> {
    // SAFETY: as for `set_ce_rows_kernel`.
    unsafe { zrun_ext_set_swiglu_kernel(kernel) }
}

/// The shim's `zrun::RopeKernel` (csrc/rope.h).
pub(crate) type RopeKernel = extern "C" fn(
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    i64,
    i64,
    i64,
    i64,
    *mut c_void,
    *mut *mut c_char,
) -> c_int;

/// Registers `kernel` behind the shim's `rope` (`None`: ATen's ops); returns the one it
/// replaces.
pub(crate) fn set_rope_kernel(kernel: Option<RopeKernel>) -> Option<RopeKernel> {
    // SAFETY: as for `set_ce_rows_kernel`.
    unsafe { zrun_ext_set_rope_kernel(kernel) }
}

/// The shim's `zrun::ColsumKernel` (csrc/colsum.h).
pub(crate) type ColsumKernel = extern "C" fn(
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    i64,
    i64,
    i64,
    i64,
    *mut c_void,
    *mut *mut c_char,
) -> c_int;

/// Registers `kernel` behind the shim's `linear` and `layer_norm` sums (`None`: ATen's ops);
/// returns the one it replaces.
pub(crate) fn set_colsum_kernel(kernel: Option<ColsumKernel>) -> Option<ColsumKernel> {
    // SAFETY: as for `set_ce_rows_kernel`.
    unsafe { zrun_ext_set_colsum_kernel(kernel) }
}

/// Turns a shim status and its message into a `Result`, freeing the message.
///
/// `op` names the call for the error (only built on failure).
pub(crate) fn check(
    status: c_int,
    err: *mut c_char,
    op: impl FnOnce() -> String,
) -> Result<(), Error> {
    let message = if err.is_null() {
        String::from("(no message)")
    } else {
        // SAFETY: a non-null `err` is a NUL-terminated string malloc'd by the shim, read once
        // here and then handed back to the shim's `free`.
        unsafe {
            let text = CStr::from_ptr(err).to_string_lossy().into_owned();
            zrun_ext_free_err(err);
            text
        }
    };
    match status {
        ZR_OK => Ok(()),
        ZR_TORCH => Err(Error::Torch { op: op(), message }),
        _ => Err(Error::Refused {
            op: op(),
            reason: message,
        }),
    }
}

/// [`Error::Undefined`] for the first of `inputs` (name, tensor) of `op` that is undefined.
pub(crate) fn require_defined(op: &str, inputs: &[(&str, &tch::Tensor)]) -> Result<(), Error> {
    match inputs.iter().find(|(_, t)| !t.defined()) {
        Some((name, _)) => Err(Error::Undefined {
            op: format!("{op} {name}"),
        }),
        None => Ok(()),
    }
}

/// Runs a shim call with two tensor out-pointers and an error out-pointer: the first tensor,
/// and with `second` the second too, or the call's error with `op` naming it.
///
/// # Safety
/// `call` must pass the pointers to a shim function that, on success, writes a fresh
/// `new torch::Tensor` into the first, and into the second when `second` (else nothing).
pub(crate) unsafe fn tensors_out(
    op: impl FnOnce() -> String,
    second: bool,
    call: impl FnOnce(*mut *mut c_void, *mut *mut c_void, *mut *mut c_char) -> c_int,
) -> Result<Vec<tch::Tensor>, Error> {
    let (mut out0, mut out1): (*mut c_void, *mut c_void) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    let mut err = std::ptr::null_mut();
    let status = call(&mut out0, &mut out1, &mut err);
    check(status, err, op)?;
    // SAFETY: on success the written out-pointers hold fresh `new torch::Tensor`s (the
    // caller's promise), each owned by the returned Tensor.
    let mut out = vec![unsafe { tch::Tensor::from_ptr(out0.cast()) }];
    if second {
        out.push(unsafe { tch::Tensor::from_ptr(out1.cast()) });
    }
    Ok(out)
}

/// The tensor a shim call returns through its out-pointer: `call` gets the out-pointer and the
/// error pointer and returns the status; `op` names the call for an error.
///
/// # Safety
/// `call` must make a shim call that, on success, writes a fresh `new torch::Tensor` into the
/// out-pointer (and nothing else into it), and otherwise pass it only valid pointers.
pub(crate) unsafe fn tensor_out(
    op: impl FnOnce() -> String,
    call: impl FnOnce(*mut *mut c_void, *mut *mut c_char) -> c_int,
) -> Result<tch::Tensor, Error> {
    let mut out: *mut c_void = std::ptr::null_mut();
    let mut err = std::ptr::null_mut();
    let status = call(&mut out, &mut err);
    check(status, err, op)?;
    // SAFETY: on success `out` is a fresh `new torch::Tensor` (the caller's promise), owned by
    // the returned Tensor.
    Ok(unsafe { tch::Tensor::from_ptr(out.cast()) })
}
