//! Memory fit: every rank's predicted peak for a config, the alternatives at the same global
//! batch (stage, offload, activation checkpointing, micro-batch) and the cheapest that fits.

use crate::config::{Capabilities, Config, ConfigError, DeviceChoice, DeviceKind};
use crate::Error;
use serde::Serialize;
use tch::{Device, Kind, Tensor};
use zrun_models::{Gpt, Model};
use zrun_shard::{estimate, Estimate, EstimateConfig, Offload, ShardLayout, Stage};

/// The CUDA context, cuBLAS workspaces and kernels that a rank holds on its GPU before it
/// allocates anything: an assumption until measured on a GPU (docs/memory.md).
pub const CUDA_FIXED_BYTES: i64 = 1 << 30;

/// NCCL's buffers between a rank and its peers (per channel and protocol), which NCCL
/// allocates itself, outside libtorch's caching allocator and its per-process fraction: an
/// assumption until measured on a GPU (docs/memory.md). None with one rank.
pub const NCCL_FIXED_BYTES: i64 = 512 << 20;

/// The runtime's fixed cost of a rank on `device` whose resident memory before its model
/// was `base_rss`; `nccl_comms`: the NCCL communicators with other ranks it holds
/// ([`nccl_comms`]), each with peer buffers of its own.
pub fn fixed_cost(device: Device, base_rss: i64, nccl_comms: i64) -> i64 {
    if device.is_cuda() {
        CUDA_FIXED_BYTES + nccl_comms * NCCL_FIXED_BYTES
    } else {
        base_rss
    }
}

/// The NCCL communicators with peers that a rank of `world` ranks sharding over groups of
/// `group` holds over `backend`: the world's, and with hybrid sharding (1 < group < world)
/// its shard group's and its replica group's (split from it, each with buffers of its own).
pub fn nccl_comms(backend: zrun_comm::Backend, world: usize, group: usize) -> i64 {
    if backend != zrun_comm::Backend::Nccl || world <= 1 {
        return 0;
    }
    if group > 1 && group < world {
        3
    } else {
        1
    }
}

/// The share of the predicted peak kept free when judging whether a config fits: the
/// estimate may err low by up to 5% (see docs/memory.md), and allocators fragment.
pub const MARGIN: f64 = 0.10;

/// One rank's prediction for one config.
#[derive(Clone, Debug, Serialize)]
pub struct RankEstimate {
    /// Global rank.
    pub rank: usize,
    /// What the run adds above the runtime's fixed cost at its peak.
    pub peak_bytes: i64,
    /// The runtime's fixed cost (libtorch's resident memory on CPU, the CUDA context on GPU).
    pub fixed_bytes: i64,
    /// Whether `fixed_bytes + peak_bytes` plus the margin is within the limit (true without one).
    pub fits: bool,
    /// The phase of the peak.
    pub phase: String,
    /// Host bytes held beside a CUDA device (offloaded optimizer state).
    pub host_bytes: i64,
    /// The terms that sum to `peak_bytes`.
    pub terms: Vec<zrun_shard::Term>,
    /// Model states as the engine will allocate them.
    pub ledger: zrun_shard::MemoryLedger,
    /// Every unit's activations with and without checkpointing.
    pub units: Vec<zrun_shard::UnitActivations>,
}

/// The knobs the planner turns; everything else stays as the config has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Choice {
    /// ZeRO stage.
    pub stage: Stage,
    /// CPU offload of the optimizer.
    pub offload: bool,
    /// Activation checkpointing.
    pub activation_checkpointing: bool,
    /// Sequences per rank per micro-step.
    pub micro_batch: usize,
    /// Micro-steps per optimizer step.
    pub grad_accum: usize,
    /// The offloaded update is delayed one step (`zero.offload_delay = 1`); only with offload,
    /// and only where the config asks for the delay.
    pub delayed: bool,
    /// The config delays its offloaded updates: a choice without the delay turns it off
    /// (`zero.offload_delay = 0`).
    #[serde(skip)]
    pub config_delays: bool,
}

impl Choice {
    /// Every choice at `per_rank` sequences per rank per step, in the planner's order of
    /// preference: stages 0-3, offload off then on (stages 1-3), checkpointing off then on,
    /// the delay on then off (with offload, where the config delays its updates: the delayed
    /// update needs more device memory and less time), and every micro-batch dividing
    /// `per_rank`, largest first, grad_accum making up the rest. `config_delays`: the config
    /// delays its offloaded updates.
    pub fn space(per_rank: usize, config_delays: bool) -> Vec<Choice> {
        let mut out = Vec::new();
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for offload in [false, true] {
                if offload && stage == Stage::Zero0 {
                    continue;
                }
                for activation_checkpointing in [false, true] {
                    let delays: &[bool] = if offload && config_delays {
                        &[true, false]
                    } else {
                        &[false]
                    };
                    for &delayed in delays {
                        for mb in (1..=per_rank).rev().filter(|m| per_rank.is_multiple_of(*m)) {
                            out.push(Choice {
                                stage,
                                offload,
                                activation_checkpointing,
                                micro_batch: mb,
                                grad_accum: per_rank / mb,
                                delayed,
                                config_delays,
                            });
                        }
                    }
                }
            }
        }
        out
    }

    /// The config's own choice.
    pub fn of(cfg: &Config) -> Choice {
        Choice {
            stage: cfg.zero.stage,
            offload: cfg.zero.offload_optimizer == Offload::Cpu,
            activation_checkpointing: cfg.zero.activation_checkpointing,
            micro_batch: cfg.train.micro_batch,
            grad_accum: cfg.train.grad_accum,
            delayed: cfg.zero.offload_delay > 0 && cfg.zero.offload_optimizer == Offload::Cpu,
            config_delays: cfg.zero.offload_delay > 0,
        }
    }

    /// `cfg` with this choice applied.
    pub fn apply(&self, cfg: &Config) -> Config {
        let mut c = cfg.clone();
        c.zero.stage = self.stage;
        c.zero.offload_optimizer = if self.offload {
            Offload::Cpu
        } else {
            Offload::None
        };
        if !self.delayed {
            c.zero.offload_delay = 0; // nothing to delay, or not delayed
        }
        c.zero.activation_checkpointing = self.activation_checkpointing;
        c.train.micro_batch = self.micro_batch;
        c.train.grad_accum = self.grad_accum;
        c
    }

    /// The choice as `--set` overrides (valid on top of the config it came from).
    pub fn overrides(&self) -> Vec<String> {
        let mut sets = vec![
            format!("zero.stage={}", self.stage),
            format!(
                "zero.offload_optimizer=\"{}\"",
                if self.offload { "cpu" } else { "none" }
            ),
            format!(
                "zero.activation_checkpointing={}",
                self.activation_checkpointing
            ),
            format!("train.micro_batch={}", self.micro_batch),
            format!("train.grad_accum={}", self.grad_accum),
        ];
        if self.config_delays && !self.delayed {
            sets.push("zero.offload_delay=0".into());
        }
        sets
    }

    /// Cheaper first: fewer collectives (lower stage), no offload, no recomputation, the
    /// delayed update (the host's step off the critical path) where the config asks for
    /// it, then the largest micro-batch (fewer, larger kernels).
    fn rank_key(&self) -> (u8, bool, bool, bool, std::cmp::Reverse<usize>) {
        (
            self.stage.number(),
            self.offload,
            self.activation_checkpointing,
            self.config_delays && self.offload && !self.delayed,
            std::cmp::Reverse(self.micro_batch),
        )
    }

    /// What this choice costs over plain data parallelism, in words.
    pub fn cost(&self) -> String {
        let mut parts = vec![match self.stage {
            Stage::Zero0 => "all-reduce",
            Stage::Zero1 => "reduce-scatter + all-gather per step",
            Stage::Zero2 => "reduce-scatter per unit + all-gather per step",
            Stage::Zero3 => "all-gather per unit twice + reduce-scatter per unit",
        }
        .to_string()];
        if self.delayed {
            parts.push("optimizer on the host, its update one step late".into());
        } else if self.offload {
            parts.push("optimizer on the host".into());
        }
        if self.activation_checkpointing {
            parts.push("forward recomputed (~+33% compute)".into());
        }
        if self.grad_accum > 1 {
            parts.push(format!("{} micro-steps per step", self.grad_accum));
        }
        parts.join(", ")
    }
}

/// How a config's ranks fare under a limit.
#[derive(Clone, Debug, Serialize)]
pub struct Fit {
    /// The knobs.
    pub choice: Choice,
    /// The largest rank's peak above the fixed cost.
    pub peak_bytes: i64,
    /// The fixed cost.
    pub fixed_bytes: i64,
    /// The phase of that peak.
    pub phase: String,
    /// Whether every rank fits.
    pub fits: bool,
}

/// The estimator's configuration for `cfg`.
pub fn estimate_config(cfg: &Config) -> Result<EstimateConfig, Error> {
    let arch = cfg.arch()?;
    let fresh =
        cfg.zero.offload_optimizer == Offload::Cpu && cfg.delay().is_some() && cfg.delay_fresh();
    Ok(EstimateConfig {
        stage: cfg.zero.stage,
        precision: cfg.zero.precision,
        reduce_dtype: cfg.zero.reduce_dtype,
        offload: cfg.zero.offload_optimizer,
        state_dtype: cfg.zero.optimizer_state_dtype,
        activation_checkpointing: cfg.zero.activation_checkpointing,
        prefetch: cfg.zero.prefetch,
        micro_batch: cfg.train.micro_batch as i64,
        seq_len: arch.seq_len(),
        eval_batch: cfg.train.micro_batch as i64,
        oom_recovery: cfg.train.on_oom == crate::config::OnOom::Shrink,
        one_micro_step: cfg.train.grad_accum == 1,
        offload_delay: cfg.zero.offload_optimizer == Offload::Cpu && cfg.delay().is_some(),
        offload_delay_fresh: fresh,
        loss_chunk: cfg.train.loss_chunk(),
        // A split delayed update reads the gradients on the device at the step's end.
        host_grads: zrun_shard::gradients_on_host(
            cfg.zero.stage,
            cfg.zero.offload_optimizer,
            cfg.train.grad_accum == 1,
            cfg.train.on_oom == crate::config::OnOom::Shrink,
        ) && !fresh,
        tied: arch.tied(),
        cuda: match cfg.dist.device {
            DeviceChoice::Cuda => true,
            DeviceChoice::Cpu => false,
            DeviceChoice::Auto => cfg
                .dist
                .resolve(Capabilities::detect())
                .is_ok_and(|d| d.device == DeviceKind::Cuda),
        },
    })
}

/// Whether `fixed + peak` plus the margin is within `limit` (always, without one).
pub fn fits(fixed: i64, peak: i64, limit: Option<i64>) -> bool {
    limit.is_none_or(|l| fixed as f64 + peak as f64 * (1.0 + MARGIN) <= l as f64)
}

/// Every rank's prediction for `cfg` on `world` ranks; `fixed` is the runtime's fixed cost.
pub fn estimate_ranks(
    cfg: &Config,
    world: usize,
    fixed: i64,
    limit: Option<i64>,
) -> Result<Vec<RankEstimate>, Error> {
    let model = cfg.build_model()?;
    let ec = estimate_config(cfg)?;
    let w = world.max(1) as i64;
    let g = cfg.shard_group_size(world.max(1))? as i64;
    (0..w)
        .map(|r| {
            let layout = ShardLayout::hybrid(model.units(), r, w, g)?;
            let e: Estimate = estimate(model.as_ref(), &layout, &ec);
            Ok(RankEstimate {
                rank: r as usize,
                peak_bytes: e.peak_bytes,
                fixed_bytes: fixed,
                fits: fits(fixed, e.peak_bytes, limit),
                phase: e.phase,
                host_bytes: e.host_bytes,
                terms: e.terms,
                ledger: e.ledger,
                units: e.units,
            })
        })
        .collect()
}

/// The alternatives to `cfg`'s own choice at its global batch, cheapest first: stages 0-3,
/// offload off and on (stages 1-3), checkpointing off and on, and every micro-batch that
/// divides the sequences per rank per step.
pub fn alternatives(
    cfg: &Config,
    world: usize,
    fixed: i64,
    limit: Option<i64>,
) -> Result<Vec<Fit>, Error> {
    let per_rank = cfg.train.micro_batch * cfg.train.grad_accum;
    let mut out = Vec::new();
    for choice in Choice::space(per_rank, cfg.zero.offload_delay > 0) {
        let ranks = estimate_ranks(&choice.apply(cfg), world, fixed, limit)?;
        let worst = ranks
            .iter()
            .max_by_key(|r| r.peak_bytes)
            .ok_or_else(|| ConfigError("no ranks to estimate".into()))?;
        out.push(Fit {
            choice,
            peak_bytes: worst.peak_bytes,
            fixed_bytes: fixed,
            phase: worst.phase.clone(),
            fits: ranks.iter().all(|r| r.fits),
        });
    }
    out.sort_by_key(|f| f.choice.rank_key());
    Ok(out)
}

/// The cheapest alternative that fits `limit`, or `None` when none does.
pub fn plan(cfg: &Config, world: usize, fixed: i64, limit: i64) -> Result<Option<Fit>, Error> {
    Ok(alternatives(cfg, world, fixed, Some(limit))?
        .into_iter()
        .find(|f| f.fits))
}

/// Runs one small forward and backward of each op a GPT step uses, in `kind` on `device`,
/// so libtorch's lazily made thread pools and kernels' buffers exist before memory is
/// measured: they belong to the runtime's fixed cost, not to the run.
pub fn warm_up(device: Device, kind: Kind) -> Result<(), Error> {
    let cfg = zrun_models::GptConfig {
        vocab_size: 16,
        seq_len: 8,
        n_layer: 1,
        n_head: 2,
        d_model: 16,
        init_std: 0.02,
        tied: false,
    };
    let gpt = Gpt::new(cfg)?;
    let params = zrun_models::init_model_params(&gpt, 0, kind, device)?;
    let leaves: Vec<Vec<Tensor>> = params
        .into_iter()
        .map(|u| u.into_iter().map(|p| p.set_requires_grad(true)).collect())
        .collect();
    let idx = Tensor::f_zeros([2, 8], (Kind::Int64, device)).map_err(torch)?;
    let logits = zrun_models::forward_model(&gpt, &leaves, &idx)?;
    let loss = zrun_models::lm_loss(&logits, &idx)?;
    loss.f_backward().map_err(torch)?;
    // And the chunked head's loss (`train.loss_chunk`), a few logits at a time.
    let units = gpt.units();
    let mut x = idx.shallow_clone();
    for (u, unit) in units.iter().enumerate() {
        let p = zrun_models::unit_inputs(&gpt, &leaves, u);
        x = if u + 1 == units.len() {
            unit.loss(&p, &x, &idx, 64)?
        } else {
            unit.forward(&p, &x)?
        };
    }
    x.f_backward().map_err(torch)?;
    drop((x, loss, logits, idx, leaves));
    // The caching CPU allocator would keep the warm-up's blocks and count them in the base;
    // they go back, so the base is the runtime's own memory.
    zrun_torch_ext::cpu_empty_cache();
    zrun_torch_ext::reset_cpu_peak();
    Ok(())
}

fn torch(e: tch::TchError) -> Error {
    Error::Model(zrun_models::Error::Torch {
        place: "memory warm-up".into(),
        op: "forward and backward",
        source: e,
    })
}

/// The runtime's fixed cost on this machine: this process's resident memory after
/// [`warm_up`] on CPU, with the CPU allocator a rank uses (what a rank holds before its
/// model is built).
pub fn fixed_bytes(device: Device, kind: Kind) -> Result<i64, Error> {
    set_allocator()?;
    warm_up(device, kind)?;
    Ok(crate::metrics::rss_bytes().0)
}

/// The environment variable that picks the CPU allocator of a rank's tensors: unset or
/// `caching` installs zrun-torch-ext's caching allocator at rank start ([`set_allocator`]);
/// `glibc` keeps c10's default allocator over glibc's malloc with glibc's own settings (faster
/// than the old 64 KiB mmap threshold, slower than the caching allocator, and its freed blocks
/// stay in glibc's heap where the estimate does not see them).
pub const CPU_ALLOCATOR_ENV: &str = "ZRUN_CPU_ALLOCATOR";

/// Whether [`CPU_ALLOCATOR_ENV`] asks for the caching CPU allocator (the default); an
/// unknown value is an error naming the allowed ones.
pub fn cpu_caching_requested() -> Result<bool, Error> {
    match std::env::var(CPU_ALLOCATOR_ENV) {
        Err(_) => Ok(true),
        Ok(v) if v.is_empty() || v == "caching" => Ok(true),
        Ok(v) if v == "glibc" => Ok(false),
        Ok(v) => Err(ConfigError(format!(
            "{CPU_ALLOCATOR_ENV}={v:?} is not an allocator: use `caching` (the default) or `glibc`"
        ))
        .into()),
    }
}

/// Sets up this rank's CPU memory before it allocates: installs the caching CPU allocator
/// for libtorch's CPU tensors unless `ZRUN_CPU_ALLOCATOR=glibc` asks for c10's default one.
/// glibc's heap keeps its own settings either way. Returns what was set.
pub fn set_allocator() -> Result<Option<String>, Error> {
    if !cpu_caching_requested()? {
        return Ok(Some(format!(
            "{CPU_ALLOCATOR_ENV}=glibc: libtorch's CPU tensors come from glibc's malloc"
        )));
    }
    zrun_torch_ext::install_cpu_caching_allocator(None)?;
    Ok(Some(
        "libtorch's CPU tensors come from the caching CPU allocator".into(),
    ))
}

/// Bytes from a size such as `80GiB`, `6GB`, `512MiB`, `1.5G` or `1000000` (G and GiB are
/// powers of 2, GB powers of 10).
pub fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "p" | "pib" => 1024f64.powi(5),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "pb" => 1e15,
        _ => {
            return Err(format!(
                "{s:?} is not a size: a number and one of B, KiB, MiB, GiB, TiB, PiB (or KB, MB, GB, TB, PB), e.g. 80GiB, 6GB or 512MiB"
            ))
        }
    };
    match num.parse::<f64>() {
        // Past a PiB no device or host has the memory, and the figure would have been cut to
        // i64's range without a word.
        Ok(n) if n * scale > MAX_BYTES as f64 => Err(format!(
            "{s:?} is more than 1 PiB, past any machine's memory: write e.g. 80GiB"
        )),
        // Under a MiB no device or host runs anything: the unit was left out (a bare number
        // is bytes), as in `--device-mem 8` for 8 GiB.
        Ok(n) if n > 0.0 && n * scale < MIN_BYTES as f64 => Err(format!(
            "{s:?} is less than 1 MiB, smaller than any machine's memory (a number without a unit is bytes): write e.g. 80GiB or 512MiB"
        )),
        Ok(n) if n > 0.0 => Ok((n * scale) as i64),
        Ok(_) => Err(format!(
            "{s:?} is no memory at all: give a size from 1 MiB to 1 PiB, e.g. 80GiB"
        )),
        _ => Err(format!(
            "{s:?} is not a size: write e.g. 80GiB, 6GB or 512MiB"
        )),
    }
}

/// The largest size [`parse_bytes`] takes: 1 PiB.
const MAX_BYTES: i64 = 1 << 50;
/// The smallest size [`parse_bytes`] takes: 1 MiB.
const MIN_BYTES: i64 = 1 << 20;

/// This machine's memory (`MemTotal` of /proc/meminfo), in bytes; 0 when unknown.
pub fn host_memory() -> i64 {
    crate::metrics::proc_bytes("/proc/meminfo", "MemTotal:").unwrap_or(0)
}

/// `bytes` as `151.0 MiB` or `3.20 GiB`.
pub fn human(bytes: i64) -> String {
    let mib = bytes as f64 / (1 << 20) as f64;
    if mib.abs() >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// What a rank may use, for suggesting fixes: `dist.memory_limit`, else the GPU's memory on
/// CUDA, else this node's memory shared by its ranks.
pub fn budget(cfg: &Config, device: Device, local_ranks: usize) -> Result<(i64, String), Error> {
    if let Some(l) = cfg.dist.memory_limit_bytes()? {
        return Ok((l, format!("dist.memory_limit = {}", human(l))));
    }
    if let Some((_, total)) = match device {
        Device::Cuda(i) => zrun_torch_ext::cuda_mem_info(i),
        _ => None,
    } {
        // The node's ranks may share GPUs, over any backend: tcp (zrun --nproc 2 on one GPU)
        // or nccl (ZRUN_NCCL_SHARE_GPU=1); each then has its share of the memory.
        let gpus = usize::try_from(tch::Cuda::device_count())
            .unwrap_or(1)
            .max(1);
        let sharing = local_ranks.div_ceil(gpus).max(1);
        if sharing > 1 {
            let per = total / sharing as i64;
            return Ok((
                per,
                format!(
                    "the GPU's {} over the {sharing} ranks sharing it",
                    human(total)
                ),
            ));
        }
        return Ok((total, format!("the GPU's {}", human(total))));
    }
    let total = host_memory();
    let per = total / local_ranks.max(1) as i64;
    Ok((
        per,
        format!("this node's {} over {local_ranks} rank(s)", human(total)),
    ))
}

/// Sets the CUDA caching allocator's options for GPU `index` before its first allocation:
/// `expandable_segments:True` (segments grow in place rather than fragmenting into fixed
/// blocks) unless `PYTORCH_CUDA_ALLOC_CONF` is set, and with `dist.memory_limit` the
/// per-process fraction of the GPU that makes the limit real. Returns the settings applied.
pub fn configure_cuda_allocator(cfg: &Config, index: usize) -> Result<String, Error> {
    let mut settings = Vec::new();
    if std::env::var_os("PYTORCH_CUDA_ALLOC_CONF").is_none() {
        settings.push("expandable_segments:True".to_string());
    }
    if let Some(limit) = cfg.dist.memory_limit_bytes()? {
        // From the driver: libtorch's allocator reads the fraction once, when CUDA is first
        // initialised, which asking libtorch for the capacity would do before it is set.
        let total = zrun_comm::gpu_total_bytes(index).ok_or_else(|| {
            ConfigError(format!(
                "dist.memory_limit: cannot read GPU {index}'s capacity to cap this rank"
            ))
        })?;
        let fraction = (limit as f64 / total as f64).min(1.0);
        settings.push(format!("per_process_memory_fraction:{fraction:.4}"));
    }
    if !settings.is_empty() {
        zrun_torch_ext::set_allocator_settings(&settings.join(","))?;
    }
    Ok(settings.join(","))
}

/// Applies `dist.memory_limit` to this process on CPU: the data segment may grow by what
/// the limit leaves above the resident memory now (`rss`), so the allocator fails where the
/// rank's resident memory would pass the limit; with the caching CPU allocator installed,
/// that allocator's reserve is capped instead. Returns the limit set, if any.
pub fn apply_memory_limit(cfg: &Config, device: Device, rss: i64) -> Result<Option<i64>, Error> {
    let Some(limit) = cfg.dist.memory_limit_bytes()? else {
        return Ok(None);
    };
    if device.is_cuda() {
        // Set before the first allocation by `configure_cuda_allocator`.
        return Ok(Some(limit));
    }
    if limit <= rss {
        return Err(ConfigError(format!(
            "dist.memory_limit = {} is below what the rank holds before its model is built ({}); raise it",
            human(limit),
            human(rss)
        ))
        .into());
    }
    if let Some(held) = zrun_torch_ext::cpu_memory_stats() {
        // The caching allocator caps its own reserve: what the limit leaves above the
        // resident memory outside it (its blocks are part of `rss`).
        let outside = rss - held.reserved as i64;
        zrun_torch_ext::install_cpu_caching_allocator(Some((limit - outside) as u64))?;
        return Ok(Some(limit));
    }
    let data = vm_data();
    let cap = (data + limit - rss) as libc::rlim_t;
    let r = libc::rlimit {
        rlim_cur: cap,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct it is given; lowering the soft limit of this
    // process is always allowed.
    if unsafe { libc::setrlimit(libc::RLIMIT_DATA, &r) } != 0 {
        return Err(ConfigError(format!(
            "dist.memory_limit: setrlimit(RLIMIT_DATA) failed: {}",
            std::io::Error::last_os_error()
        ))
        .into());
    }
    Ok(Some(limit))
}

/// This process's data segment (`VmData`), bytes.
fn vm_data() -> i64 {
    crate::metrics::proc_bytes("/proc/self/status", "VmData:").unwrap_or(0)
}

/// `cfg` with its `"auto"` knobs chosen for `world` ranks of `limit` bytes each: the cheapest
/// choice predicted to fit (as `zrun plan` orders them), varying only what is `"auto"`
/// (`zero.stage`; `train.micro_batch` and `grad_accum` at `train.global_batch`).
pub fn resolve_auto(cfg: &Config, world: usize, fixed: i64, limit: i64) -> Result<Config, Error> {
    let auto = cfg.auto;
    if !auto.stage && !auto.micro_batch {
        return Ok(cfg.clone());
    }
    let mut base = cfg.clone();
    if auto.micro_batch {
        cfg.check_global_batch(world)?;
        let global = cfg.train.global_batch.unwrap_or(0);
        (base.train.micro_batch, base.train.grad_accum) = (global / world.max(1), 1);
    }
    let fixed_choice = Choice::of(cfg);
    let pick = alternatives(&base, world, fixed, Some(limit))?
        .into_iter()
        .filter(|f| f.fits)
        .find(|f| {
            let c = f.choice;
            (auto.stage || c.stage == fixed_choice.stage)
                && c.offload == fixed_choice.offload
                && c.delayed == fixed_choice.delayed
                && c.activation_checkpointing == fixed_choice.activation_checkpointing
                && (auto.micro_batch
                    || (c.micro_batch, c.grad_accum)
                        == (fixed_choice.micro_batch, fixed_choice.grad_accum))
        })
        .ok_or_else(|| {
            ConfigError(format!(
                "no choice of the \"auto\" keys is predicted to fit {} per rank on {world} rank(s); see zrun plan for the alternatives",
                human(limit)
            ))
        })?;
    let mut out = pick.choice.apply(cfg);
    out.auto = crate::config::Auto {
        loss_chunk: cfg.auto.loss_chunk,
        ..Default::default()
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_sharding_holds_three_nccl_communicators() {
        use zrun_comm::Backend::{Nccl, Tcp};
        assert_eq!(
            nccl_comms(Nccl, 8, 4),
            3,
            "world, shard group, replica group"
        );
        assert_eq!(nccl_comms(Nccl, 8, 8), 1);
        assert_eq!(nccl_comms(Nccl, 8, 1), 1, "replicas only: the world");
        assert_eq!(nccl_comms(Tcp, 8, 4), 0);
        assert_eq!(nccl_comms(Nccl, 1, 1), 0);
        let one = fixed_cost(Device::Cuda(0), 0, 1);
        assert_eq!(
            fixed_cost(Device::Cuda(0), 0, 3) - one,
            2 * NCCL_FIXED_BYTES
        );
    }

    /// A tiny stage-2 config with the optimizer offloaded and its update delayed, in `dir`.
    fn delayed_config(dir: &std::path::Path) -> (std::path::PathBuf, Config) {
        let path = dir.join("t.toml");
        std::fs::write(
            &path,
            "[model]\npreset = \"tiny\"\n[zero]\nstage = 2\noffload_optimizer = \"cpu\"\noffload_delay = 1\n",
        )
        .unwrap();
        let cfg = Config::load(&path, &[]).unwrap();
        (path, cfg)
    }

    /// A config that delays its offloaded updates: every alternative's `--set` lines load on
    /// top of it (a choice without offload must turn the delay off, which needs offload).
    #[test]
    fn alternatives_of_a_delayed_config_are_valid_overrides_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let (path, cfg) = delayed_config(dir.path());
        let mut without = 0;
        for f in alternatives(&cfg, 2, 0, None).unwrap() {
            without += usize::from(!f.choice.offload);
            let loaded = Config::load(&path, &f.choice.overrides());
            assert!(
                loaded.is_ok(),
                "{:?}: {:?}",
                f.choice.overrides(),
                loaded.err()
            );
        }
        assert!(without > 0, "no alternative without offload was tried");
    }

    /// A config with the (split) delayed update that does not fit is offered the same choice
    /// without the delay, which needs less device memory; where both fit, the delay (faster)
    /// comes first.
    #[test]
    fn a_delayed_config_that_does_not_fit_is_offered_the_update_undelayed() {
        let dir = tempfile::tempdir().unwrap();
        let (path, cfg) = delayed_config(dir.path());
        let own = Choice::of(&cfg);
        assert!(own.delayed);
        let undelayed = Choice {
            delayed: false,
            ..own
        };
        let peak = |c: Choice| estimate_ranks(&c.apply(&cfg), 2, 0, None).unwrap()[0].peak_bytes;
        let (with, without) = (peak(own), peak(undelayed));
        assert!(with > without, "delayed {with} vs undelayed {without}");
        let same_knobs = |f: &&Fit| {
            (
                f.choice.stage,
                f.choice.activation_checkpointing,
                f.choice.micro_batch,
            ) == (own.stage, own.activation_checkpointing, own.micro_batch)
                && f.choice.offload
        };
        // Room for both: the delayed one first.
        let alts = alternatives(&cfg, 2, 0, Some(with * 2)).unwrap();
        let both: Vec<&Fit> = alts.iter().filter(same_knobs).collect();
        assert_eq!(both.len(), 2);
        assert!(both[0].choice.delayed && both[0].fits && both[1].fits);
        // Room for the undelayed one only: it is there, with the override that turns the
        // delay off, and it loads on top of the config.
        let limit = (without as f64 * (1.0 + MARGIN)).ceil() as i64;
        assert!(fits(0, without, Some(limit)) && !fits(0, with, Some(limit)));
        let alts = alternatives(&cfg, 2, 0, Some(limit)).unwrap();
        let fit = alts
            .iter()
            .filter(same_knobs)
            .find(|f| f.fits)
            .expect("the undelayed update at the same knobs fits");
        assert!(!fit.choice.delayed);
        assert!(fit
            .choice
            .overrides()
            .contains(&"zero.offload_delay=0".to_string()));
        let loaded = Config::load(&path, &fit.choice.overrides()).unwrap();
        assert_eq!(loaded.zero.offload_delay, 0);
        assert!(!alts
            .iter()
            .any(|f| f.choice.delayed && f.fits && same_knobs(&f)));
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("6G"), Ok(6 << 30));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("1PiB"), Ok(1 << 50));
        assert_eq!(parse_bytes("1024TiB"), Ok(1 << 50));
        assert!(parse_bytes("0").unwrap_err().contains("no memory at all"));
        assert!(parse_bytes("2PiB").unwrap_err().contains("more than 1 PiB"));
        for bad in [
            "",
            "GiB",
            "-1G",
            "6 parsecs",
            "0",
            "8",
            "4096",
            "1023KiB",
            "1025TiB",
            "99999999999TiB",
            "18446744073709551616",
        ] {
            let e = parse_bytes(bad).unwrap_err();
            assert!(e.contains("80GiB"), "{bad}: {e}");
        }
    }
}
