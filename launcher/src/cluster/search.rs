//! The search of `zrun plan --cluster`: every stage x shard group x offload x checkpointing
//! x micro-batch, each with its predicted memory (the first and last ranks: ranks with one
//! layout have one estimate) and step time.

use tch::Device;
use zrun_shard::{ShardLayout, Stage};
use zrun_train::config::{Config, ShardGroup};
use zrun_train::memory::{self, Choice};
use zrun_train::steptime::{self, Hardware, StepInputs, StepTime};

/// One configuration tried: its knobs, shard group, predicted memory and step.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// Stage, offload, checkpointing, micro-batch and grad_accum.
    pub choice: Choice,
    /// Shard group size G.
    pub group: usize,
    /// The largest predicted peak of a rank above the runtime's fixed cost.
    pub peak_bytes: i64,
    /// The runtime's fixed cost (on CUDA: the context and each NCCL communicator's buffers).
    pub fixed_bytes: i64,
    /// Host bytes a rank holds beside its device (offload).
    pub host_bytes: i64,
    /// Whether device and host memory fit.
    pub fits: bool,
    /// The predicted step.
    pub step: StepTime,
}

/// The search's fixed context: config, model, cluster size and limits.
pub struct Search<'a> {
    /// The config with the cluster's device.
    pub cfg: &'a Config,
    /// Its model.
    pub model: &'a dyn zrun_models::Model,
    /// World size W.
    pub world: usize,
    /// Ranks per node L.
    pub local: usize,
    /// The runtime's fixed cost per rank on CPU (measured here); on CUDA it follows the
    /// communicators ([`Search::fixed`]).
    pub cpu_fixed: i64,
    /// Whether CUDA ranks talk over NCCL (not `dist.backend = "tcp"`).
    pub nccl: bool,
    /// Device memory per rank.
    pub limit: i64,
    /// Host memory per node.
    pub host_limit: Option<i64>,
    /// Whether ranks compute on CUDA.
    pub cuda: bool,
    /// What a rank runs on.
    pub hw: Hardware,
}

impl Search<'_> {
    /// The runtime's fixed cost of a rank sharding over groups of `group`: on CUDA the
    /// context and the buffers of each NCCL communicator it holds (three with hybrid
    /// sharding), on CPU what this process measured.
    pub fn fixed(&self, group: usize) -> i64 {
        if !self.cuda {
            return self.cpu_fixed;
        }
        let backend = if self.nccl {
            zrun_comm::Backend::Nccl
        } else {
            zrun_comm::Backend::Tcp
        };
        let comms = memory::nccl_comms(backend, self.world, group);
        memory::fixed_cost(Device::Cuda(0), 0, comms)
    }

    /// Shard groups to try at stages 1-3: every multiple of the node that divides the world,
    /// largest first (W is "all", L is "node").
    pub fn groups(&self) -> Vec<usize> {
        let nodes = self.world / self.local;
        (1..=nodes)
            .rev()
            .filter(|k| nodes.is_multiple_of(*k))
            .map(|k| k * self.local)
            .collect()
    }

    /// Memory and step of the config with `choice` at shard group `group` (W at stage 0).
    pub fn evaluate(&self, choice: Choice, group: usize) -> anyhow::Result<Candidate> {
        let mut c = choice.apply(self.cfg);
        let group = if c.zero.stage == Stage::Zero0 {
            self.world
        } else {
            group
        };
        c.zero.shard_group = if group == self.world {
            ShardGroup::All
        } else {
            ShardGroup::Ranks(group)
        };
        let ec = memory::estimate_config(&c)?;
        let (mut peak, mut host) = (0i64, 0i64);
        let w = self.world as i64;
        for rank in [0, w - 1] {
            let layout = ShardLayout::hybrid(self.model.units(), rank, w, group as i64)?;
            let e = zrun_shard::estimate(self.model, &layout, &ec);
            peak = peak.max(e.peak_bytes);
            host = host.max(e.host_bytes);
        }
        let host_fits = !self.cuda
            || self.host_limit.is_none_or(|h| {
                self.local as f64 * host as f64 * (1.0 + memory::MARGIN) <= h as f64
            });
        let fixed = self.fixed(group);
        let inputs = StepInputs::from_config(&c, self.model, self.world, self.local)?;
        Ok(Candidate {
            choice,
            group,
            peak_bytes: peak,
            fixed_bytes: fixed,
            host_bytes: host,
            fits: memory::fits(fixed, peak, Some(self.limit)) && host_fits,
            step: steptime::predict(&inputs, &self.hw)?,
        })
    }

    /// Every configuration at `per_rank` sequences per rank per step ([`Choice::space`] x
    /// the shard groups of stages 1-3), fastest first (ties in the order tried).
    pub fn all(&self, per_rank: usize) -> anyhow::Result<Vec<Candidate>> {
        let mut out = Vec::new();
        for choice in Choice::space(per_rank, self.cfg.zero.offload_delay > 0) {
            let groups = if choice.stage == Stage::Zero0 {
                vec![self.world]
            } else {
                self.groups()
            };
            for group in groups {
                out.push(self.evaluate(choice, group)?);
            }
        }
        out.sort_by(|a, b| a.step.step_s.total_cmp(&b.step.step_s));
        Ok(out)
    }

    /// `zero.shard_group`'s value for group size `g`.
    pub fn group_value(&self, g: usize) -> String {
        if g == self.world {
            "\"all\"".into()
        } else if g == self.local {
            "\"node\"".into()
        } else {
            g.to_string()
        }
    }

    /// The candidate's `--set` overrides.
    pub fn overrides(&self, c: &Candidate) -> Vec<String> {
        let mut v = c.choice.overrides();
        v.push(format!("zero.shard_group={}", self.group_value(c.group)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Cluster;
    use zrun_train::config::DeviceChoice;

    /// `text` as a config on CUDA.
    fn config(text: &str) -> Config {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        std::fs::write(&path, text).unwrap();
        let mut cfg = Config::load(&path, &[]).unwrap();
        cfg.dist.device = DeviceChoice::Cuda;
        cfg
    }

    fn search<'a>(cfg: &'a Config, model: &'a dyn zrun_models::Model, nodes: usize) -> Search<'a> {
        let cl = Cluster::load("h100-8x").unwrap();
        Search {
            cfg,
            model,
            world: nodes * 8,
            local: 8,
            cpu_fixed: 0,
            nccl: true,
            limit: cl.device_memory,
            host_limit: cl.host_memory,
            cuda: true,
            hw: cl.hardware(),
        }
    }

    /// The first and last ranks stand for all: every rank's estimate is the same for a
    /// hybrid layout.
    #[test]
    fn two_ranks_stand_for_every_rank() {
        let cfg = config("[model]\npreset = \"tiny\"\n[zero]\nstage = 3\nshard_group = 8\n");
        let model = cfg.build_model().unwrap();
        let s = search(&cfg, model.as_ref(), 2);
        let c = s.evaluate(Choice::of(&cfg), 8).unwrap();
        let every = memory::estimate_ranks(&cfg, 16, s.fixed(8), Some(s.limit)).unwrap();
        assert_eq!(
            c.peak_bytes,
            every.iter().map(|r| r.peak_bytes).max().unwrap()
        );
        assert_eq!(c.fixed_bytes, every[0].fixed_bytes);
        assert_eq!(s.groups(), vec![16, 8]);
        assert_eq!(s.overrides(&c).last().unwrap(), "zero.shard_group=\"node\"");
        // Stage 0 ignores the group: one communicator, shard group "all".
        let mut zero = Choice::of(&cfg);
        zero.stage = Stage::Zero0;
        let c = s.evaluate(zero, 8).unwrap();
        assert_eq!((c.group, c.fixed_bytes), (16, s.fixed(16)));
    }

    /// 128 nodes of the preset: every stage, group, offload, checkpointing and micro-batch
    /// is tried, fast, and the fastest that fits comes first.
    #[test]
    fn a_thousand_ranks_plan_fast_and_fastest_first() {
        let cfg = config(
            "[model]\narch = \"llama\"\npreset = \"llama3.2-1b\"\n[train]\nmicro_batch = 2\n[zero]\nprecision = \"bf16\"\n",
        );
        let model = cfg.build_model().unwrap();
        let s = search(&cfg, model.as_ref(), 128);
        let t = std::time::Instant::now();
        let all = s.all(2).unwrap();
        assert!(t.elapsed().as_secs_f64() < 20.0, "{:?}", t.elapsed());
        // stage 0: 2 ckpt x 2 mb; stages 1-3: 8 groups x 2 offload x 2 ckpt x 2 mb
        assert_eq!(all.len(), 4 + 3 * 8 * 8);
        assert!(all.windows(2).all(|w| w[0].step.step_s <= w[1].step.step_s));
        let best = all.iter().find(|c| c.fits).unwrap();
        assert!(
            best.step.mfu > 0.1 && best.step.mfu < 0.45,
            "{:?}",
            best.step
        );
    }
}
