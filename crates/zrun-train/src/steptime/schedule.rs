//! The engine's schedule of one micro-step, replayed on two resources: a rank's compute
//! stream and its one communication channel (collectives run in issue order). Each waits
//! as the engine waits (crates/zrun-shard/src/micro.rs), so what overlaps is what the engine
//! overlaps.

use std::collections::VecDeque;

use zrun_shard::Stage;

use super::StepInputs;

/// What a wait is charged to.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    Gather,
    Reduce,
    Replicate,
    Refresh,
    Other,
}

/// Two resources: the rank's compute stream (`now`) and one communication channel that runs
/// collectives in issue order (`free`: when it is idle). A collective issued at `now` of
/// duration d completes at `max(now, free) + d`; a wait for it moves `now` there and charges
/// the difference as exposed.
#[derive(Default)]
pub(super) struct Sim {
    pub(super) now: f64,
    free: f64,
    pub(super) exposed: [f64; 5],
    pub(super) comm: f64,
}

impl Sim {
    pub(super) fn issue(&mut self, d: f64) -> f64 {
        self.comm += d;
        self.free = self.now.max(self.free) + d;
        self.free
    }

    pub(super) fn wait(&mut self, done: f64, kind: Kind) {
        if done > self.now {
            self.exposed[kind as usize] += done - self.now;
            self.now = done;
        }
    }
}

/// Stage 3's gathers in one order, issued `depth` positions ahead of the one taken (as the
/// engine's `Gathers::take`): taking position k issues every gather up to k + depth, then
/// waits for k's.
struct Gathers {
    times: Vec<f64>,
    next: usize,
    issued: usize,
    pending: VecDeque<f64>,
    depth: usize,
}

impl Gathers {
    fn take(&mut self, sim: &mut Sim) {
        self.next += 1;
        let until = (self.next + self.depth).min(self.times.len());
        while self.issued < until {
            self.pending.push_back(sim.issue(self.times[self.issued]));
            self.issued += 1;
        }
        if let Some(done) = self.pending.pop_front() {
            sim.wait(done, Kind::Gather);
        }
    }
}

/// Per-unit collective times.
pub(super) struct Costs {
    pub(super) gather: Vec<f64>,
    pub(super) scatter: Vec<f64>,
    pub(super) replicate: Vec<f64>,
    pub(super) forward: Vec<f64>,
}

/// Stages 2-3's reductions during backward, as the engine's `absorb_into` and `retire`: one
/// reduce-scatter in flight (issuing the next waits for the older one), then, in the step's
/// last micro-step (`replicate`), the replica all-reduce of each unit's shard once the unit
/// is complete, one of those in flight too.
#[derive(Default)]
struct Reducing {
    scattering: VecDeque<(f64, usize, bool)>,
    replicating: VecDeque<f64>,
    replicate: bool,
}

impl Reducing {
    /// Unit `u`'s reduce-scatter; `completes`: the last of the unit's gradient this
    /// micro-step (not a tied reader's share of it).
    fn absorb(&mut self, sim: &mut Sim, c: &Costs, u: usize, completes: bool) {
        self.scattering
            .push_back((sim.issue(c.scatter[u]), u, completes));
        if self.scattering.len() > 1 {
            let old = self.scattering.pop_front().expect("two in flight");
            self.retire(sim, c, old);
        }
    }

    fn retire(&mut self, sim: &mut Sim, c: &Costs, (done, u, completes): (f64, usize, bool)) {
        sim.wait(done, Kind::Reduce);
        if self.replicate && completes && c.replicate[u] > 0.0 {
            self.replicating.push_back(sim.issue(c.replicate[u]));
            if self.replicating.len() > 1 {
                let d = self.replicating.pop_front().expect("two in flight");
                sim.wait(d, Kind::Replicate);
            }
        }
    }

    fn drain(mut self, sim: &mut Sim, c: &Costs) {
        while let Some(old) = self.scattering.pop_front() {
            self.retire(sim, c, old);
        }
        while let Some(d) = self.replicating.pop_front() {
            sim.wait(d, Kind::Replicate);
        }
    }
}

/// One micro-step: forward unit by unit (stage 3 taking each unit's gather, and a tied
/// owner's before it), backward in reverse (recomputing f_u with checkpointing), stages 2-3
/// reducing each unit as its backward ends (a tied owner's share first) and, in the step's
/// `last` micro-step, all-reducing it across the replicas. Returns the backward's compute
/// seconds.
pub(super) fn micro_step(sim: &mut Sim, inp: &StepInputs, c: &Costs, last: bool) -> f64 {
    let stage3 = inp.stage == Stage::Zero3;
    let mut order = Vec::new();
    for (u, unit) in inp.units.iter().enumerate() {
        order.extend(unit.tied);
        order.push(u);
    }
    let gathers = |order: &[usize]| Gathers {
        times: order.iter().map(|&u| c.gather[u]).collect(),
        next: 0,
        issued: 0,
        pending: VecDeque::new(),
        depth: inp.prefetch,
    };
    let mut g = gathers(&order);
    for (u, unit) in inp.units.iter().enumerate() {
        if stage3 {
            for _ in 0..1 + usize::from(unit.tied.is_some()) {
                g.take(sim);
            }
        }
        sim.now += c.forward[u];
    }
    order.reverse();
    let mut g = gathers(&order);
    let mut reducing = Reducing {
        replicate: last,
        ..Reducing::default()
    };
    let mut backward = 0.0;
    for (u, unit) in inp.units.iter().enumerate().rev() {
        if stage3 {
            for _ in 0..1 + usize::from(unit.tied.is_some()) {
                g.take(sim);
            }
        }
        let b = c.forward[u] * if inp.checkpointing { 3.0 } else { 2.0 };
        sim.now += b;
        backward += b;
        if matches!(inp.stage, Stage::Zero2 | Stage::Zero3) {
            if let Some(owner) = unit.tied {
                reducing.absorb(sim, c, owner, false);
            }
            reducing.absorb(sim, c, u, true);
        }
    }
    reducing.drain(sim, c);
    backward
}
