//! The head's matmul and the cross-entropy in chunks (csrc/linear_loss.cpp): the mean loss of
//! the logits `h @ w^T` without ever holding all of them, with its own backward.

use crate::ffi;
use crate::Error;
use std::ffi::c_int;
use tch::Tensor;

/// `name(h .., w .., targets ..` with each input's shape and dtype, for an error.
fn call(name: &str, h: &Tensor, w: &Tensor, targets: &Tensor) -> String {
    format!(
        "{name}(h {:?} {:?}, w {:?} {:?}, targets {:?} {:?}",
        h.size(),
        h.kind(),
        w.size(),
        w.kind(),
        targets.size(),
        targets.kind()
    )
}

/// Mean cross-entropy of the logits `h @ w^T` (N, V) against `targets`, computed about `chunk`
/// logits at a time: the forward keeps each row's logsumexp (N floats), the backward
/// recomputes the logits chunk by chunk over the vocabulary. Rows whose target is
/// `ignore_index` are left out of the mean (all left out: NaN, as PyTorch's mean).
///
/// `h` (N, C) and `w` (V, C) are floating point of one dtype and device; `targets` (N) int64.
/// The loss is fp32 (fp64 for fp64 inputs) and, in grad mode with `h` or `w` requiring grad,
/// has an autograd graph giving both their gradients. The arithmetic is the unchunked path's:
/// logits in the inputs' dtype, softmax in fp32, the logits' gradient rounded to the inputs'
/// dtype before its matmuls; the input's gradient sums its chunks in fp32.
pub fn linear_cross_entropy(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
    chunk: i64,
) -> Result<Tensor, Error> {
    let op = || {
        format!(
            "{}, chunk {chunk}",
            call("linear_cross_entropy", h, w, targets)
        )
    };
    ffi::require_defined(
        "linear_cross_entropy",
        &[("h", h), ("w", w), ("targets", targets)],
    )?;
    // SAFETY: the three tensor pointers are live `torch::Tensor*` borrowed for the call, the
    // others are `tensor_out`'s; the shim catches every C++ exception and writes a fresh
    // tensor on success.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_linear_cross_entropy(
                h.as_ptr().cast(),
                w.as_ptr().cast(),
                targets.as_ptr().cast(),
                ignore_index,
                chunk,
                out,
                err,
            )
        })
    }
}

/// Mean cross-entropy of the logits `h @ w^T` against `targets`, on the full logits with
/// the gradient made in the forward (csrc/fused_loss.cpp): the logits, in the inputs' dtype,
/// are the only (N, V) tensor; in grad mode with `h` or `w` requiring grad the forward
/// overwrites them with their gradient (up to the upstream factor) and keeps that for the
/// backward, which is the head's two matmuls. On CUDA the per-row work is one kernel once
/// [`crate::kernels::install`] has run; elsewhere ATen's ops in fp32 a block of rows at a time.
///
/// `h` (N, C) and `w` (V, C) are bf16 or fp32 of one device; `targets` (N) int64, rows with
/// `ignore_index` left out of the mean. The loss is fp32. The arithmetic is
/// [`linear_cross_entropy`]'s but for where the upstream gradient enters: after the two
/// matmuls, not before the logits' gradient is rounded (why fp16, whose loss scale must
/// come first, is refused).
pub fn fused_linear_cross_entropy(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Tensor, Error> {
    let op = || format!("{})", call("fused_linear_cross_entropy", h, w, targets));
    ffi::require_defined(
        "fused_linear_cross_entropy",
        &[("h", h), ("w", w), ("targets", targets)],
    )?;
    // SAFETY: as in `linear_cross_entropy`.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_fused_linear_cross_entropy(
                h.as_ptr().cast(),
                w.as_ptr().cast(),
                targets.as_ptr().cast(),
                ignore_index,
                out,
                err,
            )
        })
    }
}

/// Each row's softmax cross-entropy of `logits` (N, V; contiguous bf16 or fp32) against
/// `targets` (N, int64, in [0, V)) weighted by `coef` (N, fp32): the rows' losses (fp32, N;
/// 0 where coef is 0). With `grad` the logits are overwritten by coef x (softmax - one-hot).
/// `force_aten` runs ATen's ops even where the CUDA kernel is installed (its reference).
pub fn ce_rows(
    logits: &Tensor,
    targets: &Tensor,
    coef: &Tensor,
    grad: bool,
    force_aten: bool,
) -> Result<Tensor, Error> {
    let op = || format!("ce_rows(logits {:?} {:?})", logits.size(), logits.kind());
    ffi::require_defined(
        "ce_rows",
        &[("logits", logits), ("targets", targets), ("coef", coef)],
    )?;
    // SAFETY: as in `linear_cross_entropy`; the logits are written in place, which the
    // caller owns.
    unsafe {
        ffi::tensor_out(op, |out, err| {
            ffi::zrun_ext_ce_rows(
                logits.as_ptr().cast(),
                targets.as_ptr().cast(),
                coef.as_ptr().cast(),
                c_int::from(grad),
                c_int::from(force_aten),
                out,
                err,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Reduction};

    const IGNORE: i64 = -100;

    /// Inputs as leaves of `kind`: h (n, c), w (v, c), targets (n) with some ignored.
    fn inputs(n: i64, c: i64, v: i64, kind: Kind) -> (Tensor, Tensor, Tensor) {
        tch::manual_seed(7);
        let opts = (Kind::Float, Device::Cpu);
        let h = (Tensor::randn([n, c], opts) * 2.0).to_kind(kind);
        let w = (Tensor::randn([v, c], opts) * 0.5).to_kind(kind);
        let t = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        let t = t.index_fill(0, &Tensor::from_slice(&[1i64, n - 1]), IGNORE);
        (h.set_requires_grad(true), w.set_requires_grad(true), t)
    }

    /// The unchunked path: all logits, then PyTorch's cross-entropy in fp32.
    fn full(h: &Tensor, w: &Tensor, t: &Tensor) -> Tensor {
        let logits = h.mm(&w.tr());
        let acc = if h.kind() == Kind::Double {
            Kind::Double
        } else {
            Kind::Float
        };
        logits
            .to_kind(acc)
            .cross_entropy_loss::<Tensor>(t, None, Reduction::Mean, IGNORE, 0.0)
    }

    fn loss_and_grads(loss: &Tensor, h: &Tensor, w: &Tensor) -> (f64, Tensor, Tensor) {
        let g = crate::grad(&[loss], &[&loss.ones_like()], &[h, w]).unwrap();
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
    fn equals_the_full_logits_loss_and_gradients_for_any_chunk() {
        // n, v and the chunks chosen so pieces do not divide evenly, down to one logit.
        let (n, c, v) = (37, 16, 101);
        let (h, w, t) = inputs(n, c, v, Kind::Float);
        let (want, gh, gw) = loss_and_grads(&full(&h, &w, &t), &h, &w);
        for chunk in [1, 7, 100, 1000, n * v, 1 << 30] {
            let got = linear_cross_entropy(&h, &w, &t, IGNORE, chunk).unwrap();
            assert_eq!(got.kind(), Kind::Float);
            let (l, ch, cw) = loss_and_grads(&got, &h, &w);
            assert!(
                (l - want).abs() <= 1e-6 * want.abs(),
                "chunk {chunk}: {l} vs {want}"
            );
            let (eh, ew) = (max_abs(&(&ch - &gh)), max_abs(&(&cw - &gw)));
            assert!(
                eh <= 1e-5 * max_abs(&gh),
                "chunk {chunk}: d(h) off by {eh} of {}",
                max_abs(&gh)
            );
            assert!(
                ew <= 1e-5 * max_abs(&gw),
                "chunk {chunk}: d(w) off by {ew} of {}",
                max_abs(&gw)
            );
            // Ignored rows get no gradient.
            assert_eq!(max_abs(&ch.get(1)), 0.0);
        }
    }

    #[test]
    fn bf16_stays_within_bf16_rounding_of_the_full_logits_path() {
        let (n, c, v) = (64, 32, 300);
        let (h, w, t) = inputs(n, c, v, Kind::BFloat16);
        let (want, gh, gw) = loss_and_grads(&full(&h, &w, &t), &h, &w);
        let got = linear_cross_entropy(&h, &w, &t, IGNORE, 640).unwrap();
        assert_eq!(got.kind(), Kind::Float, "the loss is fp32 of bf16 logits");
        let (l, ch, cw) = loss_and_grads(&got, &h, &w);
        assert_eq!(ch.size(), [n, c]);
        // The loss reads the same bf16 logits: equal but for the order of the fp32 sums.
        assert!((l - want).abs() <= 1e-5 * want.abs(), "{l} vs {want}");
        // The weight's gradient is the same single matmul per slice; the input's sums
        // bf16-rounded parts in fp32: within a few bf16 roundings (2^-8) of the largest.
        let (eh, ew) = (max_abs(&(&ch - &gh)), max_abs(&(&cw - &gw)));
        assert!(eh <= 4.0 / 256.0 * max_abs(&gh), "d(h) off by {eh}");
        assert!(ew <= 1.0 / 256.0 * max_abs(&gw), "d(w) off by {ew}");
    }

    #[test]
    fn without_grad_mode_gives_the_value_and_no_graph() {
        let (h, w, t) = inputs(9, 4, 13, Kind::Double);
        let want = full(&h, &w, &t).double_value(&[]);
        let got = tch::no_grad(|| linear_cross_entropy(&h, &w, &t, IGNORE, 20)).unwrap();
        assert!(!got.requires_grad());
        assert_eq!(got.kind(), Kind::Double);
        assert!((got.double_value(&[]) - want).abs() < 1e-12);
    }

    #[test]
    fn every_target_ignored_gives_nan_as_pytorch_does() {
        let (h, w, _) = inputs(5, 4, 7, Kind::Float);
        let t = Tensor::full([5], IGNORE, (Kind::Int64, Device::Cpu));
        let got = linear_cross_entropy(&h, &w, &t, IGNORE, 8).unwrap();
        assert!(got.double_value(&[]).is_nan());
        assert!(full(&h, &w, &t).double_value(&[]).is_nan());
    }

    #[test]
    fn refuses_inputs_that_do_not_fit_together() {
        let (h, w, t) = inputs(5, 4, 7, Kind::Float);
        let bad = [
            linear_cross_entropy(&h, &w.to_kind(Kind::Double), &t, IGNORE, 8),
            linear_cross_entropy(&h, &w.narrow(1, 0, 3), &t, IGNORE, 8),
            linear_cross_entropy(&h, &w, &t.narrow(0, 0, 4), IGNORE, 8),
            linear_cross_entropy(&h, &w, &t.to_kind(Kind::Int), IGNORE, 8),
            linear_cross_entropy(&h, &w, &t, IGNORE, 0),
            linear_cross_entropy(&h, &w, &Tensor::new(), IGNORE, 8),
        ];
        for (i, r) in bad.into_iter().enumerate() {
            let msg = r.expect_err("refused").to_string();
            assert!(msg.contains("linear_cross_entropy"), "{i}: {msg}");
        }
    }
}
