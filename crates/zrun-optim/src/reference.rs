//! Test helpers shared by the optimizers' tests: a seeded generator and torch.optim.AdamW
//! written out element by element in f64, the baseline both AdamW implementations meet.

use crate::AdamWConfig;

/// A uniform draw in [-1, 1) from a 64-bit LCG (reproducible, unlike libtorch's global RNG
/// shared by tests running in parallel).
pub(crate) fn lcg(state: &mut u64) -> f64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
}

/// torch.optim.AdamW (single-tensor path) in f64.
pub(crate) struct Reference {
    pub p: Vec<f64>,
    pub m: Vec<f64>,
    pub v: Vec<f64>,
    t: i32,
}

impl Reference {
    /// Zero moments, step 0, parameters `p`.
    pub fn new(p: Vec<f64>) -> Reference {
        let n = p.len();
        Reference {
            p,
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        }
    }

    /// One step with gradient `g`; `decay(i)` says whether element i gets weight decay.
    pub fn step(&mut self, g: &[f64], lr: f64, c: &AdamWConfig, decay: &dyn Fn(usize) -> bool) {
        self.t += 1;
        let bc1 = 1.0 - c.beta1.powi(self.t);
        let bc2 = 1.0 - c.beta2.powi(self.t);
        for (i, &g) in g.iter().enumerate() {
            let (p, m, v) = (&mut self.p[i], &mut self.m[i], &mut self.v[i]);
            if decay(i) {
                *p *= 1.0 - lr * c.weight_decay;
            }
            *m += (1.0 - c.beta1) * (g - *m);
            *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
            let denom = (*v).sqrt() / bc2.sqrt() + c.eps;
            *p -= lr / bc1 * *m / denom;
        }
    }
}

/// Worst relative error where |want| >= 0.1, worst absolute error elsewhere (where fp32
/// rounding, not the update, sets the error).
pub(crate) fn errors(got: &[f32], want: &[f64]) -> (f64, f64) {
    let (mut rel, mut abs) = (0f64, 0f64);
    for (&a, &b) in got.iter().zip(want) {
        let err = (a as f64 - b).abs();
        if b.abs() >= 0.1 {
            rel = rel.max(err / b.abs());
        } else {
            abs = abs.max(err);
        }
    }
    (rel, abs)
}
