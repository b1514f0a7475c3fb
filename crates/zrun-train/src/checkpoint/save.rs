//! Saving: each rank writes its file (straight from the engine, or from a host snapshot on a
//! background thread), the ranks exchange the files' sizes and hashes, rank 0 commits.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use tch::Device;
use zrun_ckpt::{rank_file_name, rng_name, tensor_name, tmp_dir, Dtype, FileEntry, Part};
use zrun_ckpt::{RankWriter, TensorSpec};
use zrun_shard::{Counters, Engine, StateDtype};

use super::{Checkpointer, Position};
use crate::reduce::{gather_bytes, reduce};
use crate::Error;

/// An asynchronous save: this rank's file is being written by a thread from a snapshot.
pub(crate) struct Pending {
    pos: Position,
    counters: Counters,
    done: Arc<AtomicBool>,
    thread: JoinHandle<Result<FileEntry, Error>>,
    started: Instant,
    /// Seconds the training loop was blocked (taking the snapshot).
    blocked_s: f64,
    /// Host bytes of the snapshot.
    bytes: u64,
}

impl Pending {
    /// Whether this rank's file is written (successfully or not).
    pub(crate) fn ready(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }
}

/// A rank's file: its tensors in order, and where each one's bytes come from.
struct Plan {
    specs: Vec<TensorSpec>,
    /// (unit, whether it has elements here) in model order.
    units: Vec<bool>,
    rng: Vec<Vec<u8>>,
}

/// The random-generator states this rank saves (`cpu`, and `cuda` on a GPU).
fn rng_states(device: Device) -> Result<Vec<(String, Vec<u8>)>, Error> {
    let mut out = vec![("cpu".to_string(), zrun_torch_ext::rng::state(Device::Cpu)?)];
    if let Device::Cuda(_) = device {
        out.push(("cuda".to_string(), zrun_torch_ext::rng::state(device)?));
    }
    Ok(out)
}

fn plan(engine: &Engine) -> Result<Plan, Error> {
    let moments = match engine.moment_dtype() {
        StateDtype::Fp32 => Dtype::F32,
        StateDtype::Bf16 => Dtype::Bf16,
    };
    let mut specs = Vec::new();
    let mut units = Vec::new();
    for (u, l) in engine.layout().units.iter().enumerate() {
        let (_, len) = engine.saved_range(u);
        units.push(len > 0);
        if len == 0 {
            continue;
        }
        for part in Part::ALL {
            specs.push(TensorSpec {
                name: tensor_name(&l.unit, part),
                dtype: if part == Part::Master {
                    Dtype::F32
                } else {
                    moments
                },
                shape: vec![len as usize],
            });
        }
    }
    let mut rng = Vec::new();
    for (device, state) in rng_states(engine.config().device)? {
        specs.push(TensorSpec {
            name: rng_name(&device),
            dtype: Dtype::U8,
            shape: vec![state.len()],
        });
        rng.push(state);
    }
    Ok(Plan { specs, units, rng })
}

impl Checkpointer {
    /// Test hook: kill this rank halfway through writing the file of step `step`.
    fn maybe_die(&self, step: u64, written: usize, total: usize) {
        if self.kill_at == Some(step) && written * 2 >= total {
            tracing::warn!(
                "{}: killing this rank mid-save (test hook)",
                super::KILL_IN_SAVE_ENV
            );
            // SAFETY: kill has no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }

    /// Writes this rank's file of `pos.step` straight from the engine, then completes the
    /// checkpoint with the other ranks; returns its directory.
    pub(crate) fn save_now(
        &mut self,
        engine: &mut Engine,
        pos: &Position,
    ) -> Result<PathBuf, Error> {
        let started = Instant::now();
        let counters = engine.counters()?;
        let written = self.write_from_engine(engine, pos.step);
        let blocked = started.elapsed().as_secs_f64();
        self.complete(engine, pos, counters, written, started, blocked)
    }

    fn write_from_engine(&self, engine: &mut Engine, step: u64) -> Result<FileEntry, Error> {
        let plan = plan(engine)?;
        let tmp = tmp_dir(&self.dir, step);
        let total = plan.specs.len();
        let mut w = RankWriter::create(&tmp, &rank_file_name(self.rank), plan.specs)?;
        let mut n = 0;
        for (u, has) in plan.units.iter().enumerate() {
            if !has {
                continue;
            }
            let s = engine.unit_state(u)?;
            for bytes in [&s.master, &s.exp_avg, &s.exp_avg_sq] {
                w.write(bytes)?;
                n += 1;
                self.maybe_die(step, n, total);
            }
        }
        for state in &plan.rng {
            w.write(state)?;
        }
        Ok(w.finish()?)
    }

    /// Snapshots this rank's state to host memory and writes it on a background thread; the
    /// checkpoint is completed at a later step boundary, once every rank's file is written.
    pub(crate) fn start_async(&mut self, engine: &mut Engine, pos: &Position) -> Result<(), Error> {
        let started = Instant::now();
        let counters = engine.counters()?;
        let plan = plan(engine)?;
        let mut data: Vec<Vec<u8>> = Vec::with_capacity(plan.specs.len());
        for (u, has) in plan.units.iter().enumerate() {
            if *has {
                let s = engine.unit_state(u)?;
                data.extend([s.master, s.exp_avg, s.exp_avg_sq]);
            }
        }
        data.extend(plan.rng);
        let bytes = data.iter().map(|d| d.len() as u64).sum();
        let (tmp, file) = (tmp_dir(&self.dir, pos.step), rank_file_name(self.rank));
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let specs = plan.specs;
        let thread = std::thread::Builder::new()
            .name("zrun-ckpt-write".into())
            .spawn(move || {
                let r = (|| {
                    let mut w = RankWriter::create(&tmp, &file, specs)?;
                    for d in &data {
                        w.write(d)?;
                    }
                    Ok(w.finish()?)
                })();
                flag.store(true, Ordering::SeqCst);
                r
            })
            .map_err(|e| Error::Save(format!("cannot start the checkpoint writer thread: {e}")))?;
        self.pending = Some(Pending {
            pos: *pos,
            counters,
            done,
            thread,
            started,
            blocked_s: started.elapsed().as_secs_f64(),
            bytes,
        });
        Ok(())
    }

    /// Waits for the asynchronous save in flight and completes it with the other ranks.
    pub(crate) fn complete_pending(&mut self, engine: &mut Engine) -> Result<PathBuf, Error> {
        let p = self
            .pending
            .take()
            .ok_or_else(|| Error::Save("no checkpoint save is in flight".into()))?;
        let wait = Instant::now();
        let was_ready = p.ready();
        let written = p
            .thread
            .join()
            .unwrap_or_else(|_| Err(Error::Save("the checkpoint writer thread panicked".into())));
        // Blocked: taking the snapshot, plus waiting here for a write that was not done.
        let waited = if was_ready {
            0.0
        } else {
            wait.elapsed().as_secs_f64()
        };
        let blocked = p.blocked_s + waited;
        if self.rank == 0 {
            tracing::debug!(
                "asynchronous save of step {}: {} MiB snapshot on this rank",
                p.pos.step,
                p.bytes >> 20
            );
        }
        self.complete(engine, &p.pos, p.counters, written, p.started, blocked)
    }

    /// The ranks exchange how their writes went; if every file is written, rank 0 writes the
    /// manifest and renames the directory into place, and all agree that it did.
    fn complete(
        &mut self,
        engine: &mut Engine,
        pos: &Position,
        counters: Counters,
        written: Result<FileEntry, Error>,
        started: Instant,
        blocked_s: f64,
    ) -> Result<PathBuf, Error> {
        let step = pos.step;
        let final_dir = zrun_ckpt::step_dir(&self.dir, step);
        let comm = engine.comm().clone();
        // ok flag (8 bytes), size (8), BLAKE3 (32).
        let mut record = [0u8; 48];
        if let Ok(f) = &written {
            record[0] = 1;
            record[8..16].copy_from_slice(&f.bytes.to_le_bytes());
            if let Some(h) = decode_hex(&f.blake3) {
                record[16..48].copy_from_slice(&h);
            }
        }
        let all = gather_bytes(comm.as_ref(), self.device, &record)?;
        let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] != 1).collect();
        if let Err(e) = written {
            return Err(Error::Save(format!(
                "checkpoint of step {step}: rank {} could not write its file: {e}; the older checkpoints are untouched",
                self.rank
            )));
        }
        if !failed.is_empty() {
            return Err(Error::Save(format!(
                "checkpoint of step {step}: rank(s) {failed:?} could not write their files (see their errors); the older checkpoints are untouched"
            )));
        }
        let mut outcome = Ok(());
        if self.rank == 0 {
            let files = all
                .iter()
                .enumerate()
                .map(|(r, rec)| FileEntry {
                    name: rank_file_name(r),
                    bytes: u64::from_le_bytes(rec[8..16].try_into().unwrap_or_default()),
                    blake3: rec[16..48].iter().map(|b| format!("{b:02x}")).collect(),
                })
                .collect();
            let manifest = self.manifest(pos, counters, files);
            outcome = zrun_ckpt::commit(&zrun_ckpt::tmp_dir(&self.dir, step), &manifest)
                .map(drop)
                .map_err(Error::from);
        }
        let ok = reduce(
            comm.as_ref(),
            self.device,
            &[f64::from(u8::from(outcome.is_ok()))],
            zrun_comm::ReduceOp::Sum,
        )?;
        outcome?;
        if ok[0] < self.world as f64 {
            return Err(Error::Save(format!(
                "checkpoint of step {step}: rank 0 could not commit it (see its error); the older checkpoints are untouched"
            )));
        }
        if self.rank == 0 {
            let bytes: u64 = all
                .iter()
                .map(|r| u64::from_le_bytes(r[8..16].try_into().unwrap_or_default()))
                .sum();
            tracing::info!(
                "saved checkpoint {} ({:.1} MiB in {} file(s), {:.2} s, training blocked {:.2} s)",
                final_dir.display(),
                bytes as f64 / (1 << 20) as f64,
                self.world,
                started.elapsed().as_secs_f64(),
                blocked_s
            );
            match zrun_ckpt::prune(&self.dir, self.keep) {
                Ok(gone) => {
                    for g in gone {
                        tracing::info!("removed {} (checkpoint.keep = {})", g.display(), self.keep);
                    }
                }
                Err(e) => tracing::warn!("could not remove old checkpoints: {e}"),
            }
        }
        Ok(final_dir)
    }

    /// The manifest of the checkpoint at `pos`.
    fn manifest(
        &self,
        pos: &Position,
        counters: Counters,
        files: Vec<FileEntry>,
    ) -> zrun_ckpt::Manifest {
        let mut m = self.template.clone();
        m.step = pos.step;
        m.tokens_seen = pos.next_sample * m.data.seq_len;
        m.data.next_sample = pos.next_sample;
        m.optimizer.steps = counters.optimizer_steps;
        m.schedule.step = pos.step;
        m.schedule.lr = pos.lr;
        m.loss_scaler.scale = counters.loss_scale;
        m.loss_scaler.clean_steps = counters.clean_steps;
        m.files = files;
        m
    }
}

fn decode_hex(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if s.len() != 64 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
