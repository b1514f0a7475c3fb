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

/// `colsum` with GELU's backward first (the MLP's `linear_gelu`): fp32 and bf16, the same
/// shapes; GELU's gradient within one rounding of its dtype of ATen's `gelu_backward`, and
/// its sums against the f64 sums of the gradient the kernel stored and of ATen's.
pub(super) fn gelu_colsum(device: Device) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    for (kind, rel) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2.0 / 128.0)] {
        for (rows, cols) in [(5i64, 64i64), (1000, 264), (4096, 1024), (7, 12)] {
            let op = || format!("check gelu colsum on {device:?} ({kind:?}, {rows} x {cols})");
            let shape = |t: Tensor| t.f_reshape([rows, cols]).map_err(|e| fail(&op(), e));
            let dy = shape(spread(rows * cols, 0.7314, 1.0, device)?)?.to_kind(kind);
            let h = shape(spread(rows * cols, 1.3172, 4.0, device)?)?.to_kind(kind);
            let got = crate::gelu_colsum_raw(&dy, &h, false)?;
            let want = crate::gelu_colsum_raw(&dy, &h, true)?;
            let own = got[0]
                .to_kind(Kind::Double)
                .sum_dim_intlist(0, false, Kind::Double);
            let aten = want[0]
                .to_kind(Kind::Double)
                .sum_dim_intlist(0, false, Kind::Double);
            let scale = max_abs(&got[0].to_kind(Kind::Float).abs().sum_dim_intlist(
                0,
                false,
                Kind::Float,
            ));
            let checks = [
                ("gradient", &got[0], &want[0], 0.0),
                ("sums of its gradient", &got[1], &own, 1e-5 * scale),
                ("sums of ATen's gradient", &got[1], &aten, 1e-5 * scale),
            ];
            for (what, got, want, slack) in checks {
                let err = max_abs(&(got.to_kind(Kind::Float) - want.to_kind(Kind::Float)));
                let bound = rel * max_abs(want) + slack;
                if err.is_nan() || err > bound || got.size() != want.size() {
                    return Err(fail(
                        &op(),
                        format!("the {what} disagrees with ATen by {err:e} (bound {bound:e}, shape {:?}); set ZRUN_KERNELS=0 to run without zrun's kernels", got.size()),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// `adamw`: three pieces (with and without weight decay and the bf16 parameters; 16-byte
/// aligned and not; one past a chunk), fp32 and bf16 gradients, two steps; against ATen's
/// fused AdamW and cast: master, m and v within a few fp32 roundings of their magnitudes,
/// the bf16 parameters exactly the kernel's master rounded and within one bf16 rounding of
/// ATen's.
pub(super) fn adamw(device: Device) -> Result<(), Error> {
    adamw_against(device, &crate::adamw_pieces)
}

/// The kernel's side of an AdamW step (`Ok(false)`: it did not run).
type AdamSide<'a> = &'a dyn Fn(&[crate::AdamPiece], &crate::AdamCoeffs) -> Result<bool, Error>;

/// [`adamw`] with `kernel` as the kernel's side.
fn adamw_against(device: Device, kernel: AdamSide) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    // Piece k: (start, len, decayed): 16-byte aligned, one element off, aligned again.
    let parts = [(0i64, 5000i64, true), (5001, 37, false), (5040, 4100, true)];
    let total = 5040 + 4100;
    for gkind in [Kind::Float, Kind::BFloat16] {
        let op = || format!("check adamw on {device:?} ({gkind:?} gradients)");
        let e = |err: tch::TchError| fail(&op(), err);
        let p0 = spread(total, 0.7314, 1.0, device)?;
        let g = spread(total, 1.3172, 0.1, device)?.to_kind(gkind);
        let m0 = spread(total, 0.5119, 0.01, device)?;
        let v0 = (spread(total, 0.2113, 1e-3, device)?.f_abs().map_err(e)? + 1e-6f64)
            .f_contiguous()
            .map_err(e)?;
        let (pk, mk, vk) = (p0.copy(), m0.copy(), v0.copy());
        let (pa, ma, va) = (p0.copy(), m0.copy(), v0.copy());
        let hk = Tensor::f_zeros([total], (Kind::BFloat16, device)).map_err(e)?;
        let c = crate::AdamCoeffs {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 0,
            grad_factor: 0.5,
        };
        let view = |t: &Tensor, at: i64, n: i64| t.f_narrow(0, at, n).map_err(e);
        for step in 1..=2u64 {
            let c = crate::AdamCoeffs { step, ..c };
            let mut pieces = Vec::new();
            for &(at, n, decay) in &parts {
                pieces.push(crate::AdamPiece {
                    param: view(&pk, at, n)?,
                    grad: view(&g, at, n)?,
                    exp_avg: view(&mk, at, n)?,
                    exp_avg_sq: view(&vk, at, n)?,
                    half: decay.then(|| view(&hk, at, n)).transpose()?,
                    decay,
                });
            }
            if !kernel(&pieces, &c)? {
                if device.is_cuda() {
                    return Err(fail(&op(), "the kernel refused its check's inputs"));
                }
                return Ok(());
            }
            let step_t = crate::scalar::full(&[1], step as f64, (Kind::Float, device))?;
            let scale = crate::scalar::full(&[1], 1.0 / c.grad_factor, (Kind::Float, device))?;
            for &(at, n, decay) in &parts {
                // ATen's kernel writes the unscaled gradient back: it gets a copy.
                let gf = view(&g, at, n)?.to_kind(Kind::Float);
                crate::fused_adam(
                    &[view(&pa, at, n)?],
                    &[gf],
                    &[view(&ma, at, n)?],
                    &[view(&va, at, n)?],
                    &step_t,
                    Some(&scale),
                    c.aten(decay),
                )?;
            }
        }
        let moved = max_abs(&(&p0 - &pa));
        let checks = [
            (
                "master",
                max_abs(&(&pk - &pa)),
                1e-6 * max_abs(&pa) + 1e-4 * moved,
            ),
            ("m", max_abs(&(&mk - &ma)), 1e-6 * max_abs(&m0).max(0.1)),
            ("v", max_abs(&(&vk - &va)), 1e-6 * max_abs(&va)),
        ];
        for (what, err, bound) in checks {
            if err.is_nan() || err > bound {
                return Err(fail(
                    &op(),
                    format!("the {what} disagrees with ATen's fused AdamW by {err:e} (bound {bound:e}); set ZRUN_KERNELS=0 to run without zrun's kernels"),
                ));
            }
        }
        for &(at, n, decay) in &parts {
            let h = view(&hk, at, n)?.to_kind(Kind::Float);
            let own = view(&pk, at, n)?
                .to_kind(Kind::BFloat16)
                .to_kind(Kind::Float);
            let want = if decay { own } else { h.zeros_like() };
            let off = max_abs(&(&h - &want));
            let aten = view(&pa, at, n)?
                .to_kind(Kind::BFloat16)
                .to_kind(Kind::Float);
            let bf = if decay { max_abs(&(&h - &aten)) } else { 0.0 };
            if off != 0.0 || bf > 2.0 / 256.0 * max_abs(&aten) {
                return Err(fail(
                    &op(),
                    format!("the bf16 parameters are {off:e} off the kernel's master rounded and {bf:e} off ATen's; set ZRUN_KERNELS=0 to run without zrun's kernels"),
                ));
            }
        }
    }
    Ok(())
}

/// `cast_into`: bf16 values copied over and added to fp32 buffers (one piece past a chunk,
/// one off 16-byte alignment); exactly ATen's `copy_` and `add_`.
pub(super) fn cast_into(device: Device) -> Result<(), Error> {
    cast_into_against(device, &crate::cast_into)
}

/// [`cast_into`] with `kernel` as the kernel's side (`Ok(false)`: it did not run).
fn cast_into_against(
    device: Device,
    kernel: &dyn Fn(&[crate::CastPiece]) -> Result<bool, Error>,
) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    let op = || format!("check cast_into on {device:?}");
    let e = |err: tch::TchError| fail(&op(), err);
    let (n1, n2) = (4100i64, 37i64);
    let src = spread(n1 + n2, 0.7314, 2.0, device)?.to_kind(Kind::BFloat16);
    let base = spread(n1 + n2 + 1, 1.3172, 1.0, device)?;
    let (got, want) = (base.copy(), base.copy());
    let (s1, s2) = (
        src.f_narrow(0, 0, n1).map_err(e)?,
        src.f_narrow(0, n1, n2).map_err(e)?,
    );
    let (d1, d2) = (
        got.f_narrow(0, 0, n1).map_err(e)?,
        got.f_narrow(0, n1 + 1, n2).map_err(e)?,
    );
    let pieces = [
        crate::CastPiece {
            dst: &d1,
            src: &s1,
            add: false,
        },
        crate::CastPiece {
            dst: &d2,
            src: &s2,
            add: true,
        },
    ];
    if !kernel(&pieces)? {
        if device.is_cuda() {
            return Err(fail(&op(), "the kernel refused its check's inputs"));
        }
        return Ok(());
    }
    want.f_narrow(0, 0, n1)
        .and_then(|mut d| d.f_copy_(&s1))
        .and_then(|()| want.f_narrow(0, n1 + 1, n2))
        .and_then(|mut d| d.f_add_(&s2).map(drop))
        .map_err(e)?;
    let off = max_abs(&(&got - &want));
    if off != 0.0 {
        return Err(fail(
            &op(),
            format!("the kernel's values are {off:e} off ATen's copy and add; set ZRUN_KERNELS=0 to run without zrun's kernels"),
        ));
    }
    Ok(())
}

/// `fresh_share`: three pieces (16-byte aligned, one element off, past a chunk; the values
/// between them untouched), fp32 and bf16 parameters with fp32 and bf16 gradients, against
/// the share computed in f64: fp32 parameters within a few fp32 roundings of the values and
/// the share, bf16 ones within one bf16 rounding.
pub(super) fn fresh_share(device: Device) -> Result<(), Error> {
    fresh_share_against(device, &crate::fresh_share)
}

/// The kernel's side of a fresh share (`Ok(false)`: it did not run).
type ShareSide<'a> = &'a dyn Fn(&[crate::SharePiece], &crate::ShareCoeffs) -> Result<bool, Error>;

/// [`fresh_share`] with `kernel` as the kernel's side.
fn fresh_share_against(device: Device, kernel: ShareSide) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    let parts = [(0i64, 5000i64), (5001, 37), (5040, 4100)];
    let total = 5040 + 4100 + 1;
    let (lr, beta1, t) = (0.3, 0.9, 2);
    let c = crate::ShareCoeffs {
        grad_factor: 0.5,
        beta2: 0.95,
        eps: 1e-8,
        step_size: lr * (1.0 - beta1) / (1.0 - f64::powi(beta1, t)),
        bc2: 1.0 - f64::powi(0.95, t),
    };
    for pkind in [Kind::Float, Kind::BFloat16] {
        for gkind in [Kind::Float, Kind::BFloat16] {
            let op = || {
                format!(
                    "check fresh_share on {device:?} ({pkind:?} parameters, {gkind:?} gradients)"
                )
            };
            let e = |err: tch::TchError| fail(&op(), err);
            let p0 = spread(total, 0.7314, 1.0, device)?
                .f_to_kind(pkind)
                .map_err(e)?;
            let g = spread(total, 1.3172, 0.1, device)?
                .f_to_kind(gkind)
                .map_err(e)?;
            let v = spread(total, 0.2113, 1e-3, device)?
                .f_abs()
                .and_then(|a| a.f_add_scalar(1e-6))
                .and_then(|a| a.f_to_kind(Kind::BFloat16))
                .map_err(e)?;
            let (got, g0, v0) = (p0.copy(), g.copy(), v.copy());
            let view = |t: &Tensor, (at, n): (i64, i64)| t.f_narrow(0, at, n).map_err(e);
            let views = parts
                .iter()
                .map(|&part| Ok((view(&got, part)?, view(&g, part)?, view(&v, part)?)))
                .collect::<Result<Vec<_>, Error>>()?;
            let pieces: Vec<crate::SharePiece> = views
                .iter()
                .map(|(param, grad, v)| crate::SharePiece { param, grad, v })
                .collect();
            if !kernel(&pieces, &c)? {
                if device.is_cuda() {
                    return Err(fail(&op(), "the kernel refused its check's inputs"));
                }
                return Ok(());
            }
            if !(g.equal(&g0) && v.equal(&v0)) {
                return Err(fail(&op(), "the kernel wrote its gradients or v; set ZRUN_KERNELS=0 to run without zrun's kernels"));
            }
            // The share in f64, taken from the pieces only.
            let wide = |t: &Tensor| t.f_to_kind(Kind::Double).map_err(e);
            let (pd, gd, vd) = (
                wide(&p0)?,
                wide(&g0)?.f_mul_scalar(c.grad_factor).map_err(e)?,
                wide(&v0)?,
            );
            let vt = (vd * c.beta2)
                .f_add(&(&gd * &gd * (1.0 - c.beta2)))
                .map_err(e)?;
            let denom = vt.f_sqrt().map_err(e)? / c.bc2.sqrt() + c.eps;
            let share = gd.f_div(&denom).map_err(e)? * c.step_size;
            let want = pd;
            for &part in &parts {
                let _ = view(&want, part)?.f_sub_(&view(&share, part)?).map_err(e)?;
            }
            let off = (wide(&got)? - &want).f_abs().map_err(e)?;
            let (err, bound) = if pkind == Kind::Float {
                let bound = 1e-6 * max_abs(&want) + 1e-5 * max_abs(&share);
                (max_abs(&off), bound)
            } else {
                // One bf16 rounding of each value (2^-8 |want|, or 2^-7 where fp32's
                // roundings move a tie), and the share's fp32 roundings where the two cancel.
                let slack =
                    want.f_abs().map_err(e)? * (1.0 / 128.0) + share.f_abs().map_err(e)? * 1e-6;
                let excess = off - slack;
                (excess.f_max().map_err(e)?.double_value(&[]), 0.0)
            };
            if err.is_nan() || err > bound {
                return Err(fail(
                    &op(),
                    format!("the parameters disagree with the share in f64 by {err:e} (bound {bound:e}); set ZRUN_KERNELS=0 to run without zrun's kernels"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's arithmetic in ATen's fp32 ops, one piece at a time.
    fn emulated(pieces: &[crate::AdamPiece], c: &crate::AdamCoeffs) -> Result<bool, Error> {
        let t = c.step as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(t), (1.0 - c.beta2.powi(t)).sqrt());
        for p in pieces {
            let g = p.grad.to_kind(Kind::Float) * c.grad_factor;
            let mut master = p.param.shallow_clone();
            if p.decay {
                crate::scalar::mul_(&master, 1.0 - c.lr * c.weight_decay)?;
            }
            let m = &p.exp_avg * c.beta1 + &g * (1.0 - c.beta1);
            let v = &p.exp_avg_sq * c.beta2 + &g * &g * (1.0 - c.beta2);
            let step = &m * (c.lr / bc1) / (v.sqrt() / bc2 + c.eps);
            let _ = master.f_sub_(&step);
            p.exp_avg.shallow_clone().copy_(&m);
            p.exp_avg_sq.shallow_clone().copy_(&v);
            if let Some(h) = &p.half {
                h.shallow_clone().copy_(&master);
            }
        }
        Ok(true)
    }

    /// The check's inputs, views and bounds pass the kernel's arithmetic against ATen's
    /// fused AdamW (its CPU kernel), and catch an update that misses the weight decay.
    #[test]
    fn the_adamw_check_passes_the_kernels_arithmetic_and_fails_a_wrong_one() {
        adamw_against(Device::Cpu, &emulated).unwrap();
        let no_decay = |ps: &[crate::AdamPiece], c: &crate::AdamCoeffs| {
            emulated(
                ps,
                &crate::AdamCoeffs {
                    weight_decay: 0.0,
                    ..*c
                },
            )
        };
        let err = adamw_against(Device::Cpu, &no_decay)
            .unwrap_err()
            .to_string();
        assert!(err.contains("the master disagrees"), "{err}");
    }

    /// The fresh share's arithmetic in ATen's fp32 ops, one piece at a time.
    fn share(pieces: &[crate::SharePiece], c: &crate::ShareCoeffs) -> Result<bool, Error> {
        for p in pieces {
            let g = p.grad.to_kind(Kind::Float) * c.grad_factor;
            let v = p.v.to_kind(Kind::Float) * c.beta2 + &g * &g * (1.0 - c.beta2);
            let step = &g * c.step_size / (v.sqrt() / c.bc2.sqrt() + c.eps);
            let _ = p
                .param
                .shallow_clone()
                .f_copy_(&(p.param.to_kind(Kind::Float) - step));
        }
        Ok(true)
    }

    /// The fresh share's check passes the kernel's arithmetic (ATen's CPU ops) for every
    /// dtype, and catches a share that misses the gradient factor, one that reads v after
    /// writing the update's into it, one that leaves a piece out, and one that writes v.
    #[test]
    fn the_fresh_share_check_passes_the_kernels_arithmetic_and_fails_wrong_ones() {
        fresh_share_against(Device::Cpu, &share).unwrap();
        let wrong: [(&str, ShareSide); 4] = [
            ("no factor", &|ps, c| {
                share(
                    ps,
                    &crate::ShareCoeffs {
                        grad_factor: 1.0,
                        ..*c
                    },
                )
            }),
            ("v after", &|ps, c| {
                for p in ps {
                    let g = p.grad.to_kind(Kind::Float) * c.grad_factor;
                    let v = (p.v.to_kind(Kind::Float) * c.beta2 + &g * &g * (1.0 - c.beta2))
                        .to_kind(Kind::BFloat16);
                    let after = crate::SharePiece { v: &v, ..*p };
                    share(&[after], c)?;
                }
                Ok(true)
            }),
            ("v written", &|ps, c| {
                share(ps, c)?;
                let _ = ps[1].v.shallow_clone().f_mul_scalar_(0.5);
                Ok(true)
            }),
            ("a piece left out", &|ps, c| share(&ps[..2], c)),
        ];
        for (what, side) in wrong {
            let err = fresh_share_against(Device::Cpu, side)
                .err()
                .unwrap_or_else(|| panic!("{what}: passed"))
                .to_string();
            let want = if what == "v written" {
                "wrote its gradients or v"
            } else {
                "the parameters disagree"
            };
            assert!(err.contains(want), "{what}: {err}");
        }
    }

    /// The layout's check passes a copy and an add in fp32, and catches an add done as a
    /// copy.
    #[test]
    fn the_layout_check_passes_copies_and_adds_and_fails_a_lost_add() {
        let run = |ps: &[crate::CastPiece], add_ok: bool| -> Result<bool, Error> {
            for p in ps {
                let mut dst = p.dst.shallow_clone();
                if p.add && add_ok {
                    let _ = dst.f_add_(p.src);
                } else {
                    let _ = dst.f_copy_(p.src);
                }
            }
            Ok(true)
        };
        cast_into_against(Device::Cpu, &|ps| run(ps, true)).unwrap();
        let err = cast_into_against(Device::Cpu, &|ps| run(ps, false))
            .unwrap_err()
            .to_string();
        assert!(err.contains("off ATen's copy and add"), "{err}");
    }
}
