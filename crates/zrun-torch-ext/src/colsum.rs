//! Linear with a bias and LayerNorm as autograd nodes (csrc/colsum.cpp): ATen's forward and
//! backward, except the sums over rows of their gradients (the bias's, LayerNorm's weight and
//! bias), which on CUDA are one pass of zrun's column-sum kernel.

use crate::ffi;
use crate::Error;
use std::ffi::c_int;
use tch::Tensor;

/// `x w^T + b` for `x` (..., in), `w` (out, in), `b` (out) of one floating dtype and device.
/// The graph keeps `x` and `w`, as autograd's linear does; values and gradients are bitwise
/// `x.linear(w, Some(b))`'s except `b`'s gradient on CUDA (bf16, fp32) with
/// [`crate::kernels::install`]: fp32 sums in the kernel's order.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor, Error> {
    let op = || format!("linear(x {:?} {:?}, w {:?})", x.size(), x.kind(), w.size());
    ffi::require_defined("linear", &[("x", x), ("w", w), ("b", b)])?;
    // SAFETY: the tensor pointers are live `torch::Tensor*` borrowed for the call; the shim
    // catches every C++ exception and writes a fresh tensor on success.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_linear(
                x.as_ptr().cast(),
                w.as_ptr().cast(),
                b.as_ptr().cast(),
                out,
                err,
            )
        })
    }
}

/// `gelu(x w^T + b)` with the tanh GELU, for `x` (..., in), `w` (out, in), `b` (out) of one
/// floating dtype and device, as one node: the graph keeps `x`, `w` and GELU's input, what
/// autograd's linear and gelu keep. Values and gradients are bitwise
/// `x.linear(w, Some(b)).gelu("tanh")`'s except on CUDA (bf16, fp32) with
/// [`crate::kernels::install`], where GELU's gradient and `b`'s (the sum of it over rows) come
/// from one pass of the column-sum kernel: GELU's derivative in ATen's steps, fp32 sums in the
/// kernel's order.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor, Error> {
    let op = || {
        format!(
            "linear_gelu(x {:?} {:?}, w {:?})",
            x.size(),
            x.kind(),
            w.size()
        )
    };
    ffi::require_defined("linear_gelu", &[("x", x), ("w", w), ("b", b)])?;
    // SAFETY: as for `linear`.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_linear_gelu(
                x.as_ptr().cast(),
                w.as_ptr().cast(),
                b.as_ptr().cast(),
                out,
                err,
            )
        })
    }
}

/// LayerNorm over the last dimension of `x` (..., C) with `w` and `b` (C): bitwise
/// `x.layer_norm([C], Some(w), Some(b), eps, _)` and its gradients, except those of `w` and
/// `b` on CUDA (bf16, fp32) with [`crate::kernels::install`]: fp32 sums in the kernel's order.
/// The graph keeps what autograd's keeps (x, w, b, a mean and an rstd per row).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor, Error> {
    let op = || format!("layer_norm(x {:?} {:?}, eps {eps})", x.size(), x.kind());
    ffi::require_defined("layer_norm", &[("x", x), ("w", w), ("b", b)])?;
    // SAFETY: as for `linear`.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_layer_norm(
                x.as_ptr().cast(),
                w.as_ptr().cast(),
                b.as_ptr().cast(),
                eps,
                out,
                err,
            )
        })
    }
}

/// Without autograd: `[sum of dy over rows]` for `dy` (rows, cols), or with `ln` = (x, mean,
/// rstd) `[sum of dy (x - mean) rstd, sum of dy]` (LayerNorm's weight and bias gradients);
/// `force_aten` takes ATen's ops even where the kernel is installed (its reference).
pub fn colsum_raw(
    dy: &Tensor,
    ln: Option<(&Tensor, &Tensor, &Tensor)>,
    force_aten: bool,
) -> Result<Vec<Tensor>, Error> {
    let op = || format!("colsum_raw(dy {:?} {:?})", dy.size(), dy.kind());
    ffi::require_defined("colsum_raw", &[("dy", dy)])?;
    let ptr = |t: Option<&Tensor>| t.map_or(std::ptr::null(), |t| t.as_ptr().cast());
    // SAFETY: the tensor pointers are live for the call (null when absent); the shim writes
    // fresh tensors into the first out-pointer (and the second with `ln`) on success only.
    unsafe {
        ffi::tensors_out(op, ln.is_some(), |out0, out1, err| {
            ffi::zrun_ext_colsum(
                dy.as_ptr().cast(),
                ptr(ln.map(|l| l.0)),
                ptr(ln.map(|l| l.1)),
                ptr(ln.map(|l| l.2)),
                c_int::from(force_aten),
                out0,
                out1,
                err,
            )
        })
    }
}

/// Without autograd: `[dy gelu'(h), its sum over rows]` for `dy` and GELU's input `h` (rows,
/// cols) of one dtype (the tanh GELU); `force_aten` takes ATen's ops even where the kernel is
/// installed (its reference).
pub fn gelu_colsum_raw(dy: &Tensor, h: &Tensor, force_aten: bool) -> Result<Vec<Tensor>, Error> {
    let op = || format!("gelu_colsum_raw(dy {:?} {:?})", dy.size(), dy.kind());
    ffi::require_defined("gelu_colsum_raw", &[("dy", dy), ("h", h)])?;
    // SAFETY: the tensor pointers are live for the call; the shim writes fresh tensors into
    // both out-pointers on success only.
    unsafe {
        ffi::tensors_out(op, true, |out0, out1, err| {
            ffi::zrun_ext_gelu_colsum(
                dy.as_ptr().cast(),
                h.as_ptr().cast(),
                c_int::from(force_aten),
                out0,
                out1,
                err,
            )
        })
    }
}
