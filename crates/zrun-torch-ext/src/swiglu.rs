//! SwiGLU's product `silu(gate) * up` as one autograd node (csrc/swiglu.cpp): it keeps gate
//! and up only, and recomputes silu in the backward; on CUDA one kernel pass each way.

use crate::ffi;
use crate::Error;
use std::ffi::c_int;
use tch::Tensor;

/// `silu(gate) * up` for `gate` and `up` of one shape, floating dtype and device. In grad
/// mode the result's graph keeps `gate` and `up` (autograd's silu-then-mul keeps silu(gate)
/// too, a third tensor of their size). Elsewhere than CUDA with [`crate::kernels::install`]
/// (and on CUDA in fp16) the values and gradients are bitwise those of `gate.silu() * up`;
/// the kernel rounds once per output instead (within one rounding of the dtype).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor, Error> {
    let op = || {
        format!(
            "swiglu(gate {:?} {:?}, up {:?} {:?})",
            gate.size(),
            gate.kind(),
            up.size(),
            up.kind()
        )
    };
    ffi::require_defined("swiglu", &[("gate", gate), ("up", up)])?;
    // SAFETY: both tensor pointers are live `torch::Tensor*` borrowed for the call, `g` is
    // null (unused) and `out1` is not written; the shim catches every C++ exception.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_swiglu(
                gate.as_ptr().cast(),
                up.as_ptr().cast(),
                std::ptr::null(),
                0,
                0,
                out.cast(),
                std::ptr::null_mut(),
                err,
            )
        })
    }
}

/// Without autograd: `[silu(a) * b]`, or with `g` the backward's `[d(a), d(b)]`;
/// `force_aten` takes ATen's ops even where the kernel is installed (its reference).
pub fn swiglu_raw(
    a: &Tensor,
    b: &Tensor,
    g: Option<&Tensor>,
    force_aten: bool,
) -> Result<Vec<Tensor>, Error> {
    let op = || format!("swiglu_raw(a {:?} {:?})", a.size(), a.kind());
    ffi::require_defined("swiglu_raw", &[("a", a), ("b", b)])?;
    // SAFETY: the tensor pointers are live for the call (`g` null when absent); the shim
    // writes fresh tensors into the first out-pointer (and the second with `g`) on success.
    unsafe {
        ffi::tensors_out(op, g.is_some(), |out0, out1, err| {
            ffi::zrun_ext_swiglu(
                a.as_ptr().cast(),
                b.as_ptr().cast(),
                g.map_or(std::ptr::null(), |g| g.as_ptr().cast()),
                1,
                c_int::from(force_aten),
                out0,
                out1,
                err,
            )
        })
    }
}
