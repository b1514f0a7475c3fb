//! Linear's, Linear-with-GELU's and LayerNorm's nodes (`linear`, `linear_gelu`,
//! `layer_norm`) against autograd's own on CPU, where both run ATen's ops: values and every
//! gradient bitwise; and the sums over rows (`colsum_raw`, `gelu_colsum_raw`) against f64.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_torch_ext::{colsum_raw, gelu_colsum_raw, grad, layer_norm, linear, linear_gelu};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

fn leaf(shape: &[i64], kind: Kind, scale: f64) -> Tensor {
    (Tensor::randn(shape, CPU) * scale)
        .to_kind(kind)
        .set_requires_grad(true)
}

/// `node(x, w, b)` against `reference` (autograd's ops) for x (..., 24), w (40, 24), b (40):
/// values and the three gradients bitwise, in fp32, bf16 and f64, on 3-d input (the flattened
/// addmm path) and 2-d input (addmm itself).
fn equals_autograd(
    seed: i64,
    node: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
    reference: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) {
    tch::manual_seed(seed);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Double] {
        for shape in [&[3i64, 5, 24][..], &[7, 24]] {
            let x = leaf(shape, kind, 1.0);
            let (w, b) = (leaf(&[40, 24], kind, 0.3), leaf(&[40], kind, 1.0));
            let want = reference(&x, &w, &b);
            let got = node(&x, &w, &b);
            assert!(got.equal(&want), "{kind:?} {shape:?}: values");
            let up = Tensor::randn(want.size(), CPU).to_kind(kind);
            let gw = grad(&[&want], &[&up], &[&x, &w, &b]).unwrap();
            let gg = grad(&[&got], &[&up], &[&x, &w, &b]).unwrap();
            for (i, what) in ["x", "w", "b"].iter().enumerate() {
                assert!(gg[i].equal(&gw[i]), "{kind:?} {shape:?}: d({what})");
            }
        }
    }
}

#[test]
fn linear_equals_autograds_linear_bitwise_with_its_gradients() {
    equals_autograd(
        11,
        |x, w, b| linear(x, w, b).unwrap(),
        |x, w, b| x.linear(w, Some(b)),
    );
}

#[test]
fn linear_gelu_equals_autograds_linear_and_gelu_bitwise_with_its_gradients() {
    equals_autograd(
        14,
        |x, w, b| linear_gelu(x, w, b).unwrap(),
        |x, w, b| x.linear(w, Some(b)).gelu("tanh"),
    );
}

#[test]
fn layer_norm_equals_autograds_layer_norm_bitwise_with_its_gradients() {
    tch::manual_seed(12);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Double] {
        let x = leaf(&[3, 5, 32], kind, 3.0);
        let (w, b) = (leaf(&[32], kind, 1.0), leaf(&[32], kind, 1.0));
        let want = x.layer_norm([32].as_slice(), Some(&w), Some(&b), 1e-5, false);
        let got = layer_norm(&x, &w, &b, 1e-5).unwrap();
        assert!(got.equal(&want), "{kind:?}: values");
        let up = Tensor::randn(want.size(), CPU).to_kind(kind);
        let gw = grad(&[&want], &[&up], &[&x, &w, &b]).unwrap();
        let gg = grad(&[&got], &[&up], &[&x, &w, &b]).unwrap();
        for (i, what) in ["x", "w", "b"].iter().enumerate() {
            assert!(gg[i].equal(&gw[i]), "{kind:?}: d({what})");
        }
    }
}

#[test]
fn the_sums_over_rows_match_f64() {
    tch::manual_seed(13);
    let (rows, cols) = (37i64, 24i64);
    let dy = Tensor::randn([rows, cols], CPU);
    let x = Tensor::randn([rows, cols], CPU) * 2.0;
    let mean = Tensor::randn([rows, 1], CPU) * 0.1;
    let rstd = Tensor::rand([rows, 1], CPU) + 0.5;
    let d = dy.to_kind(Kind::Double);
    let want_b = d.sum_dim_intlist(0, false, Kind::Double);
    let xhat = (x.to_kind(Kind::Double) - mean.to_kind(Kind::Double)) * rstd.to_kind(Kind::Double);
    let want_g = (&d * xhat).sum_dim_intlist(0, false, Kind::Double);
    let bias = colsum_raw(&dy, None, false).unwrap();
    assert!(bias[0].equal(&dy.sum_dim_intlist(0, false, Kind::Float)));
    let ln = colsum_raw(&dy, Some((&x, &mean, &rstd)), false).unwrap();
    let off = |a: &Tensor, b: &Tensor| (a.to_kind(Kind::Double) - b).abs().max().double_value(&[]);
    assert!(off(&ln[0], &want_g) < 1e-4, "{}", off(&ln[0], &want_g));
    assert!(off(&ln[1], &want_b) < 1e-4, "{}", off(&ln[1], &want_b));
    // A mean of the wrong length is refused, not read past.
    let short = Tensor::zeros([rows - 1], CPU);
    let e = colsum_raw(&dy, Some((&x, &short, &rstd)), false).unwrap_err();
    assert!(e.to_string().contains("one value per row"), "{e}");
}

#[test]
fn gelus_gradient_and_its_sums_over_rows_match_f64() {
    tch::manual_seed(15);
    let (rows, cols) = (37i64, 24i64);
    let dy = Tensor::randn([rows, cols], CPU);
    let h = Tensor::randn([rows, cols], CPU) * 3.0;
    // The tanh GELU's derivative in f64.
    let x = h.to_kind(Kind::Double);
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let t = ((&x + x.pow_tensor_scalar(3) * 0.044715) * k).tanh();
    let inner = (x.pow_tensor_scalar(2) * (3.0 * 0.044715) + 1.0) * k;
    let slope = (&t + 1.0) * 0.5 + &x * 0.5 * (1.0 - &t * &t) * inner;
    let want = dy.to_kind(Kind::Double) * slope;
    let got = gelu_colsum_raw(&dy, &h, false).unwrap();
    let off = |a: &Tensor, b: &Tensor| (a.to_kind(Kind::Double) - b).abs().max().double_value(&[]);
    assert!(off(&got[0], &want) < 1e-5, "{}", off(&got[0], &want));
    let sums = want.sum_dim_intlist(0, false, Kind::Double);
    assert!(off(&got[1], &sums) < 1e-4, "{}", off(&got[1], &sums));
    assert!(got[1].equal(&got[0].sum_dim_intlist(0, false, Kind::Float)));
    // h of another shape is refused, not read past.
    let e = gelu_colsum_raw(&dy, &h.narrow(0, 1, rows - 1), false).unwrap_err();
    assert!(e.to_string().contains("(rows, cols)"), "{e}");
}
