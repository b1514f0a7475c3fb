//! Global-norm gradient clipping.

/// The factor to multiply every gradient by so that the global norm is at most `max_norm`,
/// given the global norm (`sqrt` of the sum of squares over all ranks' shards). Returns 1
/// when no clipping is needed or `max_norm <= 0` (clipping off). As torch's
/// `clip_grad_norm_`, the factor is `max_norm / (norm + 1e-6)`.
pub fn clip_coefficient(global_norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 || !global_norm.is_finite() {
        return 1.0;
    }
    let coef = max_norm / (global_norm + 1e-6);
    coef.min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clips_only_above_the_threshold() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert!((clip_coefficient(4.0, 1.0) - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
        assert_eq!(clip_coefficient(4.0, 0.0), 1.0);
    }
}
