//! Named parameter specs and their deterministic, shard-friendly initialisation.
//!
//! Element `i` of parameter `name` under seed `seed` is a pure function of `(seed, name, i)`:
//!
//! ```text
//! base = mix64(mix64(seed) ^ fnv1a64(name))
//! h1   = mix64(base + (2i + 1) * GOLDEN)        // splitmix64 output 2i   of the stream at `base`
//! h2   = mix64(base + (2i + 2) * GOLDEN)        // splitmix64 output 2i+1 of the stream at `base`
//! u1   = ((h1 >> 11) + 1) * 2^-53               // in (0, 1]
//! u2   =  (h2 >> 11)      * 2^-53               // in [0, 1)
//! z    = sqrt(-2 ln u1) * cos(2 pi u2)          // Box-Muller, one standard normal per index
//! ```
//!
//! with `mix64` the splitmix64 finaliser and `GOLDEN = 0x9E3779B97F4A7C15` (all arithmetic
//! wrapping, in u64; the normal is computed in f64 and scaled by `std` before rounding to f32).
//! A rank therefore builds exactly its own shard, whatever the world size, in O(shard) time.

use std::thread;

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and the given standard deviation.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// All zeros (biases).
    Zeros,
    /// All ones (LayerNorm weights).
    Ones,
}

/// One named parameter of a unit.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// Full name, e.g. `"h.3.attn.qkv.weight"`; stable across world sizes (checkpoint key).
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<i64>,
    /// How it is initialised.
    pub init: Init,
    /// Whether weight decay applies: true for 2-D weights (incl. embeddings), false for
    /// biases and LayerNorm parameters.
    pub decay: bool,
}

/// splitmix64's increment (2^64 / golden ratio).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Fills below this many elements run on the calling thread only.
const PARALLEL_MIN: usize = 1 << 18;

/// The splitmix64 output function (a bijective 64-bit mixer).
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of a string's UTF-8 bytes.
fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Standard normal number `index` of the stream starting at `base` (see the module docs).
fn normal_at(base: u64, index: u64) -> f64 {
    let c = index.wrapping_mul(2);
    let h1 = mix64(base.wrapping_add(c.wrapping_add(1).wrapping_mul(GOLDEN)));
    let h2 = mix64(base.wrapping_add(c.wrapping_add(2).wrapping_mul(GOLDEN)));
    let scale = 1.0 / (1u64 << 53) as f64;
    let u1 = ((h1 >> 11) + 1) as f64 * scale;
    let u2 = (h2 >> 11) as f64 * scale;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Fill `out` with `std * normal_at(base, start + k)`.
fn fill_normal(base: u64, std: f64, start: u64, out: &mut [f32]) {
    for (k, o) in out.iter_mut().enumerate() {
        *o = (std * normal_at(base, start.wrapping_add(k as u64))) as f32;
    }
}

impl ParamSpec {
    /// Number of elements (product of the shape; 1 for a scalar).
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// Deterministic, counter-based init: fills `out` with elements `[start, start+out.len())`
    /// of this parameter (row-major), as a pure function of `(seed, self.name, element index)`.
    /// Independent of how the parameter is later sliced, so a rank can build only its shard.
    ///
    /// The generator is defined for every index, so a range running past `numel()` does not
    /// panic; callers clip ranges to `numel()` (padding belongs to the caller). Large ranges
    /// are filled on several threads with identical results.
    pub fn init_into(&self, seed: u64, start: u64, out: &mut [f32]) {
        match self.init {
            Init::Zeros => out.fill(0.0),
            Init::Ones => out.fill(1.0),
            Init::Normal { std } => {
                let base = mix64(mix64(seed) ^ fnv1a64(&self.name));
                let threads = thread::available_parallelism().map_or(1, |n| n.get());
                let threads = threads.min(out.len() / PARALLEL_MIN).max(1);
                if threads == 1 {
                    fill_normal(base, std, start, out);
                    return;
                }
                let chunk = out.len().div_ceil(threads);
                thread::scope(|s| {
                    for (c, piece) in out.chunks_mut(chunk).enumerate() {
                        let first = start.wrapping_add((c * chunk) as u64);
                        s.spawn(move || fill_normal(base, std, first, piece));
                    }
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: Vec<i64>, init: Init) -> ParamSpec {
        ParamSpec {
            name: name.to_string(),
            shape,
            init,
            decay: true,
        }
    }

    fn full(p: &ParamSpec, seed: u64) -> Vec<f32> {
        let mut v = vec![0f32; p.numel() as usize];
        p.init_into(seed, 0, &mut v);
        v
    }

    #[test]
    fn numel_is_product_of_shape() {
        assert_eq!(spec("a", vec![3, 5, 7], Init::Zeros).numel(), 105);
        assert_eq!(spec("s", vec![], Init::Zeros).numel(), 1);
    }

    #[test]
    fn subrange_equals_same_range_of_full_fill() {
        // Large enough that the full fill runs on several threads and sub-ranges do not.
        let p = spec(
            "h.0.mlp.fc.weight",
            vec![1024, 700],
            Init::Normal { std: 0.02 },
        );
        let whole = full(&p, 7);
        for &(start, len) in &[(0usize, 1usize), (1, 999), (12345, 4321), (716_700, 100)] {
            let mut part = vec![0f32; len];
            p.init_into(7, start as u64, &mut part);
            assert_eq!(&part[..], &whole[start..start + len], "range {start}+{len}");
        }
        // Shards of 3 uneven ranks reassemble the whole parameter bit for bit.
        let mut shards = Vec::new();
        let n = whole.len();
        for r in 0..3 {
            let (a, b) = (r * n / 3, (r + 1) * n / 3);
            let mut s = vec![0f32; b - a];
            p.init_into(7, a as u64, &mut s);
            shards.extend(s);
        }
        assert_eq!(shards, whole);
    }

    #[test]
    fn seed_and_name_select_the_stream() {
        let p = spec("wte.weight", vec![64, 32], Init::Normal { std: 1.0 });
        let q = spec("wpe.weight", vec![64, 32], Init::Normal { std: 1.0 });
        let a = full(&p, 1);
        assert_eq!(a, full(&p, 1), "same seed, same values");
        let b = full(&p, 2);
        let c = full(&q, 1);
        let same_b = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        let same_c = a.iter().zip(&c).filter(|(x, y)| x == y).count();
        assert!(
            same_b < 3,
            "different seed shares {same_b} of {} values",
            a.len()
        );
        assert!(same_c < 3, "different name shares {same_c} values");
    }

    #[test]
    fn normal_moments_within_tolerance() {
        let std = 0.02;
        let p = spec("lm_head.weight", vec![1000, 1000], Init::Normal { std });
        let v = full(&p, 1234);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        // Standard error of the mean is std/1000 = 2e-5; of the std about std/1414.
        assert!(mean.abs() < 1e-4, "mean {mean}");
        assert!((var.sqrt() / std - 1.0).abs() < 5e-3, "std {}", var.sqrt());
        // Tails: about 4.55% of samples lie beyond 2 sigma.
        let tail = v
            .iter()
            .filter(|&&x| f64::from(x).abs() > 2.0 * std)
            .count() as f64
            / n;
        assert!((tail - 0.0455).abs() < 2e-3, "2-sigma tail fraction {tail}");
    }

    #[test]
    fn zeros_and_ones_fill_constants() {
        let mut v = vec![5f32; 10];
        spec("b", vec![10], Init::Zeros).init_into(3, 2, &mut v);
        assert!(v.iter().all(|&x| x == 0.0));
        spec("w", vec![10], Init::Ones).init_into(3, 2, &mut v);
        assert!(v.iter().all(|&x| x == 1.0));
    }

    #[test]
    fn mixers_match_reference_values() {
        // splitmix64 seeded with 0 yields 0xE220A8397B1DCDAF first (Vigna's reference code).
        assert_eq!(mix64(GOLDEN), 0xE220_A839_7B1D_CDAF);
        // FNV-1a 64 of "" and "a" (published test vectors).
        assert_eq!(fnv1a64(""), 0xCBF2_9CE4_8422_2325);
        assert_eq!(fnv1a64("a"), 0xAF63_DC4C_8601_EC8C);
    }
}
