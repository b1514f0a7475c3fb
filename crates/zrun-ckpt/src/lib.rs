//! Checkpoint files: manifest, per-rank safetensors shards, atomic commit, integrity,
//! resharding reads and consolidation.
//!
//! A checkpoint is a directory `step-00000500/` holding `manifest.json` and one
//! `rank-00000.safetensors` per rank. Every unit of the model is one flat fp32 buffer (its view
//! table names the parameters in it); rank r of W wrote elements `[r*s, min((r+1)*s, numel))`
//! of every unit, `s = ceil(numel / W)`, as the tensors `<unit>.master`, `<unit>.exp_avg` and
//! `<unit>.exp_avg_sq`. Because the manifest records each rank's range, a reader can take any
//! element range of any unit whatever world size wrote it ([`Reader::read`]): that is how a run
//! resumes on another world size or stage without a conversion step.
//!
//! A save writes into `step-00000500.tmp/` ([`RankWriter`], one per rank, each file fsynced
//! and hashed as it is written), then [`commit`] writes the manifest last and renames the
//! directory into place: a directory without its manifest is never a checkpoint. No pickle,
//! no code runs on load; every file's size and XXH3-128 hash are checked before it is used.
//!
//! Hugging Face model directories are read and written here too ([`HfDir`], [`HfWriter`]):
//! memory-mapped safetensors shards read by element range (straight or transposed), and
//! shards plus index streamed out for `transformers`, renamed into place with the index last.

mod compare;
mod consolidate;
mod dir;
mod hash;
mod hf;
mod lock;
mod manifest;
mod read;
mod write;

use std::path::{Path, PathBuf};

pub use consolidate::{consolidate, consolidate_tmp, consolidate_until, Consolidated, OutDtype};
pub use dir::{
    complete, open_regular, refuse_inside, remove_leftovers, step_dir, tmp_dir, Opened, MANIFEST,
};
pub use hf::{parse_size, write_json, HfDir, HfDtype, HfWriter, TensorInfo};
pub use lock::{hostname, Acquired, DirLock, LockOwner, LEASE, LOCK_FILE};
pub use manifest::{
    DataOrder, DataPosition, FileEntry, Manifest, OptimizerState, RankEntry, RunRecord,
    ScalerState, ScheduleState, Shard, UnitEntry, ViewEntry, FORMAT, FORMAT_VERSION,
};
pub use read::{Checkpoint, RankFile, Reader};
pub use write::{commit, prune, rank_file_name, Dtype, RankWriter, TensorSpec};

/// Which state tensor of a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// fp32 master weights.
    Master,
    /// AdamW first moment (torch's `exp_avg`).
    ExpAvg,
    /// AdamW second moment (torch's `exp_avg_sq`).
    ExpAvgSq,
    /// fp32 compute parameters one update behind the master, held only by a checkpoint of a
    /// run with a delayed update pending ([`Manifest::delayed_params`]); not in [`Part::ALL`].
    Delayed,
}

impl Part {
    /// The three parts, in the order a rank file holds them.
    pub const ALL: [Part; 3] = [Part::Master, Part::ExpAvg, Part::ExpAvgSq];

    /// The suffix of the tensor name: `master`, `exp_avg`, `exp_avg_sq`.
    pub fn suffix(self) -> &'static str {
        match self {
            Part::Master => "master",
            Part::ExpAvg => "exp_avg",
            Part::ExpAvgSq => "exp_avg_sq",
            Part::Delayed => "delayed",
        }
    }
}

/// The name of `unit`'s `part` in a rank file: `h.3.master`.
pub fn tensor_name(unit: &str, part: Part) -> String {
    format!("{unit}.{}", part.suffix())
}

/// The name of a random generator's state in a rank file: `rng.cpu`, `rng.cuda`.
pub fn rng_name(device: &str) -> String {
    format!("rng.{device}")
}

/// Errors of checkpoint files.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file system call failed.
    #[error("checkpoint: cannot {op} {}: {source}; {}", path.display(), io_hint(source))]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A file of the checkpoint is missing, truncated or altered.
    #[error("checkpoint {}: {file} is damaged: {detail}; resume from another checkpoint", dir.display())]
    Damaged {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The file (relative to the directory).
        file: String,
        /// What is wrong.
        detail: String,
    },
    /// The directory is not a checkpoint this version can read.
    #[error("checkpoint {}: {detail}", dir.display())]
    Format {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong and what to do.
        detail: String,
    },
    /// The checkpoint holds another model.
    #[error("checkpoint {} does not fit this model: {detail}", dir.display())]
    Mismatch {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The first difference, and what to do.
        detail: String,
    },
    /// Another live run holds the checkpoint directory.
    #[error("checkpoint.dir {} is in use by {holder}: two jobs must not share a checkpoint directory; give this one another checkpoint.dir, or stop the other job", dir.display())]
    Held {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Who holds it.
        holder: String,
    },
    /// An output path given to write a checkpoint's contents to cannot be used (inside the
    /// checkpoint, a directory, or in a directory that does not exist).
    #[error("output {}: {detail}", path.display())]
    Output {
        /// The output path as given.
        path: PathBuf,
        /// What is wrong and what to do.
        detail: String,
    },
    /// A caller asked for something the format cannot express.
    #[error("checkpoint: {0}")]
    Invalid(String),
    /// A Hugging Face model directory, or a file in it, cannot be used.
    #[error("Hugging Face model {}: {detail}", path.display())]
    Hf {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong (naming the tensor where there is one) and what to do.
        detail: String,
    },
}

impl Error {
    /// True when the checkpoint or model directory given is the problem (damaged, of another
    /// format or model, held by another job, or not a checkpoint at all), or the output path
    /// given, not the machine: bad input, exit code 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Error::Damaged { .. }
                | Error::Format { .. }
                | Error::Mismatch { .. }
                | Error::Hf { .. }
                | Error::Held { .. }
                | Error::Output { .. }
        )
    }

    /// True when the checkpoint itself is damaged (a missing, truncated or altered file): a
    /// reader may fall back to an older checkpoint.
    pub fn is_damaged(&self) -> bool {
        matches!(self, Error::Damaged { .. })
    }

    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Error {
        Error::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn hf(path: &Path, detail: impl Into<String>) -> Error {
        Error::Hf {
            path: path.to_path_buf(),
            detail: detail.into(),
        }
    }

    pub(crate) fn damaged(dir: &Path, file: &str, detail: impl Into<String>) -> Error {
        Error::Damaged {
            dir: dir.to_path_buf(),
            file: file.to_string(),
            detail: detail.into(),
        }
    }
}

/// What to do about an I/O error, by its kind.
fn io_hint(e: &std::io::Error) -> &'static str {
    // Linux errno values: ENOSPC 28, EDQUOT 122, EFBIG 27, EACCES 13, EROFS 30.
    match e.raw_os_error() {
        Some(28) | Some(122) => {
            "the disk is full: free space or point checkpoint.dir at a larger disk"
        }
        Some(27) => "a file-size limit was hit (ulimit -f): raise it or free space",
        Some(13) | Some(30) => {
            "permission denied or read-only file system: make checkpoint.dir writable"
        }
        _ => match e.kind() {
            std::io::ErrorKind::NotFound => "check the path",
            _ => "check the directory and the disk",
        },
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
