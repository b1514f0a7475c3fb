//! The rotary embedding's node (`rope`) against autograd over the ATen ops it replaces
//! (x * cos + roll(x, hd/2) * sin) on CPU: the values and the gradient bitwise, and the node's
//! raw backward as that gradient.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{grad, rope, rope_raw};

#[test]
fn equals_mul_roll_add_bitwise_with_its_gradient() {
    let (b, t, h, hd) = (2i64, 7i64, 3i64, 16i64);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double] {
        tch::manual_seed(4);
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::randn([b, t, h, hd], opts)
            .to_kind(kind)
            .set_requires_grad(true);
        let cos = Tensor::randn([t, hd], opts).to_kind(kind);
        let sin = Tensor::randn([t, hd], opts).to_kind(kind);
        let up = Tensor::randn([b, t, h, hd], opts).to_kind(kind);
        let (c, s) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let want = &x * &c + x.roll([hd / 2], [-1]) * &s;
        let got = rope(&x, &cos, &sin).unwrap();
        assert!(got.equal(&want), "{kind:?}: values");
        let gw = grad(&[&want], &[&up], &[&x]).unwrap();
        let gg = grad(&[&got], &[&up], &[&x]).unwrap();
        assert!(gg[0].equal(&gw[0]), "{kind:?}: gradient");
        let raw = rope_raw(&up, &cos, &sin, true, true).unwrap();
        assert!(raw.equal(&gw[0]), "{kind:?}: raw backward");
    }
}

#[test]
fn refuses_shapes_that_do_not_fit() {
    let x = Tensor::zeros([1, 4, 2, 8], (Kind::Float, Device::Cpu));
    let cs = Tensor::zeros([4, 8], (Kind::Float, Device::Cpu));
    for (x, c) in [
        (x.narrow(3, 0, 7), cs.narrow(1, 0, 7)), // odd head size
        (x.shallow_clone(), cs.narrow(0, 0, 3)), // positions differ
        (x.shallow_clone(), cs.to_kind(Kind::Double)), // dtype differs
    ] {
        let e = rope(&x, &c, &c).expect_err("refused").to_string();
        assert!(e.contains("rope"), "{e}");
    }
}
