//! `train.toml`: typed sections, defaults, `--set` overrides and one-line errors.
//!
//! Every key is documented with its default in docs/config.md. Loading goes through a
//! `toml::Table` so that file values and `--set key=value` overrides are checked by the same
//! deserializer: an unknown key, a wrong type or an out-of-range value is one line naming the
//! file (or the override), the key, the value and what is allowed.

use serde::{Deserialize, Serialize};
use std::fmt::Display;
use std::path::{Path, PathBuf};
use zrun_models::GptConfig;
use zrun_shard::{Precision, ReduceDtype, Stage};

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
}

/// Model architecture family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2 style decoder.
    #[default]
    Gpt,
}

/// `[model]`: a preset, with any field overridden.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Architecture family.
    pub arch: Arch,
    /// Preset name: tiny, gpt2-small, gpt2-medium, gpt2-large, gpt2-xl.
    pub preset: String,
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
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: Arch::Gpt,
            preset: "tiny".into(),
            vocab_size: None,
            seq_len: None,
            n_layer: None,
            n_head: None,
            d_model: None,
            init_std: None,
        }
    }
}

/// Where the data comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// Seeded sparse Markov chain with a known loss floor.
    #[default]
    Synthetic,
    /// uint16 token files (nanoGPT `.bin`).
    Tokens,
    /// UTF-8 text as byte tokens.
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
        }
    }
}

/// Communication backend choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// nccl on GPUs, tcp on CPUs.
    #[default]
    Auto,
    /// Built-in TCP rings.
    Tcp,
    /// MPI (feature `mpi`, under mpirun).
    Mpi,
    /// NCCL (feature `cuda`).
    Nccl,
}

/// Device choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// CUDA when available, else CPU.
    #[default]
    Auto,
    /// CPU.
    Cpu,
    /// CUDA device LOCAL_RANK.
    Cuda,
}

/// `[dist]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// auto, tcp, mpi or nccl.
    pub backend: BackendChoice,
    /// auto, cpu or cuda.
    pub device: DeviceChoice,
    /// Deadline of every collective and of rendezvous, seconds.
    pub timeout_s: u64,
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            backend: BackendChoice::Auto,
            device: DeviceChoice::Auto,
            timeout_s: 600,
        }
    }
}

/// `[checkpoint]`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Directory of checkpoints (default: `<log.dir>/ckpt`).
    pub dir: Option<PathBuf>,
    /// Save every N steps (0 = never).
    pub every: u64,
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
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            dir: PathBuf::from("runs/default"),
            every: 10,
            peak_tflops: None,
        }
    }
}

impl Config {
    /// Reads `path`, applies `overrides` (`key.path=value`, value in TOML syntax or a bare
    /// string) and validates everything.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError(format!("config {file}: cannot read it ({e}); pass the path of a train.toml, e.g. configs/tiny-cpu.toml"))
        })?;
        let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let at = e
                .span()
                .map(|s| line_col(&text, s.start))
                .unwrap_or_default();
            ConfigError(format!(
                "config {file}{at}: invalid TOML: {}",
                one_line(e.message())
            ))
        })?;
        let mut set_keys = Vec::new();
        for o in overrides {
            set_keys.push(apply_override(&mut table, o)?);
        }
        let value = toml::Value::Table(table.clone());
        let cfg: Config = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            let source = source_of(&key, &file, &set_keys);
            let shown = lookup(&table, &key)
                .map(|v| format!(" = {v}"))
                .unwrap_or_default();
            ConfigError(format!(
                "{source}: {key}{shown}: {}",
                one_line(e.inner().message())
            ))
        })?;
        cfg.validate().map_err(|(key, value, allowed)| {
            let source = source_of(&key, &file, &set_keys);
            ConfigError(format!("{source}: {key} = {value}: {allowed}"))
        })?;
        Ok(cfg)
    }

    /// The preset with the `[model]` overrides applied, not yet validated (the preset name
    /// is checked by `load`).
    fn resolve_gpt(&self) -> GptConfig {
        let m = &self.model;
        let mut g = GptConfig::preset(&m.preset)
            .unwrap_or_else(|_| GptConfig::preset("tiny").expect("tiny exists"));
        g.vocab_size = m.vocab_size.unwrap_or(g.vocab_size);
        g.seq_len = m.seq_len.unwrap_or(g.seq_len);
        g.n_layer = m.n_layer.unwrap_or(g.n_layer);
        g.n_head = m.n_head.unwrap_or(g.n_head);
        g.d_model = m.d_model.unwrap_or(g.d_model);
        g.init_std = m.init_std.unwrap_or(g.init_std);
        g
    }

    /// The model architecture this config asks for.
    pub fn gpt(&self) -> Result<GptConfig, ConfigError> {
        let preset = &self.model.preset;
        GptConfig::preset(preset)
            .map_err(|e| ConfigError(format!("model.preset = {preset:?}: {e}")))?;
        let g = self.resolve_gpt();
        g.validate()
            .map_err(|e| ConfigError(format!("[model]: {e}")))?;
        Ok(g)
    }

    /// The final learning rate of the cosine decay.
    pub fn min_lr(&self) -> f64 {
        self.train.min_lr.unwrap_or(self.train.lr / 10.0)
    }

    /// Range checks; the error is (key, value, what is allowed).
    fn validate(&self) -> Result<(), (String, String, String)> {
        let t = &self.train;
        let d = &self.data;
        fn bad<T: Display>(key: &str, v: T, allowed: &str) -> Result<(), (String, String, String)> {
            Err((key.to_string(), v.to_string(), allowed.to_string()))
        }
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        if !GptConfig::PRESETS.contains(&self.model.preset.as_str()) {
            let allowed = format!("allowed presets: {}", GptConfig::PRESETS.join(", "));
            return bad("model.preset", format!("{:?}", self.model.preset), &allowed);
        }
        let m = &self.model;
        for (key, v) in [
            ("model.vocab_size", m.vocab_size),
            ("model.seq_len", m.seq_len),
            ("model.n_layer", m.n_layer),
            ("model.n_head", m.n_head),
            ("model.d_model", m.d_model),
        ] {
            if let Some(v) = v.filter(|&v| v <= 0) {
                return bad(key, v, "must be at least 1");
            }
        }
        if let Some(s) = m.init_std.filter(|&s| !finite_pos(s)) {
            return bad("model.init_std", s, "must be a finite number > 0");
        }
        let g = self.resolve_gpt();
        if g.d_model % g.n_head != 0 {
            let allowed = format!(
                "model.d_model ({}) must be a multiple of model.n_head",
                g.d_model
            );
            return bad("model.n_head", g.n_head, &allowed);
        }
        if let Err(zrun_models::Error::InvalidConfig {
            field,
            value,
            reason,
        }) = g.validate()
        {
            return bad(&format!("model.{field}"), value, &reason);
        }
        if t.steps == 0 {
            return bad("train.steps", t.steps, "must be at least 1");
        }
        if t.micro_batch == 0 {
            return bad("train.micro_batch", t.micro_batch, "must be at least 1");
        }
        if t.grad_accum == 0 {
            return bad("train.grad_accum", t.grad_accum, "must be at least 1");
        }
        if !finite_pos(t.lr) {
            return bad("train.lr", t.lr, "must be a finite number > 0");
        }
        if let Some(m) = t.min_lr {
            if !(m.is_finite() && (0.0..=t.lr).contains(&m)) {
                return bad("train.min_lr", m, "must be between 0 and train.lr");
            }
        }
        if t.warmup_steps > t.steps {
            return bad(
                "train.warmup_steps",
                t.warmup_steps,
                "must be at most train.steps",
            );
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return bad("train.weight_decay", t.weight_decay, "must be >= 0");
        }
        for (key, b) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(key, b, "must be in [0, 1)");
            }
        }
        if !finite_pos(t.eps) {
            return bad("train.eps", t.eps, "must be a finite number > 0");
        }
        if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
            return bad(
                "train.grad_clip",
                t.grad_clip,
                "must be >= 0 (0 turns clipping off)",
            );
        }
        if t.eval_batches == 0 {
            return bad("train.eval_batches", t.eval_batches, "must be at least 1");
        }
        match (d.source, &d.path) {
            (DataKind::Tokens | DataKind::Text, None) => {
                return bad(
                    "data.path",
                    "(missing)",
                    "required when data.source is \"tokens\" or \"text\"",
                );
            }
            (DataKind::Synthetic, Some(p)) => {
                return bad(
                    "data.path",
                    p.display(),
                    "not used by data.source = \"synthetic\"; remove it",
                );
            }
            _ => {}
        }
        if d.branching == 0 || d.branching as i64 >= g.vocab_size {
            return bad(
                "data.branching",
                d.branching,
                "must be at least 1 and below model.vocab_size",
            );
        }
        if !(d.eval_fraction > 0.0 && d.eval_fraction <= 0.5) {
            return bad("data.eval_fraction", d.eval_fraction, "must be in (0, 0.5]");
        }
        let z = &self.zero;
        if z.precision == Precision::Fp32 && z.reduce_dtype != ReduceDtype::Fp32 {
            return bad(
                "zero.reduce_dtype",
                z.reduce_dtype,
                "must be \"fp32\" when zero.precision is \"fp32\"",
            );
        }
        if !(z.initial_loss_scale.is_finite() && z.initial_loss_scale >= 1.0) {
            return bad(
                "zero.initial_loss_scale",
                z.initial_loss_scale,
                "must be a finite number >= 1",
            );
        }
        if z.loss_scale_window == 0 {
            return bad("zero.loss_scale_window", 0, "must be at least 1");
        }
        if z.prefetch > 8 {
            return bad("zero.prefetch", z.prefetch, "must be between 0 and 8 units");
        }
        if self.dist.timeout_s == 0 {
            return bad("dist.timeout_s", 0, "must be at least 1 second");
        }
        if self.checkpoint.every != 0 {
            return bad(
                "checkpoint.every",
                self.checkpoint.every,
                "writing checkpoints is not available in this version; set 0",
            );
        }
        if let Some(p) = self.log.peak_tflops.filter(|&p| !finite_pos(p)) {
            return bad(
                "log.peak_tflops",
                p,
                "must be a finite number > 0 (TFLOP/s of one rank)",
            );
        }
        if self.log.every == 0 {
            return bad("log.every", 0, "must be at least 1");
        }
        Ok(())
    }
}

/// Applies `key.path=value` to the table; returns the key.
fn apply_override(table: &mut toml::Table, o: &str) -> Result<String, ConfigError> {
    let (key, raw) = o
        .split_once('=')
        .filter(|(k, _)| !k.trim().is_empty())
        .ok_or_else(|| {
            ConfigError(format!(
                "--set {o}: expected key=value, e.g. --set train.steps=50"
            ))
        })?;
    let key = key.trim().to_string();
    let raw = raw.trim();
    // A TOML value if it parses as one (50, 1e-3, true, "x", [1, 2]), else a bare string.
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let parts: Vec<&str> = key.split('.').collect();
    let mut at = table;
    for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
        let entry = at
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = entry.as_table_mut().ok_or_else(|| {
            ConfigError(format!(
                "--set {o}: `{}` is a value, not a section",
                parts[..=i].join(".")
            ))
        })?;
    }
    at.insert(parts[parts.len() - 1].to_string(), value);
    Ok(key)
}

/// "--set k=..." when the key (or a parent) came from an override, else the file.
fn source_of(key: &str, file: &str, set_keys: &[String]) -> String {
    match set_keys
        .iter()
        .rev()
        .find(|k| key == k.as_str() || key.starts_with(&format!("{k}.")))
    {
        Some(k) => format!("--set {k}"),
        None => format!("config {file}"),
    }
}

/// The value at a dotted key, for error messages.
fn lookup<'a>(table: &'a toml::Table, key: &str) -> Option<&'a toml::Value> {
    let mut parts = key.split('.');
    let mut v = table.get(parts.next()?)?;
    for p in parts {
        v = v.as_table()?.get(p)?;
    }
    Some(v)
}

fn line_col(text: &str, at: usize) -> String {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    format!(":{line}:{col}")
}

/// A possibly multi-line message as one line.
fn one_line(msg: &str) -> String {
    msg.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}
