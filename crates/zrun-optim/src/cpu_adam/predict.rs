//! The base of the next update, for the delayed update's split (`zero.offload_delay_fresh`).
//!
//! AdamW's update t is `p_t = p_{t-1} (1 - lr wd) - lr / (1 - b1^t) (b1 m_{t-1} + (1 - b1) g_t)
//! / D_t`. Everything in it but the newest gradient's share is known one update ahead: the
//! base `p_{t-1} (1 - lr wd) - lr b1 / (1 - b1^t) m_{t-1} / D_{t-1}`, with
//! `D_{t-1} = sqrt(v_{t-1} / (1 - b2^(t-1))) + eps`. [`CpuAdamW::predict`] writes that base (in
//! the compute dtype) and v (bf16) from the stored state after update t-1; the device then
//! subtracts the fresh share of g_t as soon as it has g_t, and the CPU's exact update runs
//! beside the next step. The values are a function of the stored state only (plain f32
//! operations, no fused multiply-add), so writing them right after an update and writing them
//! again from a checkpoint's state give the same bits.

use super::kernel::{bf16_nearest_even, ratio_denom, BLOCK};
use super::{CpuAdamW, Grad, HalfKind, State, MIN_PER_THREAD};
use crate::Result;

/// Where the base of the next update goes: the compute dtype's copy (u16 bits) or f32.
pub enum BaseOut<'a> {
    /// bf16 or fp16 bits, rounded to nearest even.
    Half(&'a mut [u16], HalfKind),
    /// fp32.
    F32(&'a mut [f32]),
}

/// What [`CpuAdamW::predict`] writes for a range: the base and v as bf16 bits.
pub struct Prediction<'a> {
    /// The base of the next update.
    pub base: BaseOut<'a>,
    /// v, rounded to nearest even (bf16 state: its bits).
    pub v: &'a mut [u16],
}

impl<'a> Prediction<'a> {
    fn len(&self) -> usize {
        self.v.len()
    }

    /// Elements `[lo, hi)`, reborrowed.
    pub(super) fn sub(&mut self, lo: usize, hi: usize) -> Prediction<'_> {
        let base = match &mut self.base {
            BaseOut::Half(h, kind) => BaseOut::Half(&mut h[lo..hi], *kind),
            BaseOut::F32(f) => BaseOut::F32(&mut f[lo..hi]),
        };
        Prediction {
            base,
            v: &mut self.v[lo..hi],
        }
    }

    pub(super) fn split_at(self, k: usize) -> (Prediction<'a>, Prediction<'a>) {
        let (v0, v1) = self.v.split_at_mut(k);
        let (b0, b1) = match self.base {
            BaseOut::Half(h, kind) => {
                let (a, b) = h.split_at_mut(k);
                (BaseOut::Half(a, kind), BaseOut::Half(b, kind))
            }
            BaseOut::F32(f) => {
                let (a, b) = f.split_at_mut(k);
                (BaseOut::F32(a), BaseOut::F32(b))
            }
        };
        (
            Prediction { base: b0, v: v0 },
            Prediction { base: b1, v: v1 },
        )
    }
}

/// The scalars of a prediction, in f32.
#[derive(Clone, Copy)]
pub(super) struct Coeffs {
    /// 1 - lr * weight_decay, inside the decay ranges.
    keep: f32,
    /// lr * b1 / (1 - b1^(t+1)), 0 before the first update (m is zero then).
    step_size: f32,
    /// 1 / sqrt(1 - b2^t).
    inv_bc2_sqrt: f32,
    eps: f32,
}

/// Moments of a range, read only.
#[derive(Clone, Copy)]
pub(super) enum Moments<'a> {
    F32(&'a [f32], &'a [f32]),
    Bf16(&'a [u16], &'a [u16]),
}

impl Coeffs {
    /// The weight decay's factor inside (`decayed`) or outside the decay ranges.
    pub(super) fn keep(&self, decayed: bool) -> f32 {
        if decayed {
            self.keep
        } else {
            1.0
        }
    }
}

impl<'a> Moments<'a> {
    fn split_at(self, k: usize) -> (Moments<'a>, Moments<'a>) {
        match self {
            Moments::F32(m, v) => {
                let ((m0, m1), (v0, v1)) = (m.split_at(k), v.split_at(k));
                (Moments::F32(m0, v0), Moments::F32(m1, v1))
            }
            Moments::Bf16(m, v) => {
                let ((m0, m1), (v0, v1)) = (m.split_at(k), v.split_at(k));
                (Moments::Bf16(m0, v0), Moments::Bf16(m1, v1))
            }
        }
    }
}

/// One element's base from its stored master `p` and the ratio `m / denom` of the update,
/// as [`super::kernel`] computes it (the update writes it from its own ratio).
#[inline(always)]
pub(super) fn base(c: &Coeffs, keep: f32, p: f32, ratio: f32) -> f32 {
    p * keep - c.step_size * ratio
}

#[inline(always)]
pub(super) fn ratio(c: &Coeffs, m: f32, v: f32) -> f32 {
    m / ratio_denom(v, c.inv_bc2_sqrt, c.eps)
}

#[inline(always)]
fn bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Writes the prediction of one block (at most [`BLOCK`] elements) inside or outside the
/// decay ranges from its stored state: `p` the master, `mo` m and v. Compiled like the
/// update's kernels, for the widest instruction set the CPU has; plain IEEE operations (no
/// fused multiply-add) give the same bits in every copy.
pub(super) fn block(c: &Coeffs, decayed: bool, p: &[f32], mo: Moments, out: Prediction) {
    #[cfg(target_arch = "x86_64")]
    if super::kernel::has_avx512() {
        // SAFETY: the CPU supports AVX-512 F/BW/VL, AVX2 and F16C (checked at run time), the
        // only requirement of this `target_feature` function.
        unsafe { block_avx512(c, decayed, p, mo, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::kernel::has_avx2() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time).
        unsafe { block_avx2(c, decayed, p, mo, out) };
        return;
    }
    block_body(c, decayed, p, mo, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn block_avx512(c: &Coeffs, decayed: bool, p: &[f32], mo: Moments, out: Prediction) {
    block_body(c, decayed, p, mo, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_avx2(c: &Coeffs, decayed: bool, p: &[f32], mo: Moments, out: Prediction) {
    block_body(c, decayed, p, mo, out);
}

#[inline(always)]
fn block_body(c: &Coeffs, decayed: bool, p: &[f32], mo: Moments, mut out: Prediction) {
    let n = p.len();
    let keep = c.keep(decayed);
    let mut b = [0f32; BLOCK];
    let b = &mut b[..n];
    match mo {
        Moments::F32(m, v) => {
            let (m, v) = (&m[..n], &v[..n]);
            for (((o, &pj), &mj), &vj) in b.iter_mut().zip(p).zip(m).zip(v) {
                *o = base(c, keep, pj, ratio(c, mj, vj));
            }
            for (o, &x) in out.v[..n].iter_mut().zip(v) {
                *o = bf16_nearest_even(x);
            }
        }
        Moments::Bf16(m, v) => {
            let (m, v) = (&m[..n], &v[..n]);
            for (((o, &pj), &mj), &vj) in b.iter_mut().zip(p).zip(m).zip(v) {
                *o = base(c, keep, pj, ratio(c, bits_to_f32(mj), bits_to_f32(vj)));
            }
            out.v[..n].copy_from_slice(v);
        }
    }
    store_base(&mut out.base, b);
}

#[inline(always)]
fn store_base(out: &mut BaseOut, b: &[f32]) {
    let n = b.len();
    match out {
        BaseOut::F32(f) => f[..n].copy_from_slice(b),
        BaseOut::Half(h, HalfKind::Bf16) => {
            for (o, &x) in h[..n].iter_mut().zip(b) {
                *o = bf16_nearest_even(x);
            }
        }
        BaseOut::Half(h, HalfKind::Fp16) => {
            for (o, &x) in h[..n].iter_mut().zip(b) {
                *o = half::f16::from_f32(x).to_bits();
            }
        }
    }
}

/// Writes the prediction of elements `[at, at + p.len())`, block by block.
fn run(
    c: &Coeffs,
    decay: &[(usize, usize)],
    at: usize,
    p: &[f32],
    mo: Moments,
    mut out: Prediction,
) {
    let end = at + p.len();
    let mut i = at;
    while i < end {
        let next = decay.partition_point(|&(_, e)| e <= i);
        let (decayed, stop) = match decay.get(next) {
            Some(&(s, e)) if s <= i => (true, e),
            Some(&(s, _)) => (false, s),
            None => (false, end),
        };
        let stop = stop.min(end).min(i + BLOCK);
        let (lo, hi) = (i - at, stop - at);
        let mo = match mo {
            Moments::F32(m, v) => Moments::F32(&m[lo..hi], &v[lo..hi]),
            Moments::Bf16(m, v) => Moments::Bf16(&m[lo..hi], &v[lo..hi]),
        };
        block(c, decayed, &p[lo..hi], mo, out.sub(lo, hi));
        i = stop;
    }
    // Some stores may have been non-temporal.
    super::kernel::store_fence();
}

impl CpuAdamW {
    /// [`CpuAdamW::update`] that writes, instead of the compute-dtype copy, the prediction of
    /// the next update at `next_lr` into `out`, in the same pass over memory (each element's
    /// from its state as stored): the same bits [`CpuAdamW::predict`] writes later.
    #[allow(clippy::too_many_arguments)]
    pub fn update_predict<G: Grad>(
        &mut self,
        off: usize,
        params: &mut [f32],
        grads: &[G],
        lr: f64,
        grad_scale: f32,
        next_lr: f64,
        out: Prediction<'_>,
    ) -> Result<()> {
        // This update's step has begun: the prediction is of the one after it.
        let c = self.predict_coeffs(next_lr);
        self.update_inner(off, params, grads, lr, grad_scale, None, Some((c, out)))
    }

    /// Checks the lengths of a prediction of `n` elements.
    pub(super) fn check_prediction(&self, n: usize, out: &Prediction) -> Result<()> {
        self.check("predicted v", out.len(), n)?;
        match &out.base {
            BaseOut::Half(h, _) => self.check("predicted base", h.len(), n),
            BaseOut::F32(f) => self.check("predicted base", f.len(), n),
        }
    }

    /// The scalars of the prediction of update `steps() + 1` at `lr`.
    pub(super) fn predict_coeffs(&self, lr: f64) -> Coeffs {
        let c = &self.cfg;
        let t = self.step as i32;
        let (step_size, inv_bc2_sqrt) = if self.step == 0 {
            (0.0, 1.0)
        } else {
            (
                lr * c.beta1 / (1.0 - c.beta1.powi(t + 1)),
                1.0 / (1.0 - c.beta2.powi(t)).sqrt(),
            )
        };
        Coeffs {
            keep: (1.0 - lr * c.weight_decay) as f32,
            step_size: step_size as f32,
            inv_bc2_sqrt: inv_bc2_sqrt as f32,
            eps: c.eps as f32,
        }
    }

    /// Writes the base of the next update (update `steps() + 1` at `lr`) and v of elements
    /// `[off, off + params.len())` from the stored state (see the module's documentation);
    /// `params` is the fp32 master of the range.
    pub fn predict(&self, off: usize, params: &[f32], lr: f64, out: Prediction<'_>) -> Result<()> {
        let n = params.len();
        self.check_prediction(n, &out)?;
        self.range(off, n)?;
        let coeffs = self.predict_coeffs(lr);
        let mo = match &self.state {
            State::F32 { m, v } => Moments::F32(&m[off..off + n], &v[off..off + n]),
            State::Bf16 { m, v } => Moments::Bf16(&m[off..off + n], &v[off..off + n]),
        };
        let decay = &self.decay;
        let threads = self.threads.min(n / MIN_PER_THREAD).max(1);
        let Some(pool) = self.pool.as_ref().filter(|_| threads > 1) else {
            run(&coeffs, decay, off, params, mo, out);
            return Ok(());
        };
        let piece = n.div_ceil(threads).div_ceil(64) * 64;
        pool.in_place_scope(|s| {
            let (mut p, mut mo, mut out) = (params, mo, out);
            let mut at = off;
            while !p.is_empty() {
                let len = piece.min(p.len());
                let (p0, p1) = p.split_at(len);
                let (m0, m1) = mo.split_at(len);
                let (o0, o1) = out.split_at(len);
                let c = &coeffs;
                if p1.is_empty() {
                    run(c, decay, at, p0, m0, o0);
                } else {
                    s.spawn(move |_| run(c, decay, at, p0, m0, o0));
                }
                (p, mo, out) = (p1, m1, o1);
                at += len;
            }
        });
        Ok(())
    }
}
