//! GPT hyper-parameters, presets and validation.

use crate::error::{Error, Result};

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
    /// init_std 0.02. An unknown name is an error listing the allowed names.
    pub fn preset(name: &str) -> Result<GptConfig> {
        let gpt2 = |n_layer, n_head, d_model| GptConfig {
            vocab_size: GPT2_VOCAB,
            seq_len: 1024,
            n_layer,
            n_head,
            d_model,
            init_std: 0.02,
        };
        match name {
            "tiny" => Ok(GptConfig {
                vocab_size: 256,
                seq_len: 64,
                n_layer: 2,
                n_head: 4,
                d_model: 64,
                init_std: 0.02,
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
        let positive = [
            ("vocab_size", self.vocab_size),
            ("seq_len", self.seq_len),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_model", self.d_model),
        ];
        for (field, value) in positive {
            if value <= 0 {
                return Err(Error::InvalidConfig {
                    field,
                    value: value.to_string(),
                    reason: "must be > 0".to_string(),
                });
            }
        }
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
}
