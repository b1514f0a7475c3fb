//! The few libtorch C++ calls `tch` lacks, through a small C shim (csrc/) compiled against
//! the same libtorch headers as `tch`:
//!
//! - [`resize_storage`] / [`storage_nbytes`]: free the storage behind a gathered flat buffer
//!   after a unit's forward (autograd's saved views included) and bring it back before its
//!   backward, as FSDP does with `untyped_storage().resize_()`;
//! - [`grad`]: `torch.autograd.grad` with explicit output gradients;
//! - [`cuda_memory`] / [`reset_cuda_peak`]: the CUDA caching allocator's figures;
//! - [`set_cuda_device`] / [`current_cuda_device`]: the calling thread's current CUDA device;
//! - [`fused_adam`] / [`sum_of_squares`]: multi-tensor optimizer kernels (one launch for
//!   many tensors, nothing read back);
//! - [`rng::state`] / [`rng::set_state`]: the default CPU / CUDA generators' state, for
//!   checkpoints that resume with the same random draws;
//! - [`install_cpu_caching_allocator`] / [`cpu_memory_stats`]: a caching allocator for CPU
//!   tensors (freed blocks kept and reused, with a byte limit on what it reserves);
//! - [`linear_cross_entropy`]: the head's matmul and the cross-entropy in chunks, with its
//!   own backward (the full logits are never held);
//! - [`fused_linear_cross_entropy`]: the same on the full logits, their gradient written over
//!   them in the forward, through zrun's own CUDA kernel ([`kernels`], compiled with NVRTC);
//! - [`linear`] (with a bias) and [`layer_norm`]: autograd nodes whose sums over rows (the
//!   bias's gradient, LayerNorm's weight and bias gradients) are one kernel pass on CUDA;
//! - [`rms_norm`]: RMSNorm as one autograd node, fused on CUDA, keeping only its input and
//!   an rstd per row on every device;
//! - [`rope`]: the rotary position embedding as one autograd node, one kernel pass each way
//!   on CUDA;
//! - [`swiglu`]: SwiGLU's product as one autograd node keeping only its two inputs, one
//!   kernel pass each way on CUDA;
//! - [`empty_pinned_exact`]: pinned host memory of exactly the size asked, from the CUDA
//!   driver, for long-lived buffers (libtorch's caching host allocator, [`empty_pinned`],
//!   rounds each block up to a power of two bytes);
//! - [`count_allocations`]: libtorch's allocations made by a piece of code (tests that check
//!   a path allocates nothing);
//! - [`profiler_start`] / [`profiler_stop`]: libtorch's profiler around part of a run, written
//!   as a Chrome trace;
//! - [`quick_exit`]: the end of a process without libtorch's static destructors.
//!
//! No C++ exception crosses into Rust: the shim turns each into an [`Error`].

mod autograd;
mod colsum;
mod count;
mod cpu_alloc;
mod cuda;
mod error;
mod exit;
mod ffi;
pub mod kernels;
mod loss;
mod norm;
mod optim;
mod pinned;
mod profile;
pub mod rng;
mod rope;
pub mod scalar;
mod storage;
mod swiglu;

pub use autograd::grad;
pub use colsum::{colsum_raw, gelu_colsum_raw, layer_norm, linear, linear_gelu};
pub use count::{count_allocations, Allocations};
pub use cpu_alloc::{
    cpu_caching_allocator_installed, cpu_empty_cache, cpu_memory_stats,
    install_cpu_caching_allocator, reset_cpu_peak, CpuMemoryStats,
};
pub use cuda::{
    copy_async, copy_to_device_on_side_stream, cuda_mem_info, cuda_memory, current_cuda_device,
    empty_pinned, join_uploads, pinned_bytes, reset_cuda_peak, set_allocator_settings,
    set_cuda_device, CudaEvent, CudaMemory,
};
pub use error::Error;
#[doc(hidden)]
pub use exit::end_at_exit_without_destructors;
pub use exit::quick_exit;
pub use kernels::optim::{
    adamw_pieces, cast_into, fresh_share, AdamCoeffs, AdamPiece, AdamPlan, CastPiece, ShareCoeffs,
    SharePiece,
};
pub use loss::{ce_rows, fused_linear_cross_entropy, linear_cross_entropy};
pub use norm::rms_norm;
pub use optim::{fresh_share_aten, fused_adam, norm_f32, sum_of_squares, AdamStep};
pub use pinned::empty_pinned_exact;
pub use profile::{profiler_start, profiler_stop};
pub use rope::{rope, rope_raw};
pub use storage::{resize_storage, storage_nbytes};
pub use swiglu::{swiglu, swiglu_raw};
