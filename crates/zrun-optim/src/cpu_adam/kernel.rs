//! The element-wise AdamW kernels and the bf16/fp16 roundings.
//!
//! Every kernel is a plain loop over equal-length slices that LLVM vectorises; it is compiled
//! three times, generic, with AVX2 + FMA + F16C, and with AVX-512 (whose bf16 copy is written
//! with explicit non-temporal stores), and the widest copy the CPU supports is picked at run
//! time. All copies compute the same IEEE operations (`mul_add` is a fused multiply-add
//! everywhere; `sqrt` and `/` are correctly rounded), so results are bitwise identical across
//! machines, instruction sets and thread counts.

use super::predict::{self, BaseOut, Prediction};
use super::HalfKind;

/// Per-step scalars of the update, already in f32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Coeffs {
    /// Multiplies the gradient first (unscaling, clipping).
    pub grad_scale: f32,
    /// beta1 and 1 - beta1.
    pub b1: f32,
    pub omb1: f32,
    /// beta2 and 1 - beta2.
    pub b2: f32,
    pub omb2: f32,
    /// lr / (1 - beta1^t).
    pub step_size: f32,
    /// 1 / sqrt(1 - beta2^t).
    pub inv_bc2_sqrt: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Seed of the stochastic rounding of m and v for this step.
    pub seed: u32,
}

/// A gradient element the update reads: f32, or bf16 ([`Bf16`]), widened to f32 exactly.
pub trait Grad: Copy + Send + Sync + 'static {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
}

impl Grad for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// A bf16 value by its bits (the layout of a bf16 tensor's elements).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Grad for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self.0)
    }
}

/// One element's AdamW update in f32; `keep` is 1 - lr * weight_decay (1.0 outside the
/// decay ranges, where multiplying by it is exact).
#[inline(always)]
fn adam(c: &Coeffs, keep: f32, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32, f32) {
    let g = g * c.grad_scale;
    let p = p * keep;
    let m = c.b1.mul_add(m, c.omb1 * g);
    let v = c.b2.mul_add(v, (c.omb2 * g) * g);
    let ratio = m / ratio_denom(v, c.inv_bc2_sqrt, c.eps);
    let p = (-c.step_size).mul_add(ratio, p);
    (p, m, v, ratio)
}

/// AdamW's denominator `sqrt(v) / sqrt(1 - b2^t) + eps`, as the update computes it (the
/// split's prediction divides by the same, `predict.rs`).
#[inline(always)]
pub(crate) fn ratio_denom(v: f32, inv_bc2_sqrt: f32, eps: f32) -> f32 {
    v.sqrt().mul_add(inv_bc2_sqrt, eps)
}

/// A 32-bit integer hash (lowbias32): full avalanche, a few vectorisable integer ops.
#[inline(always)]
pub(crate) fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// 32 random bits for the element at `lo` (the low 32 bits of its index in the shard) under
/// the block seed (a function of the step and of the index's high 32 bits): the low 16 bits
/// round m, the high 16 bits round v.
#[inline(always)]
fn element_bits(block_seed: u32, lo: u32) -> u32 {
    hash32(lo ^ block_seed)
}

/// f32 to bf16 bits, stochastically: rounds the magnitude up with probability equal to the
/// dropped fraction (`r`'s low 16 bits are the uniform draw), so the expected value is exact.
#[inline(always)]
fn bf16_stochastic(x: f32, r: u32) -> u16 {
    (x.to_bits().wrapping_add(r & 0xffff) >> 16) as u16
}

/// f32 to bf16 bits, round to nearest, ties to even (NaN stays a quiet NaN).
#[inline(always)]
pub(crate) fn bf16_nearest_even(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        ((b >> 16) as u16) | 0x0040
    } else {
        rounded
    }
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub(crate) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Elements of one kernel call: the update of a block and its half copy stay in L1.
pub(crate) const BLOCK: usize = 2048;

/// The moments of one block, in their storage type.
pub(crate) enum MomentsMut<'a> {
    /// fp32 state.
    F32(&'a mut [f32], &'a mut [f32]),
    /// bf16 state (bits), stochastically rounded; `base` is the block's first element index
    /// in the shard, the key of its random bits (a block never crosses a multiple of 2^32).
    Bf16 {
        m: &'a mut [u16],
        v: &'a mut [u16],
        base: u64,
    },
}

/// The split's prediction of the next update (`predict.rs`), written by the update of a block
/// in the same pass from each element's new master and its m and v as stored: the bits
/// [`super::CpuAdamW::predict`] computes later from the stored state.
pub(crate) struct Next<'a> {
    pub coeffs: &'a predict::Coeffs,
    /// 1 - lr' * weight_decay inside the decay ranges, 1 outside.
    pub keep: f32,
    pub out: Prediction<'a>,
}

/// Updates one block (at most [`BLOCK`] elements) and writes its half copy or the split's
/// prediction.
pub(crate) fn update_block<G: Grad>(
    c: &Coeffs,
    keep: f32,
    p: &mut [f32],
    g: &[G],
    moments: MomentsMut<'_>,
    half: Option<(&mut [u16], HalfKind)>,
    next: Option<Next<'_>>,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512 F/BW/VL, AVX2, FMA and F16C (checked by
        // `has_avx512` at run time), the only requirement of this `target_feature` function.
        unsafe { update_block_avx512(c, keep, p, g, moments, half, next) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked by `has_avx2` at run time),
        // the only requirement of these `target_feature` functions.
        unsafe { update_block_avx2(c, keep, p, g, moments, half, next) };
        return;
    }
    update_block_generic(c, keep, p, g, moments, half, next);
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("ZRUN_NO_AVX512").is_none()
            && has_avx2()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn update_block_avx512<G: Grad>(
    c: &Coeffs,
    keep: f32,
    p: &mut [f32],
    g: &[G],
    moments: MomentsMut<'_>,
    half: Option<(&mut [u16], HalfKind)>,
    next: Option<Next<'_>>,
) {
    update_block_body(c, keep, p, g, moments, next);
    match half {
        Some((out, HalfKind::Fp16)) => {
            // SAFETY: this function runs only where F16C is present (see `update_block`).
            unsafe { fp16_f16c(p, out) }
        }
        Some((out, HalfKind::Bf16)) => {
            // SAFETY: this function runs only where AVX-512 F/BW is present (see `update_block`).
            unsafe { bf16_stream_avx512(p, out) }
        }
        None => {}
    }
}

/// bf16 round to nearest even (as [`bf16_nearest_even`]) sixteen at a time, written with
/// non-temporal stores: the copy is not read again on this core, so its cache lines are not
/// fetched before being overwritten (2 bytes of the 30 per element, but a whole read stream).
/// The caller orders the stores with [`store_fence`] before the copy is used.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(crate) unsafe fn bf16_stream_avx512(p: &[f32], out: &mut [u16]) {
    use std::arch::x86_64::*;
    let out = &mut out[..p.len()];
    // Scalar head up to a 32-byte aligned output address.
    let mis = (out.as_ptr() as usize % 32) / 2;
    let head = if mis == 0 { 0 } else { (16 - mis).min(p.len()) };
    for (o, &x) in out[..head].iter_mut().zip(&p[..head]) {
        *o = bf16_nearest_even(x);
    }
    let (p, out) = (&p[head..], &mut out[head..]);
    let mut pc = p.chunks_exact(16);
    let mut oc = out.chunks_exact_mut(16);
    let bias = _mm512_set1_epi32(0x7fff);
    let one = _mm512_set1_epi32(1);
    let quiet = _mm512_set1_epi32(0x40);
    for (src, dst) in (&mut pc).zip(&mut oc) {
        // SAFETY: `src` holds 16 f32 (unaligned load) and `dst` 16 u16 starting 32-byte aligned
        // (the head above), as the streaming store requires.
        unsafe {
            let x = _mm512_loadu_ps(src.as_ptr());
            let b = _mm512_castps_si512(x);
            let hi = _mm512_srli_epi32::<16>(b);
            let r = _mm512_add_epi32(b, _mm512_add_epi32(bias, _mm512_and_si512(hi, one)));
            let r = _mm512_srli_epi32::<16>(r);
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            let r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, quiet));
            _mm256_stream_si256(dst.as_mut_ptr() as *mut __m256i, _mm512_cvtepi32_epi16(r));
        }
    }
    for (o, &x) in oc.into_remainder().iter_mut().zip(pc.remainder()) {
        *o = bf16_nearest_even(x);
    }
}

/// Orders earlier non-temporal stores before later loads and stores of any thread that
/// synchronises with this one.
#[inline]
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` only orders stores; SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn update_block_avx2<G: Grad>(
    c: &Coeffs,
    keep: f32,
    p: &mut [f32],
    g: &[G],
    moments: MomentsMut<'_>,
    half: Option<(&mut [u16], HalfKind)>,
    next: Option<Next<'_>>,
) {
    update_block_body(c, keep, p, g, moments, next);
    match half {
        Some((out, HalfKind::Fp16)) => {
            // SAFETY: this function runs only where F16C is present (see `update_block`).
            unsafe { fp16_f16c(p, out) }
        }
        Some((out, HalfKind::Bf16)) => bf16_body(p, out),
        None => {}
    }
}

fn update_block_generic<G: Grad>(
    c: &Coeffs,
    keep: f32,
    p: &mut [f32],
    g: &[G],
    moments: MomentsMut<'_>,
    half: Option<(&mut [u16], HalfKind)>,
    next: Option<Next<'_>>,
) {
    update_block_body(c, keep, p, g, moments, next);
    match half {
        Some((out, HalfKind::Fp16)) => {
            for (o, &x) in out.iter_mut().zip(p.iter()) {
                *o = half::f16::from_f32(x).to_bits();
            }
        }
        Some((out, HalfKind::Bf16)) => bf16_body(p, out),
        None => {}
    }
}

/// Elements per inner step of the update loops (four cache lines of f32).
const STEP: usize = 64;
/// How far ahead (elements) the update loops prefetch their inputs.
const AHEAD: usize = 1024;

/// Asks for the cache line at `p` ahead of use; any address is allowed (no fault).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults or changes memory, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetches `STEP` elements of `x` starting `AHEAD` past `i` (one call per cache line).
#[inline(always)]
fn prefetch_ahead<T>(x: &[T], i: usize) {
    let base = x.as_ptr().wrapping_add(i + AHEAD);
    let per_line = 64 / std::mem::size_of::<T>();
    let mut k = 0;
    while k < STEP {
        prefetch(base.wrapping_add(k));
        k += per_line;
    }
}

/// Walks elements `[0, n)` `STEP` at a time, `i..e` the chunk: prefetches each listed array
/// `AHEAD` elements past it (the next block's lines are in flight while this one computes),
/// then runs the body. A macro, not a function taking a closure: a closure's body is not
/// compiled with the enclosing `target_feature`s (it ran 12x slower, `mul_add` as calls).
macro_rules! walk {
    ($n:expr, [$($x:expr),*], |$i:ident, $e:ident| $body:block) => {{
        let n = $n;
        let mut $i = 0;
        while $i < n {
            let $e = ($i + STEP).min(n);
            $(prefetch_ahead($x, $i);)*
            $body
            $i = $e;
        }
    }};
}

/// One element's update with bf16 state (bits): computed in f32 from the stored moments,
/// which are rounded back stochastically with the element's random bits `r`.
#[inline(always)]
fn adam_bf16(c: &Coeffs, keep: f32, p: f32, g: f32, m: u16, v: u16, r: u32) -> (f32, u16, u16) {
    let (p, m, v, _) = adam(c, keep, p, g, bf16_to_f32(m), bf16_to_f32(v));
    (p, bf16_stochastic(m, r), bf16_stochastic(v, r >> 16))
}

/// The random-bits seed of a bf16-state block whose first shard index is `base`.
#[inline(always)]
fn block_seed(c: &Coeffs, base: u64) -> u32 {
    c.seed ^ hash32(((base >> 32) as u32).wrapping_mul(0x9e37_79b9))
}

/// The update loops; inlined into each compiled copy so they vectorise with its features.
#[inline(always)]
fn update_block_body<G: Grad>(
    c: &Coeffs,
    keep: f32,
    p: &mut [f32],
    g: &[G],
    moments: MomentsMut<'_>,
    next: Option<Next<'_>>,
) {
    let n = p.len();
    let g = &g[..n];
    if let Some(Next {
        coeffs,
        keep: k,
        out,
    }) = next
    {
        let ov = out.v;
        return match out.base {
            BaseOut::Half(ob, HalfKind::Bf16) => {
                update_next(c, keep, p, g, moments, coeffs, k, ob, ov, bf16_nearest_even)
            }
            BaseOut::Half(ob, HalfKind::Fp16) => {
                let fp16 = |x| half::f16::from_f32(x).to_bits();
                update_next(c, keep, p, g, moments, coeffs, k, ob, ov, fp16)
            }
            BaseOut::F32(ob) => update_next(c, keep, p, g, moments, coeffs, k, ob, ov, |x| x),
        };
    }
    match moments {
        MomentsMut::F32(m, v) => {
            let (m, v) = (&mut m[..n], &mut v[..n]);
            walk!(n, [p, g, m, v], |i, e| {
                let (p, g, m, v) = (&mut p[i..e], &g[i..e], &mut m[i..e], &mut v[i..e]);
                for j in 0..p.len() {
                    (p[j], m[j], v[j], _) = adam(c, keep, p[j], g[j].to_f32(), m[j], v[j]);
                }
            });
        }
        MomentsMut::Bf16 { m, v, base } => {
            let (m, v) = (&mut m[..n], &mut v[..n]);
            let (seed, lo) = (block_seed(c, base), base as u32);
            walk!(n, [p, g, m, v], |i, e| {
                let (p, g, m, v) = (&mut p[i..e], &g[i..e], &mut m[i..e], &mut v[i..e]);
                let lo = lo.wrapping_add(i as u32);
                for j in 0..p.len() {
                    let r = element_bits(seed, lo.wrapping_add(j as u32));
                    (p[j], m[j], v[j]) = adam_bf16(c, keep, p[j], g[j].to_f32(), m[j], v[j], r);
                }
            });
        }
    }
}

/// The update loops that also write the split's prediction of the next update: `ob` the base
/// (converted by `conv`), `ov` v as bf16. With bf16 state the base divides by m and v as
/// rounded and stored.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn update_next<G: Grad, T>(
    c: &Coeffs,
    keep: f32,
    p: &mut [f32],
    g: &[G],
    moments: MomentsMut<'_>,
    nc: &predict::Coeffs,
    nkeep: f32,
    ob: &mut [T],
    ov: &mut [u16],
    conv: impl Fn(f32) -> T,
) {
    let n = p.len();
    let (ob, ov) = (&mut ob[..n], &mut ov[..n]);
    match moments {
        MomentsMut::F32(m, v) => {
            let (m, v) = (&mut m[..n], &mut v[..n]);
            walk!(n, [p, g, m, v], |i, e| {
                let (p, g, m, v) = (&mut p[i..e], &g[i..e], &mut m[i..e], &mut v[i..e]);
                let (ob, ov) = (&mut ob[i..e], &mut ov[i..e]);
                for j in 0..p.len() {
                    let (pj, mj, vj, rj) = adam(c, keep, p[j], g[j].to_f32(), m[j], v[j]);
                    (p[j], m[j], v[j]) = (pj, mj, vj);
                    ob[j] = conv(predict::base(nc, nkeep, pj, rj));
                    ov[j] = bf16_nearest_even(vj);
                }
            });
        }
        MomentsMut::Bf16 { m, v, base } => {
            let (m, v) = (&mut m[..n], &mut v[..n]);
            let (seed, lo) = (block_seed(c, base), base as u32);
            walk!(n, [p, g, m, v], |i, e| {
                let (p, g, m, v) = (&mut p[i..e], &g[i..e], &mut m[i..e], &mut v[i..e]);
                let (ob, ov) = (&mut ob[i..e], &mut ov[i..e]);
                let lo = lo.wrapping_add(i as u32);
                for j in 0..p.len() {
                    let r = element_bits(seed, lo.wrapping_add(j as u32));
                    let (pj, mj, vj) = adam_bf16(c, keep, p[j], g[j].to_f32(), m[j], v[j], r);
                    (p[j], m[j], v[j]) = (pj, mj, vj);
                    let ratio = predict::ratio(nc, bf16_to_f32(mj), bf16_to_f32(vj));
                    ob[j] = conv(predict::base(nc, nkeep, pj, ratio));
                    ov[j] = vj;
                }
            });
        }
    }
}

#[inline(always)]
fn bf16_body(p: &[f32], out: &mut [u16]) {
    let out = &mut out[..p.len()];
    for (o, &x) in out.iter_mut().zip(p.iter()) {
        *o = bf16_nearest_even(x);
    }
}

/// fp16 round to nearest even with the F16C instruction, eight at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fp16_f16c(p: &[f32], out: &mut [u16]) {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    let out = &mut out[..p.len()];
    let mut pc = p.chunks_exact(8);
    let mut oc = out.chunks_exact_mut(8);
    for (src, dst) in (&mut pc).zip(&mut oc) {
        // SAFETY: `src` holds 8 f32 and `dst` 8 u16 (chunks_exact); unaligned load/store.
        unsafe {
            let x = _mm256_loadu_ps(src.as_ptr());
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
            _mm_storeu_si128(dst.as_mut_ptr() as *mut __m128i, h);
        }
    }
    for (o, &x) in oc.into_remainder().iter_mut().zip(pc.remainder()) {
        *o = half::f16::from_f32(x).to_bits();
    }
}
