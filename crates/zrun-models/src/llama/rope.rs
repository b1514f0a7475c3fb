//! Rotary position embeddings in Hugging Face's convention (`rotate_half`: the first and
//! second halves of a head are the two coordinates of each rotated pair).
//!
//! ```text
//! inv_freq[i] = 1 / theta^(2i / hd)              i in [0, hd/2), fp32, then rescaled
//! freqs       = positions (x) inv_freq           (T, hd/2)
//! emb         = cat(freqs, freqs)                (T, hd)
//! rope(x)     = x * cos(emb) + rotate_half(x) * sin(emb),   rotate_half(x) = cat(-x2, x1)
//! ```
//!
//! Every step runs the same fp32 libtorch ops in the same order as transformers'
//! `LlamaRotaryEmbedding`, so the angles agree bit for bit; cos and sin are cast to the
//! activations' dtype before they multiply.

use tch::{Device, Kind, Tensor};

use super::config::RopeScaling;
use crate::error::{Result, TorchCtx};

/// The inverse frequencies (hd/2) in fp32 on `device`, as transformers computes them for
/// `rope_type` default, linear and llama3.
pub(crate) fn inv_freq(
    theta: f64,
    head_dim: i64,
    scaling: Option<&RopeScaling>,
    device: Device,
) -> Result<Tensor> {
    let p = "rope";
    // 1 / theta^(arange(0, hd, 2) / hd), all in fp32 as torch does it.
    let exponent = Tensor::f_arange_start_step(0, head_dim, 2, (Kind::Int64, device))
        .and_then(|e| e.f_to_kind(Kind::Float))
        .and_then(|e| e.f_div_scalar(head_dim as f64))
        .ctx(p, "arange")?; // (hd/2)
    let inv = Tensor::f_pow_scalar(theta, &exponent)
        .and_then(|t| t.f_reciprocal())
        .ctx(p, "pow")?;
    match scaling {
        None => Ok(inv),
        Some(RopeScaling::Linear { factor }) => inv.f_div_scalar(*factor).ctx(p, "div"),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => llama3(
            &inv,
            *factor,
            *low_freq_factor,
            *high_freq_factor,
            *original_max_position_embeddings as f64,
        )
        .ctx(p, "llama3 scaling"),
    }
}

/// transformers' `_compute_llama3_parameters` applied to the default `inv`: wavelengths
/// above `old_context / low` are divided by `factor`, those below `old_context / high` kept,
/// the ones between interpolated with `s = (old_context / wavelen - low) / (high - low)`:
/// `(1 - s) * inv / factor + s * inv`.
fn llama3(
    inv: &Tensor,
    factor: f64,
    low: f64,
    high: f64,
    old_context: f64,
) -> std::result::Result<Tensor, tch::TchError> {
    let low_wavelen = old_context / low;
    let high_wavelen = old_context / high;
    let wavelen = inv
        .f_reciprocal()?
        .f_mul_scalar(2.0 * std::f64::consts::PI)?; // (hd/2)
    let long = wavelen.f_gt(low_wavelen)?;
    let scaled = inv.f_div_scalar(factor)?.f_where_self(&long, inv)?;
    let smooth = wavelen
        .f_reciprocal()?
        .f_mul_scalar(old_context)?
        .f_sub_scalar(low)?
        .f_div_scalar(high - low)?;
    let smoothed = smooth
        .f_neg()?
        .f_add_scalar(1.0)?
        .f_mul(&scaled)?
        .f_div_scalar(factor)?
        .f_add(&smooth.f_mul(&scaled)?)?;
    let short = wavelen.f_lt(high_wavelen)?;
    let medium = short
        .f_logical_not()?
        .f_logical_and(&long.f_logical_not()?)?;
    smoothed.f_where_self(&medium, &scaled)
}

/// cos (T, hd) of positions `[pos, pos + T)` and the sin that [`apply`] takes, `[-sin, sin]`
/// over the two halves of the head, computed in fp32 and cast to `kind`.
pub(crate) fn cos_sin(
    unit: &str,
    inv_freq: &[f32],
    pos: i64,
    t: i64,
    device: Device,
    kind: Kind,
) -> Result<(Tensor, Tensor)> {
    let inv = Tensor::f_from_slice(inv_freq)
        .and_then(|i| i.f_to_device(device))
        .and_then(|i| i.f_unsqueeze(0))
        .ctx(unit, "inv_freq")?; // (1, hd/2)
    let positions = Tensor::f_arange_start(pos, pos + t, (Kind::Int64, device))
        .and_then(|p| p.f_to_kind(Kind::Float))
        .and_then(|p| p.f_unsqueeze(-1))
        .ctx(unit, "positions")?; // (T, 1)
    let freqs = positions.f_mul(&inv).ctx(unit, "freqs")?; // (T, hd/2)
    let emb = Tensor::f_cat(&[&freqs, &freqs], -1).ctx(unit, "cat(freqs)")?; // (T, hd)
    let cos = emb
        .f_cos()
        .and_then(|c| c.f_to_kind(kind))
        .ctx(unit, "cos")?;
    let half = freqs.f_sin().ctx(unit, "sin")?; // (T, hd/2)
    let sin = half
        .f_neg()
        .and_then(|neg| Tensor::f_cat(&[&neg, &half], -1))
        .and_then(|s| s.f_to_kind(kind))
        .ctx(unit, "sin")?; // (T, hd)
    Ok((cos, sin))
}

/// `x * cos + rotate_half(x) * sin` for heads `x` (B, T, h, hd) and [`cos_sin`]'s `cos` and
/// signed `sin` (T, hd): `rotate_half(x)` is `[-x2, x1]`, the halves swapped (a roll by hd/2)
/// with the first negated, and the sign is in `sin`. One autograd node
/// (`zrun_torch_ext::rope`) keeping cos and sin only: one kernel pass each way on CUDA, the
/// ATen ops x * cos + roll(x) * sin elsewhere (one roll, whose backward is one roll).
pub(crate) fn apply(unit: &str, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    zrun_torch_ext::rope(x, cos, sin).map_err(|source| crate::Error::Shim {
        place: format!("{unit}: rope"),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double)).unwrap()
    }

    #[test]
    fn default_inv_freq_is_theta_to_the_minus_2i_over_hd() {
        let inv = values(&inv_freq(10_000.0, 16, None, Device::Cpu).unwrap());
        assert_eq!(inv.len(), 8);
        for (i, got) in inv.iter().enumerate() {
            let want = 10_000f64.powf(-((2 * i) as f64) / 16.0);
            assert!((got / want - 1.0).abs() < 1e-6, "i={i}: {got} vs {want}");
        }
        assert_eq!(inv[0], 1.0);
        let linear = values(
            &inv_freq(
                10_000.0,
                16,
                Some(&RopeScaling::Linear { factor: 4.0 }),
                Device::Cpu,
            )
            .unwrap(),
        );
        for (a, b) in inv.iter().zip(&linear) {
            assert!((a / 4.0 - b).abs() <= 1e-7 * a, "{a} / 4 vs {b}");
        }
    }

    /// Llama 3.1's rope (theta 500000, head 128, factor 8, low 1, high 4, context 8192) at
    /// hand-checked points: wavelengths 2 pi / inv under 2048 are kept, over 8192 divided by
    /// 8, and in between interpolated.
    #[test]
    fn llama3_inv_freq_matches_the_formula() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let got = values(&inv_freq(500_000.0, 128, Some(&scaling), Device::Cpu).unwrap());
        let base = |i: usize| 500_000f64.powf(-((2 * i) as f64) / 128.0);
        let wavelen = |i: usize| 2.0 * std::f64::consts::PI / base(i);
        // i = 0 (wavelength 2 pi) and i = 20 (about 1.1e3 < 2048): unchanged.
        for i in [0, 20] {
            assert!(wavelen(i) < 2048.0);
            assert!((got[i] / base(i) - 1.0).abs() < 1e-5, "i={i}");
        }
        // i = 40 (about 7.9e4) and i = 63 (about 2.7e6 > 8192): divided by 8.
        for i in [40, 63] {
            assert!(wavelen(i) > 8192.0);
            assert!((got[i] / (base(i) / 8.0) - 1.0).abs() < 1e-5, "i={i}");
        }
        // i = 30 (wavelength about 2.9e3): s = (8192 / wavelen - 1) / 3, and
        // (1 - s) * inv / 8 + s * inv.
        let i = 30;
        let w = wavelen(i);
        assert!(w > 2048.0 && w < 8192.0, "{w}");
        let s = (8192.0 / w - 1.0) / 3.0;
        let want = (1.0 - s) * base(i) / 8.0 + s * base(i);
        assert!((got[i] / want - 1.0).abs() < 1e-5, "{} vs {want}", got[i]);
        assert!(want > base(i) / 8.0 && want < base(i));
    }

    #[test]
    fn rotation_keeps_norms_and_turns_pairs_by_position_times_frequency() {
        let inv = [1.0f32, 0.1];
        // cos and sin (2, 4); two positions (3 and 4), one head, head size 4: pairs (0, 2)
        // and (1, 3).
        let (cos, sin) = cos_sin("t", &inv, 3, 2, Device::Cpu, Kind::Double).unwrap();
        let x =
            Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]).reshape([1, 2, 1, 4]);
        let y = apply("t", &x, &cos, &sin).unwrap();
        let yv = values(&y.reshape([-1]));
        for (row, p) in [(0usize, 3.0f64), (1, 4.0)] {
            for (pair, f) in [(0usize, 1.0f64), (1, 0.1)] {
                let (a, b) = ([1.0, 2.0][pair], [3.0, 4.0][pair]);
                let ang = p * f64::from(f as f32);
                let want = (a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin());
                let got = (yv[row * 4 + pair], yv[row * 4 + pair + 2]);
                assert!((got.0 - want.0).abs() < 1e-6 && (got.1 - want.1).abs() < 1e-6);
            }
        }
        let n = |t: &Tensor| t.square().sum(Kind::Double).double_value(&[]);
        // cos^2 + sin^2 = 1 up to the fp32 rounding of cos and sin.
        assert!((n(&y) / n(&x) - 1.0).abs() < 1e-6);
    }
}
