//! CUDA tensors over the tcp backend, staged through pinned host buffers in stream order, as
//! gloo does for PyTorch: an input is copied to the host when the collective is issued (after
//! the kernels queued before it on the caller's stream, which the copy waits for), the
//! collective runs on the host copies, and an output is copied back on the waiting thread's
//! stream when the work is waited on, without blocking the host. This is how several CUDA
//! ranks share one GPU, where NCCL refuses two ranks on one device.

use tch::{Device, Tensor};

use crate::{Error, Work};

/// A collective's tensor as the host sees it, and where the result goes back to.
pub(super) struct Staged {
    /// The tensor itself (CPU), or its pinned host copy (CUDA).
    pub(super) host: Tensor,
    /// The CUDA tensor the host copy stands for.
    device: Option<Tensor>,
}

/// Stages `t`: CPU tensors as they are; a CUDA tensor as a pinned host buffer of its size,
/// filled with its values when `input` (a blocking copy, ordered after the kernels already
/// queued on the current stream).
pub(super) fn stage(
    t: &Tensor,
    input: bool,
    rank: usize,
    op: &'static str,
) -> Result<Staged, Error> {
    if !matches!(t.device(), Device::Cuda(_)) {
        return Ok(Staged {
            host: t.shallow_clone(),
            device: None,
        });
    }
    let fail = |detail: String| Error::Backend {
        rank,
        backend: "tcp",
        op,
        detail,
    };
    if !t.is_contiguous() {
        return Err(Error::InvalidArgument {
            rank,
            op,
            detail: "a CUDA tensor is not contiguous; call .contiguous() first".into(),
        });
    }
    let mut host = zrun_torch_ext::empty_pinned(t.numel() as i64, t.kind()).map_err(|e| {
        fail(format!(
            "staging {} elements of a CUDA tensor: {e}",
            t.numel()
        ))
    })?;
    if input {
        let flat = t
            .f_view([-1])
            .map_err(|e| fail(format!("flat view of a CUDA tensor: {e}")))?;
        host.f_copy_(&flat)
            .map_err(|e| fail(format!("copying a CUDA tensor to the host: {e}")))?;
    }
    Ok(Staged {
        host,
        device: Some(t.shallow_clone()),
    })
}

/// `work`, then (on the waiting thread, once it completed) the copy of `out`'s host buffer
/// back to its CUDA tensor, queued on that thread's current stream without blocking the host.
/// The caching host allocator keeps the pinned buffer until the copy has run.
pub(super) fn copy_back(work: Work, out: Staged, rank: usize, op: &'static str) -> Work {
    let Some(dev) = out.device else {
        return work;
    };
    let host = out.host;
    work.then(move || {
        let fail = |detail: String| Error::Backend {
            rank,
            backend: "tcp",
            op,
            detail: format!("copying the result back to the GPU: {detail}"),
        };
        let flat = dev.f_view([-1]).map_err(|e| fail(e.to_string()))?;
        zrun_torch_ext::copy_async(&flat, &host).map_err(|e| fail(e.to_string()))
    })
}
