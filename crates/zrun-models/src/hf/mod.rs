//! What zrun knows about Hugging Face checkpoints: each parameter's name and layout there
//! ([`HfParam`], from [`crate::Model::hf_params`]), the names other checkpoints use for the
//! same tensors and the tensors to skip ([`ArchConfig::hf_alias`], [`ArchConfig::hf_ignored`]),
//! and `config.json` both ways ([`ArchConfig::from_hf_config`], [`ArchConfig::to_hf_config`]).
//!
//! | zrun (GPT)              | transformers `GPT2LMHeadModel`              | layout     |
//! |-------------------------|---------------------------------------------|------------|
//! | `wte.weight`            | `transformer.wte.weight`                    |            |
//! | `wpe.weight`            | `transformer.wpe.weight`                    |            |
//! | `h.{i}.ln_1.*`          | `transformer.h.{i}.ln_1.*` (also `ln_2`)    |            |
//! | `h.{i}.attn.qkv.*`      | `transformer.h.{i}.attn.c_attn.*`           | transposed |
//! | `h.{i}.attn.proj.*`     | `transformer.h.{i}.attn.c_proj.*`           | transposed |
//! | `h.{i}.mlp.fc.*`        | `transformer.h.{i}.mlp.c_fc.*`              | transposed |
//! | `h.{i}.mlp.proj.*`      | `transformer.h.{i}.mlp.c_proj.*`            | transposed |
//! | `ln_f.*`, `lm_head.weight` | `transformer.ln_f.*`, `lm_head.weight`   |            |
//!
//! "Transposed" applies to the weights only: GPT-2's `Conv1D` keeps (in, out), the transpose
//! of zrun's (out, in). Llama's names are `model.` + zrun's (`lm_head.weight` as is), with
//! the same layout.

mod config;

pub use config::HF_LLAMA_SEQ_LEN;

use crate::config::ArchConfig;

/// One zrun parameter and where a Hugging Face checkpoint keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfParam {
    /// zrun's name (`ParamSpec::name`).
    pub name: String,
    /// transformers' state-dict name.
    pub hf_name: String,
    /// Whether the checkpoint holds the transpose of zrun's (out, in) matrix.
    pub transpose: bool,
}

/// Where `GPT2LMHeadModel` keeps the GPT parameter `name`.
pub(crate) fn gpt2_param(name: &str) -> HfParam {
    if name == "lm_head.weight" {
        return HfParam {
            name: name.to_string(),
            hf_name: name.to_string(),
            transpose: false,
        };
    }
    let renamed = name
        .replace(".attn.qkv.", ".attn.c_attn.")
        .replace(".attn.proj.", ".attn.c_proj.")
        .replace(".mlp.fc.", ".mlp.c_fc.")
        .replace(".mlp.proj.", ".mlp.c_proj.");
    let conv1d = [
        ".attn.c_attn.",
        ".attn.c_proj.",
        ".mlp.c_fc.",
        ".mlp.c_proj.",
    ];
    HfParam {
        name: name.to_string(),
        transpose: name.ends_with(".weight") && conv1d.iter().any(|m| renamed.contains(m)),
        hf_name: format!("transformer.{renamed}"),
    }
}

/// Where `LlamaForCausalLM` keeps the Llama parameter `name`.
pub(crate) fn llama_param(name: &str) -> HfParam {
    let hf_name = if name == "lm_head.weight" {
        name.to_string()
    } else {
        format!("model.{name}")
    };
    HfParam {
        name: name.to_string(),
        hf_name,
        transpose: false,
    }
}

/// The first dotted component of `name`.
fn first(name: &str) -> &str {
    name.split('.').next().unwrap_or("")
}

impl ArchConfig {
    /// The name [`crate::Model::hf_params`] uses for a tensor that a checkpoint file stores
    /// as `file_name`, where the file spells it otherwise: GPT-2 files saved from
    /// `GPT2Model` (the `gpt2` checkpoints on the Hub) leave out `transformer.`, Llama files
    /// saved from `LlamaModel` leave out `model.`. None where `file_name` needs no change
    /// (or is unknown: the caller reports it).
    pub fn hf_alias(&self, file_name: &str) -> Option<String> {
        let (prefix, roots): (&str, &[&str]) = match self {
            ArchConfig::Gpt(_) => ("transformer.", &["wte", "wpe", "h", "ln_f"]),
            ArchConfig::Llama(_) => ("model.", &["embed_tokens", "layers", "norm"]),
        };
        roots
            .contains(&first(file_name))
            .then(|| format!("{prefix}{file_name}"))
    }

    /// Whether a checkpoint's tensor `file_name` holds nothing zrun loads: GPT-2's attention
    /// mask buffers `h.{i}.attn.bias` and `h.{i}.attn.masked_bias`, Llama's
    /// `rotary_emb.inv_freq` (recomputed from the config), and the `lm_head.weight` of a
    /// tied model (a copy of the embedding that some files carry). Both spellings of a name
    /// (see [`ArchConfig::hf_alias`]) are recognised.
    pub fn hf_ignored(&self, file_name: &str) -> bool {
        let tied = match self {
            ArchConfig::Gpt(c) => c.tied,
            ArchConfig::Llama(c) => c.tied,
        };
        if file_name == "lm_head.weight" {
            return tied;
        }
        match self {
            ArchConfig::Gpt(_) => {
                let name = file_name.strip_prefix("transformer.").unwrap_or(file_name);
                name.starts_with("h.")
                    && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"))
            }
            ArchConfig::Llama(_) => file_name.ends_with("rotary_emb.inv_freq"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GptConfig, LlamaConfig};

    fn gpt(tied: bool) -> ArchConfig {
        ArchConfig::Gpt(GptConfig {
            tied,
            ..GptConfig::preset("tiny").unwrap()
        })
    }

    fn llama(tied: bool) -> ArchConfig {
        ArchConfig::Llama(LlamaConfig {
            tied,
            ..LlamaConfig::preset("llama-tiny").unwrap()
        })
    }

    /// The names of `GPT2LMHeadModel(n_layer=2).state_dict()` that hold parameters (as
    /// transformers 5 saves them; lm_head.weight only when untied).
    const GPT2_STATE_DICT: &[&str] = &[
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.ln_1.bias",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_attn.bias",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.attn.c_proj.bias",
        "transformer.h.0.ln_2.weight",
        "transformer.h.0.ln_2.bias",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_fc.bias",
        "transformer.h.0.mlp.c_proj.weight",
        "transformer.h.0.mlp.c_proj.bias",
    ];

    #[test]
    fn gpt2_names_and_transposes() {
        for tied in [false, true] {
            let model = gpt(tied).build().unwrap();
            let params = model.hf_params();
            assert_eq!(
                params.len() as i64,
                model
                    .units()
                    .iter()
                    .map(|u| u.params().len() as i64)
                    .sum::<i64>()
            );
            let names: Vec<&str> = params.iter().map(|p| p.hf_name.as_str()).collect();
            assert_eq!(&names[..14], GPT2_STATE_DICT);
            let h1 = names
                .iter()
                .filter(|n| n.starts_with("transformer.h.1."))
                .count();
            assert_eq!(h1, 12);
            let tail: Vec<&str> = names[26..].to_vec();
            if tied {
                assert_eq!(tail, ["transformer.ln_f.weight", "transformer.ln_f.bias"]);
            } else {
                assert_eq!(
                    tail,
                    [
                        "transformer.ln_f.weight",
                        "transformer.ln_f.bias",
                        "lm_head.weight"
                    ]
                );
            }
            for p in &params {
                let conv = p.hf_name.contains(".c_") && p.hf_name.ends_with(".weight");
                assert_eq!(p.transpose, conv, "{}", p.hf_name);
            }
            let qkv = params
                .iter()
                .find(|p| p.name == "h.1.attn.qkv.weight")
                .unwrap();
            assert_eq!(qkv.hf_name, "transformer.h.1.attn.c_attn.weight");
        }
    }

    #[test]
    fn llama_names_are_model_dot_ours() {
        let model = llama(false).build().unwrap();
        let params = model.hf_params();
        let names: Vec<&str> = params.iter().map(|p| p.hf_name.as_str()).collect();
        assert_eq!(names[0], "model.embed_tokens.weight");
        assert_eq!(
            &names[1..10],
            [
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight",
            ]
        );
        assert_eq!(&names[19..], ["model.norm.weight", "lm_head.weight"]);
        assert!(params.iter().all(|p| !p.transpose));
        let tied = llama(true).build().unwrap().hf_params();
        assert_eq!(tied.last().unwrap().hf_name, "model.norm.weight");
    }

    #[test]
    fn aliases_and_ignored_tensors() {
        let g = gpt(true);
        assert_eq!(
            g.hf_alias("h.3.attn.c_attn.weight").as_deref(),
            Some("transformer.h.3.attn.c_attn.weight")
        );
        assert_eq!(
            g.hf_alias("wte.weight").as_deref(),
            Some("transformer.wte.weight")
        );
        assert_eq!(g.hf_alias("transformer.wte.weight"), None);
        assert_eq!(g.hf_alias("lm_head.weight"), None);
        for name in [
            "h.0.attn.bias",
            "transformer.h.11.attn.masked_bias",
            "lm_head.weight",
        ] {
            assert!(g.hf_ignored(name), "{name}");
        }
        for name in [
            "h.0.attn.c_attn.bias",
            "transformer.h.0.attn.c_proj.bias",
            "wte.weight",
        ] {
            assert!(!g.hf_ignored(name), "{name}");
        }
        assert!(!gpt(false).hf_ignored("lm_head.weight"));

        let l = llama(false);
        assert_eq!(
            l.hf_alias("layers.0.mlp.up_proj.weight").as_deref(),
            Some("model.layers.0.mlp.up_proj.weight")
        );
        assert_eq!(
            l.hf_alias("norm.weight").as_deref(),
            Some("model.norm.weight")
        );
        assert_eq!(l.hf_alias("model.norm.weight"), None);
        assert!(l.hf_ignored("model.layers.0.self_attn.rotary_emb.inv_freq"));
        assert!(l.hf_ignored("model.rotary_emb.inv_freq"));
        assert!(!l.hf_ignored("lm_head.weight"));
        assert!(llama(true).hf_ignored("lm_head.weight"));
    }
}
