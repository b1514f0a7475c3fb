//! Linear warmup followed by cosine decay to a floor.

/// Learning rate as a function of the optimizer step (0-based).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate, reached at the end of warmup.
    pub peak: f64,
    /// Final learning rate at `total_steps` and after.
    pub min: f64,
    /// Steps of linear warmup from `peak / warmup_steps` up to `peak`.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min`.
    pub total_steps: u64,
}

impl LrSchedule {
    /// The learning rate for step `step` (0-based): `peak * (step + 1) / warmup` during
    /// warmup, then `min + (peak - min) * (1 + cos(pi * t)) / 2` with `t` going from 0 to 1
    /// over the remaining steps.
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        if step >= self.total_steps {
            return self.min;
        }
        let span = (self.total_steps - self.warmup_steps).max(1) as f64;
        let t = (step - self.warmup_steps) as f64 / span;
        self.min + (self.peak - self.min) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_peak_and_cosine_values() {
        let s = LrSchedule {
            peak: 1e-3,
            min: 1e-4,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.at(0) - 1e-4).abs() < 1e-15); // 1/10 of peak
        assert!((s.at(4) - 5e-4).abs() < 1e-15);
        assert!((s.at(9) - 1e-3).abs() < 1e-15); // warmup ends at the peak
        assert!((s.at(10) - 1e-3).abs() < 1e-15); // cosine starts at the peak
                                                  // Halfway through the decay the cosine term is zero: the midpoint of peak and min.
        assert!((s.at(60) - 5.5e-4).abs() < 1e-12);
        // A quarter of the way: min + (peak-min) * (1 + cos(pi/4)) / 2.
        let q = 1e-4 + 9e-4 * (1.0 + (0.25f64 * std::f64::consts::PI).cos()) / 2.0;
        assert!((s.at(35) - q).abs() < 1e-12);
        assert_eq!(s.at(110), 1e-4);
        assert_eq!(s.at(1000), 1e-4);
    }

    #[test]
    fn decay_is_monotone_and_no_warmup_starts_at_peak() {
        let s = LrSchedule {
            peak: 3e-3,
            min: 3e-4,
            warmup_steps: 0,
            total_steps: 50,
        };
        assert_eq!(s.at(0), 3e-3);
        for k in 1..60 {
            assert!(s.at(k) <= s.at(k - 1));
        }
    }
}
