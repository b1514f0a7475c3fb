//! Step time: one optimizer step's predicted wall time, from the model's FLOPs and a compute
//! rate, each collective's cost on its link class, and the overlap the engine achieves.
//! `zrun plan --cluster` ranks configurations by it; docs/cluster.md gives the formulas and
//! the figures they produce.
//!
//! Notation: W ranks, L per node, G the shard group (`zero.shard_group`; W at stage 0),
//! R = W/G replicas; per unit u its padded parameter count P_u and forward FLOPs per token
//! F_u; n_tok = micro_batch x seq_len tokens per micro-step; A = grad_accum; X the FLOP/s a
//! rank achieves; e the compute dtype's bytes, r the reduce dtype's.
//!
//! | term | formula |
//! |------|---------|
//! | forward of unit u | f_u = n_tok F_u / X |
//! | backward | 2 f_u, plus f_u recomputed with activation checkpointing |
//! | collective over n ranks | alpha + bytes f / busbw; f = (n-1)/n (AG, RS), 2(n-1)/n (AR) |
//! | stage 3 gather of u | AG over G of P_u e, forward and backward, `prefetch` units ahead |
//! | stages 2-3 reduction of u | RS over G of P_u r per micro-step; AR over R of P_u r / G in the last micro-step only |
//! | stage 0 end of step | AR over W of P_u r, every unit, exposed |
//! | stage 1 end of step | RS over G of P_u r, then AR over R of P_u r / G, exposed |
//! | stages 1-2 after the update | AG over G of P_u e, exposed |
//! | link of a group spanning nodes | inter class, busbw = min(intra, b1 k min(1, rails / L)), k of its ranks per node |
//! | optimizer on the device | N (24 + 3r + e') / device bytes/s; N = sum P_u / G (sum P_u at stage 0); e' = e for a 16-bit copy, 0 in fp32 |
//! | optimizer on the host | N / host AdamW rate + N e / host link (+ N r at stage 1) |

use serde::Serialize;
use zrun_models::Model;
use zrun_shard::{Offload, Precision, ReduceDtype, ShardLayout, Stage};

use crate::config::{Config, ConfigError};

mod links;
mod schedule;

pub use links::{from_toml, merge_link_class, Group, Hardware, Link, LinkClass, Op};
use schedule::{micro_step, Costs, Kind, Sim};

/// One unit as the step-time model sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnitCost {
    /// Parameters, padded for the shard group (P_u).
    pub numel: f64,
    /// Forward FLOPs per token (F_u).
    pub flops_per_token: f64,
    /// The unit whose parameter this one also reads (tied embeddings).
    pub tied: Option<usize>,
}

/// When an offloaded (host) AdamW runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostOverlap {
    /// After the step's last backward: exposed.
    None,
    /// Unit by unit during the last backward (stages 2-3, `train.grad_clip = 0`, not fp16).
    Backward,
    /// During the next step's forward and backward (`zero.offload_delay`).
    NextStep,
}

/// Everything the prediction depends on besides the hardware.
#[derive(Clone, Debug)]
pub struct StepInputs {
    /// Units in model order.
    pub units: Vec<UnitCost>,
    /// Tokens per micro-step per rank (n_tok).
    pub tokens: f64,
    /// Training FLOPs per token of the model (3x forward, no recomputation), for MFU.
    pub model_flops_per_token: f64,
    /// ZeRO stage.
    pub stage: Stage,
    /// World size W.
    pub world: usize,
    /// Ranks per node L.
    pub ranks_per_node: usize,
    /// Shard group size G.
    pub group: usize,
    /// Bytes of a compute-dtype element (e).
    pub param_bytes: f64,
    /// Bytes of a reduce-dtype element (r).
    pub grad_bytes: f64,
    /// Whether an fp32 master is kept beside 16-bit compute parameters.
    pub master_copy: bool,
    /// Activation checkpointing.
    pub checkpointing: bool,
    /// Stage 3: units gathered ahead.
    pub prefetch: usize,
    /// Micro-steps per step (A).
    pub grad_accum: usize,
    /// Whether the AdamW runs on the host.
    pub offload: bool,
    /// When the host AdamW runs.
    pub host_overlap: HostOverlap,
}

impl StepInputs {
    /// The inputs of `cfg` training `model` on `world` ranks, `ranks_per_node` per node.
    pub fn from_config(
        cfg: &Config,
        model: &dyn Model,
        world: usize,
        ranks_per_node: usize,
    ) -> Result<StepInputs, crate::Error> {
        let stage = cfg.zero.stage;
        let group = if stage == Stage::Zero0 {
            world
        } else {
            cfg.zero.shard_group.resolve(world, ranks_per_node)?
        };
        let layout = ShardLayout::hybrid(model.units(), 0, world as i64, group as i64)?;
        let units = model
            .units()
            .iter()
            .zip(&layout.units)
            .map(|(u, l)| UnitCost {
                numel: l.padded as f64,
                flops_per_token: u.flops_per_token(),
                tied: u.tied().map(|t| t.unit),
            })
            .collect();
        let offload = cfg.zero.offload_optimizer == Offload::Cpu && stage != Stage::Zero0;
        let host_overlap = if !offload {
            HostOverlap::None
        } else if cfg.delay().is_some() {
            HostOverlap::NextStep
        } else if matches!(stage, Stage::Zero2 | Stage::Zero3)
            && cfg.train.grad_clip <= 0.0
            && cfg.zero.precision != Precision::Fp16
        {
            HostOverlap::Backward
        } else {
            HostOverlap::None
        };
        Ok(StepInputs {
            units,
            tokens: (cfg.train.micro_batch as i64 * model.seq_len()) as f64,
            model_flops_per_token: model.flops_per_token(),
            stage,
            world,
            ranks_per_node,
            group,
            param_bytes: cfg.zero.precision.bytes() as f64,
            grad_bytes: match cfg.zero.reduce_dtype {
                ReduceDtype::Fp32 => 4.0,
                ReduceDtype::Bf16 => 2.0,
            },
            master_copy: cfg.zero.precision != Precision::Fp32,
            checkpointing: cfg.zero.activation_checkpointing,
            prefetch: cfg.zero.prefetch,
            grad_accum: cfg.train.grad_accum.max(1),
            offload,
            host_overlap,
        })
    }

    /// `n` consecutive ranks, L per node.
    fn consecutive(&self, n: usize) -> Group {
        let l = self.ranks_per_node.max(1);
        Group {
            n,
            per_node: n.min(l),
            spans: n > l,
        }
    }

    /// The world: every rank (W ranks, L per node).
    fn world_group(&self) -> Group {
        self.consecutive(self.world)
    }

    /// A shard group: G consecutive ranks.
    fn shard_group(&self) -> Group {
        self.consecutive(self.group)
    }

    /// A replica group: the R ranks at one position of every shard group (stride G), so
    /// `max(1, L/G)` of them on each node.
    fn replica_group(&self) -> Group {
        let l = self.ranks_per_node.max(1);
        Group {
            n: self.world / self.group.max(1),
            per_node: (l / self.group.max(1)).max(1),
            spans: self.world > l,
        }
    }
}

/// A predicted step: where its time goes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepTime {
    /// Wall time of one optimizer step: compute + exposed communication + optimizer.
    pub step_s: f64,
    /// Forward, backward and recomputation over the step's micro-steps.
    pub compute_s: f64,
    /// The part of `compute_s` that is recomputation (activation checkpointing).
    pub recompute_s: f64,
    /// Exposed waits for stage 3's parameter all-gathers.
    pub gather_s: f64,
    /// Exposed waits for gradient reductions (all-reduce at stage 0, reduce-scatter else).
    pub reduce_s: f64,
    /// Exposed waits for the replica all-reduces of hybrid sharding.
    pub replicate_s: f64,
    /// Stages 1-2: the all-gather of the updated parameters.
    pub refresh_s: f64,
    /// Small collectives (the gradient norm).
    pub other_s: f64,
    /// Exposed optimizer time (AdamW, and the host transfers with offload).
    pub optimizer_s: f64,
    /// All collective time, overlapped or not.
    pub comm_s: f64,
    /// Tokens per second per rank: `n_tok A / step_s`.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation: `model FLOPs per token x tokens_per_s / peak`.
    pub mfu: f64,
}

impl StepTime {
    /// Exposed communication of every kind.
    pub fn exposed_comm_s(&self) -> f64 {
        self.gather_s + self.reduce_s + self.replicate_s + self.refresh_s + self.other_s
    }
}

/// Predicts one optimizer step of `inp` on `hw`: A micro-steps (see `micro_step`), then the
/// end of the step by stage (stage 0: all-reduce of every unit over W; stage 1: reduce-scatter
/// over G and replica all-reduce; stages 1-3: the gradient norm's all-reduce, alpha over W),
/// the optimizer, and stages 1-2's all-gather of the updated parameters. The optimizer:
/// on the device `N (24 + 3r + e') / device_bytes_per_s` (master, m and v read and written,
/// the gradient read twice and zeroed, the compute copy written); on the host
/// `N / host_adam_params_per_s` (exposed after the backward, `max(0, t - last backward)`
/// when overlapped with it, `max(0, t - the step's compute)` when delayed) plus
/// `N e / host_link_bytes_per_s` to bring the parameters back (and `N r` down at stage 1).
pub fn predict(inp: &StepInputs, hw: &Hardware) -> Result<StepTime, ConfigError> {
    let (e, r) = (inp.param_bytes, inp.grad_bytes);
    let (shard, replica, world) = (inp.shard_group(), inp.replica_group(), inp.world_group());
    let g = inp.group.max(1) as f64;
    let per_unit = |f: &dyn Fn(&UnitCost) -> Result<f64, ConfigError>| {
        inp.units.iter().map(f).collect::<Result<Vec<f64>, _>>()
    };
    let c = Costs {
        gather: per_unit(&|u| hw.collective(Op::AllGather, shard, u.numel * e))?,
        scatter: per_unit(&|u| hw.collective(Op::ReduceScatter, shard, u.numel * r))?,
        replicate: per_unit(&|u| hw.collective(Op::AllReduce, replica, u.numel / g * r))?,
        forward: per_unit(&|u| Ok(inp.tokens * u.flops_per_token / hw.flops))?,
    };
    let mut sim = Sim::default();
    let mut last_backward = 0.0;
    for m in 0..inp.grad_accum {
        last_backward = micro_step(&mut sim, inp, &c, m + 1 == inp.grad_accum);
    }
    let compute = sim.now - sim.exposed.iter().sum::<f64>();
    match inp.stage {
        Stage::Zero0 => {
            let mut done = sim.now;
            for u in &inp.units {
                done = sim.issue(hw.collective(Op::AllReduce, world, u.numel * r)?);
            }
            sim.wait(done, Kind::Reduce);
        }
        Stage::Zero1 => {
            let mut done = sim.now;
            for &t in &c.scatter {
                done = sim.issue(t);
            }
            let mut replicated = done;
            for &t in c.replicate.iter().filter(|t| **t > 0.0) {
                replicated = sim.issue(t);
            }
            sim.wait(done, Kind::Reduce);
            sim.wait(replicated, Kind::Replicate);
        }
        Stage::Zero2 | Stage::Zero3 => {}
    }
    if inp.stage != Stage::Zero0 && inp.world > 1 {
        let norm = sim.issue(hw.link(Op::AllReduce, world)?.alpha_s);
        sim.wait(norm, Kind::Other);
    }
    let total: f64 = inp.units.iter().map(|u| u.numel).sum();
    let n = if inp.stage == Stage::Zero0 {
        total
    } else {
        total / g
    };
    let optimizer = if inp.offload {
        let host = n / hw.host_adam_params_per_s;
        let host = match inp.host_overlap {
            HostOverlap::None => host,
            HostOverlap::Backward => (host - last_backward).max(0.0),
            HostOverlap::NextStep => (host - compute).max(0.0),
        };
        let down = if inp.stage == Stage::Zero1 {
            n * r
        } else {
            0.0
        };
        host + (n * e + down) / hw.host_link_bytes_per_s
    } else {
        let copy = if inp.master_copy { e } else { 0.0 };
        n * (24.0 + 3.0 * r + copy) / hw.device_bytes_per_s
    };
    sim.now += optimizer;
    if matches!(inp.stage, Stage::Zero1 | Stage::Zero2) {
        let mut done = sim.now;
        for &t in &c.gather {
            done = sim.issue(t);
        }
        sim.wait(done, Kind::Refresh);
    }
    let recompute = if inp.checkpointing {
        inp.grad_accum as f64 * c.forward.iter().sum::<f64>()
    } else {
        0.0
    };
    let step = sim.now;
    let tokens_per_s = inp.tokens * inp.grad_accum as f64 / step;
    let x = sim.exposed;
    Ok(StepTime {
        step_s: step,
        compute_s: compute,
        recompute_s: recompute,
        gather_s: x[Kind::Gather as usize],
        reduce_s: x[Kind::Reduce as usize],
        replicate_s: x[Kind::Replicate as usize],
        refresh_s: x[Kind::Refresh as usize],
        other_s: x[Kind::Other as usize],
        optimizer_s: optimizer,
        comm_s: sim.comm,
        tokens_per_s,
        mfu: inp.model_flops_per_token * tokens_per_s / hw.peak_flops,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// X = 1e6 FLOP/s, peak 2e6; every collective alpha 1 ms and busbw 1 MB/s inside a
    /// node, 0.5 MB/s across nodes (measured with all the node's ranks, one rail); AdamW
    /// streams 1 GB/s on the device, 1e5 params/s on the host, 1 MB/s between.
    fn hardware(ranks_per_node: usize) -> Hardware {
        let mut inter = LinkClass::uniform(1e-3, 5e5);
        inter.ranks_per_node = ranks_per_node;
        Hardware {
            ranks_per_node,
            flops: 1e6,
            peak_flops: 2e6,
            intra: Some(LinkClass::uniform(1e-3, 1e6)),
            inter: Some(inter),
            device_bytes_per_s: 1e9,
            host_adam_params_per_s: 1e5,
            host_link_bytes_per_s: 1e6,
        }
    }

    /// `n` units of 1000 parameters and 1000 forward FLOPs per token, 10 tokens per
    /// micro-step (f_u = 10 ms), bf16 compute, fp32 reduction.
    fn inputs(stage: Stage, n: usize, world: usize, group: usize) -> StepInputs {
        StepInputs {
            units: vec![
                UnitCost {
                    numel: 1000.0,
                    flops_per_token: 1000.0,
                    tied: None,
                };
                n
            ],
            tokens: 10.0,
            model_flops_per_token: 3000.0 * n as f64,
            stage,
            world,
            ranks_per_node: 2,
            group,
            param_bytes: 2.0,
            grad_bytes: 4.0,
            master_copy: true,
            checkpointing: false,
            prefetch: 1,
            grad_accum: 1,
            offload: false,
            host_overlap: HostOverlap::None,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// Stage 0 on 2 ranks: compute 2 x 3 x 10 ms, then one all-reduce per unit
    /// (1 ms + 4000 B x 2(1/2) / 1 MB/s = 5 ms), then AdamW 2000 x (24 + 12 + 2) B / 1 GB/s.
    #[test]
    fn stage0_is_compute_then_an_exposed_all_reduce_per_unit() {
        let t = predict(&inputs(Stage::Zero0, 2, 2, 2), &hardware(2)).unwrap();
        assert!(close(t.compute_s, 0.06), "{t:?}");
        assert!(close(t.reduce_s, 0.010), "{t:?}");
        assert!(close(t.optimizer_s, 7.6e-5), "{t:?}");
        assert!(close(t.step_s, 0.070076), "{t:?}");
        assert!(close(t.tokens_per_s, 10.0 / 0.070076), "{t:?}");
        assert!(close(t.mfu, 6000.0 * t.tokens_per_s / 2e6), "{t:?}");
    }

    /// Stage 3, 3 units, prefetch 1 (gather 2 ms, reduce-scatter 3 ms): only the first
    /// gather of the forward and of the backward (2 + 2 ms), the last reduce-scatter (3 ms)
    /// and the norm's alpha (1 ms) are exposed; AdamW on 1500 parameters.
    #[test]
    fn stage3_exposes_the_first_gathers_and_the_last_reduction() {
        let t = predict(&inputs(Stage::Zero3, 3, 2, 2), &hardware(2)).unwrap();
        assert!(close(t.compute_s, 0.09), "{t:?}");
        assert!(close(t.gather_s, 0.004), "{t:?}");
        assert!(close(t.reduce_s, 0.003), "{t:?}");
        assert!(close(t.other_s, 0.001), "{t:?}");
        assert!(close(t.optimizer_s, 5.7e-5), "{t:?}");
        assert!(close(t.step_s, 0.098057), "{t:?}");
        // 6 gathers, 3 reduce-scatters and the norm
        assert!(close(t.comm_s, 0.012 + 0.009 + 0.001), "{t:?}");
        // Without prefetch every gather is exposed, and in backward each queues behind the
        // reduce-scatter before it: 3 x 2 ms + 2 ms + 2 x (3 + 2) ms.
        let mut none = inputs(Stage::Zero3, 3, 2, 2);
        none.prefetch = 0;
        let t = predict(&none, &hardware(2)).unwrap();
        assert!(close(t.gather_s, 0.018), "{t:?}");
    }

    /// Stage 2 sharded per node (G = L = 2) on 2 nodes of one link each (the testbed): each
    /// shard's replica all-reduce crosses it beside the other rank's, so at half the
    /// busbw (1 ms + 2000 B x 2(1/2) / 0.25 MB/s = 9 ms), behind the unit's reduce-scatter;
    /// the last reduce-scatter (3 ms) and both all-reduces (18 ms) outlast the backward;
    /// then the norm (1 ms) and the refresh all-gathers (2 x 2 ms).
    #[test]
    fn hybrid_stage2_adds_replica_all_reduces_across_nodes() {
        let t = predict(&inputs(Stage::Zero2, 2, 4, 2), &hardware(2)).unwrap();
        assert!(close(t.reduce_s, 0.003), "{t:?}");
        assert!(close(t.replicate_s, 0.018), "{t:?}");
        assert!(close(t.other_s, 0.001), "{t:?}");
        assert!(close(t.refresh_s, 0.004), "{t:?}");
        assert!(close(t.optimizer_s, 3.8e-5), "{t:?}");
        assert!(close(t.step_s, 0.086038), "{t:?}");
        assert!(close(t.comm_s, 0.029), "{t:?}");
    }

    /// With 3 micro-steps the replica all-reduces come once, in the last: the same exposed
    /// 18 ms, 6 ms of communication (3 more reduce-scatters' pairs) per extra micro-step, and
    /// the first two micro-steps' last reduce-scatters (3 ms each) exposed too.
    #[test]
    fn hybrid_stage2_all_reduces_across_the_replicas_once_per_step() {
        let one = predict(&inputs(Stage::Zero2, 2, 4, 2), &hardware(2)).unwrap();
        let mut inp = inputs(Stage::Zero2, 2, 4, 2);
        inp.grad_accum = 3;
        let t = predict(&inp, &hardware(2)).unwrap();
        assert!(close(t.replicate_s, one.replicate_s), "{t:?}");
        assert!(close(t.reduce_s, 3.0 * one.reduce_s), "{t:?}");
        assert!(close(t.comm_s, one.comm_s + 2.0 * 0.006), "{t:?}");
    }

    /// Stage 1 with the optimizer on the host, 2 micro-steps: compute 2 x 60 ms, the step's
    /// reduce-scatters (2 x 3 ms), the norm (1 ms), AdamW over 1000 parameters at 1e5/s
    /// (10 ms) with 1000 x (4 + 2) B over 1 MB/s (6 ms), the refresh (2 x 2 ms).
    #[test]
    fn offloaded_stage1_pays_the_host_adamw_and_its_transfers() {
        let mut inp = inputs(Stage::Zero1, 2, 2, 2);
        (inp.offload, inp.grad_accum) = (true, 2);
        let t = predict(&inp, &hardware(2)).unwrap();
        assert!(close(t.compute_s, 0.12), "{t:?}");
        assert!(close(t.reduce_s, 0.006), "{t:?}");
        assert!(close(t.optimizer_s, 0.016), "{t:?}");
        assert!(close(t.refresh_s, 0.004), "{t:?}");
        assert!(close(t.step_s, 0.147), "{t:?}");
    }

    /// The host AdamW overlapped with the last backward (40 ms) hides 40 of its 50 ms; a
    /// delayed update hides behind the whole step's compute (60 ms).
    #[test]
    fn host_adamw_overlaps_the_backward_or_the_next_step() {
        let mut inp = inputs(Stage::Zero2, 2, 1, 1);
        inp.offload = true;
        let mut hw = hardware(2);
        hw.host_adam_params_per_s = 4e4; // 2000 parameters (G = 1): 50 ms
        hw.host_link_bytes_per_s = f64::INFINITY;
        inp.host_overlap = HostOverlap::Backward;
        assert!(close(predict(&inp, &hw).unwrap().optimizer_s, 0.010));
        inp.host_overlap = HostOverlap::NextStep;
        assert!(close(predict(&inp, &hw).unwrap().optimizer_s, 0.0));
        inp.host_overlap = HostOverlap::None;
        assert!(close(predict(&inp, &hw).unwrap().optimizer_s, 0.050));
    }

    /// One rank with nothing to communicate runs at X: MFU = X / peak, and 3/4 of it with
    /// activation checkpointing (a fourth forward per unit).
    #[test]
    fn one_rank_runs_at_the_compute_rate_and_checkpointing_costs_a_forward() {
        let cfg = Config::default();
        let model = cfg.build_model().unwrap();
        let mut hw = hardware(1);
        hw.device_bytes_per_s = f64::INFINITY;
        let inp = StepInputs::from_config(&cfg, model.as_ref(), 1, 1).unwrap();
        let t = predict(&inp, &hw).unwrap();
        assert!((t.mfu - 0.5).abs() < 1e-9, "{t:?}");
        assert_eq!(t.exposed_comm_s(), 0.0);
        let mut ckpt = cfg.clone();
        ckpt.zero.activation_checkpointing = true;
        let inp = StepInputs::from_config(&ckpt, model.as_ref(), 1, 1).unwrap();
        let t = predict(&inp, &hw).unwrap();
        assert!((t.mfu - 0.375).abs() < 1e-9, "{t:?}");
        assert!(close(t.recompute_s, t.compute_s / 4.0), "{t:?}");
    }

    /// A config's shard group and offload reach the inputs: `"node"` is the ranks per
    /// node, stage 0 shards over all and never offloads.
    #[test]
    fn inputs_follow_the_config() {
        let mut cfg = Config::default();
        let model = cfg.build_model().unwrap();
        cfg.zero.stage = Stage::Zero3;
        cfg.zero.shard_group = crate::config::ShardGroup::Node;
        cfg.zero.offload_optimizer = Offload::Cpu;
        let inp = StepInputs::from_config(&cfg, model.as_ref(), 16, 8).unwrap();
        assert_eq!((inp.group, inp.offload), (8, true));
        assert_eq!(inp.host_overlap, HostOverlap::None, "grad_clip is on");
        let r = inp.replica_group();
        assert_eq!((r.n, r.per_node, r.spans), (2, 1, true));
        cfg.zero.stage = Stage::Zero0;
        let inp = StepInputs::from_config(&cfg, model.as_ref(), 16, 8).unwrap();
        assert_eq!((inp.group, inp.offload), (16, false));
    }
}
