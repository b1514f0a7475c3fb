//! The fused head-and-loss (`fused_linear_cross_entropy`, `ce_rows`) against PyTorch's
//! cross-entropy on the full logits, on CPU (ATen's path of the same arithmetic), and the
//! CUDA kernel's source compiled by NVRTC (which needs no GPU).

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Reduction, Tensor};
use zrun_torch_ext::{ce_rows, fused_linear_cross_entropy, grad, kernels};

const IGNORE: i64 = -100;

/// Leaves h (n, c), w (v, c) of `kind` and targets (n) with rows 1 and n-1 ignored.
fn inputs(n: i64, c: i64, v: i64, kind: Kind) -> (Tensor, Tensor, Tensor) {
    tch::manual_seed(11);
    let opts = (Kind::Float, Device::Cpu);
    let h = (Tensor::randn([n, c], opts) * 2.0).to_kind(kind);
    let w = (Tensor::randn([v, c], opts) * 0.5).to_kind(kind);
    let t = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
    let t = t.index_fill(0, &Tensor::from_slice(&[1i64, n - 1]), IGNORE);
    (h.set_requires_grad(true), w.set_requires_grad(true), t)
}

/// PyTorch's path: the logits in the inputs' dtype, cross_entropy on their fp32 copy.
fn full(h: &Tensor, w: &Tensor, t: &Tensor) -> Tensor {
    h.mm(&w.tr())
        .to_kind(Kind::Float)
        .cross_entropy_loss::<Tensor>(t, None, Reduction::Mean, IGNORE, 0.0)
}

/// Loss and the gradients of h and w (fp64) for an upstream gradient `up`.
fn run(loss: &Tensor, h: &Tensor, w: &Tensor, up: f64) -> (f64, Tensor, Tensor) {
    let g = grad(&[loss], &[&(loss.ones_like() * up)], &[h, w]).unwrap();
    (
        loss.double_value(&[]),
        g[0].to_kind(Kind::Double),
        g[1].to_kind(Kind::Double),
    )
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

#[test]
fn fp32_equals_pytorchs_cross_entropy_with_any_upstream_gradient() {
    let (n, c, v) = (37, 16, 101);
    let (h, w, t) = inputs(n, c, v, Kind::Float);
    for up in [1.0, 0.37] {
        let (want, gh, gw) = run(&full(&h, &w, &t), &h, &w, up);
        let got = fused_linear_cross_entropy(&h, &w, &t, IGNORE).unwrap();
        assert_eq!(got.kind(), Kind::Float);
        let (l, ch, cw) = run(&got, &h, &w, up);
        assert!((l - want).abs() <= 1e-6 * want.abs(), "{l} vs {want}");
        let (eh, ew) = (max_abs(&(&ch - &gh)), max_abs(&(&cw - &gw)));
        assert!(eh <= 1e-5 * max_abs(&gh), "up {up}: d(h) off by {eh}");
        assert!(ew <= 1e-5 * max_abs(&gw), "up {up}: d(w) off by {ew}");
        // Ignored rows get no gradient.
        assert_eq!(max_abs(&ch.get(1)), 0.0);
        assert_eq!(max_abs(&ch.get(n - 1)), 0.0);
    }
}

#[test]
fn bf16_stays_within_one_rounding_of_pytorchs_path() {
    let (n, c, v) = (64, 32, 300);
    let (h, w, t) = inputs(n, c, v, Kind::BFloat16);
    let (want, gh, gw) = run(&full(&h, &w, &t), &h, &w, 1.0);
    let got = fused_linear_cross_entropy(&h, &w, &t, IGNORE).unwrap();
    let (l, ch, cw) = run(&got, &h, &w, 1.0);
    // The same bf16 logits: equal but for the order of the fp32 sums.
    assert!((l - want).abs() <= 1e-5 * want.abs(), "{l} vs {want}");
    // The logits' gradient is rounded to bf16 once on both paths, from fp32 values that
    // differ in their last bits: the matmuls' results within a bf16 rounding or two.
    let (eh, ew) = (max_abs(&(&ch - &gh)), max_abs(&(&cw - &gw)));
    assert!(eh <= 2.0 / 256.0 * max_abs(&gh), "d(h) off by {eh}");
    assert!(ew <= 2.0 / 256.0 * max_abs(&gw), "d(w) off by {ew}");
}

#[test]
fn without_grad_mode_gives_the_value_and_no_graph() {
    let (h, w, t) = inputs(9, 4, 13, Kind::Float);
    let want = full(&h, &w, &t).double_value(&[]);
    let got = tch::no_grad(|| fused_linear_cross_entropy(&h, &w, &t, IGNORE)).unwrap();
    assert!(!got.requires_grad());
    assert!((got.double_value(&[]) - want).abs() <= 1e-6 * want.abs());
}

#[test]
fn every_target_ignored_gives_nan_as_pytorch_does() {
    let (h, w, _) = inputs(5, 4, 7, Kind::Float);
    let t = Tensor::full([5], IGNORE, (Kind::Int64, Device::Cpu));
    let got = fused_linear_cross_entropy(&h, &w, &t, IGNORE).unwrap();
    assert!(got.double_value(&[]).is_nan());
    assert!(full(&h, &w, &t).double_value(&[]).is_nan());
}

#[test]
fn refuses_fp16_and_inputs_that_do_not_fit_together() {
    let (h, w, t) = inputs(5, 4, 7, Kind::Float);
    let bad = [
        fused_linear_cross_entropy(&h.to_kind(Kind::Half), &w.to_kind(Kind::Half), &t, IGNORE),
        fused_linear_cross_entropy(&h, &w.to_kind(Kind::Double), &t, IGNORE),
        fused_linear_cross_entropy(&h, &w.narrow(1, 0, 3), &t, IGNORE),
        fused_linear_cross_entropy(&h, &w, &t.narrow(0, 0, 4), IGNORE),
        fused_linear_cross_entropy(&h, &w, &Tensor::new(), IGNORE),
    ];
    for (i, r) in bad.into_iter().enumerate() {
        let msg = r.expect_err("refused").to_string();
        assert!(msg.contains("fused_linear_cross_entropy"), "{i}: {msg}");
    }
}

/// The rows' arithmetic alone, against log_softmax in fp64: losses, the gradient written over
/// the logits, zeros for a row whose weight is 0.
#[test]
fn ce_rows_gives_each_rows_loss_and_writes_its_gradient() {
    tch::manual_seed(3);
    let (n, v) = (4i64, 50);
    let logits = Tensor::randn([n, v], (Kind::Float, Device::Cpu)) * 4.0;
    let targets = Tensor::from_slice(&[0i64, v - 1, 7, 3]);
    let coef = Tensor::from_slice(&[0.5f32, 0.25, 0.0, 2.0]);
    let x = logits.copy();
    let loss = ce_rows(&x, &targets, &coef, true, false).unwrap();
    let logp = logits.to_kind(Kind::Double).log_softmax(1, Kind::Double);
    let want = -logp.gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
    let onehot = Tensor::zeros([n, v], (Kind::Double, Device::Cpu)).scatter_value(
        1,
        &targets.unsqueeze(1),
        1.0,
    );
    let want_grad = (logp.exp() - onehot) * coef.to_kind(Kind::Double).unsqueeze(1);
    for r in 0..n {
        let c = coef.double_value(&[r]);
        let got = loss.double_value(&[r]);
        let expect = if c == 0.0 {
            0.0
        } else {
            want.double_value(&[r])
        };
        assert!(
            (got - expect).abs() <= 1e-5 * expect.abs().max(1.0),
            "row {r}: {got} vs {expect}"
        );
    }
    let err = max_abs(&(x.to_kind(Kind::Double) - &want_grad));
    assert!(err <= 1e-6, "gradient off by {err}");
    assert_eq!(
        max_abs(&x.get(2)),
        0.0,
        "a row of weight 0 gets a zero gradient"
    );
    // Without grad the logits stay as they were.
    let y = logits.copy();
    let _ = ce_rows(&y, &targets, &coef, false, false).unwrap();
    assert!(y.equal(&logits));
}

/// The kernels' source builds for Hopper and Ampere with the NVRTC torch's wheel ships, and
/// the PTX holds every entry point: what `kernels::install` loads on a GPU.
#[test]
fn the_cuda_kernels_compile_with_nvrtc() {
    for (major, minor) in [(9, 0), (8, 0)] {
        let ptx =
            kernels::compile(major, minor).unwrap_or_else(|e| panic!("sm_{major}{minor}: {e}"));
        assert!(
            ptx.contains(&format!(".target sm_{major}{minor}")),
            "{}",
            &ptx[..400.min(ptx.len())]
        );
        for entry in kernels::ENTRIES {
            assert!(
                ptx.contains(&format!(".entry {entry}")),
                "no {entry} in the PTX"
            );
        }
    }
}

/// The kernels' logic without a GPU: tests/kernels_emulated.cpp compiles the .cu files as
/// C++ with each CUDA thread an OS thread (barriers for __syncthreads and the warp shuffles)
/// and checks them against a double precision reference, fp32 and bf16: ce_rows' losses and
/// written gradients (rows shorter and longer than the block, a -inf logit, a NaN row, a zero
/// weight), swiglu's forward and gradients over several blocks and a grid-stride, rope,
/// colsum's sums, the optimizer's AdamW (each value against the update in double, the bf16
/// parameters the master rounded, bitwise the same however the shard is cut and aligned) and
/// the gradient layout (exact, copied over and added).
#[test]
fn the_cuda_kernels_compute_their_results_when_emulated_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("kernels_emulated");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kernels_emulated.cpp");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-o"])
        .arg(&exe)
        .arg(src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx}: {e}"));
    assert!(
        built.status.success(),
        "{cxx} failed: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = std::process::Command::new(&exe).output().unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    assert!(ran.status.success() && out.trim() == "ok", "{out}");
}
