//! The fast CPU AdamW of optimizer offload: fp32 master shard, m and v in host memory.
//!
//! One pass per element reads parameter, gradient, m and v and writes parameter, m, v and
//! (optionally) the bf16/fp16 copy of the parameter that goes back to the device. The math is
//! `torch.optim.AdamW`'s: decoupled weight decay `p *= 1 - lr * wd` (inside the decay ranges
//! only), `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
//! `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`, in f32 with fused
//! multiply-adds. A call is split over `threads` threads in contiguous pieces: the calling
//! thread takes the last, workers started once with the optimizer the others (a step is a
//! call per unit, and starting threads for each cost ~40 us a thread). Every element's
//! arithmetic is independent of the split, so results are bitwise the same for any thread
//! count and any order of sub-range calls within a step.
//!
//! With [`StateDtype::Bf16`] m and v are stored as bf16 (half the optimizer memory and
//! traffic), computed in f32 and rounded back **stochastically**: the dropped 16 bits decide
//! the rounding against a counter-based random draw keyed by (step, element index, moment), so
//! the rounding is unbiased (nearest-even would freeze v, whose 1 - b2 = 0.001 relative decay
//! is below bf16's 2^-8 resolution) and still bitwise independent of threads and call order.

mod kernel;
mod predict;

use crate::{AdamWConfig, Error, Result};
pub use kernel::{Bf16, Grad};
use kernel::{Coeffs, MomentsMut, Next, BLOCK};
pub use predict::{BaseOut, Prediction};

/// Storage type of the AdamW moments m and v (`optimizer_state_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateDtype {
    /// fp32 m and v (8 bytes per element).
    Fp32,
    /// bf16 m and v (4 bytes per element), stochastically rounded.
    Bf16,
}

impl std::fmt::Display for StateDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            StateDtype::Fp32 => "fp32",
            StateDtype::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for StateDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fp32" => Ok(StateDtype::Fp32),
            "bf16" => Ok(StateDtype::Bf16),
            _ => Err(format!(
                "optimizer state dtype `{s}` is not one of: fp32, bf16"
            )),
        }
    }
}

/// The 16-bit compute dtype of the parameter copy written by [`CpuAdamW::update`]; both
/// round to nearest, ties to even.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfKind {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    Fp16,
}

/// A range of m and v in their storage type (bf16 as raw bits).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MomentSlices<'a> {
    /// fp32 moments.
    F32(&'a [f32], &'a [f32]),
    /// bf16 moments, as their bits.
    Bf16(&'a [u16], &'a [u16]),
}

/// Moments in their storage type.
enum State {
    F32 { m: Vec<f32>, v: Vec<f32> },
    Bf16 { m: Vec<u16>, v: Vec<u16> },
}

/// Elements per thread below which a call uses fewer threads: a piece handed to a worker of
/// the pool costs its wake-up (not measured apart; with 2 threads `zrun bench adam --params
/// 300K` took 0.07 ms a call where spawning took 0.13), so pieces stay well above it.
const MIN_PER_THREAD: usize = 1 << 15;

/// AdamW for one rank's fp32 shard in host memory, updated sub-range by sub-range.
pub struct CpuAdamW {
    cfg: AdamWConfig,
    numel: usize,
    /// Sorted, merged `(start, end)` element ranges that get weight decay.
    decay: Vec<(usize, usize)>,
    state: State,
    step: u64,
    threads: usize,
    /// The `threads - 1` workers beside the calling thread (none for one thread).
    pool: Option<rayon::ThreadPool>,
}

impl CpuAdamW {
    /// Zero state for `numel` elements; `decay_ranges` (offset, len) get weight decay
    /// (clamped to the shard; overlaps are merged). `threads` is clamped to at least 1; the
    /// workers beside the calling thread start here ([`Error::Threads`] if they cannot).
    pub fn new(
        numel: usize,
        cfg: AdamWConfig,
        decay_ranges: Vec<(usize, usize)>,
        state: StateDtype,
        threads: usize,
    ) -> Result<CpuAdamW> {
        let threads = threads.max(1);
        let pool = if threads > 1 {
            let built = rayon::ThreadPoolBuilder::new()
                .num_threads(threads - 1)
                .thread_name(|i| format!("zrun-adamw-{i}"))
                .build()
                .map_err(|e| Error::Threads {
                    threads: threads - 1,
                    detail: e.to_string(),
                })?;
            Some(built)
        } else {
            None
        };
        let mut ranges: Vec<(usize, usize)> = decay_ranges
            .into_iter()
            .map(|(o, l)| (o.min(numel), o.saturating_add(l).min(numel)))
            .filter(|(s, e)| s < e)
            .collect();
        ranges.sort_unstable();
        let mut decay: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
        for (s, e) in ranges {
            match decay.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => decay.push((s, e)),
            }
        }
        let state = match state {
            StateDtype::Fp32 => State::F32 {
                m: vec![0.0; numel],
                v: vec![0.0; numel],
            },
            StateDtype::Bf16 => State::Bf16 {
                m: vec![0; numel],
                v: vec![0; numel],
            },
        };
        Ok(CpuAdamW {
            cfg,
            numel,
            decay,
            state,
            step: 0,
            threads,
            pool,
        })
    }

    /// Starts optimizer step t+1 (bias corrections use it); returns t+1.
    pub fn begin_step(&mut self) -> u64 {
        self.step += 1;
        self.step
    }

    /// Steps started so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Elements of the shard.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Storage type of m and v.
    pub fn state_dtype(&self) -> StateDtype {
        match self.state {
            State::F32 { .. } => StateDtype::Fp32,
            State::Bf16 { .. } => StateDtype::Bf16,
        }
    }

    /// Bytes of m and v (8 per element in fp32, 4 in bf16).
    pub fn state_bytes(&self) -> usize {
        match self.state {
            State::F32 { .. } => 8 * self.numel,
            State::Bf16 { .. } => 4 * self.numel,
        }
    }

    /// Threads one update call uses.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// m and v as f32 (for checkpoints and tests).
    pub fn moments(&self) -> (Vec<f32>, Vec<f32>) {
        match &self.state {
            State::F32 { m, v } => (m.clone(), v.clone()),
            State::Bf16 { m, v } => (
                m.iter().map(|&b| kernel::bf16_to_f32(b)).collect(),
                v.iter().map(|&b| kernel::bf16_to_f32(b)).collect(),
            ),
        }
    }

    /// Restores m, v (rounded to nearest even for bf16 state) and the step count.
    pub fn load(&mut self, m_in: &[f32], v_in: &[f32], step: u64) -> Result<()> {
        self.check("loaded m", m_in.len(), self.numel)?;
        self.load_range(0, m_in, v_in)?;
        self.step = step;
        Ok(())
    }

    /// Sets m and v of elements `[off, off + m_in.len())` (rounded to nearest even for bf16
    /// state), for checkpoints that are read back range by range.
    pub fn load_range(&mut self, off: usize, m_in: &[f32], v_in: &[f32]) -> Result<()> {
        let n = m_in.len();
        self.check("loaded v", v_in.len(), n)?;
        self.range(off, n)?;
        match &mut self.state {
            State::F32 { m, v } => {
                m[off..off + n].copy_from_slice(m_in);
                v[off..off + n].copy_from_slice(v_in);
            }
            State::Bf16 { m, v } => {
                for (d, &s) in m[off..off + n].iter_mut().zip(m_in) {
                    *d = kernel::bf16_nearest_even(s);
                }
                for (d, &s) in v[off..off + n].iter_mut().zip(v_in) {
                    *d = kernel::bf16_nearest_even(s);
                }
            }
        }
        Ok(())
    }

    /// m and v of elements `[off, off + len)` in their storage type (for checkpoints).
    pub fn moments_range(&self, off: usize, len: usize) -> Result<MomentSlices<'_>> {
        self.range(off, len)?;
        Ok(match &self.state {
            State::F32 { m, v } => MomentSlices::F32(&m[off..off + len], &v[off..off + len]),
            State::Bf16 { m, v } => MomentSlices::Bf16(&m[off..off + len], &v[off..off + len]),
        })
    }

    /// m and v of elements `[off, off + len)` to write in place, where they are stored as
    /// fp32 (`None` for bf16 storage: use [`CpuAdamW::load_range`]).
    pub fn moments_mut(
        &mut self,
        off: usize,
        len: usize,
    ) -> Result<Option<(&mut [f32], &mut [f32])>> {
        self.range(off, len)?;
        Ok(match &mut self.state {
            State::F32 { m, v } => Some((&mut m[off..off + len], &mut v[off..off + len])),
            State::Bf16 { .. } => None,
        })
    }

    /// Sets the count of steps taken (bias corrections and the rounding keys use it).
    pub fn set_steps(&mut self, step: u64) {
        self.step = step;
    }

    fn range(&self, off: usize, len: usize) -> Result<()> {
        match off.checked_add(len) {
            Some(end) if end <= self.numel => Ok(()),
            _ => Err(Error::Range {
                off,
                len,
                numel: self.numel,
            }),
        }
    }

    fn check(&self, what: &'static str, got: usize, expected: usize) -> Result<()> {
        if got != expected {
            return Err(Error::Size {
                what,
                got: got as i64,
                expected: expected as i64,
            });
        }
        Ok(())
    }

    /// Updates elements `[off, off + params.len())` of the shard in place with this step's
    /// `lr`; `grad_scale` multiplies the gradient first (1.0 = none); writes the rounded
    /// compute-dtype copy into `half` when given (same length, u16 bits). Any sub-range may be
    /// updated in any order within a step. Takes `&mut self`: m and v are written in place.
    /// The gradients are f32 or bf16 ([`Bf16`]): the same values update bitwise alike.
    pub fn update<G: Grad>(
        &mut self,
        off: usize,
        params: &mut [f32],
        grads: &[G],
        lr: f64,
        grad_scale: f32,
        half: Option<(&mut [u16], HalfKind)>,
    ) -> Result<()> {
        self.update_inner(off, params, grads, lr, grad_scale, half, None)
    }

    /// [`CpuAdamW::update`] with, instead of the compute-dtype copy, the prediction of the
    /// next update (`predict` the scalars, `out` where it goes), written in the update's own
    /// loop from each element's state as stored, exactly as [`CpuAdamW::predict`] writes it.
    #[allow(clippy::too_many_arguments)]
    fn update_inner<G: Grad>(
        &mut self,
        off: usize,
        params: &mut [f32],
        grads: &[G],
        lr: f64,
        grad_scale: f32,
        half: Option<(&mut [u16], HalfKind)>,
        prediction: Option<(predict::Coeffs, Prediction<'_>)>,
    ) -> Result<()> {
        let n = params.len();
        self.check("gradient sub-range", grads.len(), n)?;
        if let Some((_, out)) = &prediction {
            self.check_prediction(n, out)?;
        }
        if let Some((h, _)) = &half {
            self.check("half-precision copy", h.len(), n)?;
        }
        self.range(off, n)?;
        if self.step == 0 {
            return Err(Error::NoStep);
        }
        let coeffs = self.coeffs(lr, grad_scale);
        let keep = (1.0 - lr * self.cfg.weight_decay) as f32;
        let (predict, mut pred) = match prediction {
            Some((c, out)) => (Some(c), Some(out)),
            None => (None, None),
        };
        let job = Job {
            coeffs: &coeffs,
            keep,
            decay: &self.decay,
            predict: predict.as_ref(),
        };
        let (kind, mut half) = match half {
            Some((h, k)) => (Some(k), Some(h)),
            None => (None, None),
        };
        let moments = match &mut self.state {
            State::F32 { m, v } => Moments::F32(&mut m[off..off + n], &mut v[off..off + n]),
            State::Bf16 { m, v } => Moments::Bf16(&mut m[off..off + n], &mut v[off..off + n]),
        };
        let threads = self.threads.min(n / MIN_PER_THREAD).max(1);
        let Some(pool) = self.pool.as_ref().filter(|_| threads > 1) else {
            job.run(
                off,
                params,
                grads,
                moments,
                half.as_deref_mut(),
                kind,
                pred.take(),
            );
            return Ok(());
        };
        // Contiguous pieces, multiples of 64 elements (whole cache lines) except the last.
        let piece = n.div_ceil(threads).div_ceil(64) * 64;
        pool.in_place_scope(|s| {
            let (mut p, mut g, mut mo, mut h, mut o) = (params, grads, moments, half, pred);
            let mut at = off;
            while !p.is_empty() {
                let len = piece.min(p.len());
                let (p0, p1) = p.split_at_mut(len);
                let (g0, g1) = g.split_at(len);
                let (m0, m1) = mo.split_at(len);
                let (h0, h1) = match h {
                    Some(h) => {
                        let (a, b) = h.split_at_mut(len);
                        (Some(a), Some(b))
                    }
                    None => (None, None),
                };
                let (o0, o1) = match o {
                    Some(o) => {
                        let (a, b) = o.split_at(len);
                        (Some(a), Some(b))
                    }
                    None => (None, None),
                };
                let job = &job;
                if p1.is_empty() {
                    // The last piece runs on the calling thread.
                    job.run(at, p0, g0, m0, h0, kind, o0);
                } else {
                    s.spawn(move |_| job.run(at, p0, g0, m0, h0, kind, o0));
                }
                (p, g, mo, h, o) = (p1, g1, m1, h1, o1);
                at += len;
            }
        });
        Ok(())
    }

    fn coeffs(&self, lr: f64, grad_scale: f32) -> Coeffs {
        let c = &self.cfg;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        let s = (self.step as u32) ^ ((self.step >> 32) as u32).wrapping_mul(0x85eb_ca6b);
        Coeffs {
            grad_scale,
            b1: c.beta1 as f32,
            omb1: (1.0 - c.beta1) as f32,
            b2: c.beta2 as f32,
            omb2: (1.0 - c.beta2) as f32,
            step_size: (lr / bc1) as f32,
            inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32,
            eps: c.eps as f32,
            seed: kernel::hash32(s),
        }
    }
}

/// A sub-range of m and v.
enum Moments<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    Bf16(&'a mut [u16], &'a mut [u16]),
}

impl<'a> Moments<'a> {
    fn split_at(self, k: usize) -> (Moments<'a>, Moments<'a>) {
        match self {
            Moments::F32(m, v) => {
                let ((m0, m1), (v0, v1)) = (m.split_at_mut(k), v.split_at_mut(k));
                (Moments::F32(m0, v0), Moments::F32(m1, v1))
            }
            Moments::Bf16(m, v) => {
                let ((m0, m1), (v0, v1)) = (m.split_at_mut(k), v.split_at_mut(k));
                (Moments::Bf16(m0, v0), Moments::Bf16(m1, v1))
            }
        }
    }
}

/// What every piece of one update call shares.
struct Job<'a> {
    coeffs: &'a Coeffs,
    keep: f32,
    decay: &'a [(usize, usize)],
    /// The scalars of the next update's prediction, written after each block's update.
    predict: Option<&'a predict::Coeffs>,
}

impl Job<'_> {
    /// Updates shard elements `[at, at + p.len())`, block by block, each block inside or
    /// outside the decay ranges; with `pred`, writes each block's prediction after it.
    #[allow(clippy::too_many_arguments)]
    fn run<G: Grad>(
        &self,
        at: usize,
        p: &mut [f32],
        g: &[G],
        mut mo: Moments<'_>,
        mut half: Option<&mut [u16]>,
        kind: Option<HalfKind>,
        mut pred: Option<Prediction<'_>>,
    ) {
        let end = at + p.len();
        let mut i = at;
        while i < end {
            // The next boundary: a block end or a decay-range edge.
            let next = self.decay.partition_point(|&(_, e)| e <= i);
            let (decayed, mut stop) = match self.decay.get(next) {
                Some(&(s, e)) if s <= i => (true, e),
                Some(&(s, _)) => (false, s),
                None => (false, end),
            };
            // Blocks never cross a multiple of 2^32 (the random bits key on the low 32 bits).
            stop = stop
                .min(end)
                .min(i + BLOCK)
                .min((i | 0xffff_ffff).saturating_add(1));
            let (lo, hi) = (i - at, stop - at);
            let keep = if decayed { self.keep } else { 1.0 };
            // The update writes the prediction in the same pass.
            let next = match (self.predict, pred.as_mut()) {
                (Some(c), Some(out)) => Some(Next {
                    coeffs: c,
                    keep: c.keep(decayed),
                    out: out.sub(lo, hi),
                }),
                _ => None,
            };
            let moments = match &mut mo {
                Moments::F32(m, v) => MomentsMut::F32(&mut m[lo..hi], &mut v[lo..hi]),
                Moments::Bf16(m, v) => MomentsMut::Bf16 {
                    m: &mut m[lo..hi],
                    v: &mut v[lo..hi],
                    base: i as u64,
                },
            };
            let h = match (&mut half, kind) {
                (Some(h), Some(k)) => Some((&mut h[lo..hi], k)),
                _ => None,
            };
            let (p, g) = (&mut p[lo..hi], &g[lo..hi]);
            kernel::update_block(self.coeffs, keep, p, g, moments, h, next);
            i = stop;
        }
        // The half copy may have gone out with non-temporal stores.
        kernel::store_fence();
    }
}

#[cfg(test)]
mod tests;
