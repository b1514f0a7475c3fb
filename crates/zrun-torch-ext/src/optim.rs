//! Multi-tensor optimizer kernels: libtorch's fused Adam (`torch.optim.AdamW(fused=True)`)
//! and a sum of squares over many tensors that stays on their device, so a CUDA step costs a
//! few kernel launches and one read-back instead of thousands; and the fresh share of a split
//! delayed update in ATen's ops, where zrun's kernel is not installed.

use crate::{ffi, scalar, Error};
use std::ffi::c_void;
use std::ptr;
use tch::Tensor;

/// Hyper-parameters of one [`fused_adam`] call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f64,
    /// Exponential decay of the first moment.
    pub beta1: f64,
    /// Exponential decay of the second moment.
    pub beta2: f64,
    /// Added to the bias-corrected denominator.
    pub eps: f64,
    /// Decoupled weight decay (`p -= lr * weight_decay * p` before the update; 0: none).
    pub weight_decay: f64,
}

fn ptrs(ts: &[Tensor]) -> Vec<*const c_void> {
    ts.iter().map(|t| t.as_ptr().cast()).collect()
}

/// One AdamW update (decoupled weight decay `hp.weight_decay` on every tensor given) of every
/// `params[i]` with `grads[i]` and moments `exp_avgs[i]`, `exp_avg_sqs[i]`, in place, by
/// `at::_fused_adamw_`. `step` is a one-element fp32 tensor on the tensors' device holding the
/// step number (1 for the first update); the bias corrections use it. With `grad_scale` (one
/// fp32 element on the device) the gradients are divided by it first, and written back so.
/// fp32 tensors on one device, matching in size; libtorch's complaint otherwise comes back as
/// [`Error::Torch`].
pub fn fused_adam(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    step: &Tensor,
    grad_scale: Option<&Tensor>,
    hp: AdamStep,
) -> Result<(), Error> {
    let n = params.len();
    let op = || format!("fused_adam({n} tensors)");
    if [grads.len(), exp_avgs.len(), exp_avg_sqs.len()]
        .iter()
        .any(|&l| l != n)
    {
        return Err(Error::Refused {
            op: op(),
            reason: format!(
                "{n} parameters but {} gradients, {} first and {} second moments",
                grads.len(),
                exp_avgs.len(),
                exp_avg_sqs.len()
            ),
        });
    }
    if n == 0 {
        return Ok(());
    }
    let (p, g, m, v) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs));
    let mut err = ptr::null_mut();
    // SAFETY: every pointer is a live `torch::Tensor*` borrowed for the call and each list
    // has `n` entries; the shim catches every C++ exception.
    let status = unsafe {
        ffi::zrun_ext_fused_adam(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n,
            step.as_ptr().cast(),
            grad_scale.map_or(ptr::null(), |t| t.as_ptr().cast()),
            hp.lr,
            hp.beta1,
            hp.beta2,
            hp.eps,
            hp.weight_decay,
            &mut err,
        )
    };
    ffi::check(status, err, op)
}

/// The sum of the squares of every element of `tensors`, as a 0-d fp64 tensor on their
/// device (nothing is read back): each tensor's 2-norm in one multi-tensor kernel (fp32
/// accumulation, as `torch.nn.utils.clip_grad_norm_`), squared and summed in fp64.
pub fn sum_of_squares(tensors: &[Tensor]) -> Result<Tensor, Error> {
    let op = || format!("sum_of_squares({} tensors)", tensors.len());
    let ts = ptrs(tensors);
    // SAFETY: as in `fused_adam`; the other pointers are `tensor_out`'s, and the shim writes
    // a fresh tensor on success.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_sum_of_squares(ts.as_ptr(), ts.len(), out, err)
        })
    }
}

/// The 2-norm of `t` as a 0-d fp32 tensor on its device, accumulated in fp32 whatever its
/// dtype: one reduction, nothing read back.
pub fn norm_f32(t: &Tensor) -> Result<Tensor, Error> {
    let op = || format!("norm_f32({:?} {:?})", t.kind(), t.size());
    // SAFETY: `t` is a live tensor borrowed for the call; the other pointers are
    // `tensor_out`'s, and the shim writes a fresh tensor on success.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_norm_f32(t.as_ptr().cast(), out, err)
        })
    }
}

/// The fresh share of a split delayed update ([`crate::fresh_share`]'s arithmetic) in
/// ATen's ops, for one piece: `p` (any float dtype) loses `step_size f g / (sqrt(b2 v + (1 -
/// b2) (f g)^2) / sqrt(bc2) + eps)`, `f` = `c.grad_factor`, with `g` and `v` of `p`'s size.
/// Rearranged to four passes over one fp32 temporary and one over `p`: `d = v + (1 - b2) /
/// b2 (f g)^2` is the new v over b2, so the denominator is `s (sqrt(d) + eps / s)` with `s =
/// sqrt(b2 / bc2)`; the share is computed in fp32 and `p` rounded once.
pub fn fresh_share_aten(
    p: &Tensor,
    g: &Tensor,
    v: &Tensor,
    c: &crate::ShareCoeffs,
) -> Result<(), Error> {
    let s = (c.beta2 / c.bc2).sqrt();
    let f = c.grad_factor;
    let torch = |e: tch::TchError| Error::Torch {
        op: format!("fresh_share_aten(v {:?} {:?})", v.size(), v.kind()),
        message: e.to_string(),
    };
    let mut d = v.f_to_dtype(tch::Kind::Float, false, true).map_err(torch)?;
    scalar::addcmul_(&d, g, g, (1.0 - c.beta2) / c.beta2 * f * f)?;
    let _ = d.f_sqrt_().map_err(torch)?;
    scalar::add_(&d, c.eps / s)?;
    scalar::addcdiv_(p, g, &d, -c.step_size * f / s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// The share in f64 from the same values, against the ATen path for fp32, bf16 and fp16
    /// parameters and fp32 and bf16 gradients: fp32 within a few roundings, 16-bit within
    /// one rounding of the value; the inputs untouched.
    #[test]
    fn fresh_share_aten_takes_the_share_computed_in_f64() -> anyhow::Result<()> {
        let c = crate::ShareCoeffs {
            grad_factor: 0.25,
            beta2: 0.95,
            eps: 1e-8,
            step_size: 0.3 * 0.1 / (1.0 - 0.9f64.powi(2)),
            bc2: 1.0 - 0.95f64.powi(2),
        };
        let n = 1000;
        let base = Tensor::f_randn([n], (Kind::Float, Device::Cpu))?;
        let g0 = Tensor::f_randn([n], (Kind::Float, Device::Cpu))? * 0.1;
        let v =
            (Tensor::f_rand([n], (Kind::Float, Device::Cpu))? * 1e-3).f_to_kind(Kind::BFloat16)?;
        for (pk, rel) in [
            (Kind::Float, 1e-6),
            (Kind::BFloat16, 1.0 / 128.0),
            (Kind::Half, 1.0 / 1024.0),
        ] {
            for gk in [Kind::Float, Kind::BFloat16] {
                let (p, g) = (base.f_to_kind(pk)?, g0.f_to_kind(gk)?);
                let (p0, g_before, v_before) = (p.copy(), g.copy(), v.copy());
                fresh_share_aten(&p, &g, &v, &c)?;
                assert!(g.equal(&g_before) && v.equal(&v_before));
                let wide = |t: &Tensor| t.to_kind(Kind::Double);
                let gd = wide(&g) * c.grad_factor;
                let vt = wide(&v) * c.beta2 + &gd * &gd * (1.0 - c.beta2);
                let share = gd / (vt.sqrt() / c.bc2.sqrt() + c.eps) * c.step_size;
                let want = wide(&p0) - &share;
                let off = (wide(&p) - &want).abs();
                let bound = want.abs() * rel + share.abs() * 1e-6;
                let excess = (off - bound).max().double_value(&[]);
                assert!(excess <= 0.0, "{pk:?} {gk:?}: {excess:e} past the bound");
                assert!(
                    share.abs().max().double_value(&[]) > 0.01,
                    "a share that shows"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn fused_adam_matches_the_written_out_update() -> anyhow::Result<()> {
        // libtorch's fused kernel runs on CPU too: check the arguments reach it as meant.
        let opts = (Kind::Float, Device::Cpu);
        let hp = AdamStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let p = [Tensor::f_randn([7], opts)?, Tensor::f_randn([3], opts)?];
        let g = [Tensor::f_randn([7], opts)?, Tensor::f_randn([3], opts)?];
        let m = [Tensor::f_randn([7], opts)?, Tensor::f_randn([3], opts)?];
        let v = [Tensor::f_rand([7], opts)?, Tensor::f_rand([3], opts)?];
        let step = 3;
        let (bc1, bc2) = (1.0 - hp.beta1.powi(step), 1.0 - hp.beta2.powi(step));
        // The gradients divided by grad_scale, the parameters decayed, then Adam.
        let scale = 2.5;
        let want: Vec<Tensor> = (0..2)
            .map(|i| {
                let g = &g[i] / scale;
                let m2 = &m[i] * hp.beta1 + &g * (1.0 - hp.beta1);
                let v2 = &v[i] * hp.beta2 + &g * &g * (1.0 - hp.beta2);
                let denom = v2.sqrt() / bc2.sqrt() + hp.eps;
                &p[i] * (1.0 - hp.lr * hp.weight_decay) - m2 / denom * (hp.lr / bc1)
            })
            .collect();
        let st = Tensor::from(step as f32);
        let scale = Tensor::from_slice(&[scale as f32]);
        fused_adam(&p, &g, &m, &v, &st, Some(&scale), hp)?;
        for (a, b) in p.iter().zip(&want) {
            let d = (a - b).abs().max().double_value(&[]);
            assert!(d < 1e-6, "{d}");
        }
        Ok(())
    }

    #[test]
    fn sum_of_squares_of_bf16_tensors_is_not_rounded_to_bf16() -> anyhow::Result<()> {
        // A bf16 gradient's norm kept in fp32 (the gradients of a bf16 rank alone): its
        // square within fp32 rounding of the exact sum, not bf16's 2^-8.
        for seed in 0..4 {
            let vals: Vec<f32> = (0..1000)
                .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 - 1001.0) / 997.0)
                .collect();
            let b = Tensor::from_slice(&vals).to_kind(Kind::BFloat16);
            let want: f64 = Vec::<f32>::try_from(b.to_kind(Kind::Float))?
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum();
            let got = sum_of_squares(&[b])?.double_value(&[]);
            assert!((got - want).abs() <= 1e-6 * want, "{got} against {want}");
        }
        Ok(())
    }

    #[test]
    fn the_norm_of_a_bf16_tensor_is_accumulated_and_kept_in_fp32() -> anyhow::Result<()> {
        let vals: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 2003) as f32 / 997.0 - 1.0)
            .collect();
        let b = Tensor::from_slice(&vals).to_kind(Kind::BFloat16);
        let want: f64 = Vec::<f32>::try_from(b.to_kind(Kind::Float))?
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt();
        let n = norm_f32(&b)?;
        assert_eq!((n.kind(), n.dim()), (Kind::Float, 0));
        let got = n.double_value(&[]);
        assert!((got - want).abs() <= 1e-6 * want, "{got} against {want}");
        Ok(())
    }

    #[test]
    fn sum_of_squares_over_tensors_of_both_dtypes() -> anyhow::Result<()> {
        let a = Tensor::from_slice(&[3.0f32, 4.0]);
        let b = Tensor::from_slice(&[1.0f32, 2.0, 2.0]).to_kind(Kind::BFloat16);
        let s = sum_of_squares(&[a, b])?;
        assert_eq!(s.kind(), Kind::Double);
        assert!((s.double_value(&[]) - 34.0).abs() < 1e-4);
        assert!(sum_of_squares(&[]).is_err());
        let e = fused_adam(
            &[Tensor::from(1.0f32)],
            &[],
            &[],
            &[],
            &Tensor::from(1.0f32),
            None,
            AdamStep {
                lr: 1.0,
                beta1: 0.9,
                beta2: 0.9,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("1 parameters but 0 gradients"),
            "{e}"
        );
        Ok(())
    }
}
