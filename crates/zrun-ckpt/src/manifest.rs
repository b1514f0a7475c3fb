//! `manifest.json`: what a checkpoint holds and how to read it. Written last by rank 0; a
//! checkpoint without it is incomplete.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

mod check;
mod fit;

pub(crate) use check::tables as check_tables;

/// The `format` field of every manifest.
pub const FORMAT: &str = "zrun-checkpoint";
/// The manifest layout this version writes; it reads this one and every earlier one.
///
/// Version 2 adds the manifest's own hash: `manifest_hash`, the last member of the
/// top-level object, is the XXH3-128 of the file's bytes without that member (see
/// [`crate::commit`]); a version-2 manifest without it, or whose bytes do not match it, is
/// damaged. Version 1 manifests (no such member) are read as before, checked in every other
/// way.
pub const FORMAT_VERSION: u32 = 2;

/// Everything about a checkpoint except the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// The layout version of this manifest ([`FORMAT_VERSION`] when written).
    pub format_version: u32,
    /// The zrun version that wrote it.
    pub zrun_version: String,
    /// Optimizer steps completed (the run resumes with step `step + 1`).
    pub step: u64,
    /// Training tokens consumed so far, over all ranks.
    pub tokens_seen: u64,
    /// Where the data stream stands.
    pub data: DataPosition,
    /// The model's configuration, as the trainer describes it (`{"arch": "gpt", ...}`).
    pub model: serde_json::Value,
    /// Ranks that wrote the checkpoint.
    pub world_size: usize,
    /// ZeRO stage of the run that wrote it.
    pub stage: u8,
    /// Compute precision of that run: `fp32`, `bf16` or `fp16`.
    pub precision: String,
    /// Where its optimizer state lived: `none` or `cpu`.
    pub offload: String,
    /// The optimizer's counters and hyper-parameters.
    pub optimizer: OptimizerState,
    /// The learning-rate schedule and where it stands.
    pub schedule: ScheduleState,
    /// The fp16 loss scaler.
    pub loss_scaler: ScalerState,
    /// Every unit's flat layout and which ranks wrote which part of it, in model order.
    pub units: Vec<UnitEntry>,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankEntry>,
    /// Every data file with its size and content hash.
    pub files: Vec<FileEntry>,
    /// The run that wrote it (absent in checkpoints of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunRecord>,
    /// What fixes the order of the training samples (absent in checkpoints of older
    /// versions): a resume compares it with the new run's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_order: Option<DataOrder>,
    /// A delayed parameter update (`zero.offload_delay`) was pending: the master holds it,
    /// and every rank file also holds `<unit>.delayed`, the fp32 compute parameters one
    /// update behind it that the next step's forward runs on (absent: false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delayed_params: bool,
}

/// The identity of the run that wrote a checkpoint: a restart of the same run (the
/// launcher's `--max-restarts`, a requeued job with the same `ZRUN_RUN_ID`) has the same id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run id (`ZRUN_RUN_ID`, or one made at the run's start).
    pub id: String,
    /// The host of the rank that committed the checkpoint (rank 0).
    pub host: String,
}

/// What decides which samples each step sees: the data source, its file and size, the
/// sequence length, the seed and the global batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataOrder {
    /// `data.source`: `synthetic`, `tokens` or `text`.
    pub source: String,
    /// `data.path` as given (absent for synthetic data).
    pub path: Option<String>,
    /// Bytes of the data the path names (a file's size, or a directory's files summed).
    pub bytes: Option<u64>,
    /// Tokens per sample.
    pub seq_len: u64,
    /// `data.seed`.
    pub seed: u64,
    /// Samples per optimizer step over all ranks.
    pub global_batch: u64,
}

/// The data stream's position, in global samples (independent of the world size).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The first sample of the next step.
    pub next_sample: u64,
    /// Samples per step (micro batch x accumulation x world size) of the run that wrote it.
    pub global_batch: u64,
    /// Tokens per sample.
    pub seq_len: u64,
}

/// AdamW's counters and hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    /// `adamw`.
    pub name: String,
    /// Updates applied (the bias corrections use it; fp16 overflow steps do not count).
    pub steps: u64,
    /// Storage type of the moments in the rank files: `fp32` or `bf16`.
    pub state_dtype: String,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// The learning-rate schedule (linear warmup, cosine decay).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleState {
    /// Steps taken on it.
    pub step: u64,
    /// The learning rate of the last step taken.
    pub lr: f64,
    /// Peak learning rate.
    pub peak: f64,
    /// Final learning rate.
    pub min: f64,
    /// Warmup steps.
    pub warmup_steps: u64,
    /// Step at which the decay ends.
    pub total_steps: u64,
}

/// The dynamic loss scaler of fp16.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// Whether the run scaled its loss (fp16).
    pub enabled: bool,
    /// The current scale.
    pub scale: f64,
    /// Clean steps since the scale last changed.
    pub clean_steps: u64,
}

/// One unit: its view table, and the element range each rank wrote.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitEntry {
    /// Unit name (`embed`, `h.0`, ..., `head`).
    pub name: String,
    /// Elements of the unit's flat buffer (no padding).
    pub numel: u64,
    /// The parameters inside the flat buffer.
    pub views: Vec<ViewEntry>,
    /// `shards[r]`: the range rank r wrote (possibly empty).
    pub shards: Vec<Shard>,
}

/// A contiguous element range of a unit's flat buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// First element.
    pub start: u64,
    /// Elements.
    pub len: u64,
}

/// One named parameter inside a unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ViewEntry {
    /// The model's parameter name (`h.3.attn.qkv.weight`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// First element inside the unit's flat buffer.
    pub offset: u64,
    /// Elements (the product of `shape`).
    pub numel: u64,
    /// Whether weight decay applies to it.
    pub decay: bool,
}

/// One rank's file and what else it holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankEntry {
    /// The rank.
    pub rank: usize,
    /// Its file, relative to the checkpoint directory.
    pub file: String,
    /// Devices whose random-generator state the file holds (`cpu`, `cuda`).
    pub rng: Vec<String>,
}

/// A data file's size and content hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name, relative to the checkpoint directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Content hash of the whole file: `xxh3-128:<32 hex digits>`.
    pub hash: String,
}

impl FileEntry {
    /// The entry as 32 bytes (size, then the digest; zeros for a hash it cannot read), for
    /// ranks to exchange through a collective.
    pub fn to_record(&self) -> [u8; 32] {
        let mut r = [0u8; 32];
        r[..8].copy_from_slice(&self.bytes.to_le_bytes());
        if let Some(d) = crate::hash::parse(&self.hash) {
            r[8..24].copy_from_slice(&d);
        }
        r
    }

    /// The entry of file `name` from [`FileEntry::to_record`]'s bytes.
    pub fn from_record(name: String, r: &[u8; 32]) -> FileEntry {
        let mut d = [0u8; 16];
        d.copy_from_slice(&r[8..24]);
        FileEntry {
            name,
            bytes: u64::from_le_bytes(r[..8].try_into().unwrap_or_default()),
            hash: crate::hash::to_string(&d),
        }
    }
}

impl UnitEntry {
    /// The ranges rank r of `world` writes of a unit of `numel` elements: the padded
    /// buffer's equal slices `[r*s, (r+1)*s)` cut at `numel` (the padding is not saved).
    pub fn even_shards(numel: u64, world: usize) -> Vec<Shard> {
        let w = world.max(1) as u64;
        let s = numel.div_ceil(w);
        (0..w)
            .map(|r| {
                let start = (r * s).min(numel);
                Shard {
                    start,
                    len: (start + s).min(numel) - start,
                }
            })
            .collect()
    }
}

impl Manifest {
    /// The data file of rank `r`.
    pub fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    /// Reads and checks `dir/manifest.json` as untrusted input, before any rank file is
    /// touched: its size is bounded, it must be a zrun checkpoint of a known version, its own
    /// hash (format version 2 on) must match its bytes, and its tables must be consistent
    /// (see [`Manifest::validate`]). Every violation is one [`Error::Damaged`] or
    /// [`Error::Format`] naming the field.
    pub fn load(dir: &Path) -> Result<Manifest> {
        let text = check::read_bounded(dir)?;
        // The format fields first, so a newer layout is named as such rather than as damage.
        #[derive(Deserialize)]
        struct Head {
            format: Option<String>,
            format_version: Option<u32>,
        }
        let head: Head = serde_json::from_slice(&text)
            .map_err(|e| Error::damaged(dir, crate::MANIFEST, format!("not valid JSON ({e})")))?;
        if head.format.as_deref() != Some(FORMAT) {
            return Err(Error::Format {
                dir: dir.to_path_buf(),
                detail: format!(
                    "{} is not a zrun checkpoint manifest (format {:?}, expected {FORMAT:?})",
                    crate::MANIFEST,
                    head.format.unwrap_or_default()
                ),
            });
        }
        let version = match head.format_version {
            Some(v) if (1..=FORMAT_VERSION).contains(&v) => v,
            Some(v) if v > FORMAT_VERSION => {
                return Err(Error::Format {
                    dir: dir.to_path_buf(),
                    detail: format!(
                        "format version {v} is not one this zrun reads (1 to {FORMAT_VERSION}); it was written by a newer zrun: upgrade zrun to load it"
                    ),
                })
            }
            // Every zrun wrote a version from 1: none (or 0) is a manifest altered or cut.
            v => {
                return Err(Error::damaged(
                    dir,
                    crate::MANIFEST,
                    format!(
                        "format_version is {}, not one any zrun writes (1 to {FORMAT_VERSION})",
                        v.map_or("missing".to_string(), |v| v.to_string())
                    ),
                ))
            }
        };
        check::verify_seal(dir, version, &text)?;
        let m: Manifest = serde_json::from_slice(&text)
            .map_err(|e| Error::damaged(dir, crate::MANIFEST, format!("unreadable ({e})")))?;
        m.validate(dir)?;
        Ok(m)
    }

    /// Checks the tables of a manifest read from `dir` as untrusted input: world size and
    /// counts bounded; rank entries in rank order naming exactly `rank-NNNNN.safetensors`
    /// (no path ever leaves the directory); one file entry per rank with a size and an
    /// XXH3-128 hash; every unit's shards tiling `[0, numel)` exactly in rank order; every
    /// view's `numel` the product of its shape, inside its unit and overlapping no other;
    /// names unique; each rank file large enough for its shards; policy fields known; the
    /// step matching a `step-NNNNNNNN` directory name. [`Error::Damaged`] or
    /// [`Error::Format`] names the first violation.
    pub fn validate(&self, dir: &Path) -> Result<()> {
        check::tables(self).map_err(|d| Error::damaged(dir, crate::MANIFEST, d))?;
        check::hashes(self, dir)?;
        check::step_dir(self, dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_shards_tile_the_unit_without_padding() {
        for numel in [0u64, 1, 5, 7, 64, 1001] {
            for w in 1..7 {
                let s = UnitEntry::even_shards(numel, w);
                assert_eq!(s.len(), w);
                let mut next = 0;
                for sh in &s {
                    assert_eq!(sh.start, next.min(numel));
                    next = sh.start + sh.len;
                }
                assert_eq!(next, numel, "numel {numel} w {w}");
            }
        }
        // 7 elements over 3 ranks: padded to 9, slices of 3, the last cut to 1.
        let s = UnitEntry::even_shards(7, 3);
        assert_eq!(
            s.iter().map(|s| (s.start, s.len)).collect::<Vec<_>>(),
            vec![(0, 3), (3, 3), (6, 1)]
        );
    }
}
