//! Resuming: pick the checkpoint (`checkpoint.resume`), let every rank verify the files it
//! needs, agree, then read each rank's new slices from whatever ranks wrote them.

use std::path::{Path, PathBuf};

use tch::Device;
use zrun_ckpt::{complete, Checkpoint, Part, Reader};
use zrun_comm::ReduceOp;
use zrun_shard::{Counters, Engine, StatePart};

use super::{unit_entries, Checkpointer};
use crate::reduce::reduce;
use crate::Error;

/// The checkpoint a run resumed from.
#[derive(Clone, Debug, PartialEq)]
pub struct Resumed {
    /// Its directory.
    pub dir: PathBuf,
    /// Steps it had completed.
    pub step: u64,
    /// The first sample of the next step.
    pub next_sample: u64,
    /// Samples per step of the run that wrote it.
    pub global_batch: u64,
    /// Ranks that wrote it.
    pub world_size: usize,
    /// Their ZeRO stage.
    pub stage: u8,
    /// Their precision.
    pub precision: String,
    /// Their optimizer offload.
    pub offload: String,
}

/// How a rank found a candidate checkpoint.
enum Verdict {
    Usable,
    /// A missing, truncated or altered file: an older checkpoint may do.
    Damaged(String),
    /// Anything else (another model, a newer format, an I/O error): stop.
    Fatal(String),
}

impl Verdict {
    fn of(e: &zrun_ckpt::Error) -> Verdict {
        if e.is_damaged() {
            Verdict::Damaged(e.to_string())
        } else {
            Verdict::Fatal(e.to_string())
        }
    }
}

/// Where `TORCHELASTIC_RESTART_COUNT` says this is a restart of the job.
fn restarted() -> bool {
    std::env::var("TORCHELASTIC_RESTART_COUNT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > 0)
}

impl Checkpointer {
    /// The checkpoints to try, best first, for `checkpoint.resume = spec`; the bool says a
    /// candidate was named explicitly (damage is then an error, not a reason to fall back).
    fn candidates(&self, spec: &str) -> Result<Vec<(PathBuf, bool)>, Error> {
        let in_dir = complete(&self.dir)?;
        let newest_first = |after: u64| {
            in_dir
                .iter()
                .rev()
                .filter(|(s, _)| *s > after)
                .map(|(_, p)| (p.clone(), false))
                .collect::<Vec<_>>()
        };
        match spec {
            "auto" => Ok(newest_first(0)),
            // A restarted job continues what its first attempt saved.
            "none" if restarted() => Ok(newest_first(0)),
            "none" => match in_dir.last() {
                None => Ok(Vec::new()),
                Some((step, p)) => Err(Error::Resume(format!(
                    "checkpoint.resume = \"none\" but checkpoint.dir {} already holds checkpoints (newest {}, step {step}) that a later \"auto\" resume would mix with this run's; set checkpoint.dir to a new directory, or remove them",
                    self.dir.display(),
                    p.display()
                ))),
            },
            path => {
                let path = PathBuf::from(path);
                let step = Checkpoint::open(&path)
                    .map_err(|e| Error::Resume(format!("checkpoint.resume = {:?}: {e}", path.display().to_string())))?
                    .manifest
                    .step;
                // Newer checkpoints of this run (it was restarted) come first.
                let mut out = newest_first(step);
                out.retain(|(p, _)| !same_dir(p, &path));
                out.push((path, true));
                Ok(out)
            }
        }
    }

    /// Loads the checkpoint `checkpoint.resume` names into `engine`, verifying every file
    /// this rank reads; with `"auto"` a damaged newest checkpoint is reported and the one
    /// before it is used. Every rank calls it. `None`: start fresh.
    pub fn resume(&self, engine: &mut Engine, spec: &str) -> Result<Option<Resumed>, Error> {
        let candidates = self.candidates(spec)?;
        let mut damaged = Vec::new();
        for (dir, explicit) in &candidates {
            if let Some(r) = self.try_load(engine, dir, *explicit, &mut damaged)? {
                return Ok(Some(r));
            }
        }
        if damaged.is_empty() {
            return Ok(None);
        }
        Err(Error::Resume(format!(
            "no usable checkpoint in {}: {} damaged (see above); move them out of checkpoint.dir to start fresh",
            self.dir.display(),
            damaged.join(", ")
        )))
    }

    /// Reads `dir` into the engine on every rank (each rank verifying every file it read),
    /// and completes the load if every rank could; `None` when it is damaged somewhere and an
    /// older one may be tried (it is then loaded over what was read here).
    fn try_load(
        &self,
        engine: &mut Engine,
        dir: &Path,
        explicit: bool,
        damaged: &mut Vec<String>,
    ) -> Result<Option<Resumed>, Error> {
        let opened = Checkpoint::open(dir);
        let mut rng = Vec::new();
        let verdict = match &opened {
            Ok(ckpt) => self.read_verified(engine, ckpt, &mut rng),
            Err(e) => Verdict::of(e),
        };
        let (is_damaged, is_fatal) = match &verdict {
            Verdict::Usable => (0.0, 0.0),
            Verdict::Damaged(_) => (1.0, 0.0),
            Verdict::Fatal(_) => (0.0, 1.0),
        };
        let comm = engine.comm().clone();
        let agreed = reduce(
            comm.as_ref(),
            self.device,
            &[is_damaged, is_fatal],
            ReduceOp::Sum,
        )?;
        let here = format!("rank {}", self.rank);
        match verdict {
            Verdict::Fatal(e) => return Err(Error::Resume(format!("{here}: {e}"))),
            Verdict::Damaged(e) if explicit => return Err(Error::Resume(format!("{here}: {e}"))),
            Verdict::Damaged(e) => tracing::error!("{here}: {e}"),
            Verdict::Usable => {}
        }
        if agreed[1] > 0.0 || (explicit && agreed[0] > 0.0) {
            return Err(Error::Resume(format!(
                "checkpoint {}: another rank cannot use it (see its error)",
                dir.display()
            )));
        }
        if agreed[0] > 0.0 {
            damaged.push(dir.display().to_string());
            if self.rank == 0 {
                // Out of the way of the saves to come (this run will save that step again),
                // kept for a look at what happened.
                let aside = set_aside(dir);
                tracing::warn!(
                    "checkpoint {} is damaged (see above){}; trying the one before it",
                    dir.display(),
                    aside.map_or(String::new(), |p| format!(", moved to {}", p.display()))
                );
            }
            return Ok(None);
        }
        let ckpt = opened?;
        for (device, state) in rng {
            zrun_torch_ext::rng::set_state(device, &state)?;
        }
        let m = &ckpt.manifest;
        engine.finish_load(Counters {
            optimizer_steps: m.optimizer.steps,
            // The saved scale only means something to a run that scales (fp16 both times).
            loss_scale: if m.loss_scaler.enabled {
                m.loss_scaler.scale
            } else {
                engine.loss_scale()
            },
            clean_steps: if m.loss_scaler.enabled {
                m.loss_scaler.clean_steps
            } else {
                0
            },
        })?;
        Ok(Some(Resumed {
            dir: dir.to_path_buf(),
            step: m.step,
            next_sample: m.data.next_sample,
            global_batch: m.data.global_batch,
            world_size: m.world_size,
            stage: m.stage,
            precision: m.precision.clone(),
            offload: m.offload.clone(),
        }))
    }

    /// Reads this rank's slice of every unit of `ckpt` into the engine and its generator
    /// states into `rng`, then verifies every file it read: whether the data can be used.
    fn read_verified(
        &self,
        engine: &mut Engine,
        ckpt: &Checkpoint,
        rng: &mut Vec<(Device, Vec<u8>)>,
    ) -> Verdict {
        let mine = unit_entries(engine.layout());
        if let Err(e) = ckpt.manifest.check_units(&ckpt.dir, &mine) {
            return Verdict::of(&e);
        }
        let mut reader: Reader = ckpt.reader();
        let device = engine.config().device;
        let read = (|| -> Result<(), Error> {
            for u in 0..mine.len() {
                let start = engine.loaded_range(u).0 as u64;
                engine.load_unit_with(u, |part, buf| -> Result<(), Error> {
                    let part = match part {
                        StatePart::Master => Part::Master,
                        StatePart::ExpAvg => Part::ExpAvg,
                        StatePart::ExpAvgSq => Part::ExpAvgSq,
                    };
                    Ok(reader.read(u, part, start, buf)?)
                })?;
            }
            if let Some(state) = reader.rng(self.rank, "cpu")? {
                rng.push((Device::Cpu, state));
            }
            if let (Device::Cuda(_), Some(state)) = (device, reader.rng(self.rank, "cuda")?) {
                rng.push((device, state));
            }
            Ok(reader.verify()?)
        })();
        match read {
            Ok(()) => Verdict::Usable,
            Err(Error::Ckpt(e)) => Verdict::of(&e),
            Err(e) => Verdict::Fatal(e.to_string()),
        }
    }
}

/// Renames the damaged checkpoint `dir` to `dir.damaged` (or `.damaged-2`, ...); `None` when
/// that fails (it then stays where it is).
fn set_aside(dir: &Path) -> Option<PathBuf> {
    let name = dir.file_name()?.to_string_lossy().into_owned();
    let target = (1..100)
        .map(|i| match i {
            1 => dir.with_file_name(format!("{name}.damaged")),
            i => dir.with_file_name(format!("{name}.damaged-{i}")),
        })
        .find(|p| !p.exists())?;
    std::fs::rename(dir, &target).ok().map(|()| target)
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}
