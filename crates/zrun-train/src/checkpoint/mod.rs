//! A run's checkpoints: when to save, what the manifest records, and resuming (see
//! `zrun-ckpt` for the files themselves).
//!
//! Every step boundary, the ranks agree in one small all-reduce on two things: whether any
//! rank was asked to stop (SIGTERM/SIGUSR1 reach one process or all of them), and whether an
//! asynchronous save still being written has finished everywhere. A save, due every
//! `checkpoint.every` steps, at the end, or on a stop, then runs on every rank at that same
//! step: each writes its own file, the ranks exchange the files' sizes and hashes, and rank 0
//! writes the manifest and renames the directory into place.

mod identity;
mod load;
mod save;

use std::path::{Path, PathBuf};

use tch::Device;
use zrun_ckpt::{Manifest, UnitEntry, ViewEntry};
use zrun_shard::{Engine, Precision, ShardLayout};

use crate::config::Config;
use crate::reduce::reduce;
use crate::{stop, Error};

pub use load::Resumed;

/// Environment variable of a test hook: `R:S` makes rank R kill itself (SIGKILL) halfway
/// through writing its file of the checkpoint of step S.
pub const KILL_IN_SAVE_ENV: &str = "ZRUN_TEST_KILL_IN_SAVE";
/// Environment variable of a test hook: `R:S` makes rank R send itself SIGTERM halfway
/// through writing its file of the checkpoint of step S (a stop request during a save).
pub const SIGNAL_IN_SAVE_ENV: &str = "ZRUN_TEST_SIGNAL_IN_SAVE";

/// Where the run stands at a step boundary: what a save records beside the engine's state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Position {
    /// Optimizer steps completed.
    pub step: u64,
    /// The first sample of the next step, in global samples.
    pub next_sample: u64,
    /// The learning rate of the last step.
    pub lr: f64,
}

/// Why the run stops early: a stop signal, after the checkpoint of `step` was saved.
#[derive(Clone, Debug, PartialEq)]
pub struct Stopped {
    /// The signal this rank received (another rank may have received it instead).
    pub signal: Option<i32>,
    /// The step saved.
    pub step: u64,
    /// The checkpoint written.
    pub checkpoint: PathBuf,
}

/// A run's checkpoint schedule and the saves and loads it makes.
pub struct Checkpointer {
    dir: PathBuf,
    every: u64,
    keep: usize,
    async_save: bool,
    rank: usize,
    world: usize,
    device: Device,
    /// The manifest's fields that stay the same for the whole run.
    template: Manifest,
    /// An asynchronous save still being written.
    pending: Option<save::Pending>,
    /// The host buffer of asynchronous saves, kept from one to the next.
    snapshot: Option<Vec<u8>>,
    /// Rank 0's thread deleting checkpoints beyond `keep`.
    pruner: Option<std::thread::JoinHandle<()>>,
    /// Test hook: the step at whose save this rank kills itself.
    kill_at: Option<u64>,
    /// Test hook: the step at whose save this rank sends itself SIGTERM.
    signal_at: Option<u64>,
    /// The job's run id (rank 0's), recorded in every manifest.
    run_id: String,
    /// What fixes this run's data order, recorded and compared on resume.
    order: zrun_ckpt::DataOrder,
    /// `checkpoint.resume_changed`.
    resume_changed: crate::config::ResumeChanged,
    /// Rank 0's hold on the directory while the run lives.
    lock: Option<zrun_ckpt::DirLock>,
}

/// Rank `rank`'s step of a test hook `R:S` in the environment variable `var`.
fn hook_step(var: &str, rank: usize) -> Option<u64> {
    let v = std::env::var(var).ok()?;
    let (r, s) = v.split_once(':')?;
    (r.parse::<usize>().ok()? == rank).then(|| s.parse().ok())?
}

/// The view tables of `layout` as a checkpoint records them, each unit split into the
/// ranges the ranks of the job write: with hybrid sharding (`zero.shard_group`) the first
/// shard group's ranks write the model states and the replicas' ranks write empty ranges at
/// the unit's end, so every element is stored once.
pub fn unit_entries(layout: &ShardLayout) -> Vec<UnitEntry> {
    let g = layout.world_size;
    let w = g * layout.replicas;
    layout
        .units
        .iter()
        .map(|u| UnitEntry {
            name: u.unit.clone(),
            numel: u.numel as u64,
            views: u
                .views
                .iter()
                .map(|v| ViewEntry {
                    name: v.name.clone(),
                    shape: v.shape.iter().map(|&s| s as u64).collect(),
                    offset: v.offset as u64,
                    numel: v.numel as u64,
                    decay: v.decay,
                })
                .collect(),
            // The engine's own slices (padded, aligned), cut at the unit's end.
            shards: (0..w)
                .map(|r| {
                    let (off, len) = if r < g {
                        u.shard_range(r)
                    } else {
                        (u.numel, 0)
                    };
                    let start = off.min(u.numel) as u64;
                    zrun_ckpt::Shard {
                        start,
                        len: (off + len).min(u.numel) as u64 - start,
                    }
                })
                .collect(),
        })
        .collect()
}

/// The `[model]` of `cfg` as the manifest records it: the family, the training sequence
/// length, the Hugging Face `config.json` that `zrun export --hf` writes and the run's
/// tokenizer file, if any.
fn model_json(cfg: &Config) -> Result<serde_json::Value, Error> {
    let a = cfg.arch()?;
    let arch = match a {
        zrun_models::ArchConfig::Gpt(_) => "gpt",
        zrun_models::ArchConfig::Llama(_) => "llama",
    };
    // The tokenizer travels with exports: recorded as an absolute path.
    let tokenizer = crate::data::tokenizer_path(&cfg.data, cfg.model.init_from.as_deref())
        .and_then(|p| std::fs::canonicalize(p).ok())
        .map(|p| p.display().to_string());
    Ok(serde_json::json!({
        "arch": arch,
        "seq_len": a.seq_len(),
        "vocab_size": a.vocab_size(),
        "hf_config": a.to_hf_config(),
        "tokenizer": tokenizer,
        "special_tokens": special_tokens(cfg),
    }))
}

/// `bos_token_id`, `eos_token_id` and `pad_token_id` of `model.init_from`'s config.json, for
/// the export's: generation stops where the original model's does.
fn special_tokens(cfg: &Config) -> serde_json::Value {
    let Some(dir) = &cfg.model.init_from else {
        return serde_json::Value::Null;
    };
    let json: serde_json::Value = std::fs::read_to_string(crate::config::hf_config_path(dir))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let mut out = serde_json::Map::new();
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = json.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    serde_json::Value::Object(out)
}

/// Why `dir` cannot be written: a full disk, a quota or a file-size limit is a failure a
/// restart may get past (exit 1: `--max-restarts` tries again); anything else (permissions,
/// a read-only file system, a path through a file) is the config's (exit 2).
fn unwritable(dir: &Path, e: std::io::Error) -> Error {
    let place = format!("checkpoint.dir {}: cannot write there ({e})", dir.display());
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Error::Save(format!(
            "{place}; the disk is full: free space or point checkpoint.dir at a larger disk"
        )),
        Some(libc::EFBIG) => Error::Save(format!(
            "{place}; a file-size limit was hit (ulimit -f): raise it or free space"
        )),
        _ => Error::Config(crate::config::ConfigError(format!(
            "{place}; give a writable directory"
        ))),
    }
}

/// The file start-up writes (and removes) to see that checkpoint.dir can be written.
const WRITE_TEST: &str = ".zrun-write-test";

/// Makes `dir` ready for this run's saves (its lock held): first removes what failed or
/// interrupted saves left (on a full disk that frees the room the write test and the next
/// save need, so a rerun gets past a disk filled by the save before), then checks that a
/// file can be written there. Returns what it removed.
fn clear_and_test(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let removed = zrun_ckpt::remove_leftovers(dir).map_err(|e| match e {
        zrun_ckpt::Error::Io { source, .. } => unwritable(dir, source),
        other => Error::from(other),
    })?;
    write_test(&dir.join(WRITE_TEST), |f| {
        std::io::Write::write_all(f, b"ok")
    })
    .map_err(|e| unwritable(dir, e))?;
    Ok(removed)
}

/// Creates the file `path` (replacing one an earlier run left), writes it with `write`,
/// fsyncs it (a full disk may only show then) and removes it again, whether the write went
/// through or not: a failed write test leaves no file behind on a full disk. Opened without
/// blocking, so a FIFO at `path` is an error, not a wait for a reader.
fn write_test(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let wrote = write(&mut f).and_then(|()| f.sync_all());
    drop(f);
    let removed = std::fs::remove_file(path);
    wrote?;
    removed
}

impl Checkpointer {
    /// The schedule of `cfg` for `engine`'s rank.
    pub fn new(cfg: &Config, engine: &Engine) -> Result<Checkpointer, Error> {
        let comm = engine.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        let device = engine.config().device;
        let t = &cfg.train;
        let rng: Vec<String> = match device {
            Device::Cuda(_) => vec!["cpu".into(), "cuda".into()],
            _ => vec!["cpu".into()],
        };
        let run_id = identity::run_id(comm.as_ref(), device)?;
        let order = identity::data_order(cfg, world)?;
        let template = Manifest {
            format: zrun_ckpt::FORMAT.into(),
            format_version: zrun_ckpt::FORMAT_VERSION,
            zrun_version: env!("CARGO_PKG_VERSION").into(),
            step: 0,
            tokens_seen: 0,
            data: zrun_ckpt::DataPosition {
                next_sample: 0,
                global_batch: (t.micro_batch * t.grad_accum * world) as u64,
                seq_len: cfg.arch()?.seq_len() as u64,
            },
            model: model_json(cfg)?,
            world_size: world,
            stage: cfg.zero.stage.number(),
            precision: cfg.zero.precision.to_string(),
            offload: cfg.zero.offload_optimizer.to_string(),
            optimizer: zrun_ckpt::OptimizerState {
                name: "adamw".into(),
                steps: 0,
                state_dtype: engine.moment_dtype().to_string(),
                beta1: t.beta1,
                beta2: t.beta2,
                eps: t.eps,
                weight_decay: t.weight_decay,
            },
            schedule: zrun_ckpt::ScheduleState {
                step: 0,
                lr: 0.0,
                peak: t.lr,
                min: cfg.min_lr(),
                warmup_steps: t.warmup_steps,
                total_steps: t.steps,
            },
            loss_scaler: zrun_ckpt::ScalerState {
                enabled: cfg.zero.precision == Precision::Fp16,
                scale: 1.0,
                clean_steps: 0,
            },
            units: unit_entries(engine.layout()),
            ranks: (0..world)
                .map(|r| zrun_ckpt::RankEntry {
                    rank: r,
                    file: zrun_ckpt::rank_file_name(r),
                    rng: rng.clone(),
                })
                .collect(),
            files: Vec::new(),
            run: Some(zrun_ckpt::RunRecord {
                id: run_id.clone(),
                host: zrun_ckpt::hostname(),
            }),
            data_order: Some(order.clone()),
            delayed_params: false,
        };
        let kill_at = hook_step(KILL_IN_SAVE_ENV, rank);
        let signal_at = hook_step(SIGNAL_IN_SAVE_ENV, rank);
        // Asynchronous saves copy the state into host memory: take it now, touched, so the
        // first save blocks no longer than the others and the memory shows from the start.
        let snapshot = if cfg.checkpoint.async_save && cfg.checkpoint.every > 0 {
            let t = std::time::Instant::now();
            let bytes = save::file_bytes(engine)?;
            let buf = save::host_buffer(bytes);
            if rank == 0 {
                tracing::info!(
                    "checkpoint.async: {:.2} GiB of host memory per rank for the state snapshot ({:.1} s)",
                    bytes as f64 / (1u64 << 30) as f64,
                    t.elapsed().as_secs_f64()
                );
            }
            Some(buf)
        } else {
            None
        };
        Ok(Checkpointer {
            dir: cfg.checkpoint_dir(),
            every: cfg.checkpoint.every,
            keep: cfg.checkpoint.keep,
            async_save: cfg.checkpoint.async_save,
            rank,
            world,
            device,
            template,
            pending: None,
            snapshot,
            pruner: None,
            kill_at,
            signal_at,
            run_id,
            order,
            resume_changed: cfg.checkpoint.resume_changed,
            lock: None,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The job's run id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Rank 0 takes the directory for this run (refused while another live run holds it),
    /// removes what failed or interrupted saves left behind (temporary directories, step
    /// directories without a manifest), then makes sure it can be written (so a mistake shows
    /// now, not at the first save hours later). Every rank calls it, before the first save;
    /// all fail together when rank 0 fails.
    pub fn clean_up(&mut self, engine: &Engine) -> Result<(), Error> {
        let local = if self.rank == 0 {
            self.prepare_dir()
        } else {
            Ok(())
        };
        // Rank 0's exit code (0: it can), so that every rank stops alike: a full disk may be
        // retried by a restart, a forbidden directory not.
        let code = local.as_ref().err().map_or(0, Error::exit_code);
        let agreed = reduce(
            engine.comm().as_ref(),
            self.device,
            &[f64::from(code)],
            zrun_comm::ReduceOp::Sum,
        )?;
        local?;
        if agreed[0] > 0.0 {
            return Err(Error::Follows {
                code: agreed[0] as u8,
                message: format!(
                    "rank 0 cannot use checkpoint.dir {} (see its error)",
                    self.dir.display()
                ),
            });
        }
        Ok(())
    }

    fn prepare_dir(&mut self) -> Result<(), Error> {
        let unwritable = |e: std::io::Error| unwritable(&self.dir, e);
        std::fs::create_dir_all(&self.dir).map_err(unwritable)?;
        if self.lock.is_none() {
            let owner = zrun_ckpt::LockOwner::this_process(&self.run_id);
            let lock = zrun_ckpt::DirLock::acquire(&self.dir, owner)?;
            match &lock.acquired {
                zrun_ckpt::Acquired::FromExpired(o) => tracing::warn!(
                    "checkpoint.dir {}: taking it over from run {} on {}, whose lease expired",
                    self.dir.display(),
                    o.run_id,
                    o.host
                ),
                zrun_ckpt::Acquired::FromDead(o) => tracing::info!(
                    "checkpoint.dir {}: run {} (pid {}) held it and is gone",
                    self.dir.display(),
                    o.run_id,
                    o.pid
                ),
                _ => {}
            }
            self.lock = Some(lock);
        }
        for p in clear_and_test(&self.dir)? {
            tracing::warn!(
                "removed {}, left by a save that did not finish",
                p.display()
            );
        }
        Ok(())
    }

    /// Called after every optimizer step. Agrees with the other ranks on a stop request and
    /// on an asynchronous save in flight, saves when one is due (every `checkpoint.every`
    /// steps, at the last step, on a stop), and returns `Some` when the run must stop now.
    /// `also_stop` is a stop this rank asks for without a signal (its log cannot be written).
    pub fn at_boundary(
        &mut self,
        engine: &mut Engine,
        pos: &Position,
        last: bool,
        also_stop: bool,
    ) -> Result<Option<Stopped>, Error> {
        let signal = stop::requested();
        let busy = self.pending.as_ref().is_some_and(|p| !p.ready());
        let agreed = reduce(
            engine.comm().as_ref(),
            self.device,
            &[
                f64::from(u8::from(signal.is_some() || also_stop)),
                f64::from(u8::from(busy)),
            ],
            zrun_comm::ReduceOp::Sum,
        )?;
        let (stop, busy_anywhere) = (agreed[0] > 0.0 && !last, agreed[1] > 0.0);
        if self.pending.is_some() && !busy_anywhere {
            self.complete_pending(engine)?;
        }
        let due = self.every > 0 && (pos.step.is_multiple_of(self.every) || last);
        if !(due || stop) {
            return Ok(None);
        }
        if self.pending.is_some() {
            self.complete_pending(engine)?;
        }
        if self.async_save && !stop && !last {
            self.start_async(engine, pos)?;
            return Ok(None);
        }
        let path = self.save_now(engine, pos)?;
        if stop {
            return Ok(Some(Stopped {
                signal,
                step: pos.step,
                checkpoint: path,
            }));
        }
        if last {
            return Ok(None);
        }
        // A stop asked for while this save was written is met now, with the checkpoint just
        // saved: another step and a second save could miss checkpoint.signal_deadline_s.
        let late = stop::requested();
        let agreed = reduce(
            engine.comm().as_ref(),
            self.device,
            &[f64::from(u8::from(late.is_some()))],
            zrun_comm::ReduceOp::Sum,
        )?;
        Ok((agreed[0] > 0.0).then_some(Stopped {
            signal: late,
            step: pos.step,
            checkpoint: path,
        }))
    }

    /// Waits for an asynchronous save still in flight and completes it (every rank calls it
    /// at the same point).
    pub fn flush(&mut self, engine: &mut Engine) -> Result<(), Error> {
        if self.pending.is_some() {
            self.complete_pending(engine)?;
        }
        self.join_pruner();
        Ok(())
    }

    /// Waits for old checkpoints being deleted.
    fn join_pruner(&mut self) {
        if let Some(h) = self.pruner.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.join_pruner();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_test_removes_its_file() {
        let root = tempfile::tempdir().unwrap();
        let probe = root.path().join(WRITE_TEST);
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let e = write_test(&probe, |f| {
            std::io::Write::write_all(f, b"o")?;
            Err(full)
        })
        .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert!(!probe.exists(), "the write test's file is left behind");
        write_test(&probe, |f| std::io::Write::write_all(f, b"ok")).unwrap();
        assert!(!probe.exists());
    }

    #[test]
    fn a_failed_saves_leftovers_are_removed_before_the_write_test() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        let left = zrun_ckpt::tmp_dir(dir, 7);
        std::fs::create_dir_all(&left).unwrap();
        std::fs::write(left.join("rank-00000.safetensors"), b"partial").unwrap();
        // A write test that cannot pass: its file's name is taken by a directory.
        std::fs::create_dir(dir.join(WRITE_TEST)).unwrap();
        let e = clear_and_test(dir).unwrap_err();
        assert!(e.to_string().contains("cannot write there"), "{e}");
        assert!(!left.exists(), "the leftover must go before the write test");
        std::fs::remove_dir(dir.join(WRITE_TEST)).unwrap();
        assert!(clear_and_test(dir).unwrap().is_empty());
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0);
    }

    #[test]
    fn a_full_disk_is_restartable_and_a_forbidden_directory_is_bad_input() {
        let dir = Path::new("/ckpt");
        let code = |errno: i32| unwritable(dir, std::io::Error::from_raw_os_error(errno));
        for errno in [libc::ENOSPC, libc::EDQUOT, libc::EFBIG] {
            let e = code(errno);
            assert_eq!(e.exit_code(), 1, "{e}");
            assert!(
                e.to_string()
                    .starts_with("checkpoint.dir /ckpt: cannot write there"),
                "{e}"
            );
        }
        assert!(code(libc::ENOSPC).to_string().contains("the disk is full"));
        for errno in [libc::EACCES, libc::EROFS, libc::ENOTDIR] {
            assert_eq!(code(errno).exit_code(), 2, "{}", code(errno));
        }
    }
}
