//! The stage engine: owns a rank's parameters, gradients, fp32 master and AdamW state as the
//! ZeRO stage and precision dictate, and applies the optimizer step.
//!
//! | stage | compute parameters            | gradients | fp32 master + AdamW | reduce          | after step |
//! |-------|-------------------------------|-----------|---------------------|-----------------|------------|
//! | 0     | full                          | full      | full                | all-reduce      | —          |
//! | 1     | full                          | full      | shard               | reduce-scatter  | all-gather |
//! | 2     | full                          | shard     | shard               | RS per unit     | all-gather |
//! | 3     | shard + units in flight       | shard     | shard               | RS per unit     | —          |
//!
//! In fp32 the owned slice of the parameters is the master copy; in bf16/fp16 the master is
//! a separate contiguous fp32 buffer and the compute parameters are refreshed from it.
//! The micro-step (forward and backward unit by unit) is in `micro.rs`.

use crate::init::{init_buffer, init_into, place, place_copy, Extent};
use crate::layout::{ShardLayout, UnitLayout};
use crate::offload::{self, HostOptimizer, HostSetup};
use crate::scaler::LossScaler;
use crate::state::Mover;
use crate::{Context, Error, MemoryLedger, Offload, Precision, ReduceDtype, Result, Stage};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};
use zrun_comm::Communicator;
use zrun_models::Model;
use zrun_optim::{clip_coefficient, AdamW, AdamWConfig, StateDtype};

/// What the engine needs to know, resolved from the config once.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// ZeRO stage.
    pub stage: Stage,
    /// Compute precision.
    pub precision: Precision,
    /// dtype of gradient reduction and accumulation (fp32 unless asked; bf16 for a split
    /// delayed update whose gradients are exactly bf16, `host_grads::split_in_bf16`).
    pub reduce_dtype: ReduceDtype,
    /// Recompute each unit's forward in its backward, keeping only unit inputs.
    pub activation_checkpointing: bool,
    /// Stage 3: units gathered ahead of the one computing.
    pub prefetch: usize,
    /// fp16: initial loss scale.
    pub initial_loss_scale: f64,
    /// fp16: clean steps before the loss scale doubles.
    pub loss_scale_window: u64,
    /// Where the fp32 master and AdamW state live (stages 1-3 may offload to the host).
    pub offload: Offload,
    /// dtype of the offloaded AdamW moments.
    pub optimizer_state_dtype: StateDtype,
    /// Threads of the CPU AdamW (this rank's share of the node's cores).
    pub optimizer_threads: usize,
    /// Device of compute and state.
    pub device: Device,
    /// Seed of the deterministic parameter init.
    pub seed: u64,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
    /// Whether a micro-step that runs out of memory is recovered from
    /// ([`Engine::finish_failed_micro_step`]): stages 2-3 then keep a reserve for its
    /// stand-in collectives.
    pub oom_recovery: bool,
    /// ZeRO-Offload's delayed parameter update (offload only; `delay.rs`): `Some(w)` applies
    /// every update after the first `w` one step late; `None`: off.
    pub offload_delay: Option<u64>,
    /// The delayed update split (`zero.offload_delay_fresh`, `fresh.rs`): the device applies
    /// each gradient's own share of its update at once and the CPU the rest one step ahead,
    /// so the next forward runs on nearly the undelayed model. Needs `offload_delay`; the
    /// device then keeps its gradient shard and v (bf16) until the step's end.
    pub offload_delay_fresh: bool,
    /// Hybrid sharding (`zero.shard_group`, stages 1-3): `Some(g)` shards the model states
    /// over groups of `g` consecutive ranks (`g` divides the world size) and replicates them
    /// across the groups; `None`: one group of all ranks. Ignored at stage 0.
    pub shard_group: Option<usize>,
    /// Logits per chunk of the head's matmul and the loss ([`zrun_models::linear_lm_loss`]):
    /// the logits (B, T, V) are never held whole. 0: all logits at once, then the loss.
    pub loss_chunk: i64,
    /// The caller runs every step as one micro-step announced with
    /// [`Engine::prepare_step`] (`train.grad_accum = 1`). With CPU offload at stages 2-3 and
    /// no out-of-memory recovery, each unit's gradient then goes to the host as it is made
    /// and the device keeps no gradient shard (`host_grads.rs`).
    pub one_micro_step: bool,
}

impl EngineConfig {
    /// Whether delayed updates are split (`offload_delay_fresh` with a delay).
    pub(crate) fn fresh(&self) -> bool {
        self.offload_delay_fresh && self.offload_delay.is_some()
    }

    /// fp32 at `stage` with the defaults for everything else.
    pub fn fp32(stage: Stage, device: Device, seed: u64, adamw: AdamWConfig) -> EngineConfig {
        EngineConfig {
            stage,
            precision: Precision::Fp32,
            reduce_dtype: ReduceDtype::Fp32,
            activation_checkpointing: false,
            prefetch: 1,
            initial_loss_scale: 65536.0,
            loss_scale_window: 1000,
            offload: Offload::None,
            optimizer_state_dtype: StateDtype::Fp32,
            optimizer_threads: 1,
            device,
            seed,
            adamw,
            oom_recovery: true,
            offload_delay: None,
            offload_delay_fresh: false,
            shard_group: None,
            loss_chunk: zrun_models::LOSS_CHUNK,
            one_micro_step: false,
        }
    }
}

/// Figures of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    /// Factor the gradients were multiplied by (1 when not clipped).
    pub clip_coef: f64,
    /// False when the gradients held inf/NaN; the step was then skipped.
    pub applied: bool,
    /// The loss scale used for this step's gradients (1 outside fp16).
    pub loss_scale: f64,
}

/// Where this rank's time went since [`Engine::take_times`] was last called, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// Forward of the micro-steps, without the waits for collectives.
    pub forward: f64,
    /// Backward of the micro-steps, without the waits for collectives.
    pub backward: f64,
    /// Waiting for collectives: the communication compute did not hide.
    pub comm_wait: f64,
    /// The optimizer step (reduction, clipping, update, parameter refresh), without waits.
    pub optimizer: f64,
}

/// Where the AdamW step runs.
pub(crate) enum Optimizer {
    /// On the compute device, libtorch kernels over the owned shard.
    Device(AdamW),
    /// In host memory, the CPU AdamW (offload).
    Host(Box<HostOptimizer>),
}

/// An optimizer update that runs during the last micro-step's backward (CPU offload).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum EarlyStep {
    /// The step's update waits for [`Engine::step`].
    Off,
    /// The next micro-step's backward copies each unit's final gradient shard to the host as
    /// its reduction completes; the update waits for the step (it needs the whole gradient).
    StageArmed,
    /// The last backward has staged its units' gradients on the host.
    Staged,
    /// The next micro-step's backward updates each unit as its gradient shard is final.
    Armed { lr: f64, max_norm: f64 },
    /// The last backward has submitted its units' updates.
    Submitted { lr: f64, max_norm: f64 },
}

/// Drives one rank's training step unit by unit.
pub struct Engine {
    pub(crate) model: Arc<dyn Model>,
    pub(crate) cfg: EngineConfig,
    pub(crate) mover: Mover,
    /// Compute dtype. Stages 0-2: every unit's full buffer back to back. Stage 3: this rank's shard.
    pub(crate) params: Tensor,
    /// fp32 master when the compute dtype is not fp32 (stage 0: full; else this rank's shard).
    pub(crate) master: Option<Tensor>,
    /// Reduce dtype. Stages 0-1: full gradients. Stages 2-3: this rank's reduced shard.
    pub(crate) grads: Tensor,
    /// Per unit: its region of `grads` is stale, not zero, until overwritten (`grads.rs`).
    pub(crate) stale: Vec<bool>,
    /// Gradients live on the host only (`host_grads.rs`): `grads` is empty.
    pub(crate) host_grads: bool,
    /// With host gradients, per unit: its gradient on the device while it is made.
    pub(crate) held: Vec<Option<Tensor>>,
    /// Their dtype: the host's where that is bf16, else the reduce dtype.
    pub(crate) held_kind: Kind,
    /// With host gradients: the squares of the units' gradients, summed as they go.
    pub(crate) squares: crate::host_grads::Squares,
    /// Stages 2-3: bytes reserved for the stand-in collectives of a micro-step that ran out
    /// of memory (see `recover.rs`), so that recovering allocates nothing.
    pub(crate) reserve: Option<Tensor>,
    pub(crate) optimizer: Optimizer,
    pub(crate) scaler: LossScaler,
    pub(crate) early: EarlyStep,
    /// Whether the next micro-step is announced as the step's last.
    pub(crate) last_announced: bool,
    /// The delayed parameter update's state (`delay.rs`).
    pub(crate) delay: crate::delay::Delay,
    pub(crate) times: StepTimes,
    /// What the engine is doing now, for an error's report: a phase and a unit index.
    pub(crate) at: (Phase, usize),
    /// With `ZRUN_CUDA_MEMORY_TRACE=1` on CUDA: each phase's peak allocated bytes are logged
    /// as the next phase begins (for comparing with `zrun estimate`'s walk).
    trace_cuda: Option<usize>,
}

/// The part of a step the engine is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Idle,
    Forward,
    Loss,
    Backward,
    Step,
    Eval,
}

impl Engine {
    /// Builds the engine of rank `comm.rank()` for `model`, initialising exactly the
    /// parameters this stage keeps on this rank from `cfg.seed`. With a shard group
    /// smaller than the world (`cfg.shard_group`) every rank splits `comm` into its shard
    /// and replica groups here: a collective over `comm`, so all ranks build their engines
    /// at the same point of their collectives.
    pub fn new(
        model: Arc<dyn Model>,
        comm: Arc<dyn Communicator>,
        mut cfg: EngineConfig,
    ) -> Result<Engine> {
        let (rank, world) = (comm.rank() as i64, comm.world_size() as i64);
        let group = match (cfg.stage, cfg.shard_group) {
            (Stage::Zero0, _) | (_, None) => world,
            (_, Some(g)) => g as i64,
        };
        let layout = ShardLayout::hybrid(model.units(), rank, world, group)?;
        let (shard, replica) = groups(&comm, &layout)?;
        let dev = cfg.device;
        let param_extent = if cfg.stage == Stage::Zero3 {
            Extent::Shard
        } else {
            Extent::Full
        };
        let master_extent = if cfg.stage == Stage::Zero0 {
            Extent::Full
        } else {
            Extent::Shard
        };
        let to_dev = |t: Tensor, kind: Kind| place(t, kind, dev);
        let init = |extent| init_buffer(model.as_ref(), &layout, cfg.seed, extent);
        let offloaded = cfg.offload == Offload::Cpu;
        // Where the compute parameters hold the master's elements (the same extent, or a
        // shard group of one, whose shard is every unit), they are the master's values cast,
        // made from it instead of from a second pass of the initialiser.
        let derived = (offloaded || cfg.precision != Precision::Fp32)
            && (param_extent == master_extent || layout.world_size == 1);
        let params = if derived {
            None
        } else {
            Some(to_dev(init(param_extent)?, cfg.precision.kind()).ctx("place parameters", "-")?)
        };
        if offloaded && !offload::supported(cfg.stage) {
            return Err(Error::Unsupported(
                "zero.offload_optimizer = \"cpu\" needs a sharded optimizer: set zero.stage to 1, 2 or 3".into(),
            ));
        }
        if cfg.offload_delay.is_some() && !offloaded {
            return Err(Error::Unsupported(
                "zero.offload_delay needs zero.offload_optimizer = \"cpu\": set it, or zero.offload_delay = 0".into(),
            ));
        }
        let master = match cfg.precision {
            _ if offloaded => None,
            Precision::Fp32 => None,
            _ => Some(
                to_dev(init(master_extent)?, Kind::Float).ctx("place master parameters", "-")?,
            ),
        };
        let mut params = match (params, &master) {
            (None, Some(m)) => Some(
                m.f_to_kind(cfg.precision.kind())
                    .ctx("place parameters", "-")?,
            ),
            (params, _) => params,
        };
        // The fp32 init buffers above were host temporaries of the rank's whole extent (on
        // CUDA 30 GiB each for an 8B model at W=1). The caching CPU allocator would keep
        // their pages, beside the offloaded state allocated next (pinned, outside it) and
        // for good: no host tensor of that size comes later on a GPU. Return them now.
        zrun_torch_ext::cpu_empty_cache();
        let tied = model.units().iter().any(|u| u.tied().is_some());
        let eligible =
            crate::gradients_on_host(cfg.stage, cfg.offload, cfg.one_micro_step, cfg.oom_recovery);
        // Gradients on the host only, but for a split delayed update, which reads them on the
        // device at the step's end.
        let host_grads = eligible && !cfg.fresh();
        let split_bf16 =
            crate::host_grads::split_in_bf16(eligible, cfg.fresh(), &layout, cfg.precision, tied);
        if split_bf16 {
            cfg.reduce_dtype = ReduceDtype::Bf16;
        }
        let host_grad_kind = if host_grads || split_bf16 {
            crate::host_grads::host_grad_kind(&layout, cfg.precision, tied)
        } else {
            Kind::Float
        };
        let held_kind = match host_grad_kind {
            Kind::BFloat16 => Kind::BFloat16,
            _ => cfg.reduce_dtype.kind(),
        };
        let grad_numel = match cfg.stage {
            _ if host_grads => 0,
            Stage::Zero0 | Stage::Zero1 => layout.full_numel(),
            Stage::Zero2 | Stage::Zero3 => layout.shard_numel(),
        };
        let grads = Tensor::f_zeros([grad_numel], (cfg.reduce_dtype.kind(), dev))
            .ctx("allocate gradients", "-")?;
        // A split delayed update's v on the device, bf16 in shard layout (`fresh.rs`).
        let fresh_v = match offloaded && cfg.fresh() {
            true => Some(
                Tensor::f_zeros([layout.shard_numel()], (Kind::BFloat16, dev))
                    .ctx("allocate v on the device", "-")?,
            ),
            false => None,
        };
        let reserve_bytes = crate::recover::reserve_bytes(
            &layout,
            cfg.stage,
            cfg.precision,
            cfg.reduce_dtype,
            cfg.oom_recovery,
        );
        let reserve = match reserve_bytes {
            0 => None,
            n => Some(
                Tensor::f_zeros([n], (Kind::Uint8, dev))
                    .ctx("allocate the out-of-memory reserve", "-")?,
            ),
        };
        let (opt_numel, decay) = match master_extent {
            Extent::Full => (layout.full_numel(), layout.full_decay_ranges()),
            Extent::Shard => (layout.shard_numel(), layout.shard_decay_ranges()),
        };
        let optimizer = if offloaded {
            // At stages 2-3 on the host, the gradient shard is already host memory in shard
            // order: the CPU AdamW reads it in place (fp32) rather than from a second copy,
            // unless a delayed update reads it while the next step accumulates.
            let in_place = matches!(cfg.stage, Stage::Zero2 | Stage::Zero3)
                && !host_grads
                && dev == Device::Cpu
                && cfg.offload_delay.is_none();
            let setup = HostSetup {
                adamw: cfg.adamw,
                state: cfg.optimizer_state_dtype,
                // A delayed update runs beside the thread that launches the GPU's kernels:
                // it leaves that thread a core of its own.
                threads: if dev.is_cuda() && cfg.offload_delay.is_some() {
                    cfg.optimizer_threads.saturating_sub(1).max(1)
                } else {
                    cfg.optimizer_threads
                },
                precision: cfg.precision,
                device: dev,
                delayed: cfg.offload_delay.is_some(),
                fresh: cfg.fresh(),
                grad_kind: host_grad_kind,
            };
            let grads_in_place = in_place.then(|| grads.shallow_clone());
            let init_master = |master: &Tensor| {
                init_into(model.as_ref(), &layout, cfg.seed, Extent::Shard, master)
            };
            let host = HostOptimizer::new(&layout, init_master, setup, grads_in_place)?;
            if params.is_none() {
                let p = place_copy(host.master(), cfg.precision.kind(), dev);
                params = Some(p.ctx("place parameters", "-")?);
            }
            Optimizer::Host(Box::new(host))
        } else {
            Optimizer::Device(AdamW::new(opt_numel, dev, cfg.adamw, decay)?)
        };
        let scaler = LossScaler::new(
            cfg.precision == Precision::Fp16,
            cfg.initial_loss_scale,
            cfg.loss_scale_window,
        );
        let n_units = layout.units.len();
        let params = params
            .ok_or_else(|| Error::Unsupported("the compute parameters were not placed".into()))?;
        Ok(Engine {
            model,
            cfg,
            mover: Mover::new(comm, shard, replica, layout),
            params,
            master,
            grads,
            stale: vec![false; n_units],
            host_grads,
            held: (0..n_units).map(|_| None).collect(),
            held_kind,
            squares: Default::default(),
            reserve,
            optimizer,
            scaler,
            early: EarlyStep::Off,
            last_announced: false,
            delay: crate::delay::Delay {
                warmup: cfg.offload_delay,
                v: fresh_v,
                ..Default::default()
            },
            times: StepTimes::default(),
            at: (Phase::Idle, 0),
            trace_cuda: match dev {
                tch::Device::Cuda(i)
                    if std::env::var("ZRUN_CUDA_MEMORY_TRACE").as_deref() == Ok("1") =>
                {
                    Some(i)
                }
                _ => None,
            },
        })
    }

    /// The layout (view tables) of every unit, for this rank.
    pub fn layout(&self) -> &ShardLayout {
        &self.mover.layout
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The communicator of every rank this engine was built with (the world, also with
    /// hybrid sharding, whose shard and replica groups are the engine's own).
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.mover.comm
    }

    /// The most bytes of gathered unit parameters alive at once (stage 3; part of the
    /// ledger's `buffers`).
    pub fn gathered_peak(&self) -> i64 {
        self.mover.peak_gathered
    }

    /// Bytes reserved for recovering from an out-of-memory without allocating (stages 2-3;
    /// part of the ledger's `buffers`).
    pub fn oom_reserve_bytes(&self) -> i64 {
        self.reserve.as_ref().map_or(0, |t| t.numel() as i64)
    }

    /// Where this rank's time went since the last call (forward, backward, waits for
    /// collectives, optimizer), and starts counting again.
    pub fn take_times(&mut self) -> StepTimes {
        std::mem::take(&mut self.times)
    }

    /// Enters `phase` of unit `u` (what an out-of-memory names); with the CUDA trace on,
    /// logs the peak of the phase that ends.
    pub(crate) fn enter(&mut self, phase: Phase, u: usize) {
        if let Some(i) = self.trace_cuda {
            if let Some(m) = zrun_torch_ext::cuda_memory(i) {
                tracing::info!(
                    "cuda memory: {} peak {} allocated {}",
                    self.phase(),
                    m.peak_allocated,
                    m.allocated
                );
                zrun_torch_ext::reset_cuda_peak(i);
            }
        }
        self.at = (phase, u);
    }

    /// Where the engine is (or was when an error stopped it): `"backward of unit h.3"`,
    /// `"optimizer step"`, in the estimator's words.
    pub fn phase(&self) -> String {
        let (p, u) = self.at;
        let unit = || {
            self.mover
                .layout
                .units
                .get(u)
                .map_or("?", |l| l.unit.as_str())
                .to_string()
        };
        match p {
            Phase::Idle => "between steps".into(),
            Phase::Forward => format!("forward of unit {}", unit()),
            Phase::Loss => "loss".into(),
            Phase::Backward => format!("backward of unit {}", unit()),
            Phase::Step => "optimizer step".into(),
            Phase::Eval => format!("evaluation, unit {}", unit()),
        }
    }

    /// The current loss scale (1 outside fp16).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.scale()
    }

    /// Bytes this rank holds, by category, counted from the buffers actually allocated.
    pub fn memory(&self) -> MemoryLedger {
        let bytes = |t: &Tensor| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
        let (optimizer, host, host_buffers, scratch) = match &self.optimizer {
            Optimizer::Device(a) => (a.state_bytes(), 0, 0, a.scratch_bytes()),
            Optimizer::Host(h) => (0, h.state_bytes(), h.buffer_bytes(), 0),
        };
        // A split delayed update's v on the device (`fresh.rs`).
        let optimizer = optimizer + self.delay.v.as_ref().map_or(0, bytes);
        MemoryLedger {
            params: bytes(&self.params),
            grads: bytes(&self.grads),
            master: self.master.as_ref().map_or(0, bytes),
            optimizer,
            host,
            buffers: scratch + host_buffers + self.oom_reserve_bytes() + self.mover.peak_in_flight,
        }
    }

    pub(crate) fn units_len(&self) -> usize {
        self.mover.layout.units.len()
    }

    /// Whether a step's update can overlap the last backward: with the optimizer on the host
    /// and gradients reduced per unit (stages 2-3), when the update needs no figure of the
    /// whole gradient (no clipping, no fp16 loss scale and its overflow check).
    pub fn can_overlap_step(&self, max_norm: f64) -> bool {
        self.host_gets_unit_gradients() && max_norm <= 0.0 && self.cfg.precision != Precision::Fp16
    }

    /// Whether the next step's update is delayed (`zero.offload_delay`, past its warm-up):
    /// it then overlaps the next step's forward and backward instead of this backward.
    pub fn delays_next_update(&self) -> bool {
        self.delay_active()
    }

    /// Whether each unit's final gradient shard can go to a host optimizer during backward:
    /// offload at a stage that reduces unit by unit (2-3).
    fn host_gets_unit_gradients(&self) -> bool {
        matches!(self.optimizer, Optimizer::Host(_))
            && matches!(self.cfg.stage, Stage::Zero2 | Stage::Zero3)
    }

    /// Announces that the next [`Engine::forward_backward`] is the last micro-step before
    /// [`Engine::step`]. With hybrid sharding at stages 2-3 its backward then all-reduces each
    /// unit's gradient shard, summed over the step's micro-steps, across the replica group as
    /// the unit completes, overlapping the rest of the backward; unannounced, the step does
    /// it before the update. Either way it crosses the replicas once per step, not once per
    /// micro-step. Without replicas it changes nothing.
    pub fn last_micro_step(&mut self) {
        self.last_announced = true;
    }

    /// Announces that the next [`Engine::forward_backward`] is the last micro-step before
    /// `step(lr, max_norm)` (as [`Engine::last_micro_step`]). Where
    /// [`Engine::can_overlap_step`], that backward then hands each unit's final gradient shard
    /// to the CPU AdamW, which updates the unit on its own thread while backward goes on with
    /// earlier units; returns whether it will. Results are bitwise those of updating at
    /// `step`.
    pub fn prepare_step(&mut self, lr: f64, max_norm: f64) -> bool {
        self.last_micro_step();
        // A delayed update runs on the host buffers until the step's end: nothing may be
        // updated during this backward then; a unit's gradient is staged once the running
        // update is done with the unit (`HostOptimizer::stage_unit`).
        let delayed = self.delay.behind || self.delay_active();
        let overlap = self.can_overlap_step(max_norm) && !delayed;
        self.early = if overlap {
            EarlyStep::Armed { lr, max_norm }
        } else if self.host_gets_unit_gradients() {
            EarlyStep::StageArmed
        } else {
            EarlyStep::Off
        };
        overlap
    }

    /// Finishes the gradient reduction of the step, unscales (fp16), clips to `max_norm`
    /// (<= 0: off) by the global norm, applies AdamW with `lr`, refreshes the compute
    /// parameters and clears the gradients. A step whose gradients are not finite on any
    /// rank is skipped (and with fp16 the loss scale halves).
    pub fn step(&mut self, lr: f64, max_norm: f64) -> Result<StepStats> {
        let (t0, w0) = (std::time::Instant::now(), self.mover.waited);
        let stats = self.step_inner(lr, max_norm);
        let waited = self.mover.waited - w0;
        self.times.comm_wait += waited.as_secs_f64();
        self.times.optimizer += t0.elapsed().saturating_sub(waited).as_secs_f64();
        stats
    }

    fn step_inner(&mut self, lr: f64, max_norm: f64) -> Result<StepStats> {
        let _guard = tch::no_grad_guard();
        self.enter(Phase::Step, 0);
        if self.host_grads {
            // Before the early step ends: what it hands over goes where the rest went.
            self.check_announced()?;
            self.settle_host_grads()?;
        }
        let early = std::mem::replace(&mut self.early, EarlyStep::Off);
        // Whether the last micro-step's backward all-reduced across the replicas already.
        let replicated_in_backward = std::mem::take(&mut self.mover.replicates);
        self.last_announced = false;
        if let EarlyStep::Submitted { lr: l, max_norm: m } = early {
            if (l, m) != (lr, max_norm) {
                // The update already ran with what was announced: finish it and clear the
                // gradients, so the engine stays consistent, then say so.
                if let Optimizer::Host(h) = &mut self.optimizer {
                    h.finish()?;
                }
                self.discard_grads();
                return Err(Error::Unsupported(format!(
                    "step(lr {lr}, max_norm {max_norm}) after prepare_step(lr {l}, max_norm {m}): \
                     they must agree (this step was applied with lr {l})"
                )));
            }
        }
        let overlapped = matches!(early, EarlyStep::Submitted { .. });
        // Units that received no gradient this step read as zeros from here on.
        self.settle_grads()?;
        match self.cfg.stage {
            Stage::Zero0 => self.mover.all_reduce_units(&self.grads)?,
            Stage::Zero1 => self.mover.reduce_scatter_units(&self.grads)?,
            // Reduced per unit during backward; across the replicas there too when the last
            // micro-step was announced.
            Stage::Zero2 | Stage::Zero3 => {
                if self.mover.replicated() && !replicated_in_backward {
                    self.mover.replicate_units(&self.grads)?;
                }
            }
        }
        let grads = self.owned_grads()?;
        let local = if self.host_grads {
            // Summed unit by unit as they went to the host.
            self.squares.take()?
        } else if self.cfg.device.is_cuda() && !grads.is_empty() {
            // One multi-tensor kernel and one read-back, not one per 1M elements.
            zrun_torch_ext::sum_of_squares(&grads)
                .map_err(|e| Error::Kernel("gradient norm", e))?
                .f_double_value(&[])
                .ctx("gradient norm", "-")?
        } else {
            grads
                .iter()
                .map(crate::norm::sum_of_squares)
                .sum::<Result<f64>>()?
        };
        // The reduced gradients were just read: they count only if no collective was cut.
        self.mover.check()?;
        // Replicated shard groups hold the same shards: only the first group's count, so
        // every element is summed once.
        let local = if self.mover.layout.replica == 0 {
            local
        } else {
            0.0
        };
        // Stage 0 holds the whole reduced gradient on every rank; the others own a part.
        let sum_sq = if self.cfg.stage == Stage::Zero0 {
            local
        } else {
            self.mover.sum_over_ranks(local, self.cfg.device)?
        };
        let loss_scale = self.scaler.scale();
        let grad_norm = sum_sq.sqrt() / loss_scale;
        let applied = grad_norm.is_finite();
        let clip_coef = clip_coefficient(grad_norm, max_norm);
        self.scaler.update(applied);
        if self.delay_active() && !overlapped {
            // Gradients staged during backward need no second copy.
            let segments = (early != EarlyStep::Staged).then_some(&grads[..]);
            self.delayed_step(segments, lr, clip_coef / loss_scale, applied)?;
        } else if overlapped {
            // Every unit was updated during backward; wait for the last of them.
            if let Optimizer::Host(h) = &mut self.optimizer {
                h.finish()?;
            }
            if self.cfg.stage == Stage::Zero2 {
                self.mover.all_gather_units(&self.params)?;
            }
        } else if applied {
            // An update still pending from a delayed step (the warm-up grew on resume).
            self.catch_up()?;
            if let Optimizer::Host(h) = &mut self.optimizer {
                // The CPU AdamW unscales and clips while it reads the staged gradients.
                let (mover, params, stage) = (&self.mover, &self.params, self.cfg.stage);
                let params_of = |u| mover.owned_params(params, u, stage);
                // Gradients staged during backward need no second copy.
                let segments = (early != EarlyStep::Staged).then_some(&grads[..]);
                h.step(
                    &mover.layout,
                    segments,
                    lr,
                    clip_coef / loss_scale,
                    params_of,
                )?;
                if matches!(stage, Stage::Zero1 | Stage::Zero2) {
                    self.mover.all_gather_units(&self.params)?;
                }
            } else {
                // Clipping and unscaling ride on the update (on CUDA inside the fused kernel,
                // zrun's of which writes the bf16 parameters as well: no cast after it).
                let master = self.owned_master()?;
                // (Only where a kernel may write them: no views made for nothing.)
                let half = match &self.master {
                    Some(_) if zrun_torch_ext::kernels::optim::installed() => {
                        Some(self.owned_params()?)
                    }
                    _ => None,
                };
                let wrote = match &mut self.optimizer {
                    Optimizer::Device(a) => a.step_segments_into(
                        &master,
                        &grads,
                        lr,
                        clip_coef / loss_scale,
                        half.as_deref(),
                    )?,
                    Optimizer::Host(_) => false,
                };
                if !wrote {
                    self.cast_master()?;
                }
                self.gather_params()?;
            }
        } else {
            // Skipped: a pending delayed update is still applied at this step's end.
            self.catch_up()?;
        }
        self.delay.updates += u64::from(applied);
        self.discard_grads();
        // The update read gradients (on the host too, offloaded) and gathered parameters.
        self.mover.check()?;
        Ok(StepStats {
            grad_norm,
            clip_coef,
            applied,
            loss_scale,
        })
    }
}

/// A shared communicator.
type Comm = Arc<dyn Communicator>;

/// The shard group's and (hybrid sharding) replica group's communicators of `layout`'s rank
/// in the world `comm`: the world itself and none when one group holds all ranks; a group of
/// one ([`zrun_comm::solo`]) and the world when every rank holds a replica; else two splits
/// of the world, made in the same order on every rank.
fn groups(comm: &Comm, layout: &ShardLayout) -> Result<(Comm, Option<Comm>)> {
    if layout.replicas == 1 {
        return Ok((comm.clone(), None));
    }
    let rank = comm.rank();
    let (g, replica) = (layout.world_size as usize, layout.replica as usize);
    let (shard, across): (Comm, Comm) = if g == 1 {
        (Arc::from(zrun_comm::solo(comm.backend())), comm.clone())
    } else {
        let split = |color| comm.split(color, rank).map(Arc::from).map_err(Error::Comm);
        // The shard group (same replica index), then the replica group (same position).
        let shard = split(replica)?;
        (shard, split(rank % g)?)
    };
    let want = [
        ("shard", &shard, layout.rank, layout.world_size),
        ("replica", &across, layout.replica, layout.replicas),
    ];
    for (what, c, r, n) in want {
        if (c.rank() as i64, c.world_size() as i64) != (r, n) {
            return Err(Error::Unsupported(format!(
                "rank {rank}: the {what} group's communicator made the rank {} of {}, where the layout (zero.shard_group = {g} of {} ranks) wants {r} of {n}",
                c.rank(),
                c.world_size(),
                comm.world_size()
            )));
        }
    }
    Ok((shard, Some(across)))
}

/// The named parameter tensors of a unit as views of its flat buffer, in the unit's order.
pub(crate) fn views(layout: &UnitLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    layout
        .views
        .iter()
        .map(|v| {
            flat.f_narrow(0, v.offset, v.numel)
                .and_then(|t| t.f_view(v.shape.as_slice()))
        })
        .collect::<std::result::Result<_, _>>()
        .ctx("view parameters", &layout.unit)
}
