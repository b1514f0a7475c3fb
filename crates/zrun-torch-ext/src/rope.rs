//! The rotary position embedding as one autograd node (csrc/rope.cpp): on CUDA one kernel
//! pass each way, elsewhere ATen's mul, roll and add.

use crate::ffi;
use crate::Error;
use std::ffi::c_int;
use tch::Tensor;

/// `x * cos + roll(x, hd/2) * sin` over heads `x` (B, T, H, hd), with `cos` and the signed
/// `sin` (T, hd; the first half of sin negated, rotate_half's sign) of `x`'s dtype and device.
/// In grad mode the graph keeps `cos` and `sin` only. Off CUDA (and in fp16) the values and
/// the gradient are those of the ATen ops written out; the CUDA kernel computes in fp32 and
/// rounds once.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, Error> {
    call(x, cos, sin, None)
}

/// Without autograd: the embedding of `x` (`backward` false), or the gradient of the heads
/// for the gradient `x` (`backward` true); `force_aten` takes ATen's ops even where the kernel
/// is installed (its reference).
pub fn rope_raw(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    backward: bool,
    force_aten: bool,
) -> Result<Tensor, Error> {
    call(x, cos, sin, Some((backward, force_aten)))
}

fn call(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    raw: Option<(bool, bool)>,
) -> Result<Tensor, Error> {
    let op = || {
        format!(
            "rope(x {:?} {:?}, cos {:?})",
            x.size(),
            x.kind(),
            cos.size()
        )
    };
    ffi::require_defined("rope", &[("x", x), ("cos", cos), ("sin", sin)])?;
    let (backward, force) = raw.unwrap_or((false, false));
    // SAFETY: the tensor pointers are live `torch::Tensor*` borrowed for the call, the others
    // are `tensor_out`'s; the shim catches every C++ exception and writes a fresh tensor on
    // success.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_rope(
                x.as_ptr().cast(),
                cos.as_ptr().cast(),
                sin.as_ptr().cast(),
                c_int::from(raw.is_some()),
                c_int::from(backward),
                c_int::from(force),
                out,
                err,
            )
        })
    }
}
