//! Flat units, shard layout and the ZeRO stage engine that drives a model unit by unit.
//!
//! The model (from `zrun-models`) is a list of units; this crate lays each unit's parameters
//! out in one flat buffer ([`layout`]), owns the fp32 master copy and optimizer state, and
//! runs every micro-step explicitly, unit by unit ([`Engine`]), so a ZeRO stage can decide
//! when each unit's parameters are gathered, freed and its gradients reduced.

mod delay;
mod engine;
mod estimate;
mod fresh;
mod grads;
mod host_grads;
mod init;
pub mod layout;
mod memory;
mod micro;
mod norm;
mod offload;
mod owned;
mod policy;
mod recover;
mod scaler;
mod snapshot;
mod state;

pub use engine::{Engine, EngineConfig, StepStats, StepTimes};
pub use estimate::{estimate, runtime_heap_bytes, Estimate, EstimateConfig, Term, UnitActivations};
pub use host_grads::gradients_on_host;
pub use layout::{ShardLayout, UnitLayout, View, SHARD_ALIGN};
pub use memory::MemoryLedger;
pub use policy::{Offload, Precision, ReduceDtype, Stage};
pub use snapshot::{Counters, StatePart};
pub use zrun_optim::StateDtype;

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A libtorch call failed while running a unit or a buffer operation.
    #[error("engine: {op} failed in unit `{unit}`: {source}")]
    Torch {
        /// What the engine was doing.
        op: &'static str,
        /// The unit concerned (or `-` when none).
        unit: String,
        /// The libtorch error.
        #[source]
        source: tch::TchError,
    },
    /// A unit's forward failed.
    #[error(transparent)]
    Model(#[from] zrun_models::Error),
    /// The optimizer failed.
    #[error(transparent)]
    Optim(#[from] zrun_optim::Error),
    /// Releasing or re-allocating a gathered unit's storage failed.
    #[error("engine: storage of unit `{0}`: {1}")]
    Storage(String, #[source] zrun_torch_ext::Error),
    /// An op through the shim failed, named by the first field: a multi-tensor kernel (the
    /// gradient norm on CUDA), one of zrun's kernels (the fresh share of a split delayed
    /// update) or an op with a scalar argument (the loss seed).
    #[error("engine: {0} failed: {1}")]
    Kernel(&'static str, #[source] zrun_torch_ext::Error),
    /// A collective failed (a peer died, timed out or disagreed).
    #[error(transparent)]
    Comm(zrun_comm::Error),
    /// The configuration asks for something this engine cannot do.
    #[error("engine: {0}")]
    Unsupported(String),
}

impl Error {
    /// When this error is an allocation that failed for want of memory (libtorch's CPU
    /// allocator, or CUDA's caching allocator): the bytes it asked for, when the message
    /// says (`Some(None)` when it does not).
    pub fn out_of_memory(&self) -> Option<Option<i64>> {
        out_of_memory(self)
    }
}

/// The allocation failure in `e` or any of its sources, and its size when stated.
pub fn out_of_memory(e: &(dyn std::error::Error + 'static)) -> Option<Option<i64>> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if text.contains("can't allocate memory") || text.contains("out of memory") {
            return Some(requested_bytes(&text));
        }
        cur = err.source();
    }
    None
}

/// The size in "you tried to allocate 419430400 bytes" (CPU) or "Tried to allocate
/// 2.00 GiB" (CUDA).
fn requested_bytes(text: &str) -> Option<i64> {
    let lower = text.to_ascii_lowercase();
    let at = lower.find("tried to allocate ")? + "tried to allocate ".len();
    let mut words = lower[at..].split_whitespace();
    let n: f64 = words.next()?.parse().ok()?;
    let unit = words.next().unwrap_or("bytes");
    let scale = match unit.trim_end_matches(['.', ';', ')', ',']) {
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        _ => 1.0,
    };
    Some((n * scale) as i64)
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches an operation and unit name to a libtorch result.
pub(crate) trait Context<T> {
    fn ctx(self, op: &'static str, unit: &str) -> Result<T>;
    /// As `ctx`, dropping the value (for in-place ops, which return their own tensor).
    fn done(self, op: &'static str, unit: &str) -> Result<()>
    where
        Self: Sized,
    {
        self.ctx(op, unit).map(drop)
    }
}

impl<T> Context<T> for std::result::Result<T, tch::TchError> {
    fn ctx(self, op: &'static str, unit: &str) -> Result<T> {
        self.map_err(|source| Error::Torch {
            op,
            unit: unit.to_string(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn allocation_failures_are_recognised_with_their_size() {
        let cpu = "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 419430400 bytes. Error code 12 (Cannot allocate memory)";
        assert_eq!(super::requested_bytes(cpu), Some(419430400));
        let cuda = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB";
        assert_eq!(super::requested_bytes(cuda), Some(2 << 30));
        let e = crate::Error::Unsupported(cuda.into());
        assert_eq!(e.out_of_memory(), Some(Some(2 << 30)));
        assert_eq!(
            crate::Error::Unsupported("a peer closed".into()).out_of_memory(),
            None
        );
    }
}
