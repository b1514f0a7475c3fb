//! Config, data, the training loop and metrics for zrun.
//!
//! A worker process loads a [`config::Config`], builds a [`trainer::Run`] (model, data,
//! engine) and trains it, writing `metrics.jsonl` and `summary.json` into `log.dir`.

pub mod agree;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod hf;
pub mod kernels;
pub mod loss_chunk;
pub mod memory;
pub mod metrics;
pub mod oom;
mod reduce;
pub mod report;
pub mod sample;
pub mod steptime;
pub mod stop;
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
    #[error("cannot write {}: {source}; {}", path.display(), write_fix(source))]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Rank 0's metrics could not be written (a full disk): every rank saved a checkpoint at
    /// that step's end first, so nothing trained is lost (exit code 1).
    #[error(
        "{lost}; every rank saved checkpoint {} (step {step}) first: run the same command to resume once there is room",
        checkpoint.display()
    )]
    LogLost {
        /// The write error.
        lost: Box<Error>,
        /// The step saved.
        step: u64,
        /// The checkpoint written.
        checkpoint: PathBuf,
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
    /// Checkpoint files could not be written or read.
    #[error(transparent)]
    Ckpt(#[from] zrun_ckpt::Error),
    /// A libtorch call of the extension (random-generator state) failed.
    #[error(transparent)]
    Ext(#[from] zrun_torch_ext::Error),
    /// A checkpoint save failed; older checkpoints are untouched.
    #[error("{0}")]
    Save(String),
    /// The run cannot resume from the checkpoint it was given or found.
    #[error("{0}")]
    Resume(String),
    /// Another rank failed at a point every rank passes together, and this one stops with
    /// it, with that rank's exit code: every node's launcher then treats the failure alike
    /// (restarts it, or not for bad input).
    #[error("{message}")]
    Follows {
        /// The failing rank's exit code.
        code: u8,
        /// What happened there, for this rank's line.
        message: String,
    },
    /// An allocation failed for want of memory (exit code 4); it carries the diagnosis.
    #[error("{0}")]
    OutOfMemory(Box<oom::OutOfMemory>),
    /// A stop signal ended the run after its checkpoint was saved (exit code 3).
    #[error(
        "stopped by {} after saving checkpoint {} (step {}); run the same command to resume",
        .0.signal.map_or("a stop on another rank", stop::name),
        .0.checkpoint.display(),
        .0.step
    )]
    Stopped(checkpoint::Stopped),
}

impl Error {
    /// True when the fault is in what the user gave (config, data, flags): exit code 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Error::Config(_)
                | Error::Data(_)
                | Error::Unsupported(_)
                | Error::Resume(_)
                | Error::Follows { code: 2, .. }
                | Error::Engine(zrun_shard::Error::Unsupported(_))
        ) || matches!(self, Error::Ckpt(c) if c.is_bad_input())
    }

    /// The process exit code for this error: 2 bad input, 3 stopped by a signal after a
    /// checkpoint, 4 out of memory, 1 anything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Stopped(_) => 3,
            Error::OutOfMemory(_) => 4,
            Error::Follows { code, .. } => *code,
            e if e.is_bad_input() => 2,
            _ => 1,
        }
    }
}
/// What to do about a log file that cannot be written: make room where the disk is full,
/// else make `log.dir` writable.
fn write_fix(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => {
            "the disk (or a quota or file-size limit) is full: free room there, or set log.dir on \
             another disk"
        }
        _ => "check that the directory is writable (log.dir)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_that_cannot_be_written_says_whether_the_disk_is_full() {
        let io = |code| Error::Io {
            path: "runs/x/metrics.jsonl".into(),
            source: std::io::Error::from_raw_os_error(code),
        };
        assert!(io(libc::ENOSPC)
            .to_string()
            .contains("is full: free room there"));
        assert!(io(libc::EACCES).to_string().contains("writable (log.dir)"));
    }
}
