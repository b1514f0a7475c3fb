//! AdamW over flat fp32 shards, gradient clipping and learning-rate schedules.
//!
//! The ZeRO engine hands this crate one contiguous fp32 buffer per rank (the master
//! parameters it owns) and the matching gradient buffer; the update is a handful of
//! in-place kernels for the whole rank, with no per-tensor loop.

mod adamw;
mod clip;
mod cpu_adam;
#[cfg(test)]
mod reference;
mod schedule;
mod segments;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::clip_coefficient;
pub use cpu_adam::{BaseOut, Bf16, CpuAdamW, Grad, HalfKind, MomentSlices, Prediction, StateDtype};
pub use schedule::LrSchedule;
pub use segments::Segments;

/// Errors of the optimizer crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A libtorch call failed inside an optimizer operation.
    #[error("optimizer: {op} failed: {source}")]
    Torch {
        /// The operation that failed.
        op: &'static str,
        /// The libtorch error.
        #[source]
        source: tch::TchError,
    },
    /// An op through zrun's shim failed inside an optimizer operation.
    #[error("optimizer: {op} failed: {source}")]
    Shim {
        /// The operation that failed.
        op: &'static str,
        /// The shim's error.
        #[source]
        source: zrun_torch_ext::Error,
    },
    /// Buffers handed to the optimizer disagree in size.
    #[error("optimizer: {what} has {got} elements, expected {expected} (the rank's shard size)")]
    Size {
        /// Which buffer.
        what: &'static str,
        /// Its element count.
        got: i64,
        /// The shard size the optimizer was built for.
        expected: i64,
    },
    /// A CPU AdamW update range does not fit in the shard.
    #[error("CPU AdamW: update of elements [{off}, {off} + {len}) does not fit in the shard of {numel} elements; pass an offset and length inside the rank's shard")]
    Range {
        /// First element of the range.
        off: usize,
        /// Its length.
        len: usize,
        /// The shard size the optimizer was built for.
        numel: usize,
    },
    /// libtorch's fused Adam kernel refused or failed.
    #[error("optimizer: fused AdamW failed: {detail}")]
    Fused {
        /// The shim's message.
        detail: String,
    },
    /// The CPU AdamW's worker threads could not be started.
    #[error("CPU AdamW: cannot start {threads} worker threads: {detail}; lower train.threads (or OMP_NUM_THREADS) or raise the process's thread limit (ulimit -u)")]
    Threads {
        /// Workers asked for.
        threads: usize,
        /// The system's refusal.
        detail: String,
    },
    /// A CPU AdamW update came before the step was started.
    #[error("CPU AdamW: update before begin_step(); call begin_step() once per optimizer step before updating its sub-ranges")]
    NoStep,
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn torch<T>(op: &'static str, r: std::result::Result<T, tch::TchError>) -> Result<T> {
    r.map_err(|source| Error::Torch { op, source })
}

/// An in-place op with a scalar through [`zrun_torch_ext::scalar`]: an error where tch's own
/// would panic.
pub(crate) fn scalar(
    op: &'static str,
    r: std::result::Result<(), zrun_torch_ext::Error>,
) -> Result<()> {
    r.map_err(|source| Error::Shim { op, source })
}

/// Runs an in-place libtorch op, dropping the returned handle to the same tensor.
pub(crate) fn inplace(
    op: &'static str,
    r: std::result::Result<tch::Tensor, tch::TchError>,
) -> Result<()> {
    torch(op, r).map(drop)
}
