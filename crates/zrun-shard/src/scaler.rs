//! Dynamic loss scaling for fp16: scale the loss up so small gradients survive fp16, skip
//! steps whose gradients overflowed and halve the scale, double it after a clean window.

/// The loss scale and its update rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    window: u64,
    clean: u64,
    enabled: bool,
}

impl LossScaler {
    /// A scaler starting at `initial`, doubling after `window` clean steps; disabled means a
    /// constant scale of 1 (fp32 and bf16).
    pub fn new(enabled: bool, initial: f64, window: u64) -> LossScaler {
        LossScaler {
            scale: if enabled { initial } else { 1.0 },
            window: window.max(1),
            clean: 0,
            enabled,
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Clean steps since the scale last changed.
    pub fn clean_steps(&self) -> u64 {
        self.clean
    }

    /// Restores a saved scale and clean-step count (a disabled scaler stays at 1).
    pub fn restore(&mut self, scale: f64, clean_steps: u64) {
        if self.enabled && scale.is_finite() && scale >= 1.0 {
            self.scale = scale;
            self.clean = clean_steps;
        }
    }

    /// Records a step: finite gradients count toward growth; an overflow halves the scale.
    pub fn update(&mut self, finite: bool) {
        if !self.enabled {
            return;
        }
        if finite {
            self.clean += 1;
            if self.clean >= self.window {
                self.scale *= 2.0;
                self.clean = 0;
            }
        } else {
            self.scale = (self.scale / 2.0).max(1.0);
            self.clean = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_on_overflow_and_grows_after_a_clean_window() {
        let mut s = LossScaler::new(true, 1024.0, 3);
        s.update(false);
        assert_eq!(s.scale(), 512.0);
        s.update(true);
        s.update(true);
        assert_eq!(s.scale(), 512.0);
        s.update(true);
        assert_eq!(s.scale(), 1024.0);
        let mut off = LossScaler::new(false, 1024.0, 3);
        off.update(false);
        assert_eq!(off.scale(), 1.0);
    }
}
