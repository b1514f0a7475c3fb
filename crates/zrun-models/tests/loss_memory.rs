//! What the chunked loss holds, measured with the caching CPU allocator zrun's ranks run on,
//! against `LossBytes::chunked` (what the estimator counts) and against the full logits.
//! Alone in its own test binary: installing a CPU allocator is process-wide.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_models::{linear_lm_loss, lm_loss, LossBytes};
use zrun_torch_ext::{cpu_memory_stats, grad, install_cpu_caching_allocator, reset_cpu_peak};

fn allocated() -> (i64, i64) {
    let s = cpu_memory_stats().expect("installed");
    (s.allocated as i64, s.peak_allocated as i64)
}

/// Bytes held after the forward, the forward's peak and the backward's peak, above what was
/// held before, of `loss` over leaves h (B, T, C) and w (V, C); the backward's peak leaves
/// out the weight's gradient (a parameter gradient, which the estimator counts apart).
fn measure(loss: impl Fn(&Tensor, &Tensor) -> Tensor, h: &Tensor, w: &Tensor) -> [i64; 3] {
    let (before, _) = allocated();
    reset_cpu_peak();
    let l = loss(h, w);
    let (kept, fwd) = allocated();
    reset_cpu_peak();
    let g = grad(&[&l], &[&l.ones_like()], &[h, w]).unwrap();
    let (_, bwd) = allocated();
    let grad_w = g[1].numel() as i64 * g[1].kind().elt_size_in_bytes() as i64;
    drop((g, l));
    [kept - before, fwd - before, bwd - before - grad_w]
}

#[test]
fn the_chunked_loss_holds_what_the_estimator_counts_and_far_less_than_the_logits() {
    install_cpu_caching_allocator(None).unwrap();
    let (b, t, c, v) = (4i64, 256i64, 64i64, 8192i64);
    let n = b * t;
    let chunk = 1 << 18;
    for kind in [Kind::Float, Kind::BFloat16] {
        let elt = kind.elt_size_in_bytes() as i64;
        tch::manual_seed(3);
        let h = Tensor::randn([b, t, c], (kind, Device::Cpu)).set_requires_grad(true);
        let w = (Tensor::randn([v, c], (kind, Device::Cpu)) * 0.1).set_requires_grad(true);
        let y = Tensor::randint(v, [b, t], (Kind::Int64, Device::Cpu));
        let chunked = measure(|h, w| linear_lm_loss(h, w, &y, chunk).unwrap(), &h, &w);
        let full = measure(|h, w| lm_loss(&h.matmul(&w.tr()), &y).unwrap(), &h, &w);
        let want = LossBytes::chunked(n, v, c, elt, chunk);
        let predicted = [
            want.saved,
            want.saved + want.forward_temp,
            // The head's backward counts the gradient of h (B, T, C) itself.
            want.saved + want.backward_temp + n * c * elt,
        ];
        eprintln!("{kind:?}: chunked {chunked:?}, predicted {predicted:?}, full logits {full:?}");
        for (i, (&got, &pred)) in chunked.iter().zip(&predicted).enumerate() {
            // Small tensors round up to their allocator block: a few KiB.
            assert!(
                got >= pred * 95 / 100 && got <= pred * 102 / 100 + (64 << 10),
                "{kind:?} figure {i}: measured {got}, predicted {pred}"
            );
        }
        // The full logits path holds at least the fp32 log-probabilities of every position.
        assert!(full[0] >= 4 * n * v, "{full:?}");
        assert!(chunked[2] * 8 < full[2], "{chunked:?} vs {full:?}");
    }
}
