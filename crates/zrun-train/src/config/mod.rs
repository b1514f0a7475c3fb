//! `train.toml`: typed sections, defaults, `--set` overrides and one-line errors.
//!
//! Every key is documented with its default in docs/config.md. Loading goes through a
//! `toml::Table` so that file values and `--set key=value` overrides are checked by the same
//! deserializer: an unknown key, a wrong type or an out-of-range value is one line naming the
//! file (or the override), the key, the value and what is allowed.

mod dist;
mod load;
mod model;
mod shard_group;

pub use dist::{BackendChoice, Capabilities, DeviceChoice, DeviceKind, DistConfig, ResolvedDist};
pub use load::{read_config, toml_error};
pub use model::{arch_from_hf, hf_config_path};
pub use shard_group::ShardGroup;

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use zrun_shard::{Offload, Precision, ReduceDtype, Stage, StateDtype};

/// A config that cannot be used: one line, naming where, which key and what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The whole training configuration.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[model]`: architecture.
    pub model: ModelConfig,
    /// `[data]`: where tokens come from.
    pub data: DataConfig,
    /// `[train]`: steps, batch, optimizer and schedule.
    pub train: TrainConfig,
    /// `[zero]`: sharding stage and precision.
    pub zero: ZeroConfig,
    /// `[dist]`: communication backend, device, timeouts.
    pub dist: DistConfig,
    /// `[checkpoint]`: where and how often to save.
    pub checkpoint: CheckpointConfig,
    /// `[log]`: metrics directory and cadence.
    pub log: LogConfig,
    /// What loading adjusted, as warnings for the run's log (not a config key).
    #[serde(skip)]
    pub notes: Vec<String>,
    /// Knobs the config leaves to the planner (`"auto"`), resolved when the run starts.
    #[serde(skip)]
    pub auto: Auto,
}

/// Config keys set to `"auto"`: `zero.stage`, `train.micro_batch` and `train.loss_chunk`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Auto {
    /// `zero.stage = "auto"`.
    pub stage: bool,
    /// `train.micro_batch = "auto"` (with `train.global_batch`).
    pub micro_batch: bool,
    /// `train.loss_chunk = "auto"` (the default): the full logits on a GPU where they are
    /// predicted to fit, else chunks ([`crate::loss_chunk::resolve_loss_chunk`]).
    pub loss_chunk: bool,
}

/// Model architecture family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2 style decoder.
    #[default]
    Gpt,
    /// Llama family: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.
    Llama,
}

/// `[model]`: a preset with any field overridden, or a Hugging Face directory.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Architecture family: gpt (default) or llama; taken from `init_from` when set.
    pub arch: Option<Arch>,
    /// Preset name: tiny, gpt2-small, ... for gpt; llama-tiny, llama3.2-1b, ... for llama.
    pub preset: Option<String>,
    /// A Hugging Face model directory (`config.json`, `model.safetensors` or a sharded
    /// index): the architecture and the initial weights come from it.
    pub init_from: Option<PathBuf>,
    /// Overrides the preset's vocabulary size.
    pub vocab_size: Option<i64>,
    /// Overrides the preset's sequence length (tokens per sample).
    pub seq_len: Option<i64>,
    /// Overrides the number of transformer blocks.
    pub n_layer: Option<i64>,
    /// Overrides the number of attention heads.
    pub n_head: Option<i64>,
    /// Overrides the model width.
    pub d_model: Option<i64>,
    /// Overrides the init standard deviation.
    pub init_std: Option<f64>,
    /// Llama: key/value heads (grouped-query attention).
    pub n_kv_head: Option<i64>,
    /// Llama: width of one attention head.
    pub head_dim: Option<i64>,
    /// Llama: hidden width of the SwiGLU MLP.
    pub ffn_hidden: Option<i64>,
    /// Llama: base of the rotary embeddings.
    pub rope_theta: Option<f64>,
    /// Whether the output head multiplies by the token embedding (one shared matrix).
    pub tie_embeddings: Option<bool>,
}

/// Where the data comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// Seeded sparse Markov chain with a known loss floor.
    #[default]
    Synthetic,
    /// Token files: llm.c's header (uint16 or uint32) or headerless uint16 (nanoGPT `.bin`).
    Tokens,
    /// UTF-8 text as byte tokens, or encoded by `data.tokenizer`.
    Text,
}

/// `[data]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// synthetic, tokens or text.
    pub source: DataKind,
    /// File or directory for tokens and text (relative to the working directory).
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` that encodes `data.source = "text"` (absent: bytes).
    pub tokenizer: Option<PathBuf>,
    /// Synthetic: successors per state of the Markov chain.
    pub branching: usize,
    /// Share of windows held out for eval when there is no `val.bin`.
    pub eval_fraction: f64,
    /// Seed of the synthetic chain and of the sample order.
    pub seed: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: DataKind::Synthetic,
            path: None,
            tokenizer: None,
            branching: 4,
            eval_fraction: 0.05,
            seed: 0,
        }
    }
}

/// `[train]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Sequences per rank per micro-step.
    pub micro_batch: usize,
    /// Micro-steps per optimizer step.
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay (default lr / 10).
    pub min_lr: Option<f64>,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// Decoupled weight decay on matrices.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Global gradient-norm clip (0 = off).
    pub grad_clip: f64,
    /// Evaluate every N steps (0 = only at the end).
    pub eval_every: u64,
    /// Micro-batches per rank in one evaluation.
    pub eval_batches: usize,
    /// Seed of the parameter init.
    pub seed: u64,
    /// Intra-op threads per rank (0 = OMP_NUM_THREADS, else this rank's share of the cores).
    pub threads: usize,
    /// Sequences per optimizer step over all ranks; needed by `micro_batch = "auto"`, which
    /// then picks micro_batch and grad_accum (micro_batch x grad_accum x ranks = this).
    pub global_batch: Option<usize>,
    /// What an out-of-memory does: "stop" (exit code 4 with a diagnosis) or "shrink" (every
    /// rank drops the step, halves the micro-batch, doubles grad_accum and retries).
    pub on_oom: OnOom,
    /// Logits (positions x vocabulary entries) per chunk of the head's matmul and the loss,
    /// which then never hold the whole logits (B, T, V); 0 computes all logits at once.
    /// `"auto"` (the default, [`Auto::loss_chunk`]) holds the chunked value until resolved.
    pub loss_chunk: u64,
}

impl TrainConfig {
    /// `loss_chunk` as the engine takes it.
    pub fn loss_chunk(&self) -> i64 {
        i64::try_from(self.loss_chunk).unwrap_or(i64::MAX)
    }
}

/// `train.on_oom`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnOom {
    /// Stop with exit code 4 and a diagnosis.
    #[default]
    Stop,
    /// Drop the step, halve the micro-batch (the global batch stays), retry the same samples.
    Shrink,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 100,
            micro_batch: 8,
            grad_accum: 1,
            lr: 3e-4,
            min_lr: None,
            warmup_steps: 0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            eval_every: 0,
            eval_batches: 4,
            seed: 1234,
            threads: 0,
            global_batch: None,
            on_oom: OnOom::Stop,
            loss_chunk: zrun_models::LOSS_CHUNK as u64,
        }
    }
}

/// `[zero]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroConfig {
    /// ZeRO stage 0-3.
    pub stage: Stage,
    /// fp32, bf16 or fp16.
    pub precision: Precision,
    /// dtype gradients are reduced and accumulated in: fp32 or bf16.
    pub reduce_dtype: ReduceDtype,
    /// Keep only unit inputs and recompute each unit's forward in its backward.
    pub activation_checkpointing: bool,
    /// Stage 3: units gathered ahead of the one computing.
    pub prefetch: usize,
    /// fp16: the first loss scale.
    pub initial_loss_scale: f64,
    /// fp16: clean steps before the loss scale doubles.
    pub loss_scale_window: u64,
    /// Where the fp32 master and AdamW state live: none (device) or cpu (host memory).
    pub offload_optimizer: Offload,
    /// dtype of the offloaded AdamW moments: fp32 or bf16.
    pub optimizer_state_dtype: StateDtype,
    /// ZeRO-Offload's delayed parameter update: 1 applies each CPU AdamW update one step
    /// late, overlapping the next step's forward and backward; 0 (default) off.
    pub offload_delay: u64,
    /// Updates applied without the delay before it switches on; unset: the larger of 10
    /// and `train.warmup_steps` ([`Config::delay`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload_delay_warmup: Option<u64>,
    /// Splits each delayed update (`offload_delay = 1`; on by default): the device applies
    /// the newest gradient's share at once and the CPU the rest, so the next forward runs on
    /// nearly the undelayed model (zrun-shard's `fresh.rs`); costs the device its gradient
    /// shard and v (bf16) beside the parameters. Unset: on ([`Config::delay_fresh`]); set to
    /// true without the delay: refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload_delay_fresh: Option<bool>,
    /// Ranks one copy of the model states is sharded over (hybrid sharding): `"all"`
    /// (default), `"node"` or a divisor of the world size; replicated across the groups.
    pub shard_group: ShardGroup,
}

impl Config {
    /// Resolves `zero.shard_group` for a job of `world` ranks with `local` on each node and
    /// writes the group size back (`"all"` when it spans every rank), so that estimates made
    /// from this config later need no topology; the group size, or one line naming both
    /// numbers.
    pub fn resolve_shard_group(
        &mut self,
        world: usize,
        local: usize,
    ) -> Result<usize, ConfigError> {
        let g = self.zero.shard_group.resolve(world, local)?;
        self.zero.shard_group = if g == world {
            ShardGroup::All
        } else {
            ShardGroup::Ranks(g)
        };
        Ok(g)
    }

    /// The engine's delay setting: `Some(warm-up updates)` when `zero.offload_delay = 1`.
    /// Without `zero.offload_delay_warmup` the delay switches on once the learning rate has
    /// warmed up (`train.warmup_steps`), after 10 updates at least: a stale update hurts most
    /// while the learning rate still climbs (configs/tiny-cpu.toml, 200 steps with a 50-step
    /// warm-up: eval loss 1.4% above the undelayed run after 10 updates, 0.9% after 50).
    pub fn delay(&self) -> Option<u64> {
        let z = &self.zero;
        let warmup = z
            .offload_delay_warmup
            .unwrap_or(self.train.warmup_steps.max(10));
        (z.offload_delay > 0).then_some(warmup)
    }

    /// Whether updates are delayed and split (`zero.offload_delay_fresh`, on with the delay
    /// unless set false: in check K of 2026-11-29, benches/README.md, the plain delay
    /// stalled where the split did not).
    pub fn delay_fresh(&self) -> bool {
        self.delay().is_some() && self.zero.offload_delay_fresh.unwrap_or(true)
    }

    /// The shard group size for `world` ranks of this config once resolved (`"node"` not
    /// yet resolved counts as one node of `world` ranks).
    pub fn shard_group_size(&self, world: usize) -> Result<usize, ConfigError> {
        self.zero.shard_group.resolve(world, world)
    }
}

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig {
            stage: Stage::default(),
            precision: Precision::default(),
            reduce_dtype: ReduceDtype::default(),
            activation_checkpointing: false,
            prefetch: 1,
            initial_loss_scale: 65536.0,
            loss_scale_window: 1000,
            offload_optimizer: Offload::None,
            optimizer_state_dtype: StateDtype::Fp32,
            offload_delay: 0,
            offload_delay_warmup: None,
            offload_delay_fresh: None,
            shard_group: ShardGroup::All,
        }
    }
}

/// `[checkpoint]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Directory of checkpoints (default: `<log.dir>/ckpt`).
    pub dir: Option<PathBuf>,
    /// Save every N steps and at the end of the run (0 = only on a stop signal).
    pub every: u64,
    /// Complete checkpoints to keep, newest first (0 = all).
    pub keep: usize,
    /// `"auto"` (the newest complete checkpoint in `dir`, if any), `"none"`, or a path.
    pub resume: String,
    /// Snapshot the state to host memory and write it on a background thread.
    #[serde(rename = "async")]
    pub async_save: bool,
    /// Seconds between SIGTERM/SIGUSR1 and the end of the save it triggers; the launcher
    /// kills the ranks after it.
    pub signal_deadline_s: u64,
    /// What a resume does when the data order changed since the checkpoint (data source,
    /// path or its size, sequence length, seed, global batch).
    pub resume_changed: ResumeChanged,
}

/// `checkpoint.resume_changed`: whether a resume may change what decides the data order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResumeChanged {
    /// Stop with one line saying what changed (exit 2).
    #[default]
    Refuse,
    /// Say what changed and resume anyway.
    Allow,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            dir: None,
            every: 0,
            keep: 0,
            resume: "auto".into(),
            async_save: false,
            signal_deadline_s: 60,
            resume_changed: ResumeChanged::Refuse,
        }
    }
}

impl Config {
    /// The checkpoint directory: `checkpoint.dir`, else `<log.dir>/ckpt`.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint
            .dir
            .clone()
            .unwrap_or_else(|| self.log.dir.join("ckpt"))
    }
}

/// `[log]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Directory of metrics.jsonl and summary.json.
    pub dir: PathBuf,
    /// Log a metrics line every N steps.
    pub every: u64,
    /// Peak FLOP/s of one rank's device in TFLOP/s, for MFU (absent: no MFU).
    pub peak_tflops: Option<f64>,
    /// Record this step (1-based, 0: none) with libtorch's profiler: each rank writes
    /// `profile-rank{R}.json` (a Chrome trace) into `dir`.
    pub profile_step: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            dir: PathBuf::from("runs/default"),
            every: 10,
            peak_tflops: None,
            profile_step: 0,
        }
    }
}
