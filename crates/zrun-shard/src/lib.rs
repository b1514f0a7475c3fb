//! Flat units, shard layout and the ZeRO stage engine that drives a model unit by unit.
//!
//! The model (from `zrun-models`) is a list of units; this crate lays each unit's parameters
//! out in one flat buffer ([`layout`]), owns the fp32 master copy and optimizer state, and
//! runs every micro-step explicitly, unit by unit ([`Engine`]), so a ZeRO stage can decide
//! when each unit's parameters are gathered, freed and its gradients reduced.

mod engine;
mod init;
pub mod layout;
mod memory;
mod micro;
mod offload;
mod policy;
mod scaler;
mod snapshot;
mod state;

pub use engine::{Engine, EngineConfig, StepStats, StepTimes};
pub use layout::{ShardLayout, UnitLayout, View};
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
    /// A collective failed (a peer died, timed out or disagreed).
    #[error(transparent)]
    Comm(zrun_comm::Error),
    /// The configuration asks for something this engine cannot do.
    #[error("engine: {0}")]
    Unsupported(String),
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
