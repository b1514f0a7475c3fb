//! `[model]`: the architecture from a preset with overrides, or from a Hugging Face
//! directory's `config.json` (`model.init_from`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Arch, Config, ConfigError};
use zrun_models::{ArchConfig, GptConfig, LlamaConfig, Model};

/// A range-check failure: (key, value, what is allowed).
type Bad = (String, String, String);

fn bad(key: &str, v: impl std::fmt::Display, allowed: &str) -> Bad {
    (key.to_string(), v.to_string(), allowed.to_string())
}

/// The `config.json` of a Hugging Face model directory.
pub fn hf_config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}

/// Reads and parses `dir/config.json` into an architecture.
pub fn arch_from_hf(dir: &Path) -> Result<ArchConfig, ConfigError> {
    let path = hf_config_path(dir);
    let text = crate::data::read_at_most(&path, 64 << 20).map_err(|e| {
        ConfigError(format!(
            "{}: cannot read it ({e}); a Hugging Face model directory holds config.json and model.safetensors",
            path.display()
        ))
    })?;
    let json: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| ConfigError(format!("{}: invalid JSON: {e}", path.display())))?;
    ArchConfig::from_hf_config(&json).map_err(|e| ConfigError(format!("{}: {e}", path.display())))
}

impl Config {
    /// The model architecture this config asks for: `model.init_from`'s `config.json`, or the
    /// preset (`tiny` for GPT, `llama-tiny` for Llama) with the `[model]` overrides.
    pub fn arch(&self) -> Result<ArchConfig, ConfigError> {
        self.resolve_arch().map_err(|(key, value, allowed)| {
            ConfigError(format!("[model]: {key} = {value}: {allowed}"))
        })
    }

    /// The model itself (units and parameter specs; no tensors).
    pub fn build_model(&self) -> Result<Arc<dyn Model>, ConfigError> {
        let arch = self.arch()?;
        arch.build()
            .map_err(|e| ConfigError(format!("[model]: {e}")))
    }

    /// The architecture, with errors as (key, value, what is allowed).
    pub(super) fn resolve_arch(&self) -> Result<ArchConfig, Bad> {
        let m = &self.model;
        for (key, v) in [
            ("model.vocab_size", m.vocab_size),
            ("model.seq_len", m.seq_len),
            ("model.n_layer", m.n_layer),
            ("model.n_head", m.n_head),
            ("model.d_model", m.d_model),
            ("model.n_kv_head", m.n_kv_head),
            ("model.head_dim", m.head_dim),
            ("model.ffn_hidden", m.ffn_hidden),
        ] {
            if let Some(v) = v.filter(|&v| v <= 0) {
                return Err(bad(key, v, "must be at least 1"));
            }
        }
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        if let Some(s) = m.init_std.filter(|&s| !finite_pos(s)) {
            return Err(bad("model.init_std", s, "must be a finite number > 0"));
        }
        if let Some(s) = m.rope_theta.filter(|&s| !finite_pos(s)) {
            return Err(bad("model.rope_theta", s, "must be a finite number > 0"));
        }
        if let Some(dir) = &m.init_from {
            return self.imported(dir);
        }
        let arch = match m.arch.unwrap_or_default() {
            Arch::Gpt => ArchConfig::Gpt(self.gpt_preset()?),
            Arch::Llama => ArchConfig::Llama(self.llama_preset()?),
        };
        check(&arch)?;
        Ok(arch)
    }

    /// The GPT preset with the overrides applied.
    fn gpt_preset(&self) -> Result<GptConfig, Bad> {
        let m = &self.model;
        let name = m.preset.as_deref().unwrap_or("tiny");
        let mut g = GptConfig::preset(name).map_err(|_| {
            let allowed = format!("allowed GPT presets: {}", GptConfig::PRESETS.join(", "));
            bad("model.preset", format!("{name:?}"), &allowed)
        })?;
        for (key, set) in [
            ("model.n_kv_head", m.n_kv_head.is_some()),
            ("model.head_dim", m.head_dim.is_some()),
            ("model.ffn_hidden", m.ffn_hidden.is_some()),
            ("model.rope_theta", m.rope_theta.is_some()),
        ] {
            if set {
                return Err(bad(
                    key,
                    "(set)",
                    "is a Llama key: set model.arch = \"llama\" or remove it",
                ));
            }
        }
        g.vocab_size = m.vocab_size.unwrap_or(g.vocab_size);
        g.seq_len = m.seq_len.unwrap_or(g.seq_len);
        g.n_layer = m.n_layer.unwrap_or(g.n_layer);
        g.n_head = m.n_head.unwrap_or(g.n_head);
        g.d_model = m.d_model.unwrap_or(g.d_model);
        g.init_std = m.init_std.unwrap_or(g.init_std);
        g.tied = m.tie_embeddings.unwrap_or(g.tied);
        if g.d_model % g.n_head != 0 {
            let allowed = format!(
                "model.d_model ({}) must be a multiple of model.n_head",
                g.d_model
            );
            return Err(bad("model.n_head", g.n_head, &allowed));
        }
        Ok(g)
    }

    /// The Llama preset with the overrides applied; `head_dim` follows `d_model / n_head`
    /// when either changes and it is not set.
    fn llama_preset(&self) -> Result<LlamaConfig, Bad> {
        let m = &self.model;
        let name = m.preset.as_deref().unwrap_or("llama-tiny");
        let mut l = LlamaConfig::preset(name).map_err(|_| {
            let allowed = format!("allowed Llama presets: {}", LlamaConfig::PRESETS.join(", "));
            bad("model.preset", format!("{name:?}"), &allowed)
        })?;
        l.vocab_size = m.vocab_size.unwrap_or(l.vocab_size);
        l.seq_len = m.seq_len.unwrap_or(l.seq_len);
        l.n_layer = m.n_layer.unwrap_or(l.n_layer);
        l.n_head = m.n_head.unwrap_or(l.n_head);
        l.d_model = m.d_model.unwrap_or(l.d_model);
        l.n_kv_head = m.n_kv_head.unwrap_or(l.n_kv_head.min(l.n_head));
        l.ffn_hidden = m.ffn_hidden.unwrap_or(l.ffn_hidden);
        l.rope_theta = m.rope_theta.unwrap_or(l.rope_theta);
        l.init_std = m.init_std.unwrap_or(l.init_std);
        l.tied = m.tie_embeddings.unwrap_or(l.tied);
        if m.d_model.is_some() || m.n_head.is_some() {
            l.head_dim = l.d_model / l.n_head;
        }
        l.head_dim = m.head_dim.unwrap_or(l.head_dim);
        l.max_position_embeddings = l.max_position_embeddings.max(l.seq_len);
        Ok(l)
    }

    /// The architecture of `dir/config.json`; a `[model]` key that disagrees with it is an
    /// error naming both values (`seq_len` may shorten a Llama's training sequences).
    fn imported(&self, dir: &Path) -> Result<ArchConfig, Bad> {
        let m = &self.model;
        let path = hf_config_path(dir);
        let shown = path.display().to_string();
        if let Some(p) = &m.preset {
            return Err(bad(
                "model.preset",
                format!("{p:?}"),
                &format!(
                    "the architecture comes from {shown} (model.init_from): remove model.preset"
                ),
            ));
        }
        let mut arch =
            arch_from_hf(dir).map_err(|e| bad("model.init_from", dir.display(), &e.0))?;
        let family = match arch {
            ArchConfig::Gpt(_) => Arch::Gpt,
            ArchConfig::Llama(_) => Arch::Llama,
        };
        if let Some(a) = m.arch.filter(|&a| a != family) {
            return Err(bad(
                "model.arch",
                format!("{a:?}").to_lowercase(),
                &format!("{shown} describes a {family:?} model; remove model.arch"),
            ));
        }
        let (v, s, l, h, c) = match &arch {
            ArchConfig::Gpt(g) => (g.vocab_size, g.seq_len, g.n_layer, g.n_head, g.d_model),
            ArchConfig::Llama(g) => (g.vocab_size, g.seq_len, g.n_layer, g.n_head, g.d_model),
        };
        let mut pairs = vec![
            ("model.vocab_size", m.vocab_size, v),
            ("model.n_layer", m.n_layer, l),
            ("model.n_head", m.n_head, h),
            ("model.d_model", m.d_model, c),
        ];
        if let ArchConfig::Llama(g) = &arch {
            pairs.push(("model.n_kv_head", m.n_kv_head, g.n_kv_head));
            pairs.push(("model.head_dim", m.head_dim, g.head_dim));
            pairs.push(("model.ffn_hidden", m.ffn_hidden, g.ffn_hidden));
        } else {
            // GPT's positions are a table of n_positions rows: the file fixes seq_len.
            pairs.push(("model.seq_len", m.seq_len, s));
        }
        for (key, mine, theirs) in pairs {
            if let Some(x) = mine.filter(|&x| x != theirs) {
                return Err(bad(
                    key,
                    x,
                    &format!("conflicts with {theirs} in {shown}; remove {key} (the architecture comes from model.init_from)"),
                ));
            }
        }
        if let Some(t) = m.tie_embeddings.filter(|&t| t != arch.tied()) {
            return Err(bad(
                "model.tie_embeddings",
                t,
                &format!(
                    "conflicts with tie_word_embeddings = {} in {shown}",
                    arch.tied()
                ),
            ));
        }
        if let ArchConfig::Gpt(_) = arch {
            for (key, set) in [
                ("model.n_kv_head", m.n_kv_head.is_some()),
                ("model.head_dim", m.head_dim.is_some()),
                ("model.ffn_hidden", m.ffn_hidden.is_some()),
                ("model.rope_theta", m.rope_theta.is_some()),
            ] {
                if set {
                    return Err(bad(
                        key,
                        "(set)",
                        &format!("is a Llama key, but {shown} describes a GPT-2 model; remove it"),
                    ));
                }
            }
        }
        if let (Some(t), ArchConfig::Llama(g)) = (m.rope_theta, &arch) {
            if t != g.rope_theta {
                return Err(bad(
                    "model.rope_theta",
                    t,
                    &format!("conflicts with rope_theta = {} in {shown}", g.rope_theta),
                ));
            }
        }
        if let (Some(t), ArchConfig::Llama(g)) = (m.seq_len, &mut arch) {
            if t > g.max_position_embeddings {
                return Err(bad(
                    "model.seq_len",
                    t,
                    &format!(
                        "is more than max_position_embeddings = {} in {shown}",
                        g.max_position_embeddings
                    ),
                ));
            }
            g.seq_len = t;
        }
        check(&arch)?;
        Ok(arch)
    }
}

/// The model crate's own validation, as a `[model]` key error.
fn check(arch: &ArchConfig) -> Result<(), Bad> {
    arch.validate().map_err(|e| match e {
        zrun_models::Error::InvalidConfig {
            field,
            value,
            reason,
        } => bad(&format!("model.{field}"), value, &reason),
        other => bad("model", "(this architecture)", &other.to_string()),
    })
}
