//! A run's identity and what fixes its data order: recorded in every manifest, compared on
//! resume (see shared trust rules: a restart continues only what its own run wrote, and a
//! resume that would train on other samples says exactly what changed).

use std::path::Path;

use tch::Device;
use zrun_ckpt::DataOrder;
use zrun_comm::Communicator;

use crate::config::{Config, DataKind};
use crate::data::{shard_dir, xxh3_of, ShardIndex, INDEX_FILE};
use crate::reduce::gather_bytes;
use crate::Error;

/// Longest run id kept (bytes); longer ones are cut.
const MAX_ID: usize = 120;

/// This process's run id from its launcher's environment: zrun's `ZRUN_RUN_ID`, torchrun's
/// `TORCHELASTIC_RUN_ID` (unless its default `none`), Slurm's job id (kept when Slurm
/// requeues the job); else one made here from the host, the process and the time.
fn local_run_id() -> String {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    if let Some(id) = var("ZRUN_RUN_ID") {
        return id;
    }
    if let Some(id) = var("TORCHELASTIC_RUN_ID").filter(|v| v != "none") {
        return format!("torchrun-{id}");
    }
    if let Some(job) = var("SLURM_JOB_ID") {
        return format!("slurm-{job}");
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{}-{nanos:x}", zrun_ckpt::hostname(), std::process::id())
}

/// The job's run id: rank 0's, handed to every rank (ranks started by mpirun without an id
/// would each make their own).
pub(crate) fn run_id(comm: &dyn Communicator, device: Device) -> Result<String, Error> {
    let mut mine = local_run_id().into_bytes();
    mine.truncate(MAX_ID);
    let mut record = vec![0u8; MAX_ID + 1];
    record[0] = mine.len() as u8;
    record[1..=mine.len()].copy_from_slice(&mine);
    let all = gather_bytes(comm, device, &record)?;
    let zero = &all[0];
    let n = usize::from(zero[0]).min(MAX_ID);
    Ok(String::from_utf8_lossy(&zero[1..=n]).into_owned())
}

/// Bytes of the data `path` names: a file's size, or the sum of a directory's files.
fn data_bytes(path: &Path) -> Option<u64> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        return Some(meta.len());
    }
    let mut total = 0;
    for e in std::fs::read_dir(path).ok()? {
        let m = e.ok()?.metadata().ok()?;
        if m.is_file() {
            total += m.len();
        }
    }
    Some(total)
}

/// The prefix of a shard directory's `source` in a data order; the index's hash follows.
const SHARDS: &str = "token shards, index.json XXH3-128 ";

/// A token-shard directory's part of the data order: its `source` names the index by its
/// XXH3-128 (which covers every shard's recorded hash, and the loader checks every shard
/// against those at open), `bytes` the shards' total. An unreadable or invalid index is
/// `("token shards", None)`; opening the data reports it.
fn shard_order(dir: &Path) -> (String, Option<u64>) {
    let path = dir.join(INDEX_FILE);
    match (ShardIndex::read(dir), std::fs::read(&path)) {
        (Ok(index), Ok(text)) => {
            let digest = xxh3_of(&text);
            let bytes = index.train.iter().chain(&index.val).map(|s| s.bytes).sum();
            (format!("{SHARDS}{digest}"), Some(bytes))
        }
        _ => ("token shards".into(), None),
    }
}

/// What fixes the order of `cfg`'s samples on `world` ranks.
pub(crate) fn data_order(cfg: &Config, world: usize) -> Result<DataOrder, Error> {
    let d = &cfg.data;
    let t = &cfg.train;
    let path = match d.source {
        DataKind::Synthetic => None,
        _ => d.path.as_deref(),
    };
    let shards = match d.source {
        DataKind::Tokens => path.and_then(shard_dir).map(|dir| shard_order(&dir)),
        _ => None,
    };
    let (source, bytes) = match (d.source, shards) {
        (DataKind::Synthetic, _) => (format!("synthetic (branching {})", d.branching), None),
        (_, Some(shards)) => shards,
        (DataKind::Tokens, None) => ("tokens".into(), path.and_then(data_bytes)),
        (DataKind::Text, None) => ("text".into(), path.and_then(data_bytes)),
    };
    Ok(DataOrder {
        source,
        path: path.map(|p| p.display().to_string()),
        bytes,
        seq_len: cfg.arch()?.seq_len() as u64,
        seed: d.seed,
        global_batch: (t.micro_batch * t.grad_accum * world) as u64,
    })
}

/// What differs between the data order a checkpoint recorded (`then`) and this run's
/// (`now`), one phrase per key, in the config's names.
pub(crate) fn changes(then: &DataOrder, now: &DataOrder) -> Vec<String> {
    let mut out = Vec::new();
    let path = |o: &DataOrder| match (&o.path, o.bytes) {
        (None, _) => "none".to_string(),
        (Some(p), Some(b)) => format!("{p:?} ({b} bytes)"),
        (Some(p), None) => format!("{p:?} (unreadable)"),
    };
    let index = |o: &DataOrder| o.source.strip_prefix(SHARDS).map(str::to_string);
    match (index(then), index(now)) {
        (Some(a), Some(b)) if a != b => out.push(format!(
            "the token shards' index.json changed (XXH3-128 was {a}, now {b}: prepared again \
             or edited)"
        )),
        _ if then.source != now.source => out.push(format!(
            "data.source was {}, now {}",
            then.source, now.source
        )),
        _ => {}
    }
    if then.path != now.path || then.bytes != now.bytes {
        out.push(format!("data.path was {}, now {}", path(then), path(now)));
    }
    if then.seq_len != now.seq_len {
        out.push(format!(
            "the sequence length was {}, now {}",
            then.seq_len, now.seq_len
        ));
    }
    if then.seed != now.seed {
        out.push(format!("data.seed was {}, now {}", then.seed, now.seed));
    }
    if then.global_batch != now.global_batch {
        out.push(format!(
            "the global batch (micro_batch x grad_accum x ranks) was {} samples, now {}",
            then.global_batch, now.global_batch
        ));
    }
    out
}

/// The data order a checkpoint without one (an older version) still tells: its sequence
/// length and global batch, the rest taken as unchanged.
pub(crate) fn recorded(m: &zrun_ckpt::Manifest, now: &DataOrder) -> DataOrder {
    m.data_order.clone().unwrap_or_else(|| DataOrder {
        seq_len: m.data.seq_len,
        global_batch: m.data.global_batch,
        ..now.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order() -> DataOrder {
        DataOrder {
            source: "tokens".into(),
            path: Some("data/train.bin".into()),
            bytes: Some(2048),
            seq_len: 128,
            seed: 1,
            global_batch: 32,
        }
    }

    #[test]
    fn every_change_is_named_in_config_terms() {
        assert!(changes(&order(), &order()).is_empty());
        let mut now = order();
        now.bytes = Some(4096);
        now.seed = 2;
        now.global_batch = 64;
        let c = changes(&order(), &now);
        assert_eq!(
            c,
            [
                "data.path was \"data/train.bin\" (2048 bytes), now \"data/train.bin\" (4096 bytes)",
                "data.seed was 1, now 2",
                "the global batch (micro_batch x grad_accum x ranks) was 32 samples, now 64",
            ]
        );
    }

    #[test]
    fn a_shard_directory_prepared_again_is_named_by_its_index() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(shard_order(dir.path()), ("token shards".into(), None));
        let shard = |file: &str, tokens: u64, xxh3: &str| crate::data::ShardRecord {
            file: file.into(),
            tokens,
            documents: 1,
            bytes: 1024 + 2 * tokens,
            xxh3: xxh3.into(),
        };
        let mut index = ShardIndex {
            format: "zrun-token-shards".into(),
            version: 1,
            dtype: "uint16".into(),
            vocab_size: 256,
            tokenizer: crate::data::TokenizerRecord {
                name: "t.json".into(),
                sha256: "a".repeat(64),
            },
            eos: None,
            inputs: vec![],
            train: vec![shard("train-00000.bin", 10, &"1".repeat(32))],
            val: vec![shard("val-00000.bin", 3, &"2".repeat(32))],
        };
        index.write(dir.path()).unwrap();
        let (source, bytes) = shard_order(dir.path());
        assert_eq!(bytes, Some(1044 + 1030));
        assert!(source.starts_with(SHARDS), "{source}");
        // Same sizes, another shard content: another index, named as such.
        index.train[0].xxh3 = "3".repeat(32);
        index.write(dir.path()).unwrap();
        let (again, bytes_again) = shard_order(dir.path());
        assert_eq!(bytes_again, bytes);
        let then = DataOrder { source, ..order() };
        let now = DataOrder {
            source: again,
            ..order()
        };
        let c = changes(&then, &now);
        assert_eq!(c.len(), 1, "{c:?}");
        assert!(
            c[0].starts_with("the token shards' index.json changed"),
            "{c:?}"
        );
    }
}
