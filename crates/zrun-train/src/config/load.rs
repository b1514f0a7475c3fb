//! Loading `train.toml`: `--set` overrides, one-line errors and range checks.

use super::{Config, ConfigError, DataKind};
use std::fmt::Display;
use std::path::Path;
use zrun_shard::{Offload, Precision, ReduceDtype, Stage, StateDtype};

/// Replaces `zero.stage = "auto"`, `train.micro_batch = "auto"` and `train.loss_chunk =
/// "auto"` with placeholders (0, 1 and the chunked default) and says which were there: the
/// planner sets them when the run starts. An absent `train.loss_chunk` is `"auto"`.
fn take_auto(table: &mut toml::Table) -> super::Auto {
    let loss_chunk_set = table
        .get("train")
        .and_then(|t| t.as_table())
        .is_some_and(|t| t.contains_key("loss_chunk"));
    let mut take = |section: &str, key: &str, placeholder: i64| {
        let slot = table
            .get_mut(section)
            .and_then(|t| t.as_table_mut())
            .and_then(|t| t.get_mut(key));
        match slot {
            Some(v) if v.as_str() == Some("auto") => {
                *v = toml::Value::Integer(placeholder);
                true
            }
            _ => false,
        }
    };
    super::Auto {
        stage: take("zero", "stage", 0),
        micro_batch: take("train", "micro_batch", 1),
        loss_chunk: take("train", "loss_chunk", zrun_models::LOSS_CHUNK) || !loss_chunk_set,
    }
}

impl Config {
    /// Refuses a `train.global_batch` that `world` ranks cannot train at: with `micro_batch =
    /// "auto"` one that is not a positive multiple of the ranks; with a fixed micro-batch one
    /// other than `micro_batch x grad_accum x world` (it would be ignored without a word).
    pub fn check_global_batch(&self, world: usize) -> Result<(), ConfigError> {
        let t = &self.train;
        let (Some(global), world) = (t.global_batch, world.max(1)) else {
            return Ok(());
        };
        if self.auto.micro_batch {
            if global == 0 || !global.is_multiple_of(world) {
                return Err(ConfigError(format!(
                    "train.global_batch = {global} must be a positive multiple of the {world} ranks for train.micro_batch = \"auto\""
                )));
            }
            return Ok(());
        }
        let have = t.micro_batch * t.grad_accum * world;
        if global == have {
            return Ok(());
        }
        let per = t.micro_batch * world;
        let fix = if global > 0 && global.is_multiple_of(per) {
            format!("set train.grad_accum = {}", global / per)
        } else {
            "set train.micro_batch = \"auto\" to have the micro-batch chosen for it".to_string()
        };
        Err(ConfigError(format!(
            "train.global_batch = {global}, but train.micro_batch {} x train.grad_accum {} x {world} rank(s) is {have} sequences a step: {fix}, or remove train.global_batch",
            t.micro_batch, t.grad_accum
        )))
    }

    /// Reads `path`, applies `overrides` (`key.path=value`, value in TOML syntax or a bare
    /// string) and validates everything.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = read_config(path).map_err(|e| {
            ConfigError(format!("config {file}: cannot read it ({e}); pass the path of a train.toml, e.g. configs/tiny-cpu.toml"))
        })?;
        let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let at = e
                .span()
                .map(|s| format!(":{}", line_col(&text, s.start)))
                .unwrap_or_default();
            ConfigError(format!(
                "config {file}{at}: invalid TOML: {}",
                one_line(e.message())
            ))
        })?;
        let from_file = table.clone();
        let mut set_keys = Vec::new();
        for o in overrides {
            set_keys.push(apply_override(&mut table, o)?);
        }
        let auto = take_auto(&mut table);
        let value = toml::Value::Table(table.clone());
        let cfg: Config = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            let source = source_of(&key, &file, &set_keys, &from_file);
            let shown = lookup(&table, &key)
                .map(|v| format!(" = {}", clip(&v.to_string())))
                .unwrap_or_default();
            ConfigError(format!(
                "{source}: {key}{shown}: {}",
                one_line(e.inner().message())
            ))
        })?;
        let mut cfg = cfg;
        cfg.auto = auto;
        if auto.micro_batch && cfg.train.global_batch.is_none() {
            return Err(ConfigError(format!(
                "{file}: train.micro_batch = \"auto\" needs train.global_batch (sequences per optimizer step over all ranks), e.g. train.global_batch = 64"
            )));
        }
        let t = &mut cfg.train;
        if t.warmup_steps > t.steps {
            // A short trial run of a long config: the warmup fits the run instead.
            cfg.notes.push(format!(
                "train.warmup_steps = {} is more than train.steps = {}: the warmup is shortened to {} steps",
                t.warmup_steps, t.steps, t.steps
            ));
            t.warmup_steps = t.steps;
        }
        cfg.validate().map_err(|(key, value, allowed)| {
            let source = source_of(&key, &file, &set_keys, &from_file);
            ConfigError(format!("{source}: {key} = {}: {allowed}", clip(&value)))
        })?;
        Ok(cfg)
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
        let arch = self.resolve_arch()?;
        if t.steps == 0 {
            return bad("train.steps", t.steps, "must be at least 1");
        }
        // Upper bounds far past any real run keep the batch and memory arithmetic in range and
        // a typo from starting a hundred thousand threads.
        if !(1..=1 << 20).contains(&t.micro_batch) {
            return bad("train.micro_batch", t.micro_batch, "must be 1 to 1048576");
        }
        if !(1..=1 << 20).contains(&t.grad_accum) {
            return bad("train.grad_accum", t.grad_accum, "must be 1 to 1048576");
        }
        if t.threads > 1024 {
            return bad(
                "train.threads",
                t.threads,
                "must be 0 (the rank's share of the cores) to 1024",
            );
        }
        if !finite_pos(t.lr) {
            return bad("train.lr", t.lr, "must be a finite number > 0");
        }
        if let Some(m) = t.min_lr {
            if !(m.is_finite() && (0.0..=t.lr).contains(&m)) {
                return bad("train.min_lr", m, "must be between 0 and train.lr");
            }
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return bad("train.weight_decay", t.weight_decay, "must be >= 0");
        }
        for (key, b) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(key, b, "must be in [0, 1)");
            }
        }
        // AdamW runs in fp32: an eps below its smallest normal number is 0 or denormal there.
        if !finite_pos(t.eps) || t.eps < f64::from(f32::MIN_POSITIVE) {
            return bad(
                "train.eps",
                format!("{:e}", t.eps),
                "must be a finite number >= 1.2e-38 (fp32's smallest normal number; 1e-8 is usual)",
            );
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
        if let (Some(p), DataKind::Synthetic) = (&d.tokenizer, d.source) {
            return bad(
                "data.tokenizer",
                p.display(),
                "not used by data.source = \"synthetic\"; remove it, or encode text with it \
                 (data.source = \"text\")",
            );
        }
        // The Markov chain's successors: a setting of the synthetic source only.
        let synthetic = matches!(d.source, DataKind::Synthetic);
        if synthetic && (d.branching == 0 || d.branching as i64 >= arch.vocab_size()) {
            return bad(
                "data.branching",
                d.branching,
                "must be at least 1 and below model.vocab_size",
            );
        }
        if !(d.eval_fraction > 0.0 && d.eval_fraction <= 0.5) {
            return bad("data.eval_fraction", d.eval_fraction, "must be in (0, 0.5]");
        }
        if let Some(l) = &self.dist.memory_limit {
            if let Err(e) = crate::memory::parse_bytes(l) {
                return bad("dist.memory_limit", format!("{l:?}"), &e);
            }
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
        if z.offload_optimizer == Offload::Cpu && z.stage == Stage::Zero0 {
            return bad(
                "zero.offload_optimizer",
                "\"cpu\"",
                "needs a sharded optimizer: set zero.stage to 1, 2 or 3",
            );
        }
        if z.optimizer_state_dtype == StateDtype::Bf16 && z.offload_optimizer != Offload::Cpu {
            return bad(
                "zero.optimizer_state_dtype",
                "\"bf16\"",
                "bf16 moments are kept by the CPU AdamW only: set zero.offload_optimizer = \"cpu\"",
            );
        }
        if z.offload_delay > 1 {
            return bad(
                "zero.offload_delay",
                z.offload_delay,
                "must be 0 (off) or 1 (each update applied one step late)",
            );
        }
        if z.offload_delay == 1 && z.offload_optimizer != Offload::Cpu {
            return bad(
                "zero.offload_delay",
                1,
                "delays the CPU AdamW's update: set zero.offload_optimizer = \"cpu\", or zero.offload_delay = 0",
            );
        }
        if z.offload_delay_fresh == Some(true) && z.offload_delay == 0 {
            return bad(
                "zero.offload_delay_fresh",
                true,
                "splits the delayed update: set zero.offload_delay = 1, or leave zero.offload_delay_fresh out",
            );
        }
        if z.offload_delay == 1 && self.train.on_oom == super::OnOom::Shrink {
            return bad(
                "zero.offload_delay",
                1,
                "is not supported with train.on_oom = \"shrink\": set train.on_oom = \"stop\", or zero.offload_delay = 0",
            );
        }
        if z.loss_scale_window == 0 {
            return bad("zero.loss_scale_window", 0, "must be at least 1");
        }
        if z.prefetch > 8 {
            return bad("zero.prefetch", z.prefetch, "must be between 0 and 8 units");
        }
        // A year at most: longer deadlines overflow the clock when added to it.
        let most = zrun_comm::MAX_TIMEOUT_S;
        if !(1..=most).contains(&self.dist.timeout_s) {
            let allowed = format!("must be 1 to {most} seconds (a year)");
            return bad("dist.timeout_s", self.dist.timeout_s, &allowed);
        }
        if self.checkpoint.resume.trim().is_empty() {
            return bad(
                "checkpoint.resume",
                "\"\"",
                "give \"auto\", \"none\" or the path of a checkpoint directory",
            );
        }
        if !(1..=most).contains(&self.checkpoint.signal_deadline_s) {
            let allowed = format!("must be 1 to {most} seconds (a year)");
            return bad(
                "checkpoint.signal_deadline_s",
                self.checkpoint.signal_deadline_s,
                &allowed,
            );
        }
        if let Some(p) = self.log.peak_tflops.filter(|&p| !finite_pos(p)) {
            return bad(
                "log.peak_tflops",
                p,
                "must be a finite number > 0 (TFLOP/s of one rank)",
            );
        }
        if self.log.dir.as_os_str().is_empty() {
            return bad(
                "log.dir",
                "\"\"",
                "must name a directory (runs/NAME; \".\" for the current one)",
            );
        }
        if self.log.every == 0 {
            return bad("log.every", 0, "must be at least 1");
        }
        if self.log.profile_step > self.train.steps {
            return bad(
                "log.profile_step",
                self.log.profile_step,
                &format!(
                    "is past train.steps = {}: no step would be profiled (0 turns it off)",
                    self.train.steps
                ),
            );
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
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.trim().is_empty() || p.trim() != *p) {
        return Err(ConfigError(format!(
            "--set {o}: `{key}` is not a key: keys are section.name without spaces or empty parts, e.g. --set train.steps=50"
        )));
    }
    // A TOML value if it parses as one (50, 1e-3, true, "x", [1, 2]), else a bare string;
    // digits alone that do not parse are an integer out of TOML's range, not a string.
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").expect("parsed from `v = ...`"),
        Err(_) if is_integer_literal(raw) => {
            return Err(ConfigError(format!(
                "--set {o}: {raw} is out of range: integers are at most 9223372036854775807"
            )))
        }
        Err(_) => toml::Value::String(raw.to_string()),
    };
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
    let last = parts[parts.len() - 1].to_string();
    match (at.get_mut(&last), value) {
        // A table given for a table sets the keys it names and keeps the others, as a key
        // at a time would: `--set 'train={steps=2}'` is `--set train.steps=2`.
        (Some(toml::Value::Table(old)), toml::Value::Table(new)) => merge(old, new),
        (_, value) => {
            at.insert(last, value);
        }
    }
    Ok(key)
}

/// Sets every key of `new` in `old`, tables within tables key by key.
fn merge(old: &mut toml::Table, new: toml::Table) {
    for (k, v) in new {
        match (old.get_mut(&k), v) {
            (Some(toml::Value::Table(o)), toml::Value::Table(n)) => merge(o, n),
            (_, v) => {
                old.insert(k, v);
            }
        }
    }
}

/// Whether `raw` is written as a decimal integer (sign, digits, underscores).
fn is_integer_literal(raw: &str) -> bool {
    let digits = raw.strip_prefix(['+', '-']).unwrap_or(raw);
    digits.starts_with(|c: char| c.is_ascii_digit())
        && digits.chars().all(|c| c.is_ascii_digit() || c == '_')
}

/// "--set k=..." when the key (or a parent) came from an override, or the key is a section
/// only an override made (`--set TRAIN.STEPS=2` fails at `TRAIN`); else the file.
fn source_of(key: &str, file: &str, set_keys: &[String], from_file: &toml::Table) -> String {
    let within =
        |outer: &str, inner: &str| inner == outer || inner.starts_with(&format!("{outer}."));
    match set_keys
        .iter()
        .rev()
        .find(|k| within(k, key) || (within(key, k) && lookup(from_file, key).is_none()))
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

/// A TOML parse or type error in `text` on one line: `invalid TOML at line L, column C:
/// message` (the parser's own display spans several, with the source line drawn).
pub fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let at = e
        .span()
        .map(|s| line_col(text, s.start))
        .map_or(String::new(), |lc| {
            let (line, col) = lc.split_once(':').unwrap_or((&lc, ""));
            format!(" at line {line}, column {col}")
        });
    format!("invalid TOML{at}: {}", one_line(e.message()))
}

/// `line:col` (from 1) of byte `at` of `text`.
fn line_col(text: &str, at: usize) -> String {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    format!("{line}:{col}")
}

/// A possibly multi-line message as one line, of at most about [`SHOWN_CHARS`] characters.
fn one_line(msg: &str) -> String {
    let line = msg
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    clip(&line)
}

/// The most characters of a value or a parser's message shown in an error: a string or an
/// array of thousands would bury the line's point.
const SHOWN_CHARS: usize = 160;

/// `text` whole when short; else its start and end around how much was left out, so that
/// both the value's beginning and a message's closing "expected ..." remain.
fn clip(text: &str) -> String {
    let n = text.chars().count();
    if n <= SHOWN_CHARS {
        return text.to_string();
    }
    let keep = SHOWN_CHARS / 2 - 10;
    let head: String = text.chars().take(keep).collect();
    let tail: String = text.chars().skip(n - keep).collect();
    format!("{head} ...({} characters)... {tail}", n - 2 * keep)
}

/// The largest config file read: a train.toml is a few KiB.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The text of the config file `path`: a regular file (a device or a FIFO would be read
/// forever) of at most [`MAX_CONFIG_BYTES`], in UTF-8. The launcher reads cluster files
/// through this too.
pub fn read_config(path: &Path) -> std::io::Result<String> {
    let bytes = crate::data::read_at_most(path, MAX_CONFIG_BYTES)?;
    String::from_utf8(bytes).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text (at byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_value_is_shown_clipped_with_the_key_and_what_was_expected() {
        let dir = std::env::temp_dir().join(format!("zrun-clip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let long = "a".repeat(5000);
        let cases = [
            (
                format!("[model]\nn_layer = \"{long}\"\n"),
                "model.n_layer",
                "expected",
            ),
            (
                format!("[train]\nlr = [{}]\n", vec!["1.0"; 3000].join(", ")),
                "train.lr",
                "expected",
            ),
            (
                format!("[data]\nsource = \"{long}\"\n"),
                "data.source",
                "expected",
            ),
        ];
        for (text, key, expected) in cases {
            let path = dir.join("train.toml");
            std::fs::write(&path, text).unwrap();
            let e = Config::load(&path, &[]).unwrap_err().to_string();
            assert!(e.len() < 600, "{} characters: {e}", e.len());
            assert!(e.contains(key) && e.contains(expected), "{e}");
            assert!(e.contains("characters)"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_global_batch_the_ranks_do_not_train_at_is_refused() {
        let mut cfg = Config::default();
        (cfg.train.micro_batch, cfg.train.grad_accum) = (16, 1);
        cfg.check_global_batch(2).unwrap();
        cfg.train.global_batch = Some(32);
        cfg.check_global_batch(2).unwrap();
        cfg.train.global_batch = Some(64);
        let e = cfg.check_global_batch(2).unwrap_err().0;
        assert!(
            e.contains("16 x train.grad_accum 1 x 2 rank(s) is 32")
                && e.contains("set train.grad_accum = 2"),
            "{e}"
        );
        cfg.train.global_batch = Some(3);
        let e = cfg.check_global_batch(2).unwrap_err().0;
        assert!(e.contains("train.micro_batch = \"auto\""), "{e}");
        cfg.auto.micro_batch = true;
        assert!(cfg.check_global_batch(2).is_err(), "3 over 2 ranks");
        cfg.check_global_batch(3).unwrap();
    }

    #[test]
    fn a_config_that_is_not_a_small_regular_file_is_not_read() {
        let e = read_config(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("a device, not a regular file"), "{e}");
        let d = tempfile::tempdir().unwrap();
        let big = d.path().join("big.toml");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_CONFIG_BYTES + 1).unwrap();
        let e = read_config(&big).unwrap_err().to_string();
        assert!(e.contains("more than the 16777216"), "{e}");
        let ok = d.path().join("ok.toml");
        std::fs::write(&ok, "[train]\nsteps = 3\n").unwrap();
        assert_eq!(read_config(&ok).unwrap(), "[train]\nsteps = 3\n");
    }
}
