//! In-place ops with a scalar argument that fail with an error, never a panic.
//!
//! tch's `f_mul_scalar_`, `f_fill_`, `f_lerp_` and the like make a `Scalar` for the call and
//! free it before they read the call's error; the free unwraps that pending error, so a call
//! that fails (a sticky CUDA error, a dtype the op refuses) panics instead of returning `Err`.
//! These run the same ATen ops through the shim, where the scalar is C++'s.

use crate::{ffi, Error};
use tch::Tensor;

/// The op, as the shim numbers it.
#[derive(Clone, Copy)]
enum Op {
    Mul = 0,
    Div = 1,
    Add = 2,
    Fill = 3,
    Lerp = 4,
    MaskedFill = 5,
}

fn run(name: &str, t: &Tensor, other: Option<&Tensor>, op: Op, v: f64) -> Result<(), Error> {
    // (No list built: this runs per chunk in the CPU ranks' AdamW.)
    match other {
        Some(o) => ffi::require_defined(name, &[("self", t), ("other", o)])?,
        None => ffi::require_defined(name, &[("self", t)])?,
    }
    let other = other.map_or(std::ptr::null(), |o| o.as_ptr().cast());
    let mut err = std::ptr::null_mut();
    // SAFETY: `t` (and `other` where the op reads it, else null, which the shim does not
    // touch) are live `torch::Tensor*` borrowed for the call; the shim catches every C++
    // exception and reports it through `err`.
    let status =
        unsafe { ffi::zrun_ext_scalar_op_(t.as_ptr().cast(), other, op as i32, v, &mut err) };
    ffi::check(status, err, || {
        format!("{name}({:?} {:?}, {v})", t.size(), t.kind())
    })
}

/// `t *= v`.
pub fn mul_(t: &Tensor, v: f64) -> Result<(), Error> {
    run("mul_", t, None, Op::Mul, v)
}

/// `t /= v`.
pub fn div_(t: &Tensor, v: f64) -> Result<(), Error> {
    run("div_", t, None, Op::Div, v)
}

/// `t += v`.
pub fn add_(t: &Tensor, v: f64) -> Result<(), Error> {
    run("add_", t, None, Op::Add, v)
}

/// Every element of `t` set to `v`.
pub fn fill_(t: &Tensor, v: f64) -> Result<(), Error> {
    run("fill_", t, None, Op::Fill, v)
}

/// `t += w * (end - t)`.
pub fn lerp_(t: &Tensor, end: &Tensor, w: f64) -> Result<(), Error> {
    run("lerp_", t, Some(end), Op::Lerp, w)
}

/// The elements of `t` where `mask` is true set to `v`.
pub fn masked_fill_(t: &Tensor, mask: &Tensor, v: f64) -> Result<(), Error> {
    run("masked_fill_", t, Some(mask), Op::MaskedFill, v)
}

/// `t += v * a * b` (promoted as ATen does: a bf16 `t` with fp32 operands is computed in
/// fp32 and rounded once).
pub fn addcmul_(t: &Tensor, a: &Tensor, b: &Tensor, v: f64) -> Result<(), Error> {
    addc("addcmul_", t, a, b, false, v)
}

/// `t += v * a / b` (promoted as [`addcmul_`]).
pub fn addcdiv_(t: &Tensor, a: &Tensor, b: &Tensor, v: f64) -> Result<(), Error> {
    addc("addcdiv_", t, a, b, true, v)
}

fn addc(name: &str, t: &Tensor, a: &Tensor, b: &Tensor, div: bool, v: f64) -> Result<(), Error> {
    ffi::require_defined(name, &[("self", t), ("tensor1", a), ("tensor2", b)])?;
    let mut err = std::ptr::null_mut();
    // SAFETY: the three are live `torch::Tensor*` borrowed for the call; the shim catches
    // every C++ exception and reports it through `err`.
    let status = unsafe {
        ffi::zrun_ext_addc_(
            t.as_ptr().cast(),
            a.as_ptr().cast(),
            b.as_ptr().cast(),
            i32::from(div),
            v,
            &mut err,
        )
    };
    ffi::check(status, err, || {
        format!(
            "{name}({:?} {:?}, {:?} {:?}, {:?} {:?}, {v})",
            t.size(),
            t.kind(),
            a.size(),
            a.kind(),
            b.size(),
            b.kind()
        )
    })
}

/// A tensor of `size` and `opts` with every element `v` (tch's `f_full`, without its panic).
pub fn full(size: &[i64], v: f64, opts: (tch::Kind, tch::Device)) -> Result<Tensor, Error> {
    let t = Tensor::f_empty(size, opts).map_err(|e| Error::Torch {
        op: format!("full({size:?}, {v}, {opts:?})"),
        message: e.to_string(),
    })?;
    fill_(&t, v)?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x() -> Tensor {
        Tensor::from_slice(&[1.5f32, -2.0, 0.25, 3.0])
    }

    /// `ours` on one copy of [`x`] equals `theirs` (tch's op) on another, bitwise.
    fn same(ours: impl Fn(&Tensor) -> Result<(), Error>, theirs: impl Fn(&mut Tensor)) {
        let (a, mut b) = (x(), x());
        ours(&a).unwrap();
        theirs(&mut b);
        assert!(a.equal(&b), "{a} against {b}");
    }

    #[test]
    fn each_op_is_aten_s() {
        let end = Tensor::from_slice(&[4.0f32, 4.0, -1.0, 0.0]);
        let mask = Tensor::from_slice(&[true, false, true, false]);
        same(|t| mul_(t, -0.3), |t| drop(t.f_mul_scalar_(-0.3).unwrap()));
        same(|t| div_(t, 7.0), |t| drop(t.f_div_scalar_(7.0).unwrap()));
        same(|t| add_(t, 1e-8), |t| drop(t.f_add_scalar_(1e-8).unwrap()));
        same(|t| fill_(t, 2.5), |t| drop(t.f_fill_(2.5).unwrap()));
        same(
            |t| lerp_(t, &end, 0.1),
            |t| drop(t.f_lerp_(&end, 0.1).unwrap()),
        );
        same(
            |t| masked_fill_(t, &mask, f64::NEG_INFINITY),
            |t| drop(t.f_masked_fill_(&mask, f64::NEG_INFINITY).unwrap()),
        );
        let (a, b) = (end.to_kind(tch::Kind::BFloat16), x() + 2.0);
        same(
            |t| addcmul_(t, &a, &b, -0.7),
            |t| *t += a.to_kind(tch::Kind::Float) * &b * -0.7f64,
        );
        same(
            |t| addcdiv_(t, &a, &b, 0.3),
            |t| *t += a.to_kind(tch::Kind::Float) * 0.3f64 / &b,
        );
        let f = full(&[4], -7.25, (tch::Kind::Float, tch::Device::Cpu)).unwrap();
        same(
            |t| {
                t.shallow_clone().copy_(&f);
                Ok(())
            },
            |t| drop(t.f_fill_(-7.25).unwrap()),
        );
    }

    #[test]
    fn a_failing_op_is_an_error_where_tch_panics() {
        // A bool tensor cannot hold the product with a float.
        let flags = Tensor::from_slice(&[true, false]);
        let e = mul_(&flags, 0.5).unwrap_err().to_string();
        assert!(e.contains("mul_") && e.contains("Bool"), "{e}");
        assert!(lerp_(&x(), &Tensor::from_slice(&[1.0f32, 2.0, 3.0]), 0.5).is_err());
        let e = addcdiv_(&x(), &x(), &Tensor::from_slice(&[1.0f32, 2.0, 3.0]), 0.5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("addcdiv_"), "{e}");
        assert!(matches!(
            fill_(&Tensor::new(), 1.0),
            Err(Error::Undefined { .. })
        ));
        // What this module is for: the same failure through tch panics in the Scalar's drop.
        let caught = std::panic::catch_unwind(|| {
            let mut f = Tensor::from_slice(&[true, false]);
            let _ = f.f_mul_scalar_(0.5);
        });
        assert!(
            caught.is_err(),
            "tch returned the error: this module can go"
        );
    }
}
