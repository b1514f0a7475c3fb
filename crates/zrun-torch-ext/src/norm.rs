//! RMSNorm as one autograd node (csrc/rms_norm.cpp): ATen's fused kernels on CUDA, the same
//! arithmetic in a few ops elsewhere; on every device the graph keeps only the input and one
//! fp32 rstd per row.

use crate::ffi;
use crate::Error;
use tch::Tensor;

/// `x * rsqrt(mean(x^2) + eps) * w` over the last dimension of `x` (..., C), with `w` (C) of
/// `x`'s dtype and device: computed in fp32 (fp64 for fp64 inputs) and rounded once to the
/// dtype of `x`. In grad mode with `x` or `w` requiring grad, the result has an autograd graph
/// giving both their gradients, which holds `x`, `w` and an fp32 rstd per row (ATen's own
/// `rms_norm` keeps two fp32 copies of `x` on CPU).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, Error> {
    let op = || {
        format!(
            "rms_norm(x {:?} {:?}, w {:?} {:?}, eps {eps})",
            x.size(),
            x.kind(),
            w.size(),
            w.kind()
        )
    };
    ffi::require_defined("rms_norm", &[("x", x), ("w", w)])?;
    // SAFETY: both tensor pointers are live `torch::Tensor*` borrowed for the call, the others
    // are `tensor_out`'s; the shim catches every C++ exception and writes a fresh tensor on
    // success.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_rms_norm(x.as_ptr().cast(), w.as_ptr().cast(), eps, out, err)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// ATen's composite RMSNorm by hand, in f64: the reference.
    fn reference(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
        let xd = x.to_kind(Kind::Double);
        let r = (xd.square().mean_dim(Some([-1i64].as_slice()), true, None) + eps).rsqrt();
        xd * r * w.to_kind(Kind::Double)
    }

    fn leaves(kind: Kind) -> (Tensor, Tensor) {
        tch::manual_seed(3);
        let opts = (Kind::Float, Device::Cpu);
        let x = (Tensor::randn([3, 5, 16], opts) * 3.0).to_kind(kind);
        let w = (Tensor::randn([16], opts) + 1.0).to_kind(kind);
        (x.set_requires_grad(true), w.set_requires_grad(true))
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        (a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[])
    }

    #[test]
    fn value_and_gradients_match_autograd_through_the_composite_in_f64() {
        for (kind, tol) in [(Kind::Float, 1e-6), (Kind::Double, 1e-12)] {
            let (x, w) = leaves(kind);
            let y = rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(y.kind(), kind);
            // A weighting of the outputs, so the gradient is not the trivial one of a sum.
            let up = Tensor::randn(y.size(), (Kind::Double, Device::Cpu));
            let (gx, gw) = {
                let g = Tensor::run_backward(
                    &[(&y.to_kind(Kind::Double) * &up).sum(None)],
                    &[&x, &w],
                    false,
                    false,
                );
                (g[0].shallow_clone(), g[1].shallow_clone())
            };
            let (xd, wd) = (
                x.to_kind(Kind::Double).detach().set_requires_grad(true),
                w.to_kind(Kind::Double).detach().set_requires_grad(true),
            );
            let r = reference(&xd, &wd, 1e-5);
            assert!(max_rel(&y, &r) < tol, "{kind:?} value");
            let g = Tensor::run_backward(&[(&r * &up).sum(None)], &[&xd, &wd], false, false);
            assert!(
                max_rel(&gx, &g[0]) < 10.0 * tol,
                "{kind:?} d/dx {}",
                max_rel(&gx, &g[0])
            );
            assert!(
                max_rel(&gw, &g[1]) < 10.0 * tol,
                "{kind:?} d/dw {}",
                max_rel(&gw, &g[1])
            );
        }
    }

    #[test]
    fn bf16_rounds_once_from_fp32() {
        let (x, w) = leaves(Kind::BFloat16);
        let y = rms_norm(&x, &w, 1e-5).unwrap();
        assert_eq!(y.kind(), Kind::BFloat16);
        // ATen's own rms_norm (its CPU composite) multiplies the weight in fp32 and rounds
        // once: the same arithmetic, bitwise.
        let aten = x.rms_norm([16], Some(&w), 1e-5);
        assert!(y.equal(&aten), "differs from ATen's rms_norm");
        // transformers rounds the normalised input first, then multiplies in bf16: elsewhere.
        let xf = x.to_kind(Kind::Float);
        let r = (xf.square().mean_dim(Some([-1i64].as_slice()), true, None) + 1e-5).rsqrt();
        let twice = &w * (xf * r).to_kind(Kind::BFloat16);
        assert!(
            !y.equal(&twice),
            "the test cannot tell one rounding from two"
        );
        let up = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
        let g = Tensor::run_backward(
            &[(&y.to_kind(Kind::Float) * up).sum(None)],
            &[&x, &w],
            false,
            false,
        );
        assert_eq!((g[0].kind(), g[1].kind()), (Kind::BFloat16, Kind::BFloat16));
    }

    #[test]
    fn mismatched_inputs_are_refused() {
        let x = Tensor::zeros([2, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let e = rms_norm(&x, &w, 1e-5).unwrap_err().to_string();
        assert!(e.contains("x (..., C) and w (C)"), "{e}");
        let e = rms_norm(&x, &w.to_kind(Kind::Double), 1e-5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one dtype"), "{e}");
    }
}
