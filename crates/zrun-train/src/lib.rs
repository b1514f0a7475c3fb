//! Config, data, the training loop and metrics for zrun.
//!
//! A worker process loads a [`config::Config`], builds a [`trainer::Run`] (model, data,
//! engine) and trains it, writing `metrics.jsonl` and `summary.json` into `log.dir`.

pub mod config;
pub mod data;
pub mod metrics;
pub mod trainer;

use std::path::PathBuf;

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// The data cannot be read or does not fit the model.
    #[error(transparent)]
    Data(#[from] data::DataError),
    /// The model cannot be built.
    #[error("model: {0}")]
    Model(#[from] zrun_models::Error),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] zrun_shard::Error),
    /// A file could not be written.
    #[error("cannot write {}: {source}; check that the directory is writable (log.dir)", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Training diverged.
    #[error(
        "step {step}: loss {loss} / gradient norm {grad_norm} is not finite; lower train.lr, \
         raise train.warmup_steps or set train.grad_clip"
    )]
    NonFinite {
        /// The step that diverged.
        step: u64,
        /// Its loss.
        loss: f64,
        /// Its gradient norm.
        grad_norm: f64,
    },
    /// Asked for something this version cannot do.
    #[error("{0}")]
    Unsupported(String),
}

impl Error {
    /// True when the fault is in what the user gave (config, data, flags): exit code 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Error::Config(_)
                | Error::Data(_)
                | Error::Unsupported(_)
                | Error::Engine(zrun_shard::Error::Unsupported(_))
        )
    }
}
