//! A run's identity and what fixes its data order: recorded in every manifest, compared on
//! resume (see shared trust rules: a restart continues only what its own run wrote, and a
//! resume that would train on other samples says exactly what changed).

use std::path::Path;

use tch::Device;
use zrun_ckpt::DataOrder;
use zrun_comm::Communicator;

use crate::config::{Config, DataKind};
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

/// What fixes the order of `cfg`'s samples on `world` ranks.
pub(crate) fn data_order(cfg: &Config, world: usize) -> Result<DataOrder, Error> {
    let d = &cfg.data;
    let t = &cfg.train;
    let source = match d.source {
        DataKind::Synthetic => format!("synthetic (branching {})", d.branching),
        DataKind::Tokens => "tokens".into(),
        DataKind::Text => "text".into(),
    };
    let path = match d.source {
        DataKind::Synthetic => None,
        _ => d.path.as_deref(),
    };
    Ok(DataOrder {
        source,
        path: path.map(|p| p.display().to_string()),
        bytes: path.and_then(data_bytes),
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
    if then.source != now.source {
        out.push(format!(
            "data.source was {}, now {}",
            then.source, now.source
        ));
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
}
