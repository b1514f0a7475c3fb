//! The sum of squares of a rank's gradients, for the global gradient norm.
//!
//! On CPU the sum runs over the tensor's own memory in f64 (each f32 square is exact in f64),
//! so it allocates nothing: the chunked fp64 copies it replaces took 16 bytes per element of
//! up to 2^20 elements (16 MiB) at the optimizer step, a transient the caching CPU allocator
//! had to find room for. Elsewhere (and for dtypes other than f32 and bf16) libtorch sums
//! bounded chunks in f64.

use tch::{Device, Kind, Tensor};

use crate::{Context, Result};

/// Sum of squares of a 1-D tensor in f64.
pub(crate) fn sum_of_squares(t: &Tensor) -> Result<f64> {
    let n = t.numel();
    if n == 0 {
        return Ok(0.0);
    }
    if t.device() == Device::Cpu && t.is_contiguous() {
        match t.kind() {
            Kind::Float => {
                // SAFETY: `t` is a contiguous CPU tensor of `n` f32 elements that outlives
                // the slice, and the slice is only read while `t` is borrowed here.
                let x = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, n) };
                return Ok(sum_sq(x, |v| v));
            }
            Kind::BFloat16 => {
                // SAFETY: as above, with `n` bf16 elements read as their 16-bit patterns.
                let x = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u16, n) };
                return Ok(sum_sq(x, |b| f32::from_bits(u32::from(b) << 16)));
            }
            _ => {}
        }
    }
    chunked(t)
}

/// f64 sum of the squares of `x` read through `f32_of`, over 8 interleaved partial sums so
/// the loop vectorises.
fn sum_sq<T: Copy>(x: &[T], f32_of: impl Fn(T) -> f32) -> f64 {
    let sq = |v: T| {
        let v = f64::from(f32_of(v));
        v * v
    };
    let mut acc = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += sq(v);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| sq(v)).sum();
    acc.iter().sum::<f64>() + tail
}

/// libtorch's sum in f64 over chunks of up to 2^20 elements (no full-size temporary).
fn chunked(t: &Tensor) -> Result<f64> {
    const CHUNK: i64 = 1 << 20;
    let n = t.numel() as i64;
    let mut sum = 0.0;
    let mut off = 0;
    while off < n {
        let len = CHUNK.min(n - off);
        let c = t
            .f_narrow(0, off, len)
            .and_then(|c| c.f_to_kind(Kind::Double));
        let s = c
            .and_then(|c| c.f_square())
            .and_then(|c| c.f_sum(Kind::Double));
        sum += s
            .and_then(|s| s.f_double_value(&[]))
            .ctx("gradient norm", "-")?;
        off += len;
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_sums_equal_libtorchs_f64_sum() {
        tch::manual_seed(3);
        for &n in &[1i64, 7, 8, 9, 1000, (1 << 20) + 5] {
            let f = Tensor::randn([n], (Kind::Float, Device::Cpu)) * 3.0;
            let want = chunked(&f).unwrap();
            let got = sum_of_squares(&f).unwrap();
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "f32 n={n}: {got} vs {want}"
            );
            let b = f.to_kind(Kind::BFloat16);
            let want = chunked(&b).unwrap();
            let got = sum_of_squares(&b).unwrap();
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "bf16 n={n}: {got} vs {want}"
            );
        }
        // A view that is not contiguous takes libtorch's path.
        let m = Tensor::randn([64, 3], (Kind::Float, Device::Cpu));
        let col = m.select(1, 1);
        let want = f64::try_from(col.to_kind(Kind::Double).square().sum(Kind::Double)).unwrap();
        assert!((sum_of_squares(&col).unwrap() - want).abs() <= 1e-12 * want);
    }
}
