//! Llama hyper-parameters, rotary scaling, presets and validation.

use crate::error::{Error, Result};

/// How the rotary inverse frequencies are rescaled for long contexts (Hugging Face's
/// `rope_scaling` / `rope_parameters`; no scaling is `rope_type` "default").
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `rope_type` "linear": every inverse frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `rope_type` "llama3" (Llama 3.1 and later): wavelengths longer than
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those
    /// shorter than `original_max_position_embeddings / high_freq_factor` are kept, and the
    /// ones between are interpolated (transformers' `_compute_llama3_parameters`).
    Llama3 {
        /// Divisor of the low frequencies (8 for Llama 3.1, 32 for Llama 3.2).
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are
        /// scaled (1 for Llama 3).
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept
        /// (4 for Llama 3).
        high_freq_factor: f64,
        /// The context length of pre-training (8192 for Llama 3).
        original_max_position_embeddings: i64,
    },
}

impl RopeScaling {
    /// Hugging Face's name of the scaling, its `rope_type`.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }
}

/// Llama hyper-parameters (Llama 2, 3, 3.1, 3.2: RMSNorm, rotary positions, grouped-query
/// attention, SwiGLU MLP, no biases).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size V.
    pub vocab_size: i64,
    /// Longest training sequence (there is no position table; this bounds `forward`'s T and
    /// sizes the attention FLOPs and activation estimates).
    pub seq_len: i64,
    /// The context length the model was built for (Hugging Face's
    /// `max_position_embeddings`); kept for export, at least `seq_len`.
    pub max_position_embeddings: i64,
    /// Number of decoder layers L.
    pub n_layer: i64,
    /// Query heads per layer.
    pub n_head: i64,
    /// Key/value heads per layer (grouped-query attention); divides `n_head`.
    pub n_kv_head: i64,
    /// Model width C.
    pub d_model: i64,
    /// Size of one attention head (even: rotary embeddings rotate pairs).
    pub head_dim: i64,
    /// Width F of the SwiGLU MLP (Hugging Face's `intermediate_size`).
    pub ffn_hidden: i64,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Rotary base theta.
    pub rope_theta: f64,
    /// Rescaling of the rotary frequencies, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the head multiplies by the token embedding `embed_tokens.weight` rather than
    /// by its own `lm_head.weight`.
    pub tied: bool,
    /// Standard deviation of the Normal init of matrices and the embedding (Hugging Face's
    /// `initializer_range`).
    pub init_std: f64,
}

/// Llama 3's 128256-token vocabulary.
const LLAMA3_VOCAB: i64 = 128_256;

/// Sequence length of the Llama presets: the longest training sequence, well below their
/// context length (`max_position_embeddings`); raise it in the trainer's config.
pub(crate) const PRESET_SEQ_LEN: i64 = 2048;

impl LlamaConfig {
    /// Names accepted by [`LlamaConfig::preset`].
    pub const PRESETS: &'static [&'static str] = &[
        "llama-tiny",
        "llama3.2-1b",
        "llama3.2-3b",
        "llama3.1-8b",
        "llama2-7b",
    ];

    /// A named preset, with the shapes of the released models and `seq_len` 2048 for all
    /// (Llama 2's context is 4096, Llama 3.1's and 3.2's 131072; set a longer `seq_len` to
    /// train on longer sequences):
    ///
    /// - `"llama-tiny"`: V 256, seq_len 64, L 2, 4 heads, 2 kv heads, C 64, head 16, F 128,
    ///   theta 10000, untied; for tests and demos.
    /// - `"llama3.2-1b"`: V 128256, L 16, C 2048, 32 heads, 8 kv heads, head 64, F 8192,
    ///   theta 500000, llama3 scaling (32, 1, 4, 8192), tied; 1,235,814,400 parameters.
    /// - `"llama3.2-3b"`: L 28, C 3072, 24 heads, 8 kv heads, head 128, F 8192, as 1B
    ///   otherwise; 3,212,749,824 parameters.
    /// - `"llama3.1-8b"`: V 128256, L 32, C 4096, 32 heads, 8 kv heads, head 128, F 14336,
    ///   theta 500000, llama3 scaling (8, 1, 4, 8192), untied; 8,030,261,248 parameters.
    /// - `"llama2-7b"`: V 32000, L 32, C 4096, 32 heads (no grouping), head 128, F 11008,
    ///   theta 10000, context 4096, untied; 6,738,415,616 parameters.
    ///
    /// All use RMSNorm epsilon 1e-5 and init_std 0.02. An unknown name is an error listing
    /// the allowed names.
    pub fn preset(name: &str) -> Result<LlamaConfig> {
        let llama3 = |factor| RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let base = LlamaConfig {
            vocab_size: LLAMA3_VOCAB,
            seq_len: PRESET_SEQ_LEN,
            max_position_embeddings: 131_072,
            n_layer: 16,
            n_head: 32,
            n_kv_head: 8,
            d_model: 2048,
            head_dim: 64,
            ffn_hidden: 8192,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: Some(llama3(32.0)),
            tied: true,
            init_std: 0.02,
        };
        match name {
            "llama-tiny" => Ok(LlamaConfig {
                vocab_size: 256,
                seq_len: 64,
                max_position_embeddings: 64,
                n_layer: 2,
                n_head: 4,
                n_kv_head: 2,
                d_model: 64,
                head_dim: 16,
                ffn_hidden: 128,
                rope_theta: 10_000.0,
                rope_scaling: None,
                tied: false,
                ..base
            }),
            "llama3.2-1b" => Ok(base),
            "llama3.2-3b" => Ok(LlamaConfig {
                n_layer: 28,
                n_head: 24,
                d_model: 3072,
                head_dim: 128,
                ..base
            }),
            "llama3.1-8b" => Ok(LlamaConfig {
                n_layer: 32,
                d_model: 4096,
                head_dim: 128,
                ffn_hidden: 14336,
                rope_scaling: Some(llama3(8.0)),
                tied: false,
                ..base
            }),
            "llama2-7b" => Ok(LlamaConfig {
                vocab_size: 32000,
                max_position_embeddings: 4096,
                n_layer: 32,
                n_kv_head: 32,
                d_model: 4096,
                head_dim: 128,
                ffn_hidden: 11008,
                rope_theta: 10_000.0,
                rope_scaling: None,
                tied: false,
                ..base
            }),
            _ => Err(Error::UnknownPreset {
                name: name.to_string(),
                allowed: Self::PRESETS.join(", "),
            }),
        }
    }

    /// Check that the architecture can be built: every size > 0, `n_head % n_kv_head == 0`,
    /// `head_dim` even, `seq_len <= max_position_embeddings`, epsilon, theta, init_std and
    /// the scaling's numbers finite and > 0, a llama3 scaling's `high_freq_factor` above its
    /// `low_freq_factor`. The error names the first offending field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: String, reason: String| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        crate::config::sizes_in_range(&[
            ("vocab_size", self.vocab_size),
            ("seq_len", self.seq_len),
            ("max_position_embeddings", self.max_position_embeddings),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_kv_head", self.n_kv_head),
            ("d_model", self.d_model),
            ("head_dim", self.head_dim),
            ("ffn_hidden", self.ffn_hidden),
        ])?;
        if self.n_head % self.n_kv_head != 0 {
            return bad(
                "n_kv_head",
                self.n_kv_head.to_string(),
                format!(
                    "must divide n_head = {} (each kv head serves n_head / n_kv_head query heads)",
                    self.n_head
                ),
            );
        }
        if self.head_dim % 2 != 0 {
            return bad(
                "head_dim",
                self.head_dim.to_string(),
                "must be even (rotary embeddings rotate pairs of dimensions)".to_string(),
            );
        }
        if self.seq_len > self.max_position_embeddings {
            return bad(
                "seq_len",
                self.seq_len.to_string(),
                format!(
                    "must be <= max_position_embeddings = {}; raise max_position_embeddings \
                     to train on longer sequences",
                    self.max_position_embeddings
                ),
            );
        }
        let mut floats = vec![
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
            ("init_std", self.init_std),
        ];
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => floats.push(("rope_scaling.factor", *factor)),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                floats.push(("rope_scaling.factor", *factor));
                floats.push(("rope_scaling.low_freq_factor", *low_freq_factor));
                floats.push(("rope_scaling.high_freq_factor", *high_freq_factor));
                if *original_max_position_embeddings <= 0 {
                    return bad(
                        "rope_scaling.original_max_position_embeddings",
                        original_max_position_embeddings.to_string(),
                        "must be > 0 (8192 for Llama 3)".to_string(),
                    );
                }
                if high_freq_factor <= low_freq_factor {
                    return bad(
                        "rope_scaling.high_freq_factor",
                        high_freq_factor.to_string(),
                        format!("must be > low_freq_factor = {low_freq_factor} (Llama 3: 4 and 1)"),
                    );
                }
            }
        }
        for (field, value) in floats {
            if !(value.is_finite() && value > 0.0) {
                return bad(
                    field,
                    value.to_string(),
                    "must be finite and > 0".to_string(),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_preset_validates_and_unknown_names_list_them() {
        for name in LlamaConfig::PRESETS {
            LlamaConfig::preset(name).unwrap().validate().unwrap();
        }
        let msg = LlamaConfig::preset("llama4").unwrap_err().to_string();
        assert!(msg.contains("llama4"), "{msg}");
        for name in LlamaConfig::PRESETS {
            assert!(msg.contains(name), "{msg} lacks {name}");
        }
    }

    #[test]
    fn validate_names_the_bad_field() {
        let base = LlamaConfig::preset("llama3.2-1b").unwrap();
        let llama3 = |low, high, orig| RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: orig,
        };
        let cases: Vec<(LlamaConfig, &str)> = vec![
            (
                LlamaConfig {
                    vocab_size: 0,
                    ..base.clone()
                },
                "vocab_size",
            ),
            (
                LlamaConfig {
                    seq_len: 0,
                    ..base.clone()
                },
                "seq_len",
            ),
            (
                LlamaConfig {
                    seq_len: 200_000,
                    ..base.clone()
                },
                "seq_len",
            ),
            (
                LlamaConfig {
                    max_position_embeddings: -1,
                    ..base.clone()
                },
                "max_position_embeddings",
            ),
            (
                LlamaConfig {
                    n_layer: 0,
                    ..base.clone()
                },
                "n_layer",
            ),
            (
                LlamaConfig {
                    n_layer: 100_000_000,
                    ..base.clone()
                },
                "n_layer",
            ),
            (
                LlamaConfig {
                    ffn_hidden: 1 << 40,
                    ..base.clone()
                },
                "ffn_hidden",
            ),
            (
                LlamaConfig {
                    n_head: 0,
                    ..base.clone()
                },
                "n_head",
            ),
            (
                LlamaConfig {
                    n_kv_head: 0,
                    ..base.clone()
                },
                "n_kv_head",
            ),
            (
                LlamaConfig {
                    n_kv_head: 5,
                    ..base.clone()
                },
                "n_kv_head",
            ),
            (
                LlamaConfig {
                    d_model: 0,
                    ..base.clone()
                },
                "d_model",
            ),
            (
                LlamaConfig {
                    head_dim: 63,
                    ..base.clone()
                },
                "head_dim",
            ),
            (
                LlamaConfig {
                    ffn_hidden: 0,
                    ..base.clone()
                },
                "ffn_hidden",
            ),
            (
                LlamaConfig {
                    rms_norm_eps: 0.0,
                    ..base.clone()
                },
                "rms_norm_eps",
            ),
            (
                LlamaConfig {
                    rope_theta: f64::NAN,
                    ..base.clone()
                },
                "rope_theta",
            ),
            (
                LlamaConfig {
                    init_std: -0.02,
                    ..base.clone()
                },
                "init_std",
            ),
            (
                LlamaConfig {
                    rope_scaling: Some(RopeScaling::Linear { factor: 0.0 }),
                    ..base.clone()
                },
                "rope_scaling.factor",
            ),
            (
                LlamaConfig {
                    rope_scaling: Some(llama3(4.0, 1.0, 8192)),
                    ..base.clone()
                },
                "rope_scaling.high_freq_factor",
            ),
            (
                LlamaConfig {
                    rope_scaling: Some(llama3(1.0, 4.0, 0)),
                    ..base.clone()
                },
                "rope_scaling.original_max_position_embeddings",
            ),
            (
                LlamaConfig {
                    rope_scaling: Some(llama3(-1.0, 4.0, 8192)),
                    ..base.clone()
                },
                "rope_scaling.low_freq_factor",
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
