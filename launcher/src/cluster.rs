//! `zrun plan --cluster NAME_OR_FILE [--nodes N]`: the fastest configuration that fits a
//! cluster of any size, by predicted step time (`zrun_train::steptime`) among those whose
//! predicted memory (`zrun_shard::estimate`) fits.
//!
//!     zrun plan train.toml --cluster h100-8x --nodes 16
//!     zrun plan train.toml --cluster cluster.toml          # from `zrun bench comm --save`
//!
//! It searches stage 0-3 x shard group (all, node, and the divisors of the world between
//! them that hold whole nodes) x optimizer offload x activation checkpointing x micro-batch
//! (the divisors of the sequences per rank per step at the config's global batch). Ranks
//! with the same layout have the same estimate, so it estimates the first and the last
//! rank only: 1024 ranks cost what 8 do. The cluster file and the presets: docs/cluster.md.

mod search;

use std::path::Path;

use serde::Deserialize;
use serde_json::json;
use tch::Device;
use zrun_train::config::{BackendChoice, Config, DeviceChoice};
use zrun_train::memory::{self, human, Choice};
use zrun_train::steptime::{self, Hardware, LinkClass, StepTime};

use crate::fit::PlanArgs;
use crate::launch::BadInput;
pub use search::{Candidate, Search};

/// The presets `--cluster` takes by name.
pub const PRESETS: &[&str] = &["h100-8x"];

/// A cluster: its nodes, what each rank has, and its links.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// What `--cluster` named.
    pub name: String,
    /// Nodes (default of `--nodes`).
    pub nodes: usize,
    /// Ranks (GPUs) per node.
    pub gpus_per_node: usize,
    /// Whether ranks compute on CUDA devices (else CPU).
    pub cuda: bool,
    /// Memory one rank may use, bytes.
    pub device_memory: i64,
    /// Host memory of a node, bytes (for offloaded optimizer state); `None`: not checked.
    pub host_memory: Option<i64>,
    /// Declared FLOP/s per rank.
    pub flops: f64,
    /// Fraction of `flops` the step's kernels achieve.
    pub achievable: f64,
    /// Peak FLOP/s per rank for MFU.
    pub peak_flops: f64,
    /// Bytes per second a rank's device AdamW streams.
    pub device_bytes_per_s: f64,
    /// Parameters per second the node's host AdamW updates (all its ranks together).
    pub host_adam_params_per_s: f64,
    /// Bytes per second between a rank's device and the host, each way.
    pub host_link_bytes_per_s: f64,
    /// Links inside a node.
    pub intra: Option<LinkClass>,
    /// Links across nodes.
    pub inter: Option<LinkClass>,
}

/// The `[cluster]` table of a cluster file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Section {
    nodes: Option<usize>,
    gpus_per_node: Option<usize>,
    device: Option<String>,
    device_memory: String,
    host_memory: Option<String>,
    flops: f64,
    achievable: Option<f64>,
    peak_flops: Option<f64>,
    device_bytes_per_s: Option<f64>,
    host_adam_params_per_s: Option<f64>,
    host_link_bytes_per_s: Option<f64>,
}

/// A cluster file: `[cluster]` plus `[intra]`/`[inter]` as `zrun bench comm --save` writes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    cluster: Section,
    intra: Option<LinkClass>,
    inter: Option<LinkClass>,
}

impl Cluster {
    /// `h100-8x`: nodes of 8 H100 SXM 80GB on NVLink (NVSwitch), one 400 Gbit/s NIC per
    /// GPU across nodes. Sources and assumptions:
    /// - 989.4 TFLOP/s dense bf16 per GPU (NVIDIA H100 SXM datasheet: 1,979 with sparsity);
    ///   achieved 0.45 of it in the step's kernels (an assumption: torchtitan measures 33-39%
    ///   MFU for Llama 3.1 8B with FSDP on 8-128 H100s, communication and recomputation
    ///   included; measure yours with one GPU's MFU);
    /// - 81,559 MiB per GPU (what the 80GB part reports), 2 TiB of host memory per node
    ///   (DGX H100);
    /// - intra: nccl-tests' busbw on 8 H100 over NVSwitch, about 360 GB/s at large sizes for
    ///   all-gather, reduce-scatter and ring all-reduce (NVLink 4: 450 GB/s each way per GPU;
    ///   NVLS all-reduce reaches more, not assumed), alpha 15 us;
    /// - inter: 400 Gbit/s = 50 GB/s per NIC, about 46 GB/s busbw per NIC in nccl-tests,
    ///   8 rails (a ring with all 8 ranks of each node spreads over the 8 NICs: 368 GB/s,
    ///   capped at the intra 360), alpha 40 us;
    /// - device AdamW 2.5 TB/s (HBM3: 3.35 TB/s); host AdamW 10 Gparam/s per node (two
    ///   Xeon 8480C, ~600 GB/s of DDR5, half of it at 30 bytes per parameter); 25 GB/s per
    ///   GPU to the host (PCIe Gen5 x16: 64 GB/s each way, shared with the NICs).
    fn h100_8x() -> Cluster {
        let mut inter = LinkClass::uniform(40e-6, 46e9);
        inter.rails = 8;
        Cluster {
            name: "h100-8x".into(),
            nodes: 1,
            gpus_per_node: 8,
            cuda: true,
            device_memory: 81_559 << 20,
            host_memory: Some(2 << 40),
            flops: 989.4e12,
            achievable: 0.45,
            peak_flops: 989.4e12,
            device_bytes_per_s: 2.5e12,
            host_adam_params_per_s: 10e9,
            host_link_bytes_per_s: 25e9,
            intra: Some(LinkClass::uniform(15e-6, 360e9)),
            inter: Some(inter),
        }
    }

    /// A preset by name, else a cluster file; an error names both.
    pub fn load(name: &str) -> anyhow::Result<Cluster> {
        if name == "h100-8x" {
            return Ok(Cluster::h100_8x());
        }
        let path = Path::new(name);
        let text = zrun_train::config::read_config(path).map_err(|e| {
            BadInput(format!(
                "--cluster {name}: not a preset ({}) and not a readable file ({e}); a cluster file is described in docs/cluster.md",
                PRESETS.join(", ")
            ))
        })?;
        let f: File = steptime::from_toml(&text, &format!("--cluster {name}"))
            .map_err(|e| BadInput(e.to_string()))?;
        let s = f.cluster;
        let bytes = |key: &str, v: &str| {
            memory::parse_bytes(v).map_err(|e| BadInput(format!("{name}: cluster.{key}: {e}")))
        };
        let cuda = match s.device.as_deref().unwrap_or("cuda") {
            "cuda" => true,
            "cpu" => false,
            other => {
                return Err(BadInput(format!(
                    "{name}: cluster.device = {other:?}: use \"cuda\" or \"cpu\""
                ))
                .into())
            }
        };
        let achievable = s.achievable.unwrap_or(1.0);
        if !(s.flops > 0.0 && achievable > 0.0 && achievable <= 1.0) {
            return Err(BadInput(format!(
                "{name}: cluster.flops must be > 0 and cluster.achievable in (0, 1]"
            ))
            .into());
        }
        let fast = if cuda { 1e12 } else { 1e10 };
        Ok(Cluster {
            name: name.into(),
            nodes: s.nodes.unwrap_or(1),
            gpus_per_node: s
                .gpus_per_node
                .or(f.intra.as_ref().map(|c| c.ranks_per_node))
                .unwrap_or(1),
            cuda,
            device_memory: bytes("device_memory", &s.device_memory)?,
            host_memory: s
                .host_memory
                .map(|h| bytes("host_memory", &h))
                .transpose()?,
            flops: s.flops,
            achievable,
            peak_flops: s.peak_flops.unwrap_or(s.flops),
            device_bytes_per_s: s.device_bytes_per_s.unwrap_or(fast),
            host_adam_params_per_s: s.host_adam_params_per_s.unwrap_or(1e9),
            host_link_bytes_per_s: s.host_link_bytes_per_s.unwrap_or(fast / 40.0),
            intra: f.intra,
            inter: f.inter,
        })
    }

    /// What one rank runs on: `flops x achievable`, the node's host AdamW rate shared by its
    /// ranks.
    pub fn hardware(&self) -> Hardware {
        Hardware {
            ranks_per_node: self.gpus_per_node,
            flops: self.flops * self.achievable,
            peak_flops: self.peak_flops,
            intra: self.intra.clone(),
            inter: self.inter.clone(),
            device_bytes_per_s: self.device_bytes_per_s,
            host_adam_params_per_s: self.host_adam_params_per_s / self.gpus_per_node as f64,
            host_link_bytes_per_s: self.host_link_bytes_per_s,
        }
    }
}

/// A candidate as JSON.
fn json(s: &Search, c: &Candidate) -> serde_json::Value {
    json!({
        "set": s.overrides(c),
        "shard_group": c.group,
        "fits": c.fits,
        "peak_bytes": c.peak_bytes,
        "fixed_bytes": c.fixed_bytes,
        "host_bytes": c.host_bytes,
        "tokens_per_s_per_rank": c.step.tokens_per_s,
        "mfu": c.step.mfu,
        "step": c.step,
    })
}

/// One table row, headed `label`.
fn row(s: &Search, label: &str, c: &Candidate) -> String {
    let ch = &c.choice;
    format!(
        "  {label:>4} {:>12} {:>6.1}% {:>9.3} {:>11} {:>5} {:>6} {:>11} {:>4} {:>9}",
        thousands(c.step.tokens_per_s),
        c.step.mfu * 100.0,
        c.step.step_s,
        human(c.peak_bytes + c.fixed_bytes),
        ch.stage.to_string(),
        s.group_value(c.group).trim_matches('"'),
        match (ch.offload, ch.delayed) {
            (true, true) => "cpu delayed",
            (true, false) => "cpu",
            (false, _) => "none",
        },
        if ch.activation_checkpointing {
            "on"
        } else {
            "off"
        },
        format!("{} x {}", ch.micro_batch, ch.grad_accum),
    )
}

/// `x` with an SI prefix and three significant digits: `989 TFLOP/s`, `8.03 G`.
fn si(x: f64, unit: &str) -> String {
    let (v, prefix) = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
        .iter()
        .find(|(scale, _)| x >= *scale)
        .map_or((x, ""), |(scale, p)| (x / scale, *p));
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$} {prefix}{unit}")
}

/// `5833.2` as `5,833`.
fn thousands(x: f64) -> String {
    let s = format!("{:.0}", x.max(0.0));
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Where a step's time goes, in one line.
fn breakdown(t: &StepTime) -> String {
    format!(
        "step {:.3} s = compute {:.3} s (recompute {:.3}) + exposed communication {:.3} s (gathers {:.3}, reductions {:.3}, replicas {:.3}, refresh {:.3}, norm {:.4}) + optimizer {:.3} s; {:.3} s of communication in all",
        t.step_s,
        t.compute_s,
        t.recompute_s,
        t.exposed_comm_s(),
        t.gather_s,
        t.reduce_s,
        t.replicate_s,
        t.refresh_s,
        t.other_s,
        t.optimizer_s,
        t.comm_s
    )
}

/// Runs `zrun plan --cluster`.
pub fn plan(a: &PlanArgs, name: &str) -> anyhow::Result<u8> {
    let cl = Cluster::load(name)?;
    if a.fit.nproc != 1 || a.fit.nnodes != 1 || a.verify {
        return Err(BadInput(
            "--cluster gives the ranks per node and --nodes the nodes: drop --nproc, --nnodes and --verify".into(),
        )
        .into());
    }
    let nodes = a.nodes.unwrap_or(cl.nodes);
    if nodes == 0 || cl.gpus_per_node == 0 {
        return Err(BadInput("--nodes and cluster.gpus_per_node must be at least 1".into()).into());
    }
    // The search walks shard groups up to the world: past what one job runs it only runs
    // long.
    let most = crate::launch::MAX_WORLD;
    if nodes.saturating_mul(cl.gpus_per_node) > most {
        return Err(BadInput(format!(
            "--nodes {nodes} x {} rank(s) per node: more ranks than one job runs (at most {most}); give fewer --nodes",
            cl.gpus_per_node
        ))
        .into());
    }
    let (local, world) = (cl.gpus_per_node, nodes * cl.gpus_per_node);
    let limit = match &a.fit.device_mem {
        Some(s) => memory::parse_bytes(s).map_err(|e| BadInput(format!("--device-mem: {e}")))?,
        None => cl.device_memory,
    };
    let mut cfg = Config::load(&a.fit.config, &a.fit.set)?;
    cfg.dist.device = if cl.cuda {
        DeviceChoice::Cuda
    } else {
        DeviceChoice::Cpu
    };
    let per_rank = match cfg.train.global_batch {
        Some(gb) if gb == 0 || !gb.is_multiple_of(world) => {
            return Err(BadInput(format!(
                "train.global_batch = {gb} is not a positive multiple of the {world} ranks: set one, or remove it to keep {} sequences per rank",
                cfg.train.micro_batch * cfg.train.grad_accum
            ))
            .into())
        }
        Some(gb) => gb / world,
        None => cfg.train.micro_batch * cfg.train.grad_accum,
    };
    let model = cfg.build_model()?;
    let cpu_fixed = if cl.cuda {
        0
    } else {
        memory::fixed_bytes(Device::Cpu, cfg.zero.precision.kind())?
    };
    let search = Search {
        cfg: &cfg,
        model: model.as_ref(),
        world,
        local,
        cpu_fixed,
        nccl: cfg.dist.backend != BackendChoice::Tcp,
        limit,
        host_limit: cl.host_memory,
        cuda: cl.cuda,
        hw: cl.hardware(),
    };
    let all = search.all(per_rank)?;
    let fitting: Vec<&Candidate> = all.iter().filter(|c| c.fits).collect();
    let own = own_choice(&search, &cfg);
    let seq = model.seq_len();
    if a.fit.json {
        println!(
            "{}",
            json!({
                "cluster": cl.name, "nodes": nodes, "ranks_per_node": local, "world": world,
                "limit_bytes": limit, "sequences_per_rank": per_rank, "seq_len": seq,
                "tried": all.len(), "fit": fitting.len(),
                "best": fitting.first().map(|c| json(&search, c)),
                "runners_up": fitting.iter().skip(1).take(4).map(|c| json(&search, c)).collect::<Vec<_>>(),
                "config": own.as_ref().ok().map(|c| json(&search, c)),
            })
        );
        return Ok(if fitting.is_empty() { 2 } else { 0 });
    }
    println!(
        "cluster {}: {nodes} node(s) x {local} = {world} ranks, {} per rank{}; {} per rank ({:.2} of {}), MFU against {}",
        cl.name,
        human(limit),
        cl.host_memory
            .map_or(String::new(), |h| format!(", {} host per node", human(h))),
        si(cl.flops * cl.achievable, "FLOP/s"),
        cl.achievable,
        si(cl.flops, "FLOP/s"),
        si(cl.peak_flops, "FLOP/s")
    );
    println!(
        "model: {} parameters, {} per token (training); {per_rank} sequence(s) x {seq} tokens per rank per step (global batch {})",
        si(model.param_count() as f64, ""),
        si(model.flops_per_token(), "FLOP"),
        per_rank * world
    );
    println!(
        "tried {} configurations, {} fit (1.{:02.0} x peak + runtime {} within {} per rank{})",
        all.len(),
        fitting.len(),
        memory::MARGIN * 100.0,
        if cl.cuda {
            format!(
                "{} + {} per NCCL communicator",
                human(memory::CUDA_FIXED_BYTES),
                human(memory::NCCL_FIXED_BYTES)
            )
        } else {
            human(cpu_fixed)
        },
        human(limit),
        if cl.cuda && cl.host_memory.is_some() {
            ", offloaded state within host memory"
        } else {
            ""
        }
    );
    let Some(best) = fitting.first() else {
        let least = all.iter().min_by_key(|c| c.peak_bytes);
        return Err(BadInput(format!(
            "nothing fits {} per rank on {world} ranks: the smallest peak is {} + runtime {} ({}); add nodes, shorten model.seq_len or lower the batch",
            human(limit),
            least.map_or_else(String::new, |c| human(c.peak_bytes)),
            least.map_or_else(String::new, |c| human(c.fixed_bytes)),
            least.map_or_else(String::new, |c| search.overrides(c).join(" ")),
        ))
        .into());
    };
    println!(
        "  {:>4} {:>12} {:>7} {:>9} {:>11} {:>5} {:>6} {:>11} {:>4} {:>9}",
        "rank",
        "tokens/s/GPU",
        "MFU",
        "step (s)",
        "memory",
        "stage",
        "group",
        "offload",
        "ckpt",
        "mb x acc"
    );
    let top: Vec<&&Candidate> = fitting.iter().take(5).collect();
    for (i, c) in top.iter().enumerate() {
        println!("{}", row(&search, &(i + 1).to_string(), c));
    }
    println!("best: {}", breakdown(&best.step));
    for (i, c) in top.iter().enumerate() {
        let sets: Vec<String> = search
            .overrides(c)
            .iter()
            .map(|o| format!("--set {o}"))
            .collect();
        println!("  {}: {}", i + 1, sets.join(" "));
    }
    match own {
        Ok(c) => {
            println!(
                "the config as given ({}):",
                if c.fits { "fits" } else { "does NOT fit" }
            );
            println!("{}", row(&search, "cfg", &c));
            println!("  {}", breakdown(&c.step));
        }
        Err(e) => println!("the config as given: not evaluated: {e}"),
    }
    Ok(0)
}

/// The config's own choice and shard group, evaluated on the cluster.
fn own_choice(s: &Search, cfg: &Config) -> anyhow::Result<Candidate> {
    if cfg.auto.stage || cfg.auto.micro_batch {
        anyhow::bail!("it leaves zero.stage or train.micro_batch to \"auto\"");
    }
    let g = cfg.zero.shard_group.resolve(s.world, s.local)?;
    s.evaluate(Choice::of(cfg), g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_files_load_with_defaults_and_name_bad_values() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        let links = "all_gather = { alpha_s = 1e-4, busbw = 1e9 }\nreduce_scatter = { alpha_s = 1e-4, busbw = 1e9 }\nall_reduce = { alpha_s = 2e-4, busbw = 1e9 }\n";
        std::fs::write(
            &path,
            format!("[cluster]\ndevice = \"cpu\"\ndevice_memory = \"4GiB\"\nflops = 1e11\nachievable = 0.5\n\n[intra]\nranks_per_node = 2\n{links}"),
        )
        .unwrap();
        let c = Cluster::load(path.to_str().unwrap()).unwrap();
        assert_eq!((c.gpus_per_node, c.cuda, c.nodes), (2, false, 1));
        assert_eq!(c.device_memory, 4 << 30);
        let hw = c.hardware();
        assert_eq!((hw.flops, hw.peak_flops), (5e10, 1e11));
        assert!(c.inter.is_none());
        std::fs::write(
            &path,
            "[cluster]\ndevice = \"tpu\"\ndevice_memory = \"4GiB\"\nflops = 1e11\n",
        )
        .unwrap();
        let e = Cluster::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"tpu\""), "{e}");
        let e = Cluster::load("h200-8x").unwrap_err().to_string();
        assert!(
            e.contains("h100-8x") && e.contains("docs/cluster.md"),
            "{e}"
        );
    }

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(5832.6), "5,833");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1234567.0), "1,234,567");
        assert_eq!(si(989.4e12, "FLOP/s"), "989 TFLOP/s");
        assert_eq!(si(8.03e9, ""), "8.03 G");
        assert_eq!(si(26e9, "FLOP/s"), "26.0 GFLOP/s");
        assert_eq!(si(5.0, "B"), "5.00 B");
    }
}
