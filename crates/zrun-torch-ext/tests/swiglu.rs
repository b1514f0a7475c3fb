//! SwiGLU's node (`swiglu`) against autograd's silu-then-mul on CPU, where both run ATen's
//! ops: the values and both gradients bitwise, and what the graph keeps.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{grad, swiglu, swiglu_raw};

fn leaves(kind: Kind, shape: &[i64]) -> (Tensor, Tensor) {
    tch::manual_seed(5);
    let opts = (Kind::Float, Device::Cpu);
    let a = (Tensor::randn(shape, opts) * 3.0).to_kind(kind);
    let b = Tensor::randn(shape, opts).to_kind(kind);
    (a.set_requires_grad(true), b.set_requires_grad(true))
}

#[test]
fn equals_silu_then_mul_bitwise_with_its_gradients() {
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double] {
        let (a, b) = leaves(kind, &[3, 5, 64]);
        let up = Tensor::randn([3, 5, 64], (Kind::Float, Device::Cpu)).to_kind(kind);
        let want = a.silu() * &b;
        let got = swiglu(&a, &b).unwrap();
        assert!(got.equal(&want), "{kind:?}: values");
        let gw = grad(&[&want], &[&up], &[&a, &b]).unwrap();
        let gg = grad(&[&got], &[&up], &[&a, &b]).unwrap();
        assert!(gg[0].equal(&gw[0]), "{kind:?}: d(gate)");
        assert!(gg[1].equal(&gw[1]), "{kind:?}: d(up)");
        // Without autograd, the raw forward and backward are the same ops.
        let raw = swiglu_raw(&a.detach(), &b.detach(), None, false).unwrap();
        assert!(raw[0].equal(&want), "{kind:?}: raw values");
        let raw = swiglu_raw(&a.detach(), &b.detach(), Some(&up), true).unwrap();
        assert!(
            raw[0].equal(&gw[0]) && raw[1].equal(&gw[1]),
            "{kind:?}: raw gradients"
        );
    }
}
