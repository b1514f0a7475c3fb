//! `zrun estimate` and `zrun plan`: every rank's predicted memory before anything is
//! allocated, the alternatives at the same global batch, and the cheapest that fits.

use std::path::PathBuf;

use serde_json::json;
use tch::Device;
use zrun_train::config::Config;
use zrun_train::memory::{self, human, Choice, Fit, RankEstimate};

use crate::launch::BadInput;

/// Flags shared by `zrun estimate` and `zrun plan`.
#[derive(clap::Args, Debug, Clone)]
pub struct FitArgs {
    /// The training config (TOML).
    pub config: PathBuf,
    /// Override a config key, as when training.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Ranks per node.
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Nodes.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// Everything one rank may use (e.g. 80GiB, 6GB); default: dist.memory_limit.
    #[arg(long, value_name = "SIZE")]
    pub device_mem: Option<String>,
    /// One JSON object per line instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `zrun plan`.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    pub fit: FitArgs,
    /// Run two steps of the choice on this machine and print measured against predicted.
    #[arg(long)]
    pub verify: bool,
    /// A cluster preset (h100-8x) or file (docs/cluster.md): the fastest predicted step
    /// over stage, shard group, offload, checkpointing and micro-batch that fits it.
    #[arg(long, value_name = "NAME_OR_FILE")]
    pub cluster: Option<String>,
    /// With --cluster: nodes (default: the cluster's).
    #[arg(long, requires = "cluster")]
    pub nodes: Option<usize>,
}

/// The config, the world size, the limit and the runtime's fixed cost.
struct Setting {
    cfg: Config,
    world: usize,
    limit: Option<i64>,
    fixed: i64,
}

fn setting(a: &FitArgs) -> anyhow::Result<Setting> {
    let cfg = Config::load(&a.config, &a.set)?;
    if a.nproc == 0 || a.nnodes == 0 {
        return Err(BadInput("--nproc and --nnodes must be at least 1".into()).into());
    }
    crate::launch::check_world(a.nproc, a.nnodes)?;
    let limit = match &a.device_mem {
        Some(s) => {
            Some(memory::parse_bytes(s).map_err(|e| BadInput(format!("--device-mem: {e}")))?)
        }
        None => cfg.dist.memory_limit_bytes()?,
    };
    let cuda = memory::estimate_config(&cfg)?.cuda;
    let world = a.nproc * a.nnodes;
    let mut cfg = cfg;
    let group = cfg.resolve_shard_group(world, a.nproc)?;
    let fixed = if cuda {
        // More than one rank on GPUs talk over NCCL unless the config says tcp.
        let backend = match cfg.dist.backend {
            zrun_train::config::BackendChoice::Tcp => zrun_comm::Backend::Tcp,
            _ => zrun_comm::Backend::Nccl,
        };
        memory::fixed_cost(
            Device::Cuda(0),
            0,
            memory::nccl_comms(backend, world, group),
        )
    } else {
        memory::fixed_bytes(Device::Cpu, cfg.zero.precision.kind())?
    };
    if cfg.auto.stage || cfg.auto.micro_batch {
        let budget = match limit {
            Some(l) => l,
            None => memory::budget(&cfg, Device::Cpu, a.nproc)?.0,
        };
        cfg = memory::resolve_auto(&cfg, world, fixed, budget)?;
        println!(
            "\"auto\" resolved for {} per rank: {}",
            human(budget),
            Choice::of(&cfg).overrides().join(" ")
        );
    }
    // The loss's chunking (`"auto"`: the full logits on a GPU where they fit): against the
    // limit, else this machine's first GPU when it has one (a GPU per rank).
    let loss_limit = limit.or_else(|| zrun_comm::gpu_total_bytes(0).map(|b| b as i64));
    let (cfg, why) =
        zrun_train::loss_chunk::resolve_loss_chunk(&cfg, cuda, world, fixed, loss_limit)?;
    match why {
        // stdout holds only JSON then
        Some(why) if a.json => eprintln!("{why}"),
        Some(why) => println!("{why}"),
        None => {}
    }
    Ok(Setting {
        cfg,
        world,
        limit,
        fixed,
    })
}

/// Runs `zrun estimate`.
pub fn estimate(a: &FitArgs) -> anyhow::Result<u8> {
    let s = setting(a)?;
    let ranks = memory::estimate_ranks(&s.cfg, s.world, s.fixed, s.limit)?;
    let alts = memory::alternatives(&s.cfg, s.world, s.fixed, s.limit)?;
    if a.json {
        for r in &ranks {
            println!("{}", rank_json(r));
        }
        return Ok(0);
    }
    let c = &s.cfg;
    println!(
        "{}: {} rank(s), stage {}, {}, micro-batch {} x {} tokens, grad_accum {}, activation checkpointing {}, optimizer offload {}",
        a.config.display(),
        s.world,
        c.zero.stage,
        c.zero.precision,
        c.train.micro_batch,
        c.arch()?.seq_len(),
        c.train.grad_accum,
        on_off(c.zero.activation_checkpointing),
        c.zero.offload_optimizer,
    );
    let g = c.shard_group_size(s.world)?;
    if g < s.world {
        println!(
            "zero.shard_group = {g}: model states sharded over groups of {g} ranks, replicated {} times",
            s.world / g
        );
    }
    let mut shown: Option<&RankEstimate> = None;
    for r in &ranks {
        if shown.is_some_and(|p| same(p, r)) {
            continue;
        }
        let until = ranks[r.rank..]
            .iter()
            .take_while(|q| same(r, q))
            .last()
            .map_or(r.rank, |q| q.rank);
        print_rank(r, until, s.limit);
        shown = Some(r);
    }
    if let Some(hint) = bf16_grads_hint(&s, &ranks)? {
        println!("{hint}");
    }
    println!();
    print_alternatives(&s, &alts, &Choice::of(&s.cfg));
    Ok(0)
}

/// Where bf16 gradients would be exact (docs/config.md: one rank, one micro-step a step, no
/// tied parameter, 16-bit compute) and the config keeps fp32 ones: the line saying what they
/// would save at the peak.
fn bf16_grads_hint(s: &Setting, ranks: &[RankEstimate]) -> anyhow::Result<Option<String>> {
    use zrun_shard::{Precision, ReduceDtype};
    let c = &s.cfg;
    if s.world != 1
        || c.train.grad_accum != 1
        || c.zero.precision == Precision::Fp32
        || c.zero.reduce_dtype != ReduceDtype::Fp32
        || c.arch()?.tied()
    {
        return Ok(None);
    }
    let mut bf16 = c.clone();
    bf16.zero.reduce_dtype = ReduceDtype::Bf16;
    let with = memory::estimate_ranks(&bf16, 1, s.fixed, s.limit)?;
    let (Some(now), Some(then)) = (ranks.first(), with.first()) else {
        return Ok(None);
    };
    let saved = now.peak_bytes - then.peak_bytes;
    Ok((saved > 0).then(|| {
        format!(
            "one rank, one micro-step a step, no tied parameter: --set zero.reduce_dtype=\"bf16\" trains exactly as fp32 gradients do, with {} less at the peak",
            human(saved)
        )
    }))
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Ranks whose figures are all equal are printed once.
fn same(a: &RankEstimate, b: &RankEstimate) -> bool {
    (a.peak_bytes, &a.phase, &a.terms, a.ledger) == (b.peak_bytes, &b.phase, &b.terms, b.ledger)
}

fn print_rank(r: &RankEstimate, until: usize, limit: Option<i64>) {
    let who = if until > r.rank {
        format!("ranks {}-{until}", r.rank)
    } else {
        format!("rank {}", r.rank)
    };
    let verdict = match limit {
        Some(l) if r.fits => format!("fits {} (margin {:.0}%)", human(l), memory::MARGIN * 100.0),
        Some(l) => format!("does NOT fit {}", human(l)),
        None => "no limit given (--device-mem)".into(),
    };
    println!(
        "{who}: peak {} + runtime {} = {}, in {}; {verdict}",
        human(r.peak_bytes),
        human(r.fixed_bytes),
        human(r.peak_bytes + r.fixed_bytes),
        r.phase
    );
    let l = &r.ledger;
    // With a GPU the offloaded optimizer's staging buffers are host memory too.
    let host_buffers = (r.host_bytes - l.host).max(0);
    let buffers = if host_buffers > 0 {
        format!(
            "{} on the device, {} on the host",
            human(l.buffers - host_buffers),
            human(host_buffers)
        )
    } else {
        human(l.buffers)
    };
    println!(
        "  model states: parameters {}, gradients {}, fp32 master {}, AdamW m+v {}, on the host {}; fixed buffers {buffers}",
        human(l.params),
        human(l.grads),
        human(l.master),
        human(l.optimizer),
        human(l.host),
    );
    let terms: Vec<String> = r
        .terms
        .iter()
        .map(|t| format!("{} {}", t.name, human(t.bytes)))
        .collect();
    println!("  at the peak: {}", terms.join(", "));
    if r.host_bytes > 0 {
        println!("  host memory beside the GPU: {}", human(r.host_bytes));
    }
    let units: Vec<String> = r
        .units
        .iter()
        .map(|u| {
            format!(
                "{} {} ({} checkpointed)",
                u.unit,
                human(u.kept),
                human(u.kept_checkpointed)
            )
        })
        .collect();
    println!("  activations per unit: {}", units.join(", "));
}

/// One row per stage, offload and checkpointing: the peak at the config's micro-batch and,
/// with a limit, the largest micro-batch (grad_accum making up the global batch) that fits.
fn print_alternatives(s: &Setting, alts: &[Fit], current: &Choice) {
    let c = &s.cfg.train;
    println!(
        "alternatives at the same global batch ({} sequences per rank per step = micro_batch x grad_accum), cheapest first:",
        c.micro_batch * c.grad_accum
    );
    println!(
        "  {:<5} {:<11} {:<4} {:>12}  {:<34} cost",
        "stage",
        "offload",
        "ckpt",
        format!("peak at mb {}", c.micro_batch),
        if s.limit.is_some() {
            "largest micro-batch that fits"
        } else {
            "peak at micro-batch 1"
        }
    );
    let mut rows: Vec<(Choice, Vec<&Fit>)> = Vec::new();
    for f in alts {
        let key = Choice {
            micro_batch: 0,
            grad_accum: 0,
            ..f.choice
        };
        match rows.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(f),
            None => rows.push((key, vec![f])),
        }
    }
    for (key, fits) in rows {
        let at = fits.iter().find(|f| f.choice.micro_batch == c.micro_batch);
        let peak = at.map_or_else(|| "-".into(), |f| human(f.peak_bytes));
        let other = match s.limit {
            Some(_) => fits.iter().find(|f| f.fits).map_or_else(
                || "none".to_string(),
                |f| {
                    format!(
                        "{} x {} ({})",
                        f.choice.micro_batch,
                        f.choice.grad_accum,
                        human(f.peak_bytes)
                    )
                },
            ),
            None => fits
                .last()
                .map_or_else(|| "-".into(), |f| human(f.peak_bytes)),
        };
        let this = Choice {
            micro_batch: 0,
            grad_accum: 0,
            ..*current
        };
        let mark = if key == this { "  <- the config" } else { "" };
        println!(
            "  {:<5} {:<11} {:<4} {:>12}  {:<34} {}{mark}",
            key.stage.to_string(),
            match (key.offload, key.delayed) {
                (true, true) => "cpu delayed",
                (true, false) => "cpu",
                (false, _) => "none",
            },
            on_off(key.activation_checkpointing),
            peak,
            other,
            Choice {
                grad_accum: 1,
                ..key
            }
            .cost()
        );
    }
}

fn rank_json(r: &RankEstimate) -> serde_json::Value {
    let terms: serde_json::Map<String, serde_json::Value> = r
        .terms
        .iter()
        .map(|t| (t.name.replace(' ', "_"), json!(t.bytes)))
        .collect();
    json!({
        "rank": r.rank,
        "peak_bytes": r.peak_bytes,
        "fixed_bytes": r.fixed_bytes,
        "fits": r.fits,
        "phase": r.phase,
        "host_bytes": r.host_bytes,
        "terms": terms,
        "model_states": r.ledger,
        "units": r.units,
    })
}

/// Runs `zrun plan`.
pub fn plan(a: &PlanArgs) -> anyhow::Result<u8> {
    if let Some(cluster) = &a.cluster {
        return crate::cluster::plan(a, cluster);
    }
    let s = setting(&a.fit)?;
    let Some(limit) = s.limit else {
        return Err(BadInput(
            "zrun plan needs the memory one rank may use: --device-mem 80GiB (or dist.memory_limit in the config)".into(),
        )
        .into());
    };
    let alts = memory::alternatives(&s.cfg, s.world, s.fixed, Some(limit))?;
    if s.fixed >= limit {
        return Err(BadInput(format!(
            "{} per rank is less than the runtime alone takes before any model ({}): raise --device-mem",
            human(limit),
            human(s.fixed)
        ))
        .into());
    }
    let Some(best) = alts.iter().find(|f| f.fits) else {
        let least = alts.iter().min_by_key(|f| f.peak_bytes);
        return Err(BadInput(format!(
            "nothing fits {} per rank on {} rank(s) at this global batch: the smallest peak is {} + runtime {} ({}); add ranks, shorten model.seq_len or use a smaller model",
            human(limit),
            s.world,
            least.map_or_else(String::new, |f| human(f.peak_bytes)),
            human(s.fixed),
            least.map_or_else(String::new, |f| set_line(&f.choice)),
        ))
        .into());
    };
    if a.fit.json {
        println!(
            "{}",
            json!({
                "choice": best.choice,
                "set": best.choice.overrides(),
                "peak_bytes": best.peak_bytes,
                "fixed_bytes": best.fixed_bytes,
                "limit_bytes": limit,
                "phase": best.phase,
            })
        );
    } else {
        println!(
            "plan for {} rank(s) with {} each: {}",
            s.world,
            human(limit),
            set_line(&best.choice)
        );
        println!(
            "  predicted peak {} + runtime {} = {} ({:.0}% of the limit), in {}; cost: {}",
            human(best.peak_bytes),
            human(best.fixed_bytes),
            human(best.peak_bytes + best.fixed_bytes),
            100.0 * (best.peak_bytes + best.fixed_bytes) as f64 / limit as f64,
            best.phase,
            best.choice.cost()
        );
        let cheaper: Vec<&Fit> = alts.iter().take_while(|f| !f.fits).collect();
        if !cheaper.is_empty() {
            println!(
                "  cheaper, rejected (predicted peak + runtime over the limit less the margin):"
            );
            for f in cheaper.iter().rev().take(6).rev() {
                println!(
                    "    {}: {} + runtime {}",
                    set_line(&f.choice),
                    human(f.peak_bytes),
                    human(f.fixed_bytes)
                );
            }
        }
        let runners: Vec<&Fit> = alts
            .iter()
            .skip_while(|f| !f.fits)
            .skip(1)
            .filter(|f| f.fits)
            .take(3)
            .collect();
        if !runners.is_empty() {
            println!("  runners-up (costlier):");
            for f in runners {
                println!(
                    "    {}: {}; cost: {}",
                    set_line(&f.choice),
                    human(f.peak_bytes),
                    f.choice.cost()
                );
            }
        }
    }
    if a.verify {
        return verify(&a.fit, best);
    }
    Ok(0)
}

/// `--set` flags for a choice.
fn set_line(c: &Choice) -> String {
    c.overrides()
        .iter()
        .map(|o| format!("--set {o}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Trains two steps of `best` on this machine's ranks and prints measured against predicted.
fn verify(a: &FitArgs, best: &Fit) -> anyhow::Result<u8> {
    if a.nnodes > 1 {
        return Err(BadInput("--verify runs on this node only: use --nnodes 1".into()).into());
    }
    let dir = std::env::temp_dir().join(format!("zrun-plan-verify-{}", std::process::id()));
    let exe = std::env::current_exe()?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--quiet")
        .arg("--nproc")
        .arg(a.nproc.to_string())
        .arg(&a.config);
    let mut sets = a.set.clone();
    sets.extend(best.choice.overrides());
    sets.extend([
        "train.steps=2".to_string(),
        "train.eval_batches=1".to_string(),
        "checkpoint.every=0".to_string(),
        "checkpoint.resume=\"none\"".to_string(),
        format!("log.dir={:?}", dir.display().to_string()),
    ]);
    for o in &sets {
        cmd.arg("--set").arg(o);
    }
    let status = cmd.status()?;
    if !status.success() {
        return Err(anyhow::anyhow!(
            "--verify: the two-step run of the plan failed ({status}); its logs are in {}",
            dir.display()
        ));
    }
    let text = std::fs::read_to_string(dir.join("summary.json"))?;
    let summary: serde_json::Value = serde_json::from_str(&text)?;
    let nums = |k: &str| -> Vec<i64> {
        summary[k]
            .as_array()
            .map(|v| v.iter().filter_map(|x| x.as_i64()).collect())
            .unwrap_or_default()
    };
    let (peak, base, est) = (
        nums("peak_rss_bytes"),
        nums("base_rss_bytes"),
        nums("estimated_peak_bytes"),
    );
    for (r, ((p, b), e)) in peak.iter().zip(&base).zip(&est).enumerate() {
        let measured = p - b;
        println!(
            "  verify rank {r}: measured peak {} above the runtime's {} against predicted {} (ratio {:.3})",
            human(measured),
            human(*b),
            human(*e),
            *e as f64 / measured.max(1) as f64
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(0)
}
