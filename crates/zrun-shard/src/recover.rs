//! Surviving a failed micro-step (an allocation that ran out of memory) without hanging the
//! other ranks: the failed rank issues the rest of the micro-step's collectives, in the order
//! every rank issues them, with stand-in buffers, so the others' collectives complete; then
//! every rank abandons the step with nothing applied.
//!
//! The stand-ins allocate nothing: right after an out-of-memory a second allocation may fail
//! too, and the other ranks would then wait in their collectives until the timeout. They use
//! a reserve the engine allocates with the model states at stages 2-3 (the only stages whose
//! micro-step has collectives), one buffer of the largest padded unit in the wider of the
//! reduce dtype and (stage 3) the compute dtype: a stand-in gather fills a slice of it, a
//! stand-in reduce-scatter reads a zeroed slice of it and writes this rank's reduced slice
//! into its own gradient shard, which [`Engine::abandon_step`] clears. The collectives run
//! one at a time, so one unit's room serves them all.

use crate::engine::{EarlyStep, Engine};
use crate::layout::ShardLayout;
use crate::state::Collective;
use crate::{Context, Precision, ReduceDtype, Result, Stage};
use tch::{Kind, Tensor};

/// Bytes of the stand-in reserve at `stage`: the largest padded unit in the wider of the
/// reduce dtype and, at stage 3 (which gathers), the compute dtype; none at stages 0-1, and
/// none when the run does not recover from an out-of-memory (`recovery` false: a failed
/// micro-step then ends the run, and no stand-in collective is issued).
pub(crate) fn reserve_bytes(
    layout: &ShardLayout,
    stage: Stage,
    precision: Precision,
    reduce: ReduceDtype,
    recovery: bool,
) -> i64 {
    if !recovery {
        return 0;
    }
    let rb = reduce.kind().elt_size_in_bytes() as i64;
    let widest = match stage {
        Stage::Zero0 | Stage::Zero1 => return 0,
        Stage::Zero2 => rb,
        Stage::Zero3 => rb.max(precision.bytes()),
    };
    layout.units.iter().map(|l| l.padded).max().unwrap_or(0) * widest
}

/// The first `numel` elements of `kind` of the byte buffer `reserve`.
fn reserve_view(reserve: &Tensor, numel: i64, kind: Kind, unit: &str) -> Result<Tensor> {
    let bytes = numel * kind.elt_size_in_bytes() as i64;
    reserve
        .f_narrow(0, 0, bytes)
        .and_then(|t| t.f_view_dtype(kind))
        .ctx("view the out-of-memory reserve", unit)
}

/// The collectives of one micro-step in the order the engine issues them, for a model whose
/// units read the tied parameters `ties[u]` (the owning unit), at `stage` with stage-3
/// gathers `depth` ahead: forward gathers every unit in order, a unit with a tied parameter
/// right after its owner again; backward, for each unit from the last, gathers ahead (the
/// unit, then its tied owner) then reduce-scatters the tied parameter's gradient into its
/// owner and the unit's own gradient (gathers at stage 3 only, reduce-scatters at stages 2-3).
pub(crate) fn schedule(
    stage: Stage,
    ties: &[Option<usize>],
    depth: usize,
) -> Vec<(Collective, usize)> {
    let mut forward = Vec::new();
    for (u, t) in ties.iter().enumerate() {
        forward.extend(*t);
        forward.push(u);
    }
    let mut out = Vec::new();
    if stage == Stage::Zero3 {
        out.extend(forward.iter().map(|&u| (Collective::Gather, u)));
    }
    if !matches!(stage, Stage::Zero2 | Stage::Zero3) {
        return out;
    }
    let backward: Vec<usize> = forward.into_iter().rev().collect();
    let (mut taken, mut gathered) = (0, 0);
    for u in (0..ties.len()).rev() {
        taken += 1 + usize::from(ties[u].is_some());
        if stage == Stage::Zero3 {
            let want = (taken + depth).min(backward.len());
            out.extend(
                backward[gathered.min(want)..want]
                    .iter()
                    .map(|&v| (Collective::Gather, v)),
            );
            gathered = gathered.max(want);
        }
        out.extend(ties[u].map(|s| (Collective::ReduceScatter, s)));
        out.push((Collective::ReduceScatter, u));
    }
    out
}

/// Each unit's tied owner, if any.
pub(crate) fn ties(model: &dyn zrun_models::Model) -> Vec<Option<usize>> {
    model
        .units()
        .iter()
        .map(|u| u.tied().map(|t| t.unit))
        .collect()
}

impl Engine {
    /// After `forward_backward` failed on this rank only: issues, with stand-in buffers, the
    /// collectives of the micro-step this rank had not issued yet, and waits for each, so
    /// the other ranks' collectives complete. Allocates no tensor: the stand-ins are slices
    /// of the reserve made with the engine, and the reduced stand-ins land in this rank's
    /// gradient shard, which is left for [`Engine::abandon_step`] to clear.
    pub fn finish_failed_micro_step(&mut self) -> Result<()> {
        let all = schedule(
            self.cfg.stage,
            &ties(self.model.as_ref()),
            self.cfg.prefetch,
        );
        let done = std::mem::take(&mut self.mover.issued);
        if !all.starts_with(&done) {
            return Err(crate::Error::Unsupported(format!(
                "the failed micro-step issued {done:?}, which is not how every rank's micro-step begins ({all:?}): the ranks cannot be kept in step"
            )));
        }
        let rest = &all[done.len()..];
        if rest.is_empty() {
            return Ok(());
        }
        let Some(reserve) = self.reserve.as_ref() else {
            return Err(crate::Error::Unsupported(format!(
                "stage {} keeps no out-of-memory reserve for the stand-ins of {rest:?} (EngineConfig::oom_recovery is off)",
                self.cfg.stage
            )));
        };
        let _guard = tch::no_grad_guard();
        for &(op, u) in rest {
            let l = &self.mover.layout.units[u];
            let (input, output) = match op {
                Collective::Gather => (
                    self.mover.shard_of(&self.params, u)?,
                    reserve_view(reserve, l.padded, self.params.kind(), &l.unit)?,
                ),
                Collective::ReduceScatter => {
                    // Zeroed each time: a gather or the collective itself may have written it.
                    let mut zeros =
                        reserve_view(reserve, l.padded, self.cfg.reduce_dtype.kind(), &l.unit)?;
                    zeros
                        .f_zero_()
                        .done("zero the stand-in gradient", &l.unit)?;
                    (zeros, self.mover.shard_of(&self.grads, u)?)
                }
            };
            self.mover.stand_in(op, u, &input, &output)?;
        }
        self.mover.issued.clear();
        Ok(())
    }

    /// Drops the step in progress on every rank after a failed micro-step: the gradients are
    /// cleared; parameters, master, optimizer state, step count and loss scale are as before
    /// the step (no update has run: an overlapped update is not armed under this policy).
    pub fn abandon_step(&mut self) -> Result<()> {
        if matches!(
            self.early,
            EarlyStep::Armed { .. } | EarlyStep::Submitted { .. }
        ) {
            return Err(crate::Error::Unsupported(
                "abandon_step after prepare_step armed an overlapped update: do not call prepare_step when a step may be abandoned".into(),
            ));
        }
        self.early = EarlyStep::Off;
        let _guard = tch::no_grad_guard();
        self.grads.f_zero_().done("zero gradients", "-")?;
        self.mover.reset_in_flight();
        Ok(())
    }

    /// Marks the start of a micro-step's collectives (see [`Engine::finish_failed_micro_step`]).
    pub(crate) fn begin_micro_step(&mut self) {
        self.mover.issued.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Collective::{Gather as G, ReduceScatter as R};

    /// The engine's real micro-step issues exactly the schedule, at every stage, prefetch
    /// depth and checkpointing setting.
    #[test]
    fn a_micro_step_issues_its_schedule() {
        use std::sync::Arc;
        for tied in [false, true] {
            let cfg = zrun_models::GptConfig {
                tied,
                ..zrun_models::GptConfig::preset("tiny").unwrap()
            };
            let model: Arc<dyn zrun_models::Model> = Arc::new(zrun_models::Gpt::new(cfg).unwrap());
            issues_its_schedule(model);
        }
    }

    fn issues_its_schedule(model: std::sync::Arc<dyn zrun_models::Model>) {
        use std::sync::Arc;
        let adamw = zrun_optim::AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for (prefetch, ckpt) in [(1, false), (2, false), (1, true)] {
                let topo = zrun_comm::Topology::single();
                let comm = zrun_comm::init(
                    &topo,
                    zrun_comm::Backend::Tcp,
                    std::time::Duration::from_secs(5),
                )
                .unwrap();
                let cfg = crate::EngineConfig {
                    prefetch,
                    activation_checkpointing: ckpt,
                    ..crate::EngineConfig::fp32(stage, tch::Device::Cpu, 1, adamw)
                };
                let mut e = Engine::new(model.clone(), Arc::from(comm), cfg).unwrap();
                let x = Tensor::zeros([2, 8], (tch::Kind::Int64, tch::Device::Cpu));
                e.forward_backward(&x, &x, 1.0).unwrap();
                let want = schedule(stage, &ties(model.as_ref()), prefetch);
                assert_eq!(
                    e.mover.issued, want,
                    "stage {stage} prefetch {prefetch} ckpt {ckpt}"
                );
            }
        }
    }

    #[test]
    fn the_schedule_is_forward_gathers_then_backward_gathers_ahead_and_reductions() {
        assert!(schedule(Stage::Zero0, &[None; 3], 1).is_empty());
        assert!(schedule(Stage::Zero1, &[None; 3], 1).is_empty());
        assert_eq!(
            schedule(Stage::Zero2, &[None; 3], 1),
            vec![(R, 2), (R, 1), (R, 0)]
        );
        assert_eq!(
            schedule(Stage::Zero3, &[None; 3], 1),
            vec![
                (G, 0),
                (G, 1),
                (G, 2),
                (G, 2),
                (G, 1),
                (R, 2),
                (G, 0),
                (R, 1),
                (R, 0)
            ]
        );
        assert_eq!(
            schedule(Stage::Zero3, &[None; 3], 5),
            vec![
                (G, 0),
                (G, 1),
                (G, 2),
                (G, 2),
                (G, 1),
                (G, 0),
                (R, 2),
                (R, 1),
                (R, 0)
            ]
        );
        // A head reading the embedding: gathered again before the head, after it backward,
        // and its gradient reduced into the embedding's before the head's own.
        let tied = [None, None, Some(0)];
        assert_eq!(
            schedule(Stage::Zero2, &tied, 1),
            vec![(R, 0), (R, 2), (R, 1), (R, 0)]
        );
        assert_eq!(
            schedule(Stage::Zero3, &tied, 1),
            vec![
                (G, 0),
                (G, 1),
                (G, 0),
                (G, 2),
                (G, 2),
                (G, 0),
                (G, 1),
                (R, 0),
                (R, 2),
                (G, 0),
                (R, 1),
                (R, 0)
            ]
        );
    }
}
