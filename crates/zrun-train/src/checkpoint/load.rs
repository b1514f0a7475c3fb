//! Resuming: pick the checkpoint (`checkpoint.resume`), let every rank verify the files it
//! needs, agree, then read each rank's new slices from whatever ranks wrote them.

use std::path::{Path, PathBuf};

use tch::Device;
use zrun_ckpt::{complete, Checkpoint, Part, Reader};
use zrun_shard::{Counters, Engine, StatePart};

use super::{identity, unit_entries, Checkpointer};
use crate::config::ResumeChanged;
use crate::reduce::{gather_bytes, reduce};
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
    /// Ranks that wrote it.
    pub world_size: usize,
    /// Their ZeRO stage.
    pub stage: u8,
    /// Their precision.
    pub precision: String,
    /// Their optimizer offload.
    pub offload: String,
    /// What fixed the data order of the run that wrote it.
    pub data_order: zrun_ckpt::DataOrder,
    /// That run's id, when recorded.
    pub run_id: Option<String>,
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

/// The run id a checkpoint's manifest records (`None`: unreadable, or an older version).
fn written_by(dir: &Path) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Head {
        run: Option<zrun_ckpt::RunRecord>,
    }
    let text = std::fs::read(dir.join(zrun_ckpt::MANIFEST)).ok()?;
    let head: Head = serde_json::from_slice(&text).ok()?;
    head.run.map(|r| r.id)
}

/// A list of candidates as every rank can compare it: (count, newest step, digest).
fn fingerprint(list: &[(PathBuf, bool)]) -> (u64, u64, [u8; 16]) {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut newest = 0;
    for (p, explicit) in list {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
        h.update(name.unwrap_or_default().as_bytes());
        h.update(&[u8::from(*explicit), 0]);
        if let Some(step) = p
            .file_name()
            .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse::<u64>().ok())
        {
            newest = newest.max(step);
        }
    }
    (list.len() as u64, newest, h.digest128().to_le_bytes())
}

impl Checkpointer {
    /// The checkpoints to try, best first, for `checkpoint.resume = spec`; the bool says a
    /// candidate was named explicitly (damage is then an error, not a reason to fall back).
    ///
    /// `auto` takes any checkpoint in the directory (whoever wrote it; the data order is
    /// compared once one is read). `none` and a path continue only what this run wrote
    /// since (a restart of it, keyed on the run id, not on the restart count): `none`
    /// refuses a directory holding another run's checkpoints, a path refuses one holding
    /// another run's checkpoints newer than it (this run would save over them).
    fn candidates(&self, spec: &str) -> Result<Vec<(PathBuf, bool)>, Error> {
        let in_dir = complete(&self.dir)?;
        let ours = |p: &Path| written_by(p).as_deref() == Some(self.run_id.as_str());
        let newest_first = |after: u64, own: bool| {
            in_dir
                .iter()
                .rev()
                .filter(|(s, p)| *s > after && (!own || ours(p)))
                .map(|(_, p)| (p.clone(), false))
                .collect::<Vec<_>>()
        };
        let foreign = |after: u64| {
            in_dir
                .iter()
                .rev()
                .find(|(s, p)| *s > after && !ours(p))
                .cloned()
        };
        match spec {
            "auto" => Ok(newest_first(0, false)),
            "none" => match foreign(0) {
                None => Ok(newest_first(0, true)),
                Some((step, p)) => Err(Error::Resume(format!(
                    "checkpoint.resume = \"none\" but checkpoint.dir {} already holds checkpoints of another run (newest {}, step {step}) that a later \"auto\" resume would mix with this run's; set checkpoint.dir to a new directory, or remove them",
                    self.dir.display(),
                    p.display()
                ))),
            },
            path => {
                let path = PathBuf::from(path);
                if !path.exists() {
                    return Err(Error::Resume(format!(
                        "checkpoint.resume = {:?}: there is no such directory; give a checkpoint's directory (such as {}), \"auto\" or \"none\"",
                        path.display().to_string(),
                        self.dir.join("step-00000100").display()
                    )));
                }
                let step = Checkpoint::open(&path)
                    .map_err(|e| Error::Resume(format!("checkpoint.resume = {:?}: {e}", path.display().to_string())))?
                    .manifest
                    .step;
                if let Some((newer, p)) = foreign(step).filter(|(_, p)| !same_dir(p, &path)) {
                    return Err(Error::Resume(format!(
                        "checkpoint.resume names step {step} ({}), but checkpoint.dir {} holds {} (step {newer}) of another run: this run would save over it; move the newer checkpoints out of checkpoint.dir or give another checkpoint.dir",
                        path.display(),
                        self.dir.display(),
                        p.display()
                    )));
                }
                // Newer checkpoints of this very run (it was restarted) come first.
                let mut out = newest_first(step, true);
                out.retain(|(p, _)| !same_dir(p, &path));
                out.push((path, true));
                Ok(out)
            }
        }
    }

    /// The candidates of `spec`, the same on every rank: each rank lists `checkpoint.dir`
    /// itself, and all compare their lists with rank 0's (a node-local directory, or a
    /// mount that caches listings, would have ranks load different steps).
    fn agreed_candidates(
        &self,
        engine: &Engine,
        spec: &str,
    ) -> Result<Vec<(PathBuf, bool)>, Error> {
        let listed = self.candidates(spec);
        let (n, newest, digest) = listed.as_ref().map_or((0, 0, [0; 16]), |l| fingerprint(l));
        // 0, or this rank's exit code: the others stop with the same one.
        let mut record = vec![listed.as_ref().err().map_or(0, Error::exit_code)];
        record.extend(n.to_le_bytes());
        record.extend(newest.to_le_bytes());
        record.extend(digest);
        let all = gather_bytes(engine.comm().as_ref(), self.device, &record)?;
        let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] != 0).collect();
        let listed = listed?;
        if !failed.is_empty() {
            return Err(Error::Follows {
                code: all[failed[0]][0],
                message: format!(
                    "rank(s) {failed:?} cannot resume from checkpoint.dir {} (see their errors)",
                    self.dir.display()
                ),
            });
        }
        let seen = |r: usize| {
            let w = |i: usize| u64::from_le_bytes(all[r][i..i + 8].try_into().unwrap_or_default());
            format!("rank {r}: {} checkpoint(s), newest step {}", w(1), w(9))
        };
        let differ: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
        if !differ.is_empty() {
            let theirs: Vec<String> = differ.iter().map(|&r| seen(r)).collect();
            return Err(Error::Resume(format!(
                "ranks {differ:?} see other checkpoints in checkpoint.dir {} than rank 0 ({}; {}): every rank must see one shared directory (a node-local directory, or a mount that caches listings, shows each node something else)",
                self.dir.display(),
                seen(0),
                theirs.join("; ")
            )));
        }
        Ok(listed)
    }

    /// Loads the checkpoint `checkpoint.resume` names into `engine`, verifying every file
    /// this rank reads; with `"auto"` a damaged newest checkpoint is reported and the one
    /// before it is used. Every rank calls it. `None`: start fresh.
    pub fn resume(&self, engine: &mut Engine, spec: &str) -> Result<Option<Resumed>, Error> {
        let candidates = self.agreed_candidates(engine, spec)?;
        let mut damaged = Vec::new();
        for (dir, explicit) in &candidates {
            if let Some(r) = self.try_load(engine, dir, *explicit, &mut damaged)? {
                self.check_order(engine, &r)?;
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

    /// Compares the data order `r` recorded with this run's: a change is an error naming
    /// every changed key, unless `checkpoint.resume_changed = "allow"` (then a warning).
    /// Rank 0 decides for all (the ranks may see the data file's size differently).
    fn check_order(&self, engine: &Engine, r: &Resumed) -> Result<(), Error> {
        let changes = identity::changes(&r.data_order, &self.order);
        let refuse = !changes.is_empty() && self.resume_changed == ResumeChanged::Refuse;
        let mine = if self.rank == 0 {
            f64::from(u8::from(refuse))
        } else {
            0.0
        };
        let decided = reduce(
            engine.comm().as_ref(),
            self.device,
            &[mine],
            zrun_comm::ReduceOp::Sum,
        )?;
        let what = if changes.is_empty() {
            "the data order changed (see rank 0's error)".to_string()
        } else {
            changes.join("; ")
        };
        if decided[0] > 0.0 {
            return Err(Error::Resume(format!(
                "checkpoint {} was written with other data settings: {what}; resuming would train on other samples than its run would have: set checkpoint.resume_changed = \"allow\" to resume anyway, or give another checkpoint.dir to start fresh",
                r.dir.display()
            )));
        }
        if self.rank == 0 && !changes.is_empty() {
            tracing::warn!(
                "resuming {} with other data settings (checkpoint.resume_changed = \"allow\"): {what}",
                r.dir.display()
            );
        }
        Ok(())
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
        let status: u8 = match &verdict {
            Verdict::Usable => 0,
            Verdict::Damaged(_) => 1,
            Verdict::Fatal(_) => 2,
        };
        // Every rank read the manifest itself: the ranks that could use it must have read
        // the same one.
        let digest = match &opened {
            Ok(c) => manifest_digest(&c.manifest),
            Err(_) => [0; 16],
        };
        let mut record = vec![status];
        record.extend(digest);
        let comm = engine.comm().clone();
        let all = gather_bytes(comm.as_ref(), self.device, &record)?;
        let anywhere = |status: u8| all.iter().any(|r| r[0] == status);
        let (damaged_somewhere, fatal_somewhere) = (anywhere(1), anywhere(2));
        let here = format!("rank {}", self.rank);
        let usable: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == 0).collect();
        let other: Vec<usize> = usable
            .iter()
            .copied()
            .filter(|&r| all[r][1..] != all[usable[0]][1..])
            .collect();
        if !other.is_empty() {
            return Err(Error::Resume(format!(
                "checkpoint {}: ranks {other:?} read another manifest.json than rank {}: every rank must see one shared checkpoint.dir",
                dir.display(),
                usable[0]
            )));
        }
        match verdict {
            // The launcher names the rank of each line: without the rank in it, an error
            // every rank meets (another model) is shown once.
            Verdict::Fatal(e) => return Err(Error::Resume(e)),
            Verdict::Damaged(e) if explicit => return Err(Error::Resume(e)),
            Verdict::Damaged(e) => tracing::error!("{here}: {e}"),
            Verdict::Usable => {}
        }
        if fatal_somewhere || (explicit && damaged_somewhere) {
            return Err(Error::Resume(format!(
                "checkpoint {}: another rank cannot use it (see its error)",
                dir.display()
            )));
        }
        if damaged_somewhere {
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
        if self.rank == 0 {
            ckpt.warn_if_unsealed();
        }
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
            params_behind: m.delayed_params,
        })?;
        Ok(Some(Resumed {
            data_order: identity::recorded(m, &self.order),
            run_id: m.run.as_ref().map(|r| r.id.clone()),
            dir: dir.to_path_buf(),
            step: m.step,
            next_sample: m.data.next_sample,
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
        let fix = "use the same [model] settings, or another checkpoint.dir (or \
                   model.init_from on a `zrun export --hf` of it, to train another model from \
                   its weights)";
        let m = &ckpt.manifest;
        if let Err(e) = m
            .check_model(&ckpt.dir, &self.template.model, fix)
            .and_then(|()| m.check_units(&ckpt.dir, &mine, fix))
        {
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
                if ckpt.manifest.delayed_params {
                    // Read only where this run delays its updates too.
                    engine.load_delayed_params(u, |buf| -> Result<(), Error> {
                        Ok(reader.read(u, Part::Delayed, start, buf)?)
                    })?;
                }
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

/// A digest of a manifest as this rank read it.
fn manifest_digest(m: &zrun_ckpt::Manifest) -> [u8; 16] {
    let bytes = serde_json::to_vec(m).unwrap_or_default();
    xxhash_rust::xxh3::xxh3_128(&bytes).to_le_bytes()
}
