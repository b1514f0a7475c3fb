//! The training loop of one rank: data, engine, schedule, eval, metrics.

use crate::checkpoint::{Checkpointer, Position, Resumed};
use crate::config::{Capabilities, Config, ConfigError, DeviceKind, DistConfig};
use crate::data::{Cursor, Dataset, Loader};
use crate::metrics::{cuda_peak_bytes, median, rss_bytes, MetricsWriter, StepMetrics, Summary};
use crate::reduce::{gather_bytes, reduce};
use crate::report;
use crate::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tch::Device;
use zrun_comm::{Communicator, ReduceOp, Topology};
use zrun_models::Model;
use zrun_optim::{AdamWConfig, LrSchedule};
use zrun_shard::{Engine, EngineConfig, Offload, Precision};

mod shrink;

/// `cfg` with its `"auto"` keys chosen by the planner for this job's ranks and memory; every
/// rank takes rank 0's choice (their fixed costs may differ by a few pages).
fn resolve_auto(
    cfg: &Config,
    comm: &dyn Communicator,
    device: Device,
    fixed: i64,
    rank: RankInfo,
) -> Result<Config, Error> {
    if !cfg.auto.stage && !cfg.auto.micro_batch {
        return Ok(cfg.clone());
    }
    let (limit, _) = crate::memory::budget(cfg, device, rank.local_world_size)?;
    let mine = crate::memory::resolve_auto(cfg, rank.world_size, fixed, limit)?;
    let c = crate::memory::Choice::of(&mine);
    let record: Vec<u8> = [
        c.stage.number() as u64,
        u64::from(c.offload),
        u64::from(c.activation_checkpointing),
        c.micro_batch as u64,
        c.grad_accum as u64,
        u64::from(c.delayed),
    ]
    .iter()
    .flat_map(|x| x.to_le_bytes())
    .collect();
    let all = gather_bytes(comm, device, &record)?;
    let word =
        |i: usize| u64::from_le_bytes(all[0][8 * i..8 * i + 8].try_into().unwrap_or_default());
    let chosen = crate::memory::Choice {
        stage: zrun_shard::Stage::from_number(word(0) as i64).unwrap_or(c.stage),
        offload: word(1) == 1,
        activation_checkpointing: word(2) == 1,
        micro_batch: word(3) as usize,
        grad_accum: word(4) as usize,
        delayed: word(5) == 1,
        config_delays: c.config_delays,
    };
    if rank.rank == 0 {
        tracing::info!(
            "\"auto\": {} (the cheapest predicted to fit {} per rank)",
            chosen.overrides().join(" "),
            crate::memory::human(limit)
        );
    }
    let mut out = chosen.apply(cfg);
    out.auto = crate::config::Auto {
        loss_chunk: cfg.auto.loss_chunk,
        ..Default::default()
    };
    Ok(out)
}

/// Where this process sits in the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
}

impl RankInfo {
    /// A job of one rank.
    pub fn single() -> RankInfo {
        RankInfo {
            rank: 0,
            world_size: 1,
            local_world_size: 1,
        }
    }
}

/// How a run ended without error.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// It trained to `train.steps`.
    Finished(Box<Summary>),
    /// The checkpoint it resumed from was at `train.steps` already: nothing to train.
    AlreadyDone {
        /// The step of that checkpoint.
        step: u64,
        /// Its directory.
        checkpoint: PathBuf,
    },
}

/// Everything a run needs, built from the config before the first step.
pub struct Run {
    cfg: Config,
    rank: RankInfo,
    model: Arc<dyn Model>,
    dataset: Arc<Dataset>,
    engine: Engine,
    ckpt: Checkpointer,
    /// Resident bytes before the model was built (libtorch loaded, nothing allocated).
    base_rss: i64,
}

impl Run {
    /// Builds model, data and engine for the rank of `comm`; the first place bad input is
    /// reported. `topo` places the rank on its node: the node's ranks share its cores, and on
    /// CUDA the rank computes on its own GPU ([`rank_device`]), made current on this thread
    /// before anything is allocated.
    pub fn new(cfg: &Config, comm: Arc<dyn Communicator>, topo: &Topology) -> Result<Run, Error> {
        let rank = RankInfo {
            rank: comm.rank(),
            world_size: comm.world_size(),
            local_world_size: topo.local_world_size,
        };
        // Under mpirun or srun no launcher checked it for this world size.
        cfg.check_global_batch(rank.world_size)?;
        let mut resolved = cfg.clone();
        let group = resolved.resolve_shard_group(rank.world_size, rank.local_world_size)?;
        let cfg = &resolved;
        // `dist.device` against the backend actually connected (auto: CPU for tcp and mpi).
        let dist = DistConfig {
            backend: comm.backend().into(),
            ..cfg.dist.clone()
        }
        .resolve(Capabilities::detect())?;
        let device = rank_device(dist.device, topo)?;
        if let Device::Cuda(i) = device {
            let set = crate::memory::configure_cuda_allocator(cfg, i)?;
            if rank.rank == 0 && !set.is_empty() {
                tracing::info!("CUDA caching allocator: {set}");
            }
        }
        // The first collective: every rank trains the same settings on the same layout.
        let settings = crate::agree::settings(cfg, rank.local_world_size, group);
        crate::agree::check(comm.as_ref(), device, &settings)?;
        // libtorch's default generators (CPU, and CUDA on a GPU) from train.seed and the rank:
        // a checkpoint saves their state, which is then a function of the config too.
        tch::manual_seed(cfg.train.seed.wrapping_add(rank.rank as u64) as i64);
        crate::memory::warm_up(device, cfg.zero.precision.kind())?;
        let base_rss = rss_bytes().0;
        let nccl_comms = crate::memory::nccl_comms(comm.backend(), rank.world_size, group);
        let fixed = crate::memory::fixed_cost(device, base_rss, nccl_comms);
        let cfg = &resolve_auto(cfg, comm.as_ref(), device, fixed, rank)?;
        // The loss's chunking computes nothing across ranks: each may choose for itself.
        let limit = if device.is_cuda() && cfg.auto.loss_chunk {
            Some(crate::memory::budget(cfg, device, rank.local_world_size)?.0)
        } else {
            None
        };
        let (cfg, why) = crate::loss_chunk::resolve_loss_chunk(
            cfg,
            device.is_cuda(),
            rank.world_size,
            fixed,
            limit,
        )?;
        let cfg = &cfg;
        if let (0, Some(why)) = (rank.rank, why) {
            tracing::info!("{why}");
        }
        crate::kernels::install(cfg, device, rank.rank);
        if let Some(l) = crate::memory::apply_memory_limit(cfg, device, base_rss)? {
            if rank.rank == 0 {
                tracing::info!(
                    "dist.memory_limit: each rank may use {}",
                    crate::memory::human(l)
                );
            }
        }
        let threads = set_threads(cfg.train.threads, rank.local_world_size);
        let model = cfg.build_model()?;
        let dataset = Arc::new(Dataset::open(&crate::data::options_of(
            cfg,
            model.seq_len(),
            model.vocab_size(),
        ))?);
        let t = &cfg.train;
        let engine = Engine::new(
            model.clone(),
            comm,
            EngineConfig {
                stage: cfg.zero.stage,
                precision: cfg.zero.precision,
                reduce_dtype: cfg.zero.reduce_dtype,
                activation_checkpointing: cfg.zero.activation_checkpointing,
                prefetch: cfg.zero.prefetch,
                initial_loss_scale: cfg.zero.initial_loss_scale,
                loss_scale_window: cfg.zero.loss_scale_window,
                offload: cfg.zero.offload_optimizer,
                optimizer_state_dtype: cfg.zero.optimizer_state_dtype,
                optimizer_threads: threads,
                device,
                seed: t.seed,
                adamw: AdamWConfig {
                    beta1: t.beta1,
                    beta2: t.beta2,
                    eps: t.eps,
                    weight_decay: t.weight_decay,
                },
                oom_recovery: t.on_oom == crate::config::OnOom::Shrink,
                offload_delay: cfg.delay(),
                offload_delay_fresh: cfg.delay_fresh(),
                shard_group: (group < rank.world_size).then_some(group),
                loss_chunk: t.loss_chunk(),
                one_micro_step: t.grad_accum == 1,
            },
        )
        .map_err(|e| match e.out_of_memory() {
            Some(bytes) => crate::oom::at_startup(cfg, rank, device, fixed, bytes),
            None => e.into(),
        })?;
        let ckpt = Checkpointer::new(cfg, &engine)?;
        Ok(Run {
            cfg: cfg.clone(),
            rank,
            model,
            dataset,
            engine,
            ckpt,
            base_rss,
        })
    }

    /// This rank's predicted memory for the run's config (see `zrun estimate`).
    pub fn estimate(&self) -> zrun_shard::Estimate {
        let ec = self
            .engine
            .estimate_config(self.cfg.train.micro_batch as i64, self.model.seq_len());
        zrun_shard::estimate(self.model.as_ref(), self.engine.layout(), &ec)
    }

    /// The engine (for inspection before training).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, mutable (for gathering parameters after training).
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Stops the profiler started for step `step` (the device's queued work done first, so
    /// its last kernels are in) and writes this rank's trace into the log directory.
    fn write_profile(&self, step: u64) -> Result<(), Error> {
        if let tch::Device::Cuda(i) = self.engine.config().device {
            tch::Cuda::synchronize(i as i64);
        }
        let path = self
            .cfg
            .log
            .dir
            .join(format!("profile-rank{}.json", self.engine.comm().rank()));
        if let Err(e) = zrun_torch_ext::profiler_stop(&path) {
            // A diagnosis only: the run goes on without it.
            tracing::warn!("{e}; training goes on without the profile");
            return Ok(());
        }
        if self.engine.comm().rank() == 0 {
            tracing::info!(
                "profile of step {step} written to {} (and one per rank beside it); python benches/profile_table.py sums it by kind",
                path.display()
            );
        }
        Ok(())
    }

    /// Mean of `x` over the ranks.
    fn average(&self, x: f64) -> Result<f64, Error> {
        let comm = self.engine.comm();
        let device = self.engine.config().device;
        Ok(reduce(comm.as_ref(), device, &[x], ReduceOp::Avg)?[0])
    }

    /// `x` of every rank, in rank order (exact: a gather only copies bits).
    fn gather(&self, x: i64) -> Result<Vec<i64>, Error> {
        let comm = self.engine.comm();
        let device = self.engine.config().device;
        let all = gather_bytes(comm.as_ref(), device, &x.to_le_bytes())?;
        Ok(all
            .iter()
            .map(|b| i64::from_le_bytes(b[..8].try_into().unwrap_or_default()))
            .collect())
    }

    /// Every rank's `x`, or `None` when some rank has none (every rank calls, with or
    /// without a value, so the ranks never disagree on the collective).
    fn gather_present(&self, x: Option<u64>) -> Result<Option<Vec<i64>>, Error> {
        let all = self.gather(x.map_or(-1, |v| v as i64))?;
        Ok(all.iter().all(|&v| v >= 0).then_some(all))
    }

    /// Every rank's figures (`time` is this rank's; every rank calls).
    fn figures(&self, time: report::Breakdown) -> Result<Vec<report::RankFigures>, Error> {
        let mine = report::RankFigures {
            rank: self.rank.rank,
            time,
            memory: report::MemoryByKind::of(&self.engine, self.base_rss),
        };
        let device = self.engine.config().device;
        report::gather(self.engine.comm().as_ref(), device, &mine)
    }

    /// Removes what interrupted saves left, then loads the checkpoint `checkpoint.resume`
    /// names (or finds) into the engine; every rank calls it. `None`: a fresh start.
    pub fn restore(&mut self) -> Result<Option<Resumed>, Error> {
        self.ckpt.clean_up(&self.engine)?;
        let resumed = self
            .ckpt
            .resume(&mut self.engine, &self.cfg.checkpoint.resume.clone())?;
        if let (Some(r), 0) = (&resumed, self.rank.rank) {
            let z = &self.cfg.zero;
            let now = format!(
                "{} rank(s), stage {}, {}, offload {}",
                self.rank.world_size, z.stage, z.precision, z.offload_optimizer
            );
            let then = format!(
                "{} rank(s), stage {}, {}, offload {}",
                r.world_size, r.stage, r.precision, r.offload
            );
            let by = match &r.run_id {
                Some(id) if id == self.ckpt.run_id() => "this run".to_string(),
                Some(id) => format!("run {id}"),
                None => "an earlier run".to_string(),
            };
            tracing::info!(
                "resuming from {} at step {} (written by {by}: {then}{})",
                r.dir.display(),
                r.step,
                if then == now {
                    String::new()
                } else {
                    format!("; now {now}")
                }
            );
        }
        if let (None, Some(dir)) = (&resumed, &self.cfg.model.init_from) {
            let t0 = std::time::Instant::now();
            let arch = self.cfg.arch()?;
            crate::hf::load_into(&mut self.engine, &arch, self.model.as_ref(), dir)?;
            if self.rank.rank == 0 {
                tracing::info!(
                    "initialised from {} in {:.1} s (rank 0's peak resident memory so far: {} MiB)",
                    dir.display(),
                    t0.elapsed().as_secs_f64(),
                    rss_bytes().1 >> 20
                );
            }
        }
        Ok(resumed)
    }

    /// Saves a checkpoint of the engine's state now, at `pos` (every rank calls it).
    pub fn save(&mut self, pos: &Position) -> Result<PathBuf, Error> {
        self.ckpt.save_now(&mut self.engine, pos)
    }

    /// Starts an asynchronous save at `pos`: the state is copied to host memory now and
    /// written by a background thread; [`Run::flush_saves`] completes it.
    pub fn save_async(&mut self, pos: &Position) -> Result<(), Error> {
        self.ckpt.flush(&mut self.engine)?;
        self.ckpt.start_async(&mut self.engine, pos)
    }

    /// Waits for an asynchronous save in flight and completes it, and for old checkpoints
    /// being deleted (every rank calls it).
    pub fn flush_saves(&mut self) -> Result<(), Error> {
        self.ckpt.flush(&mut self.engine)
    }

    /// The exact loss floor of the data, when known.
    pub fn loss_floor(&self) -> Option<f64> {
        self.dataset.loss_floor()
    }

    /// Mean loss over `train.eval_batches` held-out micro-batches of every rank.
    pub fn evaluate(&mut self, loader: &Loader) -> Result<f64, Error> {
        let n = self.cfg.train.eval_batches;
        let mut sum = 0.0;
        for i in 0..n {
            let (x, y) = loader.eval_batch(i)?;
            sum += self.engine.eval_loss(&x, &y)?;
        }
        self.average(sum / n as f64)
    }

    /// Trains `train.steps` steps, writing metrics (rank 0); returns the summary.
    pub fn train(&mut self) -> Result<Outcome, Error> {
        match self.train_steps() {
            Err(e) => match zrun_shard::out_of_memory(&e) {
                Some(bytes) => Err(self.out_of_memory(bytes)),
                None => Err(e),
            },
            ok => ok,
        }
    }

    fn train_steps(&mut self) -> Result<Outcome, Error> {
        let start = Instant::now();
        let t = self.cfg.train.clone();
        let every = self.cfg.log.every;
        let schedule = LrSchedule {
            peak: t.lr,
            min: self.cfg.min_lr(),
            warmup_steps: t.warmup_steps,
            total_steps: t.steps,
        };
        let r = self.rank;
        if r.rank == 0 {
            for note in &self.cfg.notes {
                tracing::warn!("{note}");
            }
        }
        let resumed = self.restore()?;
        let first = resumed.as_ref().map_or(0, |c| c.step);
        if let Some(c) = resumed.as_ref().filter(|c| c.step >= t.steps) {
            if r.rank == 0 {
                tracing::info!(
                    "checkpoint {} is at step {}, and train.steps = {}: nothing left to train (raise train.steps to train on)",
                    c.dir.display(),
                    c.step,
                    t.steps
                );
            }
            return Ok(Outcome::AlreadyDone {
                step: c.step,
                checkpoint: c.dir.clone(),
            });
        }
        let mut loader = Loader::new(
            self.dataset.clone(),
            r.rank,
            r.world_size,
            t.micro_batch,
            t.grad_accum,
            Cursor {
                next_sample: resumed.as_ref().map_or(0, |c| c.next_sample),
            },
        );
        let mut metrics = if r.rank == 0 {
            let dir = &self.cfg.log.dir;
            let opened = match first {
                0 => MetricsWriter::create(dir),
                step => MetricsWriter::resume(dir, step),
            };
            Some(opened.map_err(|e| Error::Io {
                path: dir.clone(),
                source: e,
            })?)
        } else {
            None
        };
        // A metrics line that could not be written (rank 0).
        let mut log_lost = None;
        let tokens_per_step =
            (t.grad_accum * r.world_size * t.micro_batch) as f64 * self.model.seq_len() as f64;
        let mem = self.engine.memory();
        // Every rank announces itself with its own bytes; rank 0 then speaks for the job.
        tracing::info!(
            params = self.model.param_count(),
            model_state_mib = mem.model_states() >> 20,
            loss_floor = ?self.loss_floor(),
            "rank {}/{}: training steps {}..={} of {} tokens",
            r.rank,
            r.world_size,
            first + 1,
            t.steps,
            tokens_per_step
        );
        if r.rank == 0 && self.cfg.zero.offload_optimizer == Offload::Cpu {
            if let Some(w) = self.cfg.delay() {
                tracing::info!(
                    "CPU AdamW: delayed one step after {w} update(s) (zero.offload_delay = 1): \
                     each update overlaps the next step's forward and backward, which run on \
                     parameters one update stale"
                );
                // Measured (docs/config.md): gpt2-medium at lr 3e-4 stalls with it.
                if self.cfg.delay_fresh() {
                    tracing::info!(
                        "zero.offload_delay_fresh: the device applies each gradient's own \
                         share of its update at once, so the next forward runs on nearly the \
                         undelayed model"
                    );
                } else {
                    tracing::warn!(
                        "zero.offload_delay = 1 lowers the largest learning rate that trains \
                     (stale updates through AdamW's momentum): at lr {} compare the loss with \
                     a run with zero.offload_delay = 0, or drop zero.offload_delay_fresh = false \
                     (docs/config.md)",
                        t.lr
                    );
                }
            } else if self.engine.can_overlap_step(t.grad_clip) {
                tracing::info!("CPU AdamW: each unit updates during backward, once its gradient shard is reduced");
            } else {
                tracing::info!(
                    "CPU AdamW: updates at the optimizer step, after the global gradient norm \
                     (overlap with backward needs stage 2 or 3, grad_clip = 0 and no fp16)"
                );
            }
        }
        let mut rates = Vec::new();
        // Where the steps' time went: since the last logged line, and over the run.
        let (mut since_log, mut run_time) = (report::Sum::default(), report::Sum::default());
        let started = Instant::now();
        // The launcher draws rank 0's progress from metrics.jsonl: no per-step lines then.
        let lines = r.rank == 0 && std::env::var("ZRUN_PROGRESS").as_deref() != Ok("launcher");
        let mut last_loss = f64::NAN;
        let mut eval_loss = None;
        let mut skipped = 0u64;
        let flops_per_token = self.model.flops_per_token();
        let peak_flops = self.cfg.log.peak_tflops.map(|t| t * 1e12);
        let mut shrinks = Vec::new();
        let profile = self.cfg.log.profile_step;
        for step in first..t.steps {
            if profile == step + 1 {
                zrun_torch_ext::profiler_start(self.engine.config().device.is_cuda())?;
            }
            let t0 = Instant::now();
            let lr = schedule.at(step);
            let start = loader.cursor();
            let (loss, data_s) = loop {
                match self.micro_steps(&mut loader, lr)? {
                    Ok(done) => break done,
                    Err(failed) => {
                        let s = self.shrink(step + 1, failed)?;
                        loader = Loader::new(
                            self.dataset.clone(),
                            r.rank,
                            r.world_size,
                            s.to.0,
                            s.to.1,
                            start,
                        );
                        shrinks.push(s);
                    }
                }
            };
            // A split delayed update prepares the next update's base at its rate.
            self.engine.set_next_lr(schedule.at(step + 1));
            let stats = self.engine.step(lr, t.grad_clip)?;
            if profile == step + 1 {
                self.write_profile(step + 1)?;
            }
            let overflow_skip = !stats.applied && self.cfg.zero.precision == Precision::Fp16;
            if overflow_skip && stats.loss_scale <= 1.0 {
                // No lower scale to try: the model itself is not finite (a NaN loss), and
                // skipping on would end the run with exit 0 and NaN weights.
                return Err(Error::NonFinite {
                    step: step + 1,
                    loss,
                    grad_norm: stats.grad_norm,
                });
            }
            if overflow_skip {
                skipped += 1;
                tracing::warn!(
                    "step {}: fp16 gradients overflowed at loss scale {}; step skipped, scale now {}",
                    step + 1,
                    stats.loss_scale,
                    self.engine.loss_scale()
                );
            } else if !stats.applied {
                // The gradient norm is global: every rank stops here together.
                return Err(Error::NonFinite {
                    step: step + 1,
                    loss,
                    grad_norm: stats.grad_norm,
                });
            }
            let dt = t0.elapsed().as_secs_f64();
            let spent = breakdown(dt, data_s, self.engine.take_times());
            since_log.add(spent);
            if step > first || t.steps == first + 1 {
                rates.push(tokens_per_step / dt);
                run_time.add(spent);
            }
            let done = step + 1;
            let evaluate = t.eval_every > 0 && done % t.eval_every == 0 || done == t.steps;
            eval_loss = if evaluate {
                Some(self.evaluate(&loader)?)
            } else {
                None
            };
            // Only logged steps need the job's mean loss: one small all-reduce, not every step.
            if done % every == 0 || done == t.steps || eval_loss.is_some() {
                let loss = self.average(loss)?;
                last_loss = loss;
                let (rss, peak) = rss_bytes();
                let cpu = zrun_torch_ext::cpu_memory_stats()
                    .filter(|_| self.engine.config().device == tch::Device::Cpu);
                let mem = self.engine.memory();
                let tokens_per_s = tokens_per_step / dt;
                let ranks = self.figures(std::mem::take(&mut since_log).mean())?;
                let m = StepMetrics {
                    step: done,
                    loss,
                    lr,
                    grad_norm: stats.grad_norm,
                    tokens_per_s,
                    step_time_s: dt,
                    mfu: peak_flops
                        .map(|p| tokens_per_s / r.world_size as f64 * flops_per_token / p),
                    loss_scale: (self.cfg.zero.precision == Precision::Fp16)
                        .then_some(stats.loss_scale),
                    skipped: overflow_skip,
                    model_state_bytes: mem.model_states(),
                    engine_bytes: mem.total(),
                    rss_bytes: rss,
                    peak_rss_bytes: peak,
                    cuda_peak_bytes: cuda_peak_bytes(self.engine.config().device),
                    cpu_allocated_peak_bytes: cpu.map(|c| c.peak_allocated as i64),
                    cpu_reserved_peak_bytes: cpu.map(|c| c.peak_reserved as i64),
                    eval_loss,
                    tokens: loader.cursor().next_sample * self.model.seq_len() as u64,
                    micro_batch: self.cfg.train.micro_batch,
                    ranks,
                };
                // Every rank logs the same averaged figures: rank 0 speaks for the job.
                if lines {
                    let elapsed = started.elapsed().as_secs_f64();
                    let eta = elapsed / (done - first) as f64 * (t.steps - done) as f64;
                    tracing::info!(
                        "step {done}/{} loss {loss:.4}{} lr {lr:.3e} grad_norm {:.3} {:.0} tok/s{} {:.3}s rss {} MiB elapsed {} eta {}",
                        t.steps,
                        eval_loss.map(|e| format!(" eval {e:.4}")).unwrap_or_default(),
                        stats.grad_norm,
                        m.tokens_per_s,
                        m.mfu.map(|f| format!(" mfu {:.1}%", 100.0 * f)).unwrap_or_default(),
                        dt,
                        rss >> 20,
                        clock(elapsed),
                        clock(eta)
                    );
                }
                if let Some(Err(e)) = metrics.as_mut().map(|w| w.write(&m)) {
                    // Every rank saves at this step's end, then the run ends with this error.
                    metrics = None;
                    log_lost = Some(Error::Io {
                        path: self.cfg.log.dir.join("metrics.jsonl"),
                        source: e,
                    });
                }
            }
            let pos = Position {
                step: done,
                next_sample: loader.cursor().next_sample,
                lr,
            };
            let last = done == t.steps;
            let asked = log_lost.is_some();
            if let Some(stopped) = self.ckpt.at_boundary(&mut self.engine, &pos, last, asked)? {
                return Err(match log_lost {
                    Some(lost) => Error::LogLost {
                        lost: Box::new(lost),
                        step: stopped.step,
                        checkpoint: stopped.checkpoint,
                    },
                    None => Error::Stopped(stopped),
                });
            }
        }
        self.ckpt.flush(&mut self.engine)?;
        if let Some(lost) = log_lost {
            return Err(lost);
        }
        let ranks = self.figures(run_time.mean())?;
        let estimate = self.estimate();
        let stragglers = report::stragglers(&ranks);
        let cpu = zrun_torch_ext::cpu_memory_stats();
        let summary = Summary {
            stragglers,
            shrinks,
            ranks,
            steps: t.steps,
            final_loss: last_loss,
            eval_loss: eval_loss.unwrap_or(f64::NAN),
            loss_floor: self.loss_floor(),
            tokens_per_s: median(&rates),
            peak_rss_bytes: self.gather(rss_bytes().1)?,
            base_rss_bytes: self.gather(self.base_rss)?,
            estimated_peak_bytes: self.gather(estimate.peak_bytes)?,
            estimated_peak_phase: estimate.phase,
            cuda_peak_bytes: match cuda_peak_bytes(self.engine.config().device) {
                Some(b) => Some(self.gather(b)?),
                None => None,
            },
            cpu_allocated_peak_bytes: self.gather_present(cpu.map(|c| c.peak_allocated))?,
            cpu_reserved_peak_bytes: self.gather_present(cpu.map(|c| c.peak_reserved))?,
            model_state_bytes: self.gather(self.engine.memory().model_states())?,
            skipped_steps: skipped,
            params: self.model.param_count(),
            world_size: r.world_size,
            wall_time_s: start.elapsed().as_secs_f64(),
        };
        if let Some(w) = &metrics {
            w.summary(&summary).map_err(|e| Error::Io {
                path: self.cfg.log.dir.join("summary.json"),
                source: e,
            })?;
        }
        Ok(Outcome::Finished(Box::new(summary)))
    }
}

/// The device of the rank `topo` describes, for a run on `kind`: the CPU, or its own GPU
/// ([`zrun_comm::gpu_index`] over the devices libtorch sees: the rule the nccl backend
/// follows too), made the calling thread's current CUDA device so that libtorch allocates
/// and launches there. Call it on the thread that drives the model, before it allocates.
pub fn rank_device(kind: DeviceKind, topo: &Topology) -> Result<Device, Error> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => {
            let visible = usize::try_from(tch::Cuda::device_count()).unwrap_or(0);
            let gpu = topo
                .gpu_index(visible)
                .map_err(|e| ConfigError(e.to_string()))?;
            zrun_torch_ext::set_cuda_device(gpu)?;
            Ok(Device::Cuda(gpu))
        }
    }
}

/// libtorch intra-op threads: `train.threads`, else OMP_NUM_THREADS, else this rank's
/// share of the node's cores.
fn set_threads(configured: usize, local_world_size: usize) -> usize {
    let from_env = std::env::var("OMP_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = match (configured, from_env) {
        (0, Some(n)) if n > 0 => n,
        (0, _) => (cores / local_world_size.max(1)).max(1),
        (n, _) => n,
    };
    tch::set_num_threads(n as i32);
    n
}

/// A step's parts: `dt` seconds in all, `data_s` reading data, the engine's `times`, and
/// the rest.
fn breakdown(dt: f64, data_s: f64, times: zrun_shard::StepTimes) -> report::Breakdown {
    let parts = data_s + times.forward + times.backward + times.comm_wait + times.optimizer;
    report::Breakdown {
        step_time_s: dt,
        data_s,
        forward_s: times.forward,
        backward_s: times.backward,
        comm_wait_s: times.comm_wait,
        optimizer_s: times.optimizer,
        other_s: (dt - parts).max(0.0),
    }
}

/// Seconds as `1h02m03s`, `2m03s` or `3s`.
fn clock(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}
