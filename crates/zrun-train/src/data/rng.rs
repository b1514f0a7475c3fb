//! A small counter-seedable random number generator (SplitMix64).
//!
//! Data must be reproducible from `(seed, salt, index)` alone, on every rank and across
//! resumes, so every stream is derived by hashing those words rather than by advancing a
//! shared generator.

/// SplitMix64's output mix: a bijective avalanche of one 64-bit word.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 stream: fast, statistically solid for simulation, trivially seedable.
#[derive(Clone, Debug)]
pub(crate) struct Rng {
    state: u64,
}

impl Rng {
    /// A stream determined by the given words (order matters).
    pub(crate) fn from_words(words: &[u64]) -> Rng {
        let mut h = 0x9e37_79b9_7f4a_7c15_u64;
        for &w in words {
            h = mix64(h ^ mix64(w.wrapping_add(0x632b_e59b_d9b4_e019)));
        }
        Rng { state: h }
    }

    /// Next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// Uniform in the open interval (0, 1), 53 bits of precision.
    pub(crate) fn next_open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, n)` for `n >= 1`, exactly unbiased (Lemire's multiply-shift
    /// with rejection).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        // Rejection on the low word of the 128-bit product removes the bias exactly.
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

/// Fisher-Yates shuffle in place.
pub(crate) fn shuffle(xs: &mut [u32], rng: &mut Rng) {
    for i in (1..xs.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        xs.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_is_in_range_and_roughly_uniform() {
        let mut rng = Rng::from_words(&[1, 2]);
        let mut counts = [0u32; 7];
        for _ in 0..70_000 {
            counts[rng.below(7) as usize] += 1;
        }
        // Each bucket expects 10_000; 5 sigma is about 450.
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn streams_depend_on_every_word() {
        let a = Rng::from_words(&[7, 0, 3]).next_u64();
        let b = Rng::from_words(&[7, 0, 4]).next_u64();
        let c = Rng::from_words(&[7, 1, 3]).next_u64();
        let a2 = Rng::from_words(&[7, 0, 3]).next_u64();
        assert_eq!(a, a2);
        assert_ne!(a, b);
        assert_ne!(a, c);
        let x = Rng::from_words(&[9]).next_open01();
        assert!(x > 0.0 && x < 1.0);
    }
}
