//! A rank's memory before anything is allocated: the model states by the rules the engine
//! allocates by, and a walk through one step (forward unit by unit, the loss, backward in
//! reverse, the optimizer step, an evaluation) that adds what each phase holds on top of
//! them: activations, stage-3 gathers in flight, gradient reductions, loss temporaries. The
//! peak is the largest of these sums and the phase it falls in; `docs/memory.md` gives every
//! term's formula.

use crate::{Engine, MemoryLedger, Offload, Precision, ReduceDtype, ShardLayout, Stage};
use serde::Serialize;
use zrun_models::{Activations, LossBytes, Model};
use zrun_optim::{AdamW, StateDtype};

/// What the estimate depends on besides the model and the layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EstimateConfig {
    /// ZeRO stage.
    pub stage: Stage,
    /// Compute precision.
    pub precision: Precision,
    /// dtype of gradient reduction and accumulation.
    pub reduce_dtype: ReduceDtype,
    /// Where the fp32 master and AdamW state live.
    pub offload: Offload,
    /// dtype of offloaded AdamW moments.
    pub state_dtype: StateDtype,
    /// Recompute each unit's forward in its backward.
    pub activation_checkpointing: bool,
    /// Stage 3: units gathered ahead of the one computing.
    pub prefetch: usize,
    /// Sequences per micro-step on this rank.
    pub micro_batch: i64,
    /// Tokens per sequence.
    pub seq_len: i64,
    /// Sequences per evaluation batch.
    pub eval_batch: i64,
    /// Whether compute runs on a CUDA device (then host memory is not device memory).
    pub cuda: bool,
    /// Whether a micro-step that runs out of memory is recovered from (its reserve counts).
    pub oom_recovery: bool,
    /// Whether every step is one micro-step (no gradient accumulation).
    pub one_micro_step: bool,
    /// Whether updates are delayed (`zero.offload_delay`): the host then keeps a gradient
    /// copy of its own.
    pub offload_delay: bool,
    /// Whether delayed updates are split (`zero.offload_delay_fresh`): v (bf16) on the
    /// device, v and (without a 16-bit staging buffer) an fp32 base on the host.
    pub offload_delay_fresh: bool,
    /// Logits per chunk of the head's matmul and the loss (0: all logits at once).
    pub loss_chunk: i64,
    /// Whether gradients live on the host only ([`crate::gradients_on_host`]): the device
    /// holds each unit's while it is made.
    pub host_grads: bool,
    /// Whether the model has a tied parameter (its gradient is a sum).
    pub tied: bool,
}

impl EstimateConfig {
    /// Whether the gradients could live on the host only ([`crate::gradients_on_host`]).
    fn eligible(&self) -> bool {
        crate::gradients_on_host(
            self.stage,
            self.offload,
            self.one_micro_step,
            self.oom_recovery,
        )
    }

    /// Whether updates are delayed and split.
    fn fresh(&self) -> bool {
        self.offload_delay && self.offload_delay_fresh
    }

    /// This config as the engine runs it on `layout`: a split delayed update whose gradients
    /// are exactly bf16 values reduces in bf16 (`host_grads::split_in_bf16`).
    fn resolved(&self, layout: &ShardLayout) -> EstimateConfig {
        let mut cfg = *self;
        let (eligible, fresh) = (self.eligible(), self.fresh());
        if crate::host_grads::split_in_bf16(eligible, fresh, layout, self.precision, self.tied) {
            cfg.reduce_dtype = ReduceDtype::Bf16;
        }
        cfg
    }

    /// Whether the host's gradients are bf16 (on the host only, or a split delayed update's
    /// copy of its device buffer, where they are exactly bf16 values).
    fn bf16_host_grads(&self, layout: &ShardLayout) -> bool {
        (self.host_grads || (self.fresh() && self.eligible()))
            && crate::host_grads::host_grad_kind(layout, self.precision, self.tied)
                == tch::Kind::BFloat16
    }

    /// Bytes per element of the gradients on the host (offloaded, staged or host only) and of
    /// a unit's gradient held on the device while it is made (host only).
    fn host_grad_bytes(&self, layout: &ShardLayout) -> (i64, i64) {
        if self.bf16_host_grads(layout) {
            (2, 2)
        } else {
            (4, self.reduce_dtype.kind().elt_size_in_bytes() as i64)
        }
    }
}

/// What a CPU rank's resident memory gains in training outside its tensors, at the least:
/// small blocks glibc's heap keeps (autograd's nodes, the runtime's bookkeeping) and library
/// code paged in by the first steps (docs/memory.md).
pub const HEAP_BYTES: i64 = 4 << 20;

/// What the heap gains with the micro-batch on top of [`HEAP_BYTES`], reached from
/// [`HEAP_FULL_TOKENS`] tokens per micro-batch on: the CPU matrix kernels' own buffers, which
/// grow with the matrices up to a cap. Measured as resident memory less the caching
/// allocator's reserve (fp32, 1-4 ranks): 3.8-5.3 MiB in all at 128 tokens, 5.8 at 256,
/// 7.1-8.9 from 512 (docs/memory.md).
pub const HEAP_BATCH_BYTES: i64 = 7 << 19;

/// Tokens per micro-batch from which the heap holds [`HEAP_BATCH_BYTES`] in full.
pub const HEAP_FULL_TOKENS: i64 = 512;

/// The kernels oneDNN generates for 16-bit matrix products on CPUs with AVX-512 (its brgemm
/// kernels, kept in its primitive cache outside libtorch's allocator): measured at 9-10 MiB
/// per rank for the GPT and Llama steps, whatever their width and batch (docs/memory.md).
pub const ONEDNN_KERNEL_BYTES: i64 = 10 << 20;

/// With activation checkpointing, the kernels of the forward recomputed without autograd,
/// which oneDNN caches beside the others: measured 1.5-3.5 MiB more (docs/memory.md).
pub const ONEDNN_RECOMPUTE_BYTES: i64 = 2 << 20;

/// Memory a CPU rank's runtime takes from the C heap while it trains, outside the tensors:
/// [`HEAP_BYTES`] and its share of [`HEAP_BATCH_BYTES`] for `cfg`'s micro-batch, and
/// [`ONEDNN_KERNEL_BYTES`] (with checkpointing [`ONEDNN_RECOMPUTE_BYTES`] more) where 16-bit
/// compute runs through oneDNN's AVX-512 kernels (without AVX-512 libtorch computes bf16
/// itself, and they do not exist). Nothing on CUDA.
pub fn runtime_heap_bytes(cfg: &EstimateConfig) -> i64 {
    if cfg.cuda {
        return 0;
    }
    let tokens = (cfg.micro_batch * cfg.seq_len).clamp(0, HEAP_FULL_TOKENS);
    let heap = HEAP_BYTES + HEAP_BATCH_BYTES * tokens / HEAP_FULL_TOKENS;
    let kernels = if cfg.precision != Precision::Fp32 && onednn_avx512() {
        ONEDNN_KERNEL_BYTES
            + if cfg.activation_checkpointing {
                ONEDNN_RECOMPUTE_BYTES
            } else {
                0
            }
    } else {
        0
    };
    heap + kernels
}

/// Whether this CPU has the AVX-512 subsets oneDNN's 16-bit kernels need (libtorch then
/// computes bf16 through oneDNN).
fn onednn_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One term of a rank's memory at its peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Term {
    /// What it is, e.g. `"activations kept"`.
    pub name: &'static str,
    /// Bytes.
    pub bytes: i64,
}

/// One unit's activations, with and without activation checkpointing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UnitActivations {
    /// Unit name.
    pub unit: String,
    /// What its forward keeps until its backward without checkpointing (output included).
    pub kept: i64,
    /// What it keeps with checkpointing (its output, the next unit's input).
    pub kept_checkpointed: i64,
}

/// A rank's predicted memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// The engine's model-state bytes and fixed buffers (what `Engine::memory` reports
    /// after construction).
    pub ledger: MemoryLedger,
    /// The predicted peak of the compute device (on CPU: everything this rank allocates).
    pub peak_bytes: i64,
    /// Where the peak falls, e.g. `"backward of unit head"`.
    pub phase: String,
    /// The terms that sum to `peak_bytes`.
    pub terms: Vec<Term>,
    /// Host memory held for the run with a CUDA device (offloaded optimizer, staging).
    pub host_bytes: i64,
    /// Every unit's activations at this micro-batch.
    pub units: Vec<UnitActivations>,
}

impl MemoryLedger {
    /// What [`Engine::new`] allocates for `layout`'s rank under `cfg`: the model states where
    /// they live and the fixed buffers (AdamW scratch, host gradient staging, the
    /// out-of-memory reserve of stages 2-3), computed without allocating.
    pub fn planned(layout: &ShardLayout, cfg: &EstimateConfig) -> MemoryLedger {
        let cfg = &cfg.resolved(layout);
        let mut m = MemoryLedger::plan(layout, cfg.stage, cfg.precision, cfg.reduce_dtype);
        if cfg.host_grads {
            m.grads = 0;
        }
        let reserve = oom_reserve(layout, cfg);
        let shard = layout.shard_numel();
        if cfg.offload == Offload::Cpu {
            let moments = match cfg.state_dtype {
                StateDtype::Fp32 => 8,
                StateDtype::Bf16 => 4,
            };
            // Pinned with CUDA, of exactly their size (`offload::buffers`).
            m.host = 4 * shard + moments * shard;
            (m.master, m.optimizer) = (0, 0);
            // The host reads the gradient shard in place only when it already is fp32 host
            // memory in shard order (stages 2-3 on CPU) and no delayed update reads it while
            // the next step accumulates; otherwise it stages a copy.
            let in_place = matches!(cfg.stage, Stage::Zero2 | Stage::Zero3)
                && !cfg.host_grads
                && !cfg.cuda
                && !cfg.offload_delay
                && cfg.reduce_dtype == ReduceDtype::Fp32;
            let (gb, _) = cfg.host_grad_bytes(layout);
            let grads = if in_place { 0 } else { gb * shard };
            // A delayed update keeps unit 0's gradient in a pair of buffers (`offload`).
            let spare = match layout.units.first() {
                Some(first) if cfg.offload_delay => gb * first.shard_len(),
                _ => 0,
            };
            let staging = if cfg.cuda && cfg.precision != Precision::Fp32 {
                cfg.precision.bytes() * shard
            } else {
                0
            };
            // A split delayed update: v on the device (bf16, counted as optimizer state on
            // it), and on the host v and the base where no staging buffer holds it.
            let split = if cfg.fresh() {
                m.optimizer = 2 * shard;
                2 * shard + if staging == 0 { 4 * shard } else { 0 }
            } else {
                0
            };
            m.buffers = grads + spare + staging + split + reserve;
        } else {
            let owned = if cfg.stage == Stage::Zero0 {
                layout.full_numel()
            } else {
                shard
            };
            m.buffers = AdamW::scratch_bytes_for(owned) + reserve;
        }
        m
    }
}

/// The device buffer kept for the stand-in collectives of a micro-step that ran out of
/// memory: the largest padded unit in the wider of the reduce dtype and (stage 3) the
/// compute dtype; nothing at stages 0-1.
fn oom_reserve(layout: &ShardLayout, cfg: &EstimateConfig) -> i64 {
    crate::recover::reserve_bytes(
        layout,
        cfg.stage,
        cfg.precision,
        cfg.reduce_dtype,
        cfg.oom_recovery,
    )
}

/// Running sum of one phase's terms, and the largest seen.
struct Walk {
    peak: i64,
    phase: String,
    terms: Vec<Term>,
}

impl Walk {
    fn at(&mut self, phase: impl FnOnce() -> String, terms: &[(&'static str, i64)]) {
        let sum: i64 = terms.iter().map(|t| t.1).sum();
        if sum > self.peak {
            self.peak = sum;
            self.phase = phase();
            self.terms = terms
                .iter()
                .filter(|t| t.1 != 0)
                .map(|&(name, bytes)| Term { name, bytes })
                .collect();
        }
    }
}

/// Each unit's activations for `b` sequences of `t` tokens; a chunked head's output is the
/// loss, its logits are never held.
fn unit_activations(model: &dyn Model, b: i64, t: i64, cfg: &EstimateConfig) -> Vec<Activations> {
    let elt = cfg.precision.bytes();
    let mut acts: Vec<Activations> = model
        .units()
        .iter()
        .map(|u| u.activations(b, t, elt))
        .collect();
    if let (true, Some(head)) = (cfg.loss_chunk > 0 || fused_loss(cfg), acts.last_mut()) {
        head.output = 0;
    }
    acts
}

/// Whether the full logits' loss is the fused one ([`zrun_models::fused_loss_on`]: CUDA,
/// bf16 or fp32).
fn fused_loss(cfg: &EstimateConfig) -> bool {
    cfg.loss_chunk == 0 && zrun_models::fused_loss_on(cfg.cuda, cfg.precision.kind())
}

/// The loss over `tokens` positions: chunked with the head's matmul, or on the full logits
/// (fused on CUDA, PyTorch's cross_entropy elsewhere).
fn loss_bytes(model: &dyn Model, tokens: i64, cfg: &EstimateConfig) -> LossBytes {
    let (v, elt) = (model.vocab_size(), cfg.precision.bytes());
    if cfg.loss_chunk > 0 {
        LossBytes::chunked(tokens, v, model.d_model(), elt, cfg.loss_chunk)
    } else if fused_loss(cfg) {
        LossBytes::fused(tokens, v, elt)
    } else {
        LossBytes::new(tokens, v, elt)
    }
}

/// Predicts the peak memory of `layout`'s rank training `model` under `cfg`. With a hybrid
/// layout ([`ShardLayout::hybrid`]) the model states are those of its shard group's size
/// (the all-reduce across the replica group runs in place on the gradient shards).
pub fn estimate(model: &dyn Model, layout: &ShardLayout, cfg: &EstimateConfig) -> Estimate {
    let cfg = &cfg.resolved(layout);
    let ledger = MemoryLedger::planned(layout, cfg);
    let units = model.units();
    let n = units.len();
    let elt = cfg.precision.bytes();
    let rb = cfg.reduce_dtype.kind().elt_size_in_bytes() as i64;
    let (b, t) = (cfg.micro_batch, cfg.seq_len);
    let acts = unit_activations(model, b, t, cfg);
    let loss = loss_bytes(model, b * t, cfg);
    let ckpt = cfg.activation_checkpointing;
    // A shard group of one gathers nothing and reduce-scatters in place (`Mover::gathers`).
    let gathers = cfg.stage == Stage::Zero3 && layout.world_size > 1;
    let sharded_grads = matches!(cfg.stage, Stage::Zero2 | Stage::Zero3);

    // Held for the whole run: the model states on the device, and on CPU the host's too.
    // With offload the fixed buffers are host staging, except the out-of-memory reserve.
    let host_buffers = if cfg.offload == Offload::Cpu {
        ledger.buffers - oom_reserve(layout, cfg)
    } else {
        0
    };
    let host = ledger.host + host_buffers;
    let device_buffers = ledger.buffers - host_buffers;
    let host_on_device = if cfg.cuda { 0 } else { host };
    let states = ledger.device_model_states() + device_buffers + host_on_device;
    let heap = runtime_heap_bytes(cfg);
    let batch = 2 * 8 * b * t; // token ids and targets, int64

    let gathered = |first: usize, rev: bool| -> i64 {
        if !gathers {
            return 0;
        }
        (0..=cfg.prefetch)
            .filter_map(|k| {
                if rev {
                    first.checked_sub(k)
                } else {
                    Some(first + k)
                }
            })
            .filter(|&v| v < n)
            .map(|v| layout.units[v].padded * elt)
            .sum()
    };
    // A unit reading a tied parameter (a head reading the embedding) has its owner gathered
    // again at stage 3, and makes that parameter's gradient too.
    let tied_gathered = |u: usize| -> i64 {
        match units[u].tied() {
            Some(t) if gathers => layout.units[t.unit].padded * elt,
            _ => 0,
        }
    };
    let tied_grad = |u: usize| -> i64 {
        units[u]
            .tied()
            .map_or(0, |t| layout.units[t.unit].views[t.param].numel * elt)
    };
    // A rank alone lays gradients straight into its shards.
    let reduce = |u: usize| -> i64 {
        if layout.single_rank() {
            return 0;
        }
        let l = &layout.units[u];
        let shard = if layout.world_size > 1 {
            l.shard_len()
        } else {
            0
        };
        (l.padded + shard) * rb
    };
    // Gradients on the host only: a rank alone makes each unit's in a buffer of its own,
    // which the copy to the host reads (with CUDA through a cast of it on the device where
    // it is narrower than the host's); a tied parameter's part waits from its reader's
    // backward to its owner's.
    let (host_b, held_b) = cfg.host_grad_bytes(layout);
    // Offloaded at stages 2-3, each unit's final gradient is copied to the host during the
    // backward (the trainer announces the last micro-step; not with "shrink", whose copies
    // wait for the step), from CUDA through a cast on the device where the device's dtype is
    // narrower than the host's.
    let offloaded = cfg.offload == Offload::Cpu;
    let cast = offloaded && cfg.cuda && held_b != host_b;
    let staged_in_backward = sharded_grads && (cfg.host_grads || !cfg.oom_recovery);
    let host_cast = |u: usize| -> i64 {
        if cast && staged_in_backward {
            layout.units[u].shard_len() * host_b
        } else {
            0
        }
    };
    let unit_grad = |u: usize| -> i64 {
        let own = if cfg.host_grads && layout.single_rank() {
            layout.units[u].shard_len() * held_b
        } else {
            0
        };
        own + host_cast(u)
    };
    // The tied parts held at unit u's backward (`made`: its own gradient is made too).
    let tied_held = |u: usize, made: bool| -> i64 {
        if !cfg.host_grads {
            return 0;
        }
        (0..n)
            .filter_map(|r| units[r].tied().map(|t| (r, t.unit)))
            .filter(|&(r, t)| {
                let waiting = t < u && (u < r || (made && u == r));
                // Over several ranks the owner's shard is added into the part.
                waiting || (made && t == u && !layout.single_rank())
            })
            .map(|(_, t)| layout.units[t].shard_len() * held_b)
            .sum()
    };
    // What a unit's forward keeps until its backward.
    let kept = |u: usize| -> i64 {
        if ckpt {
            acts[u].output
        } else {
            acts[u].saved + acts[u].output
        }
    };
    let name = |u: usize| units[u].name().to_string();

    let mut walk = Walk {
        peak: 0,
        phase: String::new(),
        terms: Vec::new(),
    };
    // Forward, unit by unit.
    let mut before = 0; // kept by the units before u
    for (u, a) in acts.iter().enumerate() {
        let temp = if ckpt { a.no_grad_temp } else { a.forward_temp };
        walk.at(
            || format!("forward of unit {}", name(u)),
            &[
                ("model states", states),
                ("allocator heap", heap),
                ("batch", batch),
                ("activations kept", before + kept(u)),
                ("forward temporaries", temp),
                ("gathered parameters", gathered(u, false) + tied_gathered(u)),
            ],
        );
        before += kept(u);
    }
    // The loss: with checkpointing it runs without autograd (only its value is needed).
    walk.at(
        || "loss".to_string(),
        &[
            ("model states", states),
            ("allocator heap", heap),
            ("batch", batch),
            ("activations kept", before),
            ("loss temporaries", loss.forward_temp + loss.saved),
        ],
    );
    // Backward, in reverse. Unit u holds its graph (recomputed first with checkpointing);
    // the head's logits were dropped before the backward unless they are recomputed (the
    // loss kept the log-probabilities it needs); a unit's activations go with its backward.
    let mut below = before;
    let mut upstream = 0;
    for u in (0..n).rev() {
        let a = acts[u];
        below -= kept(u);
        let head = u == n - 1;
        let own = a.saved + if head && !ckpt { 0 } else { a.output };
        let loss_bytes = if head {
            loss.saved + loss.backward_temp
        } else {
            0
        };
        let param_grads = layout.units[u].numel * elt + tied_grad(u);
        let in_flight = if sharded_grads && u + 1 < n {
            reduce(u + 1)
        } else {
            0
        };
        walk.at(
            || format!("backward of unit {}", name(u)),
            &[
                ("model states", states),
                ("allocator heap", heap),
                ("batch", batch),
                ("activations kept", below + own),
                ("loss temporaries", loss_bytes),
                ("upstream gradient", upstream),
                ("backward temporaries", a.backward_temp),
                ("parameter gradients", param_grads),
                ("gathered parameters", gathered(u, true) + tied_gathered(u)),
                ("gradient reduction", in_flight),
                ("tied gradient held", tied_held(u, false)),
            ],
        );
        // Absorbing the unit's gradients: at stages 2-3 a flat buffer in the reduce dtype
        // is laid out while the previous unit's reduction may still be in flight.
        upstream = if u > 0 { acts[u - 1].output } else { 0 };
        if sharded_grads {
            walk.at(
                || format!("gradient reduction of unit {}", name(u)),
                &[
                    ("model states", states),
                    ("allocator heap", heap),
                    ("batch", batch),
                    ("activations kept", below),
                    ("upstream gradient", upstream),
                    ("parameter gradients", param_grads),
                    ("gradient reduction", reduce(u) + in_flight),
                    ("unit gradient", unit_grad(u)),
                    ("tied gradient held", tied_held(u, true)),
                ],
            );
        }
    }
    // The optimizer step: stage 1 reduces every unit at once, stages 1-2 gather the new
    // parameters through private copies of the owned slices (a shard group of one does
    // neither: its owned slices are the full buffers).
    let shard = layout.shard_numel();
    let step_buffers = match cfg.stage {
        _ if layout.world_size == 1 => 0,
        Stage::Zero0 | Stage::Zero3 => 0,
        Stage::Zero1 => shard * rb + shard * elt,
        Stage::Zero2 => shard * elt,
    };
    // The gradient norm: on CUDA, libtorch squares chunks of up to 2^20 owned elements in
    // fp64 (8 bytes, and 8 more for the square); on CPU it reads the gradients in place.
    let owned_piece = match cfg.stage {
        Stage::Zero0 => layout.full_numel(),
        Stage::Zero1 => layout
            .units
            .iter()
            .map(|l| l.shard_len())
            .max()
            .unwrap_or(0),
        Stage::Zero2 | Stage::Zero3 => shard,
    };
    let norm = if cfg.cuda {
        16 * owned_piece.min(1 << 20)
    } else {
        0
    };
    // Gradients staged for an offloaded update at the step go in pieces (stage 1's owned
    // slices, or stages 2-3's shard with "shrink"), each cast on the device as above.
    let staged_at_step = offloaded && !staged_in_backward && !cfg.host_grads;
    let step_cast = if cast && staged_at_step {
        host_b * owned_piece.min(crate::offload::STAGE_PIECE)
    } else {
        0
    };
    walk.at(
        || "optimizer step".to_string(),
        &[
            ("model states", states),
            ("allocator heap", heap),
            ("step buffers", step_buffers),
            ("gradient norm scratch", norm),
            ("host copy's cast", step_cast),
        ],
    );
    // Evaluation: a forward without autograd at the evaluation batch.
    let eb = cfg.eval_batch;
    let eval_loss = loss_bytes(model, eb * t, cfg);
    let eval_acts = unit_activations(model, eb, t, cfg);
    for (u, &a) in eval_acts.iter().enumerate() {
        let input = if u == 0 { 0 } else { eval_acts[u - 1].output };
        let tail = if u == n - 1 {
            eval_loss.forward_temp + eval_loss.saved
        } else {
            0
        };
        walk.at(
            || format!("evaluation, unit {}", name(u)),
            &[
                ("model states", states),
                ("allocator heap", heap),
                ("batch", 2 * 8 * eb * t),
                ("activations kept", input + a.output),
                ("forward temporaries", a.no_grad_temp + tail),
                ("gathered parameters", gathered(u, false) + tied_gathered(u)),
            ],
        );
    }
    Estimate {
        ledger,
        peak_bytes: walk.peak,
        phase: walk.phase,
        terms: walk.terms,
        host_bytes: if cfg.cuda { host } else { 0 },
        units: units
            .iter()
            .zip(&acts)
            .map(|(u, a)| UnitActivations {
                unit: u.name().to_string(),
                kept: a.saved + a.output,
                kept_checkpointed: a.output,
            })
            .collect(),
    }
}

impl Engine {
    /// The estimate's configuration for this engine at a micro-batch of `micro_batch`
    /// sequences of `seq_len` tokens.
    pub fn estimate_config(&self, micro_batch: i64, seq_len: i64) -> EstimateConfig {
        let c = self.config();
        EstimateConfig {
            stage: c.stage,
            precision: c.precision,
            reduce_dtype: c.reduce_dtype,
            offload: c.offload,
            state_dtype: c.optimizer_state_dtype,
            activation_checkpointing: c.activation_checkpointing,
            prefetch: c.prefetch,
            micro_batch,
            seq_len,
            eval_batch: micro_batch,
            oom_recovery: c.oom_recovery,
            one_micro_step: c.one_micro_step,
            offload_delay: c.offload_delay.is_some(),
            offload_delay_fresh: c.fresh(),
            cuda: c.device.is_cuda(),
            loss_chunk: c.loss_chunk,
            host_grads: self.host_grads,
            tied: self.model.units().iter().any(|u| u.tied().is_some()),
        }
    }
}
