//! `torch.autograd.grad(outputs, inputs, grad_outputs)`: tch's `run_backward` seeds every
//! output with ones, while a unit-by-unit backward needs the upstream gradient as the seed.

use crate::ffi;
use crate::Error;
use std::ffi::c_void;
use std::ptr;
use tch::Tensor;

/// Runs autograd from `outputs` with explicit `grad_outputs` (same shapes), returning the
/// gradients of `inputs` (like torch.autograd.grad(outputs, inputs, grad_outputs)); frees the graph.
///
/// Gradients are returned, not accumulated into the inputs' `.grad`. Every input must
/// require grad and be reached from the outputs (`allow_unused=false`); libtorch's complaint
/// otherwise, or about a shape mismatch between an output and its gradient, comes back as
/// [`Error::Torch`]. A second call over the same graph fails: the graph is freed.
pub fn grad(
    outputs: &[&Tensor],
    grad_outputs: &[&Tensor],
    inputs: &[&Tensor],
) -> Result<Vec<Tensor>, Error> {
    let op = || format!("grad({} outputs, {} inputs)", outputs.len(), inputs.len());
    if outputs.len() != grad_outputs.len() {
        return Err(Error::GradCount {
            outputs: outputs.len(),
            grad_outputs: grad_outputs.len(),
        });
    }
    if let Some(i) = outputs.iter().position(|t| !t.defined()) {
        return Err(Error::Undefined {
            op: format!("{} output {i}", op()),
        });
    }
    if let Some(i) = grad_outputs.iter().position(|t| !t.defined()) {
        return Err(Error::Undefined {
            op: format!("{} grad_output {i}", op()),
        });
    }
    if let Some(i) = inputs.iter().position(|t| !t.defined()) {
        return Err(Error::Undefined {
            op: format!("{} input {i}", op()),
        });
    }
    let outs: Vec<*const c_void> = outputs.iter().map(|t| t.as_ptr().cast()).collect();
    let gouts: Vec<*const c_void> = grad_outputs.iter().map(|t| t.as_ptr().cast()).collect();
    let ins: Vec<*const c_void> = inputs.iter().map(|t| t.as_ptr().cast()).collect();
    let mut results: Vec<*mut c_void> = vec![ptr::null_mut(); inputs.len()];
    let mut err = ptr::null_mut();
    // SAFETY: every pointer is a live `torch::Tensor*` borrowed for the call; `outs` and
    // `gouts` have `outs.len()` entries, `ins` and `results` `ins.len()`; the shim writes
    // `results` only on success and catches every C++ exception.
    let status = unsafe {
        ffi::zrun_ext_grad(
            outs.as_ptr(),
            gouts.as_ptr(),
            outs.len(),
            ins.as_ptr(),
            ins.len(),
            results.as_mut_ptr(),
            &mut err,
        )
    };
    ffi::check(status, err, op)?;
    Ok(results
        .into_iter()
        // SAFETY: on success each entry is a fresh `new torch::Tensor`, owned from here on
        // by the returned `Tensor` (whose drop deletes it).
        .map(|p| unsafe { Tensor::from_ptr(p.cast()) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// A small two-input graph: out = tanh(x @ w) * x[:, :1], shape (4, 3).
    fn graph(x: &Tensor, w: &Tensor) -> Tensor {
        x.matmul(w).tanh() * x.narrow(1, 0, 1)
    }

    #[test]
    fn grad_equals_run_backward_on_weighted_sum() -> anyhow::Result<()> {
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::f_randn([4, 5], opts)?.f_set_requires_grad(true)?;
        let w = Tensor::f_randn([5, 3], opts)?.f_set_requires_grad(true)?;
        let g = Tensor::f_randn([4, 3], opts)?;

        let out = graph(&x, &w);
        let ours = grad(&[&out], &[&g], &[&x, &w])?;

        let out2 = graph(&x, &w);
        let loss = (&out2 * &g).sum(Kind::Float);
        let theirs = Tensor::f_run_backward(&[&loss], &[&x, &w], false, false)?;
        assert_eq!(ours.len(), 2);
        for (a, b) in ours.iter().zip(&theirs) {
            assert_eq!(a.size(), b.size());
            assert!(max_abs_diff(a, b) <= 1e-6, "diff {}", max_abs_diff(a, b));
        }
        // Not accumulated into .grad.
        assert!(!x.grad().defined());
        Ok(())
    }

    #[test]
    fn grad_with_two_outputs_sums_their_contributions() -> anyhow::Result<()> {
        let opts = (Kind::Double, Device::Cpu);
        let x = Tensor::f_randn([6], opts)?.f_set_requires_grad(true)?;
        let a = &x * 2.0; // d/dx = 2
        let b = &x * &x; // d/dx = 2x
        let ga = Tensor::f_randn([6], opts)?;
        let gb = Tensor::f_randn([6], opts)?;
        let gx = grad(&[&a, &b], &[&ga, &gb], &[&x])?;
        let expected = &ga * 2.0 + &gb * 2.0 * x.detach();
        assert!(max_abs_diff(&gx[0], &expected) < 1e-12);
        Ok(())
    }

    #[test]
    fn errors_not_panics() -> anyhow::Result<()> {
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::f_randn([4, 5], opts)?.f_set_requires_grad(true)?;
        let w = Tensor::f_randn([5, 3], opts)?.f_set_requires_grad(true)?;
        let out = graph(&x, &w);

        let wrong_shape = Tensor::f_ones([3, 4], opts)?;
        match grad(&[&out], &[&wrong_shape], &[&x]) {
            Err(Error::Torch { message, .. }) => {
                assert!(message.to_lowercase().contains("shape"), "{message}")
            }
            other => panic!("expected a libtorch error, got {other:?}"),
        }

        let g = Tensor::f_ones([4, 3], opts)?;
        let plain = Tensor::f_ones([2], opts)?; // does not require grad
        assert!(matches!(
            grad(&[&out], &[&g], &[&plain]),
            Err(Error::Torch { .. })
        ));
        assert!(matches!(
            grad(&[&out], &[], &[&x]),
            Err(Error::GradCount { .. })
        ));
        assert!(matches!(
            grad(&[&out], &[&Tensor::new()], &[&x]),
            Err(Error::Undefined { .. })
        ));

        // The graph survives the failed calls above; after a real call it is freed.
        grad(&[&out], &[&g], &[&x])?;
        assert!(matches!(
            grad(&[&out], &[&g], &[&x]),
            Err(Error::Torch { .. })
        ));
        Ok(())
    }
}
