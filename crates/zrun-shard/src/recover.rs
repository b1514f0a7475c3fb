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
//! one at a time, so one unit's room serves them all. With hybrid sharding a stand-in
//! all-reduce across the replica group reduces the rank's own gradient shard in place.

use crate::engine::{EarlyStep, Engine};
use crate::layout::ShardLayout;
use crate::state::Collective;
use crate::{Context, Precision, ReduceDtype, Result, Stage};
use tch::{Kind, Tensor};

/// Bytes of the stand-in reserve at `stage`: the largest padded unit in the wider of the
/// reduce dtype and, at stage 3 over a shard group of more than one rank (which gathers),
/// the compute dtype; none at stages 0-1, and
/// none when the run does not recover from an out-of-memory (`recovery` false: a failed
/// micro-step then ends the run, and no stand-in collective is issued), and none for a rank
/// alone ([`ShardLayout::single_rank`]: no other rank waits in a collective).
pub(crate) fn reserve_bytes(
    layout: &ShardLayout,
    stage: Stage,
    precision: Precision,
    reduce: ReduceDtype,
    recovery: bool,
) -> i64 {
    if !recovery || layout.single_rank() {
        return 0;
    }
    let rb = reduce.kind().elt_size_in_bytes() as i64;
    let widest = match stage {
        Stage::Zero0 | Stage::Zero1 => return 0,
        // A shard group of one gathers nothing (`Mover::gathers`).
        Stage::Zero3 if layout.world_size > 1 => rb.max(precision.bytes()),
        Stage::Zero2 | Stage::Zero3 => rb,
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
/// `replicate` (hybrid sharding, the step's last micro-step): each unit's shard is
/// all-reduced across the replica group once its own reduce-scatter (which completes it) is
/// done, right after the next reduce-scatter is issued, the last one's at the end.
pub(crate) fn schedule(
    stage: Stage,
    ties: &[Option<usize>],
    depth: usize,
    replicate: bool,
) -> Vec<(Collective, usize)> {
    let mut forward = Vec::new();
    for (u, t) in ties.iter().enumerate() {
        forward.extend(*t);
        forward.push(u);
    }
    let mut out = Vec::new();
    if stage == Stage::Zero3 {
        out.extend(forward.iter().map(|&u| (Collective::Gather, u, true)));
    }
    if !matches!(stage, Stage::Zero2 | Stage::Zero3) {
        return with_replicates(out, false);
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
                    .map(|&v| (Collective::Gather, v, true)),
            );
            gathered = gathered.max(want);
        }
        // A tied parameter's gradient is only part of its owner's: it completes nothing.
        out.extend(ties[u].map(|s| (Collective::ReduceScatter, s, false)));
        out.push((Collective::ReduceScatter, u, true));
    }
    with_replicates(out, replicate)
}

/// `ops` (each with whether it completes its unit) with, when `replicate`, each completing
/// reduce-scatter's replica all-reduce where the engine issues it: after the next
/// reduce-scatter (one reduce-scatter stays in flight; the older one is then waited for and
/// its unit's shard all-reduced), the last one's at the end.
fn with_replicates(
    ops: Vec<(Collective, usize, bool)>,
    replicate: bool,
) -> Vec<(Collective, usize)> {
    let mut out = Vec::with_capacity(ops.len() * 3 / 2);
    let mut scattering: Option<(usize, bool)> = None;
    let replicates = |older: Option<(usize, bool)>| {
        older
            .filter(|&(_, completes)| completes && replicate)
            .map(|(u, _)| (Collective::Replicate, u))
    };
    for (op, u, completes) in ops {
        out.push((op, u));
        if op == Collective::ReduceScatter {
            out.extend(replicates(scattering.replace((u, completes))));
        }
    }
    out.extend(replicates(scattering));
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
        if self.mover.layout.single_rank() {
            // No other rank waits in a collective: there is nothing to stand in for.
            self.mover.issued.clear();
            return Ok(());
        }
        let all = self.micro_step_schedule();
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
                Collective::Replicate => {
                    // In place on this rank's own gradient shard (cleared by abandon_step).
                    let own = self.mover.shard_of(&self.grads, u)?;
                    (own.shallow_clone(), own)
                }
            };
            self.mover.stand_in(op, u, &input, &output)?;
        }
        self.mover.issued.clear();
        Ok(())
    }

    /// The collectives of this engine's micro-step ([`schedule`]); over a shard group of one
    /// rank, which gathers nothing ([`crate::state::Mover::gathers`]), without the gathers.
    pub(crate) fn micro_step_schedule(&self) -> Vec<(Collective, usize)> {
        let mut all = schedule(
            self.cfg.stage,
            &ties(self.model.as_ref()),
            self.cfg.prefetch,
            self.mover.replicates,
        );
        if !self.mover.gathers(self.cfg.stage) {
            all.retain(|&(op, _)| op != Collective::Gather);
        }
        all
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
        self.last_announced = false;
        self.mover.replicates = false;
        let _guard = tch::no_grad_guard();
        self.discard_grads();
        self.mover.reset_in_flight();
        Ok(())
    }

    /// Marks the start of a micro-step's collectives (see [`Engine::finish_failed_micro_step`]),
    /// which all-reduce across the replicas when `replicate`.
    pub(crate) fn begin_micro_step(&mut self, replicate: bool) {
        self.mover.issued.clear();
        self.mover.replicates = replicate;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use zrun_comm::{Backend, Communicator, ReduceOp, Work};

    type CommResult<T> = std::result::Result<T, zrun_comm::Error>;
    use Collective::{Gather as G, ReduceScatter as R, Replicate as A};

    /// The engine's real micro-step issues exactly the schedule, at every stage, prefetch
    /// depth and checkpointing setting, sharded over all ranks and (hybrid sharding) over
    /// groups of 2 and of 1 of 4 ranks.
    #[test]
    fn a_micro_step_issues_its_schedule() {
        for tied in [false, true] {
            let cfg = zrun_models::GptConfig {
                tied,
                ..zrun_models::GptConfig::preset("tiny").unwrap()
            };
            let model: Arc<dyn zrun_models::Model> = Arc::new(zrun_models::Gpt::new(cfg).unwrap());
            let topo = zrun_comm::Topology::single();
            let timeout = std::time::Duration::from_secs(5);
            let single: Arc<dyn Communicator> =
                Arc::from(zrun_comm::init(&topo, Backend::Tcp, timeout).unwrap());
            issues_its_schedule(model.clone(), single, None);
            for group in [2, 1] {
                let echo = Arc::new(Echo {
                    rank: 0,
                    world: 4,
                    sub: Some((0, 4 / group)),
                });
                issues_its_schedule(model.clone(), echo, Some(group));
            }
        }
    }

    fn issues_its_schedule(
        model: Arc<dyn zrun_models::Model>,
        comm: Arc<dyn Communicator>,
        shard_group: Option<usize>,
    ) {
        let adamw = zrun_optim::AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for (prefetch, ckpt) in [(1, false), (2, false), (1, true)] {
                let cfg = crate::EngineConfig {
                    prefetch,
                    activation_checkpointing: ckpt,
                    shard_group,
                    ..crate::EngineConfig::fp32(stage, tch::Device::Cpu, 1, adamw)
                };
                let mut e = Engine::new(model.clone(), comm.clone(), cfg).unwrap();
                let replicated = shard_group.is_some() && stage != Stage::Zero0;
                assert_eq!(e.mover.replicated(), replicated);
                let x = Tensor::zeros([2, 8], (tch::Kind::Int64, tch::Device::Cpu));
                // A micro-step not announced as the last, then the last: only the last
                // all-reduces across the replicas.
                for last in [false, true] {
                    if last {
                        e.last_micro_step();
                    }
                    e.forward_backward(&x, &x, 1.0).unwrap();
                    let replicate = replicated && last;
                    let mut want = schedule(stage, &ties(model.as_ref()), prefetch, replicate);
                    // A shard group of one (one rank, or groups of 1) gathers nothing.
                    if shard_group.unwrap_or(1) == 1 {
                        want.retain(|&(op, _)| op != G);
                    }
                    assert_eq!(e.micro_step_schedule(), want);
                    assert_eq!(
                        e.mover.issued, want,
                        "stage {stage} prefetch {prefetch} ckpt {ckpt} shard group {shard_group:?} last {last}"
                    );
                    let replicates = want.iter().filter(|(op, _)| *op == A).count();
                    let sharded = matches!(stage, Stage::Zero2 | Stage::Zero3);
                    // Each unit once, when its gradient is complete.
                    let units = model.units().len();
                    assert_eq!(replicates, if replicate && sharded { units } else { 0 });
                }
                // After the micro-step that all-reduced across the replicas, only the step
                // may come; then micro-steps again.
                let sharded = matches!(stage, Stage::Zero2 | Stage::Zero3);
                assert_eq!(
                    e.forward_backward(&x, &x, 1.0).is_err(),
                    replicated && sharded
                );
                e.step(1e-3, 0.0).unwrap();
                e.forward_backward(&x, &x, 1.0).unwrap();
            }
        }
    }

    /// A communicator whose every rank holds the same data: a gather repeats this rank's
    /// shard, a reduce-scatter keeps its chunk, an all-reduce changes nothing. Its splits are
    /// rank `sub.0` of `sub.1`. For checking the order of collectives without peers.
    struct Echo {
        rank: usize,
        world: usize,
        sub: Option<(usize, usize)>,
    }

    impl Communicator for Echo {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn backend(&self) -> Backend {
            Backend::Tcp
        }
        fn all_gather(&self, shard: &Tensor, full: &Tensor) -> CommResult<Work> {
            let n = shard.numel() as i64;
            for i in 0..full.numel() as i64 / n {
                full.narrow(0, i * n, n).copy_(shard);
            }
            Ok(Work::ready())
        }
        fn reduce_scatter(&self, full: &Tensor, shard: &Tensor, _: ReduceOp) -> CommResult<Work> {
            let n = shard.numel() as i64;
            shard
                .shallow_clone()
                .copy_(&full.narrow(0, self.rank as i64 * n, n));
            Ok(Work::ready())
        }
        fn all_reduce(&self, _: &Tensor, _: ReduceOp) -> CommResult<Work> {
            Ok(Work::ready())
        }
        fn broadcast(&self, _: &Tensor, _: usize) -> CommResult<Work> {
            Ok(Work::ready())
        }
        fn barrier(&self) -> CommResult<Work> {
            Ok(Work::ready())
        }
        fn split(&self, _: usize, _: usize) -> CommResult<Box<dyn Communicator>> {
            let (rank, world) = self.sub.expect("a split of a split");
            Ok(Box::new(Echo {
                rank,
                world,
                sub: None,
            }))
        }
    }

    #[test]
    fn replicated_reductions_follow_the_next_reduce_scatter_and_the_last_ends_the_step() {
        for stage in [Stage::Zero0, Stage::Zero1] {
            assert!(schedule(stage, &[None; 3], 1, true).is_empty());
        }
        assert_eq!(
            schedule(Stage::Zero2, &[None; 3], 1, true),
            vec![(R, 2), (R, 1), (A, 2), (R, 0), (A, 1), (A, 0)]
        );
        assert_eq!(
            schedule(Stage::Zero3, &[None; 3], 1, true),
            vec![
                (G, 0),
                (G, 1),
                (G, 2),
                (G, 2),
                (G, 1),
                (R, 2),
                (G, 0),
                (R, 1),
                (A, 2),
                (R, 0),
                (A, 1),
                (A, 0)
            ]
        );
        // A tied head: its share of the embedding's gradient is reduced on its own, before
        // the head's; the embedding's shard is all-reduced once, when its own completes it.
        assert_eq!(
            schedule(Stage::Zero2, &[None, None, Some(0)], 1, true),
            vec![(R, 0), (R, 2), (R, 1), (A, 2), (R, 0), (A, 1), (A, 0)]
        );
        assert_eq!(
            schedule(Stage::Zero2, &[None], 1, true),
            vec![(R, 0), (A, 0)]
        );
    }

    #[test]
    fn the_schedule_is_forward_gathers_then_backward_gathers_ahead_and_reductions() {
        assert!(schedule(Stage::Zero0, &[None; 3], 1, false).is_empty());
        assert!(schedule(Stage::Zero1, &[None; 3], 1, false).is_empty());
        assert_eq!(
            schedule(Stage::Zero2, &[None; 3], 1, false),
            vec![(R, 2), (R, 1), (R, 0)]
        );
        assert_eq!(
            schedule(Stage::Zero3, &[None; 3], 1, false),
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
            schedule(Stage::Zero3, &[None; 3], 5, false),
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
            schedule(Stage::Zero2, &tied, 1, false),
            vec![(R, 0), (R, 2), (R, 1), (R, 0)]
        );
        assert_eq!(
            schedule(Stage::Zero3, &tied, 1, false),
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
