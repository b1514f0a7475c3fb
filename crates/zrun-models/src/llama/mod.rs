//! Llama (Llama 2, 3, 3.1, 3.2 as transformers' `LlamaForCausalLM`) as an ordered list of
//! units: `"embed"`, `"layers.0"` .. `"layers.{L-1}"`, `"head"`. The head owns
//! `lm_head.weight`, or with `LlamaConfig::tied` multiplies by `embed_tokens.weight`.
//!
//! Parameter count, with q = nh hd and kv = nkv hd:
//! `V C + L (2C + 2 C q + 2 C kv + 3 C F) + C`, plus `V C` for an untied `lm_head`
//! (embed_tokens, layers, norm, lm_head).
//!
//! FLOPs per token (forward) = 2 * (matmul weights: `L (2 C q + 2 C kv + 3 C F) + V C`) +
//! attention `4 L T q` at T = seq_len; training = 3x forward, as for GPT.

mod config;
mod rope;
mod units;

pub use config::{LlamaConfig, RopeScaling};

use tch::Device;

use crate::error::{Result, TorchCtx};
use crate::hf::{self, HfParam};
use crate::unit::{Model, Unit};

/// A Llama model: configuration plus its units. Holds no tensors, so even the largest preset
/// is cheap to build; materialise parameters with `init_into` / `init_unit_params`.
pub struct Llama {
    cfg: LlamaConfig,
    units: Vec<Box<dyn Unit>>,
}

impl Llama {
    /// Validate `cfg` and lay out the units and their parameter specs.
    pub fn new(cfg: LlamaConfig) -> Result<Llama> {
        cfg.validate()?;
        let inv_freq = Vec::<f32>::try_from(cfg.rope_inv_freq(Device::Cpu)?)
            .ctx("rope", "inv_freq to host")?;
        let dims = units::Dims {
            c: cfg.d_model,
            n_head: cfg.n_head,
            n_kv_head: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            ffn: cfg.ffn_hidden,
            seq_len: cfg.seq_len,
            eps: cfg.rms_norm_eps,
        };
        let (v, c, std) = (cfg.vocab_size, cfg.d_model, cfg.init_std);
        let mut list: Vec<Box<dyn Unit>> = Vec::with_capacity(cfg.n_layer as usize + 2);
        list.push(Box::new(units::Embed::new(v, c, cfg.seq_len, std)));
        for i in 0..cfg.n_layer {
            list.push(Box::new(units::Block::new(i, dims, inv_freq.clone(), std)));
        }
        list.push(Box::new(units::Head::new(
            v,
            c,
            cfg.seq_len,
            cfg.rms_norm_eps,
            std,
            cfg.tied,
        )));
        Ok(Llama { cfg, units: list })
    }

    /// The configuration this model was built from.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
}

impl LlamaConfig {
    /// The rotary inverse frequencies (head_dim / 2) in fp32 on `device`, computed as
    /// transformers computes them (`1 / theta^(2i / hd)`, then the `rope_scaling`).
    pub fn rope_inv_freq(&self, device: Device) -> Result<tch::Tensor> {
        rope::inv_freq(
            self.rope_theta,
            self.head_dim,
            self.rope_scaling.as_ref(),
            device,
        )
    }
}

impl Model for Llama {
    fn units(&self) -> &[Box<dyn Unit>] {
        &self.units
    }

    fn param_count(&self) -> i64 {
        self.units
            .iter()
            .flat_map(|u| u.params())
            .map(|p| p.numel())
            .sum()
    }

    fn flops_per_token(&self) -> f64 {
        3.0 * self.units.iter().map(|u| u.flops_per_token()).sum::<f64>()
    }

    fn vocab_size(&self) -> i64 {
        self.cfg.vocab_size
    }

    fn d_model(&self) -> i64 {
        self.cfg.d_model
    }

    fn seq_len(&self) -> i64 {
        self.cfg.seq_len
    }

    /// `model.` + the zrun name, and `lm_head.weight`; nothing is transposed.
    fn hf_params(&self) -> Vec<HfParam> {
        self.units
            .iter()
            .flat_map(|u| u.params())
            .map(|p| hf::llama_param(&p.name))
            .collect()
    }
}

#[cfg(test)]
mod tests;
