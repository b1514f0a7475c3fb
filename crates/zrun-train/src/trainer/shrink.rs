//! Out of memory during a step: the diagnosis (`train.on_oom = "stop"`), or dropping the step
//! on every rank and retrying it at a smaller micro-batch (`"shrink"`).

use super::Run;
use crate::config::OnOom;
use crate::data::Loader;
use crate::reduce::gather_bytes;
use crate::{report, Error};
use std::time::Instant;

/// The ranks whose micro-step ran out of memory, as every rank learned it.
pub(super) struct Failure {
    /// Each of them and where it failed.
    ranks: Vec<(usize, String)>,
    /// This rank's request when it was one of them (`Some(None)`: the size is unknown).
    mine: Option<Option<i64>>,
}

impl Run {
    /// The micro-steps of one step: `Ok((mean loss, seconds reading data))`, or with
    /// `train.on_oom = "shrink"` the [`Failure`] when ranks ran out of memory, every rank
    /// having finished the micro-step's collectives and dropped the step.
    pub(super) fn micro_steps(
        &mut self,
        loader: &mut Loader,
        lr: f64,
    ) -> Result<Result<(f64, f64), Failure>, Error> {
        let t = &self.cfg.train;
        let (accum, clip) = (t.grad_accum, t.grad_clip);
        let shrink = t.on_oom == OnOom::Shrink;
        let (mut loss, mut data_s) = (0.0, 0.0);
        for micro in 0..accum {
            // An update overlapped with backward cannot be taken back: not when a step
            // may be dropped. A hybrid run's all-reduce across the replicas can, so it
            // overlaps the last backward either way.
            if micro + 1 == accum {
                if shrink {
                    self.engine.last_micro_step();
                } else {
                    self.engine.prepare_step(lr, clip);
                }
            }
            let read = Instant::now();
            let (x, y) = loader.next_micro_batch()?;
            data_s += read.elapsed().as_secs_f64();
            let mine = match self.engine.forward_backward(&x, &y, 1.0 / accum as f64) {
                Ok(l) => {
                    loss += l / accum as f64;
                    None
                }
                Err(e) if shrink => match e.out_of_memory() {
                    Some(bytes) => {
                        let phase = self.engine.phase();
                        self.engine.finish_failed_micro_step()?;
                        Some((bytes, phase))
                    }
                    None => return Err(e.into()),
                },
                Err(e) => return Err(e.into()),
            };
            if shrink {
                let comm = self.engine.comm().clone();
                let device = self.engine.config().device;
                // Every rank's flag and, when it failed, the phase it failed in.
                let mut record = [0u8; 64];
                if let Some((_, phase)) = &mine {
                    record[0] = 1;
                    let p = phase.as_bytes();
                    let n = p.len().min(63);
                    record[1..=n].copy_from_slice(&p[..n]);
                }
                let all = gather_bytes(comm.as_ref(), device, &record)?;
                if all.iter().any(|b| b[0] == 1) {
                    self.engine.abandon_step()?;
                    let ranks = all
                        .iter()
                        .enumerate()
                        .filter(|(_, b)| b[0] == 1)
                        .map(|(r, b)| {
                            let phase = String::from_utf8_lossy(&b[1..]);
                            (r, phase.trim_end_matches('\0').to_string())
                        })
                        .collect();
                    let mine = mine.map(|(bytes, _)| bytes);
                    return Ok(Err(Failure { ranks, mine }));
                }
            }
        }
        Ok(Ok((loss, data_s)))
    }

    /// After ranks ran out of memory in step `step`: halves the micro-batch (to its largest
    /// divisor not above half) and multiplies grad_accum to keep the global batch, or at
    /// micro-batch 1 ends the run with the out-of-memory error.
    pub(super) fn shrink(
        &mut self,
        step: u64,
        failed: Failure,
    ) -> Result<crate::metrics::Shrink, Error> {
        let t = &mut self.cfg.train;
        let (mb, accum) = (t.micro_batch, t.grad_accum);
        let ranks: Vec<usize> = failed.ranks.iter().map(|f| f.0).collect();
        if mb == 1 {
            return Err(match failed.mine {
                Some(bytes) => self.out_of_memory(bytes),
                None => Error::OutOfMemory(Box::new(crate::oom::OutOfMemory {
                    rank: self.rank.rank,
                    phase: format!("step {step} on rank(s) {ranks:?}"),
                    bytes: None,
                    report: format!(
                        "rank(s) {ranks:?} ran out of memory at micro-batch 1: nothing left to shrink"
                    ),
                    file: None,
                })),
            });
        }
        let new = (1..=mb / 2)
            .rev()
            .find(|d| mb.is_multiple_of(*d))
            .unwrap_or(1);
        let s = crate::metrics::Shrink {
            step,
            ranks: ranks.clone(),
            phases: failed.ranks.iter().map(|f| f.1.clone()).collect(),
            from: (mb, accum),
            to: (new, accum * (mb / new)),
        };
        (t.micro_batch, t.grad_accum) = s.to;
        if self.rank.rank == 0 {
            let wher: Vec<String> = failed
                .ranks
                .iter()
                .map(|(r, p)| format!("rank {r} in {p}"))
                .collect();
            tracing::warn!(
                "step {step}: out of memory at micro-batch {mb} x grad_accum {accum} ({}); every rank dropped the step and retries it at {} x {} (the global batch stays)",
                wher.join(", "),
                s.to.0,
                s.to.1
            );
        }
        Ok(s)
    }

    /// The error of an allocation that failed for want of `bytes`: the diagnosis, written to
    /// `<log.dir>/oom-rank-N.txt` for the launcher to print once.
    pub(super) fn out_of_memory(&self, bytes: Option<i64>) -> Error {
        let device = self.engine.config().device;
        let group = self.engine.layout().world_size as usize;
        let nccl_comms =
            crate::memory::nccl_comms(self.engine.comm().backend(), self.rank.world_size, group);
        let fixed = crate::memory::fixed_cost(device, self.base_rss, nccl_comms);
        let phase = self.engine.phase();
        match crate::memory::budget(&self.cfg, device, self.rank.local_world_size) {
            Ok(budget) => crate::oom::Diagnosis {
                cfg: &self.cfg,
                rank: self.rank.rank,
                world: self.rank.world_size,
                phase,
                bytes,
                held: Some(report::MemoryByKind::of(&self.engine, self.base_rss)),
                oom_reserve: self.engine.oom_reserve_bytes(),
                predicted: self.estimate(),
                fixed,
                budget,
            }
            .into_error(),
            Err(e) => Error::OutOfMemory(Box::new(crate::oom::OutOfMemory {
                rank: self.rank.rank,
                phase,
                bytes,
                report: format!("(no diagnosis: {e})"),
                file: None,
            })),
        }
    }
}
