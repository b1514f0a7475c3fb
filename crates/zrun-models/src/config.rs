//! GPT hyper-parameters, presets and validation, and [`ArchConfig`], either family's.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpt::Gpt;
use crate::llama::{Llama, LlamaConfig};
use crate::unit::Model;

/// The largest value each size field may take: well past every published model (vocabularies
/// of ~256k, 16k-wide residual streams, ~130 layers, 1M-token contexts), and small enough
/// that the memory arithmetic on them (parameters, activations, bytes in i64) cannot
/// overflow, and that a config or an untrusted config.json cannot make zrun build millions of
/// layers before anything else is checked.
const LIMITS: &[(&str, i64)] = &[
    ("vocab_size", 1 << 24),
    ("seq_len", 1 << 24),
    ("max_position_embeddings", 1 << 24),
    ("n_layer", 4096),
    ("n_head", 4096),
    ("n_kv_head", 4096),
    ("d_model", 1 << 17),
    ("head_dim", 4096),
    ("ffn_hidden", 1 << 20),
];

/// Each size field in `fields` is > 0 and at most its [`LIMITS`] entry.
pub(crate) fn sizes_in_range(fields: &[(&'static str, i64)]) -> Result<()> {
    for &(field, value) in fields {
        let max = LIMITS
            .iter()
            .find(|(f, _)| *f == field)
            .map_or(i64::MAX, |&(_, m)| m);
        let reason = if value <= 0 {
            "must be > 0".to_string()
        } else if value > max {
            format!("must be at most {max}, past any real model's")
        } else {
            continue;
        };
        return Err(Error::InvalidConfig {
            field,
            value: value.to_string(),
            reason,
        });
    }
    Ok(())
}

/// GPT hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size V.
    pub vocab_size: i64,
    /// Longest sequence T_max (rows of the position table).
    pub seq_len: i64,
    /// Number of transformer blocks L.
    pub n_layer: i64,
    /// Attention heads per block.
    pub n_head: i64,
    /// Model width C.
    pub d_model: i64,
    /// Standard deviation of the Normal init of matrices and embeddings.
    pub init_std: f64,
    /// Whether the head multiplies by the token embedding `wte.weight` (as GPT-2 on the Hub)
    /// rather than by its own `lm_head.weight`.
    pub tied: bool,
}

/// GPT-2's 50257-token vocabulary padded up to a multiple of 64 (as nanoGPT).
const GPT2_VOCAB: i64 = 50304;

impl GptConfig {
    /// Names accepted by [`GptConfig::preset`].
    pub const PRESETS: &'static [&'static str] =
        &["tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"];

    /// A named preset: `"tiny"` (V 256, T 64, 2 layers, 4 heads, C 64) for tests and demos,
    /// and the GPT-2 family `"gpt2-small"` (12, 12, 768), `"gpt2-medium"` (24, 16, 1024),
    /// `"gpt2-large"` (36, 20, 1280), `"gpt2-xl"` (48, 25, 1600) with V 50304, T 1024 and
    /// init_std 0.02, all with an untied head. An unknown name is an error listing the
    /// allowed names.
    pub fn preset(name: &str) -> Result<GptConfig> {
        let gpt2 = |n_layer, n_head, d_model| GptConfig {
            vocab_size: GPT2_VOCAB,
            seq_len: 1024,
            n_layer,
            n_head,
            d_model,
            init_std: 0.02,
            tied: false,
        };
        match name {
            "tiny" => Ok(GptConfig {
                vocab_size: 256,
                seq_len: 64,
                n_layer: 2,
                n_head: 4,
                d_model: 64,
                init_std: 0.02,
                tied: false,
            }),
            "gpt2-small" => Ok(gpt2(12, 12, 768)),
            "gpt2-medium" => Ok(gpt2(24, 16, 1024)),
            "gpt2-large" => Ok(gpt2(36, 20, 1280)),
            "gpt2-xl" => Ok(gpt2(48, 25, 1600)),
            _ => Err(Error::UnknownPreset {
                name: name.to_string(),
                allowed: Self::PRESETS.join(", "),
            }),
        }
    }

    /// Check that the architecture can be built: every size > 0, `d_model % n_head == 0`,
    /// `init_std` finite and > 0. The error names the first offending field.
    pub fn validate(&self) -> Result<()> {
        sizes_in_range(&[
            ("vocab_size", self.vocab_size),
            ("seq_len", self.seq_len),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_model", self.d_model),
        ])?;
        if self.d_model % self.n_head != 0 {
            return Err(Error::InvalidConfig {
                field: "d_model",
                value: self.d_model.to_string(),
                reason: format!(
                    "must be a multiple of n_head = {} (head size = d_model / n_head)",
                    self.n_head
                ),
            });
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return Err(Error::InvalidConfig {
                field: "init_std",
                value: self.init_std.to_string(),
                reason: "must be finite and > 0 (GPT-2 uses 0.02)".to_string(),
            });
        }
        Ok(())
    }
}

/// The architecture of a model, of either family zrun builds.
#[derive(Clone, Debug, PartialEq)]
pub enum ArchConfig {
    /// GPT-2 layout ([`Gpt`]).
    Gpt(GptConfig),
    /// Llama layout ([`Llama`]).
    Llama(LlamaConfig),
}

impl ArchConfig {
    /// The families [`ArchConfig::preset`] takes.
    pub const ARCHS: &'static [&'static str] = &["gpt", "llama"];

    /// Preset `name` of family `arch` ("gpt": [`GptConfig::preset`], "llama":
    /// [`LlamaConfig::preset`]). An unknown family or name is an error listing the allowed
    /// ones.
    pub fn preset(arch: &str, name: &str) -> Result<ArchConfig> {
        match arch {
            "gpt" => GptConfig::preset(name).map(ArchConfig::Gpt),
            "llama" => LlamaConfig::preset(name).map(ArchConfig::Llama),
            _ => Err(Error::InvalidConfig {
                field: "arch",
                value: format!("{arch:?}"),
                reason: format!("allowed: {}", Self::ARCHS.join(", ")),
            }),
        }
    }

    /// The family: "gpt" or "llama".
    pub fn arch(&self) -> &'static str {
        match self {
            ArchConfig::Gpt(_) => "gpt",
            ArchConfig::Llama(_) => "llama",
        }
    }

    /// The family's `validate`.
    pub fn validate(&self) -> Result<()> {
        match self {
            ArchConfig::Gpt(c) => c.validate(),
            ArchConfig::Llama(c) => c.validate(),
        }
    }

    /// The model, validated; it holds no tensors.
    pub fn build(&self) -> Result<Arc<dyn Model>> {
        Ok(match self {
            ArchConfig::Gpt(c) => Arc::new(Gpt::new(c.clone())?),
            ArchConfig::Llama(c) => Arc::new(Llama::new(c.clone())?),
        })
    }

    /// Longest training sequence.
    pub fn seq_len(&self) -> i64 {
        match self {
            ArchConfig::Gpt(c) => c.seq_len,
            ArchConfig::Llama(c) => c.seq_len,
        }
    }

    /// Vocabulary size V.
    pub fn vocab_size(&self) -> i64 {
        match self {
            ArchConfig::Gpt(c) => c.vocab_size,
            ArchConfig::Llama(c) => c.vocab_size,
        }
    }

    /// Whether the head reads the token embedding (tied) instead of its own matrix.
    pub fn tied(&self) -> bool {
        match self {
            ArchConfig::Gpt(c) => c.tied,
            ArchConfig::Llama(c) => c.tied,
        }
    }
}

impl From<GptConfig> for ArchConfig {
    fn from(c: GptConfig) -> ArchConfig {
        ArchConfig::Gpt(c)
    }
}

impl From<LlamaConfig> for ArchConfig {
    fn from(c: LlamaConfig) -> ArchConfig {
        ArchConfig::Llama(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_preset_builds_and_validates() {
        for name in GptConfig::PRESETS {
            let cfg = GptConfig::preset(name).unwrap();
            cfg.validate().unwrap();
        }
        let xl = GptConfig::preset("gpt2-xl").unwrap();
        assert_eq!((xl.n_layer, xl.n_head, xl.d_model), (48, 25, 1600));
        assert_eq!((xl.vocab_size, xl.seq_len), (50304, 1024));
    }

    #[test]
    fn unknown_preset_lists_allowed_names() {
        let msg = GptConfig::preset("gpt3").unwrap_err().to_string();
        assert!(msg.contains("gpt3"), "{msg}");
        for name in GptConfig::PRESETS {
            assert!(msg.contains(name), "{msg} lacks {name}");
        }
    }

    #[test]
    fn validate_names_the_bad_field() {
        let base = GptConfig::preset("tiny").unwrap();
        let cases: Vec<(GptConfig, &str)> = vec![
            (
                GptConfig {
                    vocab_size: 0,
                    ..base.clone()
                },
                "vocab_size",
            ),
            (
                GptConfig {
                    seq_len: -1,
                    ..base.clone()
                },
                "seq_len",
            ),
            (
                GptConfig {
                    n_layer: 0,
                    ..base.clone()
                },
                "n_layer",
            ),
            (
                GptConfig {
                    n_head: 0,
                    ..base.clone()
                },
                "n_head",
            ),
            (
                GptConfig {
                    d_model: 66,
                    ..base.clone()
                },
                "d_model",
            ),
            (
                GptConfig {
                    d_model: 4_000_000_000,
                    n_head: 1,
                    ..base.clone()
                },
                "d_model",
            ),
            (
                GptConfig {
                    n_layer: 100_000_000,
                    ..base.clone()
                },
                "n_layer",
            ),
            (
                GptConfig {
                    init_std: f64::NAN,
                    ..base.clone()
                },
                "init_std",
            ),
            (
                GptConfig {
                    init_std: 0.0,
                    ..base.clone()
                },
                "init_std",
            ),
        ];
        for (cfg, field) in cases {
            match cfg.validate() {
                Err(Error::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn arch_presets_build_both_families() {
        for (arch, names) in [("gpt", GptConfig::PRESETS), ("llama", LlamaConfig::PRESETS)] {
            for name in names {
                let cfg = ArchConfig::preset(arch, name).unwrap();
                assert_eq!(cfg.arch(), arch);
                let model = cfg.build().unwrap();
                assert_eq!(model.seq_len(), cfg.seq_len(), "{name}");
                assert_eq!(model.vocab_size(), cfg.vocab_size(), "{name}");
            }
        }
        assert!(matches!(
            ArchConfig::preset("llama", "tiny"),
            Err(Error::UnknownPreset { .. })
        ));
        let msg = ArchConfig::preset("mamba", "tiny").unwrap_err().to_string();
        assert!(msg.contains("mamba") && msg.contains("gpt, llama"), "{msg}");
        let bad = ArchConfig::from(GptConfig {
            n_head: 5,
            ..GptConfig::preset("tiny").unwrap()
        });
        assert!(bad.build().is_err());
    }
}
