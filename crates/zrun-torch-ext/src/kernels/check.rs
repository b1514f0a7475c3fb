//! Each kernel against ATen's ops on the device it was loaded for, before a training step
//! uses it: a kernel that disagrees is not installed.

use super::fail;
use crate::Error;
use tch::{Device, Kind, Tensor};

/// `n` values spread like normal draws of scale `scale`, without drawing from libtorch's
/// generators (a check must not move the run's random streams): sin of a stride through the
/// integers, made on the CPU and moved to `device`.
fn spread(n: i64, stride: f64, scale: f64, device: Device) -> Result<Tensor, Error> {
    let op = || format!("make check inputs on {device:?}");
    Tensor::f_arange(n, (Kind::Float, Device::Cpu))
        .and_then(|t| (t * stride).f_sin())
        .and_then(|t| (t * scale).f_to_device(device))
        .map_err(|e| fail(&op(), e))
}

fn max_abs(t: &Tensor) -> f64 {
    t.to_kind(Kind::Float).abs().max().double_value(&[])
}

/// `ce_rows`: fp32 and bf16, rows shorter and longer than a block, targets at both ends,
/// rows of weight 0; losses within 1e-5 relative, gradients within one rounding of the
/// logits' dtype.
pub(super) fn ce_rows(device: Device) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    for (kind, tol) in [(Kind::Float, 1e-6), (Kind::BFloat16, 1.0 / 128.0)] {
        for (n, v) in [(5i64, 37i64), (7, 1000), (3, 50_257)] {
            let op = || format!("check ce_rows on {device:?} ({kind:?}, {n} x {v})");
            let logits = spread(n * v, 0.7314, 3.0, device)?
                .f_reshape([n, v])
                .map_err(|e| fail(&op(), e))?
                .to_kind(kind);
            let rows = usize::try_from(n).unwrap_or(0);
            let targets =
                Tensor::from_slice(&[0i64, v - 1, 1, v / 2, 2, 3, 4][..rows]).to_device(device);
            let coef = Tensor::from_slice(&[0.25f32, 0.0, 0.5, 0.125, 0.0, 1.0, 2.0][..rows])
                .to_device(device);
            let (a, b) = (logits.copy(), logits.copy());
            let got = crate::ce_rows(&a, &targets, &coef, true, false)?;
            let want = crate::ce_rows(&b, &targets, &coef, true, true)?;
            let loss_err = max_abs(&(&got - &want));
            let loss_top = max_abs(&want).max(1.0);
            let grad_err = max_abs(&(a.to_kind(Kind::Float) - b.to_kind(Kind::Float)));
            let grad_top = max_abs(&b).max(f64::MIN_POSITIVE);
            if !(loss_err <= 1e-5 * loss_top && grad_err <= tol * grad_top) {
                return Err(fail(
                    &op(),
                    format!("the kernel disagrees with ATen: losses off by {loss_err:e} (of {loss_top:e}), gradients by {grad_err:e} (of {grad_top:e}); set ZRUN_KERNELS=0 to run without zrun's kernels"),
                ));
            }
        }
    }
    Ok(())
}

/// `swiglu`: forward and both gradients, fp32 and bf16, sizes below and above one block;
/// within one rounding of the dtype (ATen rounds silu(a) before the product, the kernel
/// does not).
pub(super) fn swiglu(device: Device) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    for (kind, tol) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2.0 / 128.0)] {
        for n in [7i64, 100_003] {
            let op = || format!("check swiglu on {device:?} ({kind:?}, {n} values)");
            let r = |stride: f64, s: f64| -> Result<Tensor, Error> {
                Ok(spread(n, stride, s, device)?.to_kind(kind))
            };
            let (a, b, g) = (r(0.7314, 4.0)?, r(1.3172, 1.0)?, r(0.5119, 1.0)?);
            let pairs = [
                (
                    crate::swiglu_raw(&a, &b, None, false)?,
                    crate::swiglu_raw(&a, &b, None, true)?,
                ),
                (
                    crate::swiglu_raw(&a, &b, Some(&g), false)?,
                    crate::swiglu_raw(&a, &b, Some(&g), true)?,
                ),
            ];
            for (got, want) in pairs {
                for (x, y) in got.iter().zip(&want) {
                    let err = max_abs(&(x.to_kind(Kind::Float) - y.to_kind(Kind::Float)));
                    let top = max_abs(y).max(f64::MIN_POSITIVE);
                    if err.is_nan() || err > tol * top {
                        return Err(fail(
                            &op(),
                            format!("the kernel disagrees with ATen by {err:e} (of {top:e}); set ZRUN_KERNELS=0 to run without zrun's kernels"),
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// `rope`: forward and gradient, fp32 and bf16, a few positions and heads; within one rounding
/// of the dtype of the largest value (ATen rounds each product, the kernel once).
pub(super) fn rope(device: Device) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    let (b, t, h, hd) = (2i64, 5i64, 3i64, 8i64);
    for (kind, tol) in [(Kind::Float, 1e-6), (Kind::BFloat16, 2.0 / 128.0)] {
        let op = || format!("check rope on {device:?} ({kind:?})");
        let shape = |t: Tensor, dims: &[i64]| t.f_reshape(dims).map_err(|e| fail(&op(), e));
        let x = shape(spread(b * t * h * hd, 0.7314, 2.0, device)?, &[b, t, h, hd])?.to_kind(kind);
        let cos = shape(spread(t * hd, 1.3172, 1.0, device)?, &[t, hd])?.to_kind(kind);
        let sin = shape(spread(t * hd, 0.5119, 1.0, device)?, &[t, hd])?.to_kind(kind);
        for backward in [false, true] {
            let got = crate::rope_raw(&x, &cos, &sin, backward, false)?;
            let want = crate::rope_raw(&x, &cos, &sin, backward, true)?;
            let err = max_abs(&(got.to_kind(Kind::Float) - want.to_kind(Kind::Float)));
            let top = max_abs(&want).max(f64::MIN_POSITIVE);
            if err.is_nan() || err > tol * top {
                return Err(fail(
                    &op(),
                    format!("the kernel disagrees with ATen (backward {backward}) by {err:e} (of {top:e}); set ZRUN_KERNELS=0 to run without zrun's kernels"),
                ));
            }
        }
    }
    Ok(())
}

/// `colsum`: a bias's gradient and LayerNorm's weight and bias gradients, fp32 and bf16, rows
/// fewer and more than a split, a last span of columns cut short and columns the kernel does
/// not take (ATen's); against the sums in f64 from ATen's mean and rstd, within one rounding
/// of the dtype of the largest sum plus fp32 summation error (1e-5 of the largest column's sum
/// of magnitudes).
pub(super) fn colsum(device: Device) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    let eps = 1e-5;
    for (kind, rel) in [(Kind::Float, 1e-6), (Kind::BFloat16, 2.0 / 128.0)] {
        for (rows, cols) in [(5i64, 64i64), (1000, 264), (4096, 1024), (7, 12)] {
            let op = || format!("check colsum on {device:?} ({kind:?}, {rows} x {cols})");
            let shape = |t: Tensor| t.f_reshape([rows, cols]).map_err(|e| fail(&op(), e));
            let dy = shape(spread(rows * cols, 0.7314, 1.0, device)?)?.to_kind(kind);
            let x = shape(spread(rows * cols, 1.3172, 2.0, device)?)?.to_kind(kind);
            let (w, b) = (
                spread(cols, 0.5119, 1.0, device)?.to_kind(kind),
                spread(cols, 0.2113, 1.0, device)?.to_kind(kind),
            );
            let (_, mean, rstd) = x
                .f_native_layer_norm([cols].as_slice(), Some(&w), Some(&b), eps)
                .map_err(|e| fail(&op(), e))?;
            // The sums in f64 from ATen's mean and rstd.
            let (dyd, xd) = (dy.to_kind(Kind::Double), x.to_kind(Kind::Double));
            let xhat = (xd - mean.to_kind(Kind::Double)) * rstd.to_kind(Kind::Double);
            let db = dyd.sum_dim_intlist(0, false, Kind::Double);
            let dg = (&dyd * xhat).sum_dim_intlist(0, false, Kind::Double);
            let bias = crate::colsum_raw(&dy, None, false)?;
            let ln = crate::colsum_raw(&dy, Some((&x, &mean, &rstd)), false)?;
            let pairs = [(&bias[0], &db), (&ln[0], &dg), (&ln[1], &db)];
            let spread_of = |t: &Tensor| {
                max_abs(
                    &t.to_kind(Kind::Float)
                        .abs()
                        .sum_dim_intlist(0, false, Kind::Float),
                )
            };
            let scale = spread_of(&dy).max(spread_of(&(&dy * &x)));
            for (what, (got, want)) in ["bias", "ln weight", "ln bias"].iter().zip(pairs) {
                let err = max_abs(&(got.to_kind(Kind::Float) - want.to_kind(Kind::Float)));
                let bound = rel * max_abs(want) + 1e-5 * scale;
                if err.is_nan() || err > bound || got.size() != [cols] {
                    return Err(fail(
                        &op(),
                        format!("the {what} sums disagree with ATen by {err:e} (bound {bound:e}, shape {:?}); set ZRUN_KERNELS=0 to run without zrun's kernels", got.size()),
                    ));
                }
            }
        }
    }
    Ok(())
}
