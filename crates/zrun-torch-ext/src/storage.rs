//! Resizing the storage behind a tensor, as `tensor.untyped_storage().resize_(n)` does in
//! PyTorch: the FSDP / ZeRO-3 way to free a gathered flat buffer that autograd still holds
//! views of, and to bring it back before the backward.

use crate::ffi;
use crate::Error;
use std::ptr;
use tch::Tensor;

/// Resizes the storage behind `t` (shared by all its views) to `nbytes`; 0 releases the
/// memory; growing gives uninitialised contents.
///
/// Every tensor sharing the storage (views, and the tensors autograd saved for the backward)
/// sees the change, so after a resize to 0 none of them may be read until the storage is
/// grown back and filled. Fill it through a tensor that does not share `t`'s version counter
/// (`t.data()`, or raw writes such as a collective's): an in-place op on `t` itself bumps the
/// version autograd saved and its backward then refuses to run.
///
/// On CUDA the memory goes back to the caching allocator on the current stream's terms: if
/// another stream still uses the buffer, synchronise with it first.
///
/// Errors: [`Error::Undefined`] for an undefined tensor; [`Error::Refused`] for a storage
/// libtorch does not own (e.g. `from_blob`), a tensor without storage, or `0 < nbytes` smaller
/// than the bytes `t` itself reaches; [`Error::Torch`] when the allocator fails.
pub fn resize_storage(t: &Tensor, nbytes: usize) -> Result<(), Error> {
    let op = || format!("resize_storage(nbytes={nbytes})");
    if !t.defined() {
        return Err(Error::Undefined { op: op() });
    }
    let mut err = ptr::null_mut();
    // SAFETY: `t.as_ptr()` is a live `torch::Tensor*` for the duration of the call (borrowed
    // from `t`); the shim catches every C++ exception and reports it through `err`.
    let status = unsafe { ffi::zrun_ext_resize_storage(t.as_ptr().cast(), nbytes, &mut err) };
    ffi::check(status, err, op)
}

/// Bytes of the storage behind `t` (the whole storage, not only the part `t` views).
pub fn storage_nbytes(t: &Tensor) -> Result<usize, Error> {
    let op = || String::from("storage_nbytes");
    if !t.defined() {
        return Err(Error::Undefined { op: op() });
    }
    let mut out = 0usize;
    let mut err = ptr::null_mut();
    // SAFETY: as in `resize_storage`; `out` is a valid place for one usize.
    let status = unsafe { ffi::zrun_ext_storage_nbytes(t.as_ptr().cast(), &mut out, &mut err) };
    ffi::check(status, err, op)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn resize_to_zero_and_back_every_view_sees_new_data() -> anyhow::Result<()> {
        let flat = Tensor::zeros([1024], (Kind::Float, Device::Cpu));
        let a = flat.narrow(0, 0, 512).view([16, 32]); // (16, 32)
        let b = flat.narrow(0, 512, 512).view([32, 16]); // (32, 16)
        assert_eq!(storage_nbytes(&flat)?, 4096);
        assert_eq!(
            storage_nbytes(&b)?,
            4096,
            "a view reports the whole shared storage"
        );

        resize_storage(&a, 0)?;
        assert_eq!(storage_nbytes(&flat)?, 0);
        assert_eq!(storage_nbytes(&b)?, 0);

        resize_storage(&flat, 4096)?;
        assert_eq!(storage_nbytes(&a)?, 4096);
        let src = Tensor::arange(1024, (Kind::Float, Device::Cpu));
        flat.data().f_copy_(&src)?;
        assert_eq!(max_abs_diff(&a, &src.narrow(0, 0, 512).view([16, 32])), 0.0);
        assert_eq!(
            max_abs_diff(&b, &src.narrow(0, 512, 512).view([32, 16])),
            0.0
        );
        // Independent of `src`: b's first element is element 512 of the flat buffer.
        assert_eq!(b.double_value(&[0, 0]), 512.0);
        Ok(())
    }

    #[test]
    fn growing_past_the_old_size_and_same_size_noop() -> anyhow::Result<()> {
        let t = Tensor::ones([8], (Kind::Double, Device::Cpu));
        resize_storage(&t, 64)?; // same size: contents kept
        assert_eq!(t.sum(Kind::Double).double_value(&[]), 8.0);
        resize_storage(&t, 4096)?;
        assert_eq!(storage_nbytes(&t)?, 4096);
        let mut d = t.data();
        let _ = d.f_fill_(3.0)?;
        assert_eq!(t.sum(Kind::Double).double_value(&[]), 24.0);
        Ok(())
    }

    #[test]
    fn refuses_too_small_undefined_and_foreign_storage() {
        let flat = Tensor::zeros([100], (Kind::Float, Device::Cpu));
        let tail = flat.narrow(0, 90, 10);
        // `tail` reaches byte 400; 396 is too small, 0 and 400 are fine.
        match resize_storage(&tail, 396) {
            Err(Error::Refused { reason, .. }) => assert!(reason.contains("400"), "{reason}"),
            other => panic!("expected Refused, got {other:?}"),
        }
        assert_eq!(
            storage_nbytes(&flat).ok(),
            Some(400),
            "a refused resize changes nothing"
        );

        assert!(matches!(
            resize_storage(&Tensor::new(), 0),
            Err(Error::Undefined { .. })
        ));
        assert!(matches!(
            storage_nbytes(&Tensor::new()),
            Err(Error::Undefined { .. })
        ));

        let host = [1.0f32; 16];
        // SAFETY: `host` outlives `blob`, which is dropped at the end of this scope.
        let blob = unsafe {
            Tensor::f_from_blob(host.as_ptr().cast(), &[16], &[1], Kind::Float, Device::Cpu)
        };
        let blob = blob.expect("from_blob");
        match resize_storage(&blob, 0) {
            Err(Error::Refused { reason, .. }) => assert!(reason.contains("not resizable")),
            other => panic!("expected Refused, got {other:?}"),
        }
        assert_eq!(blob.sum(Kind::Float).double_value(&[]), 16.0);
    }

    /// A flat leaf of 40 doubles whose elements [4, 34) are W (6, 5); x (3, 5) a leaf too;
    /// y = sum(x @ W^T). Autograd saves W (a view of `flat`) for dy/dx.
    struct Graph {
        flat: Tensor,
        x: Tensor,
        y: Tensor,
    }

    fn build(flat_values: &Tensor, x_values: &Tensor) -> anyhow::Result<Graph> {
        let flat = flat_values.copy().f_set_requires_grad(true)?;
        let w = flat.f_narrow(0, 4, 30)?.f_view([6, 5])?; // (out, in)
        let x = x_values.copy().f_set_requires_grad(true)?;
        let y = x.f_matmul(&w.f_tr()?)?.f_sum(Kind::Double)?; // (3, 6) -> ()
        Ok(Graph { flat, x, y })
    }

    /// Frees `flat`'s storage after the forward, grows it back, fills it with `refill`
    /// through `data()` (as a collective writes into it), then runs the backward.
    fn backward_after_refill(g: &Graph, refill: &Tensor) -> anyhow::Result<(Tensor, Tensor)> {
        resize_storage(&g.flat, 0)?;
        assert_eq!(storage_nbytes(&g.flat)?, 0);
        resize_storage(&g.flat, 40 * 8)?;
        g.flat.data().f_copy_(refill)?;
        let grads = Tensor::f_run_backward(&[&g.y], &[&g.x, &g.flat], false, false)?;
        Ok((grads[0].shallow_clone(), grads[1].shallow_clone()))
    }

    #[test]
    fn saved_tensors_alias_the_resized_storage() -> anyhow::Result<()> {
        let opts = (Kind::Double, Device::Cpu);
        let flat_values = Tensor::f_randn([40], opts)?;
        let x_values = Tensor::f_randn([3, 5], opts)?;

        // Baseline: the same graph, never freed.
        let base = build(&flat_values, &x_values)?;
        let base_gx = Tensor::f_run_backward(&[&base.y], &[&base.x], false, false)?;
        let base_gx = &base_gx[0];
        // Independent of autograd: dy/dx[i, :] = sum over W's rows.
        let w = flat_values.narrow(0, 4, 30).view([6, 5]);
        let expected_gx = w
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Double)
            .expand([3, 5], false);
        assert!(max_abs_diff(base_gx, &expected_gx) < 1e-12);

        // Freed and refilled with the same values: bitwise the baseline.
        let same = build(&flat_values, &x_values)?;
        let (gx, gflat) = backward_after_refill(&same, &flat_values)?;
        assert_eq!(max_abs_diff(&gx, base_gx), 0.0);
        // dy/dW[o, :] = sum over x's rows, for every o; the padding gets nothing.
        let xsum = x_values.sum_dim_intlist([0i64].as_slice(), false, Kind::Double); // (5,)
        let expected_gflat = Tensor::zeros([40], opts);
        expected_gflat
            .narrow(0, 4, 30)
            .view([6, 5])
            .copy_(&xsum.expand([6, 5], false));
        assert!(max_abs_diff(&gflat, &expected_gflat) < 1e-12);

        // Refilled with different values: dy/dx follows the new W, proving autograd's saved
        // W aliases the storage rather than holding its own copy.
        let other_values = Tensor::f_randn([40], opts)?;
        let other = build(&flat_values, &x_values)?;
        let (gx2, _) = backward_after_refill(&other, &other_values)?;
        let w2 = other_values.narrow(0, 4, 30).view([6, 5]);
        let expected_gx2 = w2
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Double)
            .expand([3, 5], false);
        assert!(max_abs_diff(&gx2, &expected_gx2) < 1e-12);
        assert!(
            max_abs_diff(&gx2, base_gx) > 1e-3,
            "new values must change dy/dx"
        );
        Ok(())
    }

    #[test]
    fn refilling_through_the_leaf_itself_makes_backward_refuse() -> anyhow::Result<()> {
        // The hazard `resize_storage`'s doc warns of: an in-place op on `flat` (not on
        // `flat.data()`) bumps the version counter autograd saved with W.
        let opts = (Kind::Double, Device::Cpu);
        let flat_values = Tensor::f_randn([40], opts)?;
        let g = build(&flat_values, &Tensor::f_randn([3, 5], opts)?)?;
        resize_storage(&g.flat, 0)?;
        resize_storage(&g.flat, 40 * 8)?;
        {
            let _guard = tch::no_grad_guard();
            let mut leaf = g.flat.shallow_clone();
            leaf.f_copy_(&flat_values)?;
        }
        let err = Tensor::f_run_backward(&[&g.y], &[&g.x], false, false)
            .err()
            .ok_or_else(|| anyhow::anyhow!("backward ran despite the version bump"))?;
        assert!(err.to_string().contains("inplace"), "{err}");
        Ok(())
    }
}
