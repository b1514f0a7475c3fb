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
    /// The writer; gives the snapshot buffer back for the next save.
    thread: JoinHandle<(Result<FileEntry, Error>, Vec<u8>)>,
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

/// Bytes of the tensors of this rank's file (what an asynchronous save holds in memory).
pub(super) fn file_bytes(engine: &Engine) -> Result<usize, Error> {
    Ok(plan(engine)?.specs.iter().map(TensorSpec::bytes).sum())
}

fn plan(engine: &Engine) -> Result<Plan, Error> {
    let moments = match engine.moment_dtype() {
        StateDtype::Fp32 => Dtype::F32,
        StateDtype::Bf16 => Dtype::Bf16,
    };
    let mut specs = Vec::new();
    let mut units = Vec::new();
    // Compute parameters behind the master (a delayed update pending) are saved after it.
    let delayed = engine.params_behind().then_some(Part::Delayed);
    for (u, l) in engine.layout().units.iter().enumerate() {
        let (_, len) = engine.saved_range(u);
        units.push(len > 0);
        if len == 0 {
            continue;
        }
        for part in Part::ALL.into_iter().chain(delayed) {
            specs.push(TensorSpec {
                name: tensor_name(&l.unit, part),
                dtype: match part {
                    Part::Master | Part::Delayed => Dtype::F32,
                    Part::ExpAvg | Part::ExpAvgSq => moments,
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
    /// Test hooks: kill this rank, or send it SIGTERM, halfway through writing the file of
    /// step `step`.
    fn maybe_die(&self, step: u64, written: usize, total: usize) {
        if self.signal_at == Some(step)
            && written * 2 >= total
            && crate::stop::requested().is_none()
        {
            tracing::warn!(
                "{}: sending this rank SIGTERM mid-save (test hook)",
                super::SIGNAL_IN_SAVE_ENV
            );
            // SAFETY: raise has no memory-safety preconditions; the handler only stores.
            unsafe {
                libc::raise(libc::SIGTERM);
            }
        }
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
            if *has {
                // Straight from the engine's memory: the training loop waits meanwhile.
                let mut put = |bytes: &[u8]| -> Result<(), Error> {
                    w.write(bytes)?;
                    n += 1;
                    self.maybe_die(step, n, total);
                    Ok(())
                };
                engine.visit_unit_state(u, |_, bytes| put(bytes))?;
                if engine.params_behind() {
                    engine.visit_delayed_params(u, put)?;
                }
            }
        }
        for state in &plan.rng {
            w.write(state)?;
        }
        Ok(w.finish()?)
    }

    /// Copies this rank's state into host memory (a buffer kept from one asynchronous save to
    /// the next) and writes it on a background thread; the checkpoint is completed at a later
    /// step boundary, once every rank's file is written.
    pub(crate) fn start_async(&mut self, engine: &mut Engine, pos: &Position) -> Result<(), Error> {
        let started = Instant::now();
        let counters = engine.counters()?;
        let plan = plan(engine)?;
        let sizes: Vec<usize> = plan.specs.iter().map(TensorSpec::bytes).collect();
        let total: usize = sizes.iter().sum();
        // The first save allocates (and touches) the buffer; later ones reuse it.
        let mut buf = self.snapshot.take().unwrap_or_else(|| host_buffer(total));
        buf.resize(total, 0);
        let mut at = 0;
        for (u, has) in plan.units.iter().enumerate() {
            if *has {
                let mut put = |bytes: &[u8]| -> Result<(), Error> {
                    buf[at..at + bytes.len()].copy_from_slice(bytes);
                    at += bytes.len();
                    Ok(())
                };
                engine.visit_unit_state(u, |_, bytes| put(bytes))?;
                if engine.params_behind() {
                    engine.visit_delayed_params(u, put)?;
                }
            }
        }
        for state in &plan.rng {
            buf[at..at + state.len()].copy_from_slice(state);
            at += state.len();
        }
        let (tmp, file) = (tmp_dir(&self.dir, pos.step), rank_file_name(self.rank));
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let specs = plan.specs;
        // Reads the host snapshot `buf` only (the device state was copied into it above, on
        // the model's thread): no CUDA call, so no current device to set.
        let thread = std::thread::Builder::new()
            .name("zrun-ckpt-write".into())
            .spawn(move || {
                let r = (|| {
                    let mut w = RankWriter::create(&tmp, &file, specs)?;
                    let mut at = 0;
                    for n in sizes {
                        w.write(&buf[at..at + n])?;
                        at += n;
                    }
                    Ok(w.finish()?)
                })();
                flag.store(true, Ordering::SeqCst);
                (r, buf)
            })
            .map_err(|e| Error::Save(format!("cannot start the checkpoint writer thread: {e}")))?;
        self.pending = Some(Pending {
            pos: *pos,
            counters,
            done,
            thread,
            started,
            blocked_s: started.elapsed().as_secs_f64(),
            bytes: total as u64,
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
        let written = match p.thread.join() {
            Ok((r, buf)) => {
                self.snapshot = Some(buf);
                r
            }
            Err(_) => Err(Error::Save("the checkpoint writer thread panicked".into())),
        };
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
        // ok flag (8 bytes), then the file's entry (size, digest: 32).
        let mut record = [0u8; 40];
        if let Ok(f) = &written {
            record[0] = 1;
            record[8..].copy_from_slice(&f.to_record());
        }
        let all = gather_bytes(comm.as_ref(), self.device, &record)?;
        let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] != 1).collect();
        if !failed.is_empty() {
            self.discard(step);
        }
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
                .map(|(r, rec)| {
                    let entry: [u8; 32] = rec[8..40].try_into().unwrap_or([0; 32]);
                    FileEntry::from_record(rank_file_name(r), &entry)
                })
                .collect();
            let manifest = self.manifest(pos, counters, files);
            outcome = zrun_ckpt::commit(&zrun_ckpt::tmp_dir(&self.dir, step), &manifest)
                .map(drop)
                .map_err(Error::from);
        }
        if outcome.is_err() {
            self.discard(step);
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
        // Rank 0 renamed the directory on its node: every rank must see its file there, as
        // it wrote it, before the checkpoint counts and older ones may go.
        let mine = all[self.rank][8..16]
            .try_into()
            .map(u64::from_le_bytes)
            .unwrap_or(0);
        let there = std::fs::metadata(final_dir.join(rank_file_name(self.rank)))
            .is_ok_and(|m| m.is_file() && m.len() == mine);
        let seen = gather_bytes(comm.as_ref(), self.device, &[u8::from(there)])?;
        let absent: Vec<usize> = (0..seen.len()).filter(|&r| seen[r][0] != 1).collect();
        if !absent.is_empty() {
            if self.rank == 0 {
                // Not a checkpoint any rank can resume from: out of the way of a later resume.
                let aside = final_dir.with_extension("incomplete");
                let _ = std::fs::rename(&final_dir, &aside);
            }
            return Err(Error::Save(format!(
                "checkpoint {}: rank(s) {absent:?} do not see their files in it after rank 0 committed it; checkpoint.dir must be one directory that every node sees (a shared file system); the older checkpoints are untouched",
                final_dir.display()
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
            self.prune();
        }
        Ok(final_dir)
    }

    /// Rank 0 removes the temporary directory of the save of `step`, which failed: called
    /// once every rank has reported how its write went (no rank writes into it any more, and
    /// the directory lock keeps other runs out), so on a full disk the room its partial files
    /// took is free again for a rerun. What cannot be removed is left to the next start-up's
    /// clean-up.
    fn discard(&self, step: u64) {
        if self.rank != 0 {
            return;
        }
        let tmp = tmp_dir(&self.dir, step);
        match std::fs::remove_dir_all(&tmp) {
            Ok(()) => tracing::info!("removed {}, the failed save's files", tmp.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                "could not remove {} ({e}); the next start removes it",
                tmp.display()
            ),
        }
    }

    /// Deletes the checkpoints beyond `checkpoint.keep` on a background thread (deleting
    /// gigabytes takes seconds, which training need not wait for); the newest one is
    /// complete already.
    fn prune(&mut self) {
        if self.keep == 0 {
            return;
        }
        self.join_pruner();
        let (dir, keep) = (self.dir.clone(), self.keep);
        let work = move || match zrun_ckpt::prune(&dir, keep) {
            Ok(gone) => {
                for g in gone {
                    tracing::info!("removed {} (checkpoint.keep = {keep})", g.display());
                }
            }
            Err(e) => tracing::warn!("could not remove old checkpoints: {e}"),
        };
        let spawned = std::thread::Builder::new()
            .name("zrun-ckpt-prune".into())
            .spawn(work);
        match spawned {
            Ok(h) => self.pruner = Some(h),
            Err(e) => tracing::warn!("could not start removing old checkpoints: {e}"),
        }
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
        m.delayed_params = counters.params_behind;
        m.files = files;
        m
    }
}

/// A zeroed buffer of `n` bytes backed by transparent huge pages where the kernel allows it
/// (`madvise` mode): touching it the first time then takes 2 MiB page faults instead of
/// 4 KiB ones, 512 times fewer.
pub(super) fn host_buffer(n: usize) -> Vec<u8> {
    const HUGE: usize = 2 << 20;
    let mut v = Vec::<u8>::with_capacity(n);
    let p = v.as_mut_ptr() as usize;
    let (start, end) = (p.next_multiple_of(HUGE), (p + n) / HUGE * HUGE);
    if end > start {
        // SAFETY: [start, end) lies inside the allocation just made and not yet touched;
        // madvise only changes how the kernel backs it.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    v.resize(n, 0);
    v
}
