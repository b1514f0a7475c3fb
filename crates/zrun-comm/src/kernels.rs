//! Element-wise reduction kernels on raw byte buffers; 16-bit types accumulate in fp32.

use half::{bf16, f16};

use crate::buf::DType;

/// Elements per reduction block: the fp32 accumulator (256 KiB) stays in cache.
pub(crate) const BLOCK: usize = 64 * 1024;

fn as_f32(b: &[u8]) -> &[f32] {
    debug_assert_eq!(b.as_ptr() as usize % 4, 0);
    // SAFETY: callers pass tensor memory or scratch of fp32 elements, 4-byte aligned
    // (tensor storage is aligned and offsets are whole elements); the length is rounded down.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4) }
}

fn as_f32_mut(b: &mut [u8]) -> &mut [f32] {
    debug_assert_eq!(b.as_ptr() as usize % 4, 0);
    // SAFETY: as in `as_f32`, and the borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut f32, b.len() / 4) }
}

fn as_u16(b: &[u8]) -> &[u16] {
    debug_assert_eq!(b.as_ptr() as usize % 2, 0);
    // SAFETY: 16-bit tensor memory or scratch, 2-byte aligned; length rounded down.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u16, b.len() / 2) }
}

fn as_u16_mut(b: &mut [u8]) -> &mut [u16] {
    debug_assert_eq!(b.as_ptr() as usize % 2, 0);
    // SAFETY: as in `as_u16`, and the borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u16, b.len() / 2) }
}

/// Bytes of a slice of plain numbers (used for aligned scratch buffers).
pub(crate) fn bytes_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: T is a plain number type (f32/u16/u64) without padding; the borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

/// `acc[i] = src[i]` as fp32.
pub(crate) fn load(dtype: DType, src: &[u8], acc: &mut [f32]) {
    match dtype {
        DType::F32 => acc.copy_from_slice(as_f32(src)),
        DType::BF16 => {
            for (a, &s) in acc.iter_mut().zip(as_u16(src)) {
                *a = f32::from_bits(u32::from(s) << 16);
            }
        }
        DType::F16 => {
            for (a, &s) in acc.iter_mut().zip(as_u16(src)) {
                *a = f16::from_bits(s).to_f32();
            }
        }
    }
}

/// `acc[i] += src[i]` in fp32.
pub(crate) fn accumulate(dtype: DType, src: &[u8], acc: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (a, &s) in acc.iter_mut().zip(as_f32(src)) {
                *a += s;
            }
        }
        DType::BF16 => {
            for (a, &s) in acc.iter_mut().zip(as_u16(src)) {
                *a += f32::from_bits(u32::from(s) << 16);
            }
        }
        DType::F16 => {
            for (a, &s) in acc.iter_mut().zip(as_u16(src)) {
                *a += f16::from_bits(s).to_f32();
            }
        }
    }
}

/// `dst[i] = acc[i] / div` rounded to `dtype` (no division when `div` is 1).
pub(crate) fn store(dtype: DType, acc: &[f32], div: f32, dst: &mut [u8]) {
    match dtype {
        DType::F32 => {
            let d = as_f32_mut(dst);
            if div == 1.0 {
                d.copy_from_slice(acc);
            } else {
                for (o, &a) in d.iter_mut().zip(acc) {
                    *o = a / div;
                }
            }
        }
        DType::BF16 => {
            for (o, &a) in as_u16_mut(dst).iter_mut().zip(acc) {
                *o = bf16::from_f32(a / div).to_bits();
            }
        }
        DType::F16 => {
            for (o, &a) in as_u16_mut(dst).iter_mut().zip(acc) {
                *o = f16::from_f32(a / div).to_bits();
            }
        }
    }
}

/// `out = (a + b) / div`, element-wise in fp32, rounded to `dtype`. `out` may alias neither.
/// `acc` is scratch of at least `BLOCK` elements.
pub(crate) fn add2(dtype: DType, a: &[u8], b: &[u8], div: f32, out: &mut [u8], acc: &mut [f32]) {
    if dtype == DType::F32 && div == 1.0 {
        for ((o, &x), &y) in as_f32_mut(out).iter_mut().zip(as_f32(a)).zip(as_f32(b)) {
            *o = x + y;
        }
        return;
    }
    let es = dtype.size();
    let n = a.len() / es;
    let mut i = 0;
    while i < n {
        let m = BLOCK.min(n - i);
        let r = i * es..(i + m) * es;
        load(dtype, &a[r.clone()], &mut acc[..m]);
        accumulate(dtype, &b[r.clone()], &mut acc[..m]);
        store(dtype, &acc[..m], div, &mut out[r]);
        i += m;
    }
}

/// `dst = (dst + src) / div` in fp32, rounded to `dtype`.
pub(crate) fn add_in_place(dtype: DType, dst: &mut [u8], src: &[u8], div: f32, acc: &mut [f32]) {
    if dtype == DType::F32 && div == 1.0 {
        for (o, &y) in as_f32_mut(dst).iter_mut().zip(as_f32(src)) {
            *o += y;
        }
        return;
    }
    let es = dtype.size();
    let n = dst.len() / es;
    let mut i = 0;
    while i < n {
        let m = BLOCK.min(n - i);
        let r = i * es..(i + m) * es;
        load(dtype, &dst[r.clone()], &mut acc[..m]);
        accumulate(dtype, &src[r.clone()], &mut acc[..m]);
        store(dtype, &acc[..m], div, &mut dst[r]);
        i += m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add2_matches_scalar_sum_for_every_dtype() {
        let a: Vec<f32> = (0..1000).map(|i| (i % 13) as f32 - 6.0).collect();
        let b: Vec<f32> = (0..1000).map(|i| (i % 7) as f32 * 0.5).collect();
        let mut acc = vec![0f32; BLOCK];
        let (mut ab, mut bb, mut out) = (a.clone(), b.clone(), vec![0f32; 1000]);
        add2(
            DType::F32,
            bytes_mut(&mut ab),
            bytes_mut(&mut bb),
            2.0,
            bytes_mut(&mut out),
            &mut acc,
        );
        for i in 0..1000 {
            assert_eq!(out[i], (a[i] + b[i]) / 2.0);
        }
        // bf16 and fp16: inputs exactly representable, sums too
        for dt in [DType::BF16, DType::F16] {
            let enc = |v: &[f32]| -> Vec<u16> {
                v.iter()
                    .map(|&x| match dt {
                        DType::BF16 => bf16::from_f32(x).to_bits(),
                        _ => f16::from_f32(x).to_bits(),
                    })
                    .collect()
            };
            let (mut ea, mut eb, mut out) = (enc(&a), enc(&b), vec![0u16; 1000]);
            add2(
                dt,
                bytes_mut(&mut ea),
                bytes_mut(&mut eb),
                1.0,
                bytes_mut(&mut out),
                &mut acc,
            );
            for (i, &bits) in out.iter().enumerate() {
                let got = match dt {
                    DType::BF16 => bf16::from_bits(bits).to_f32(),
                    _ => f16::from_bits(bits).to_f32(),
                };
                assert_eq!(got, a[i] + b[i], "{dt:?} at {i}");
            }
        }
    }

    #[test]
    fn bf16_store_rounds_to_nearest_even() {
        let mut out = [0u16; 2];
        // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: rounds to even (1.0)
        store(
            DType::BF16,
            &[1.0 + 1.0 / 256.0, 3.0],
            1.0,
            bytes_mut(&mut out),
        );
        assert_eq!(bf16::from_bits(out[0]).to_f32(), 1.0);
        assert_eq!(bf16::from_bits(out[1]).to_f32(), 3.0);
    }
}
