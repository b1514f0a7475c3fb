//! An allocation that failed for want of memory: the diagnosis (the phase and request, what
//! was held by kind, the allocator's view, the estimate for this config and the cheapest
//! changes predicted to fit), written to `<log.dir>/oom-rank-N.txt` for the launcher to print
//! once.

use crate::config::Config;
use crate::memory::{alternatives, fits, human};
use crate::report::MemoryByKind;
use crate::Error;
use zrun_shard::Estimate;

/// A rank's allocation that failed for want of memory, with the diagnosis written for it.
#[derive(Debug)]
pub struct OutOfMemory {
    /// The rank.
    pub rank: usize,
    /// Where it happened, e.g. `"backward of unit h.3"`.
    pub phase: String,
    /// The bytes the failed allocation asked for, when the allocator said.
    pub bytes: Option<i64>,
    /// The diagnosis: what was held by kind, the allocator's view, the estimate and the fixes.
    pub report: String,
    /// Where the diagnosis was written (`<log.dir>/oom-rank-N.txt`), when it could be.
    pub file: Option<std::path::PathBuf>,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tried = self
            .bytes
            .map_or_else(String::new, |b| format!(" allocating {}", human(b)));
        write!(
            f,
            "rank {}: out of memory in {}{tried}",
            self.rank, self.phase
        )?;
        match &self.file {
            Some(p) => write!(f, "; the diagnosis is in {}", p.display()),
            None => write!(f, "\n{}", self.report),
        }
    }
}

/// What a diagnosis is made of.
pub struct Diagnosis<'a> {
    /// The run's config.
    pub cfg: &'a Config,
    /// The rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Where it failed.
    pub phase: String,
    /// The request, when known.
    pub bytes: Option<i64>,
    /// What the rank held, by kind (none before its engine was built).
    pub held: Option<MemoryByKind>,
    /// Of the held buffers: the reserve for recovering from an out-of-memory (stages 2-3).
    pub oom_reserve: i64,
    /// The rank's prediction for this config.
    pub predicted: Estimate,
    /// The runtime's fixed cost (the resident memory before the model was built on CPU).
    pub fixed: i64,
    /// What a rank may use, and where that figure comes from.
    pub budget: (i64, String),
}

impl Diagnosis<'_> {
    /// Renders the report, writes it to `<log.dir>/oom-rank-N.txt` and returns the error that
    /// carries it.
    pub fn into_error(self) -> Error {
        let report = self
            .render()
            .unwrap_or_else(|e| format!("(no diagnosis: {e})"));
        let dir = &self.cfg.log.dir;
        let path = dir.join(format!("oom-rank-{}.txt", self.rank));
        let file = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&path, format!("{report}\n")))
            .is_ok()
            .then_some(path);
        Error::OutOfMemory(Box::new(OutOfMemory {
            rank: self.rank,
            phase: self.phase,
            bytes: self.bytes,
            report,
            file,
        }))
    }

    /// The report's lines.
    fn render(&self) -> Result<String, Error> {
        let mut out = Vec::new();
        let tried = self.bytes.map_or_else(String::new, |b| {
            format!(": it tried to allocate {}", human(b))
        });
        out.push(format!(
            "rank {} ran out of memory in {}{tried}",
            self.rank, self.phase
        ));
        let may_use = &self.budget.1;
        match &self.held {
            Some(h) => {
                out.push(format!(
                    "  held by kind: parameters {}, gradients {}, fp32 master {}, AdamW m+v {}, host {}, buffers {} (stage-3 gathers {}, out-of-memory reserve {}), activations and temporaries {}",
                    human(h.params),
                    human(h.grads),
                    human(h.master),
                    human(h.optimizer),
                    human(h.host),
                    human(h.buffers),
                    human(h.gathered),
                    human(self.oom_reserve),
                    human(h.activations)
                ));
                let resident = format!(
                    "resident {} now, {} at the peak, {} before the model",
                    human(h.rss),
                    human(h.rss_peak),
                    human(self.fixed)
                );
                let allocator = match (h.cuda_allocated_peak, h.cuda_reserved_peak) {
                    (Some(a), Some(r)) => format!(
                        "CUDA allocated peak {}, reserved peak {}, reserved but unallocated now {}",
                        human(a),
                        human(r),
                        human(h.cuda_reserved_unallocated.unwrap_or(0))
                    ),
                    _ => match (h.cpu_allocated_peak, h.cpu_reserved_peak) {
                        (Some(a), Some(r)) => format!(
                            "CPU allocated peak {}, reserved peak {}; {resident}",
                            human(a),
                            human(r)
                        ),
                        _ => resident,
                    },
                };
                out.push(format!(
                    "  allocator: {allocator}; a rank may use {may_use}"
                ));
            }
            None => {
                let l = &self.predicted.ledger;
                out.push(format!(
                    "  this config's model states: parameters {}, gradients {}, fp32 master {}, AdamW m+v {}, host {}; a rank may use {may_use}",
                    human(l.params),
                    human(l.grads),
                    human(l.master),
                    human(l.optimizer),
                    human(l.host)
                ));
            }
        }
        let p = &self.predicted;
        out.push(format!(
            "  estimate for this config: peak {} + runtime {} = {}, in {} ({})",
            human(p.peak_bytes),
            human(self.fixed),
            human(p.peak_bytes + self.fixed),
            p.phase,
            if fits(self.fixed, p.peak_bytes, Some(self.budget.0)) {
                "predicted to fit: the estimate missed something; please report it"
            } else {
                "predicted not to fit"
            }
        ));
        let alts = alternatives(self.cfg, self.world, self.fixed, Some(self.budget.0))?;
        let fitting: Vec<String> = alts
            .iter()
            .filter(|f| f.fits)
            .take(3)
            .map(|f| {
                let sets: Vec<String> = f
                    .choice
                    .overrides()
                    .iter()
                    .map(|o| format!("--set {o}"))
                    .collect();
                format!("    {}   (peak {})", sets.join(" "), human(f.peak_bytes))
            })
            .collect();
        if fitting.is_empty() {
            out.push(format!(
                "  nothing at this global batch is predicted to fit {}: add ranks, shorten model.seq_len or use a smaller model",
                human(self.budget.0)
            ));
        } else {
            out.push("  predicted to fit, cheapest first:".into());
            out.extend(fitting);
        }
        Ok(out.join("\n"))
    }
}

/// The error of a rank whose model states did not fit while its engine was built.
pub fn at_startup(
    cfg: &Config,
    rank: crate::trainer::RankInfo,
    device: tch::Device,
    fixed: i64,
    bytes: Option<i64>,
) -> Error {
    let phase = "building the engine (allocating the model states)".to_string();
    let parts = (|| -> Result<(Estimate, (i64, String)), Error> {
        let model = cfg.build_model()?;
        let (r, w) = (rank.rank as i64, rank.world_size as i64);
        let g = cfg.shard_group_size(rank.world_size)? as i64;
        let layout = zrun_shard::ShardLayout::hybrid(model.units(), r, w, g)?;
        let predicted = zrun_shard::estimate(
            model.as_ref(),
            &layout,
            &crate::memory::estimate_config(cfg)?,
        );
        let budget = crate::memory::budget(cfg, device, rank.local_world_size)?;
        Ok((predicted, budget))
    })();
    match parts {
        Ok((predicted, budget)) => Diagnosis {
            cfg,
            rank: rank.rank,
            world: rank.world_size,
            phase,
            bytes,
            held: None,
            oom_reserve: 0,
            predicted,
            fixed,
            budget,
        }
        .into_error(),
        Err(e) => Error::OutOfMemory(Box::new(OutOfMemory {
            rank: rank.rank,
            phase,
            bytes,
            report: format!("(no diagnosis: {e})"),
            file: None,
        })),
    }
}
