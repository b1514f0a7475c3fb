//! GPT (nanoGPT-like, GPT-2 layout, no dropout) as an ordered list of units: `"embed"`,
//! `"h.0"` .. `"h.{L-1}"`, `"head"`. The head owns `lm_head.weight`, or with
//! `GptConfig::tied` multiplies by the embedding's `wte.weight` (as GPT-2 on the Hub).
//!
//! Parameter count: `V*C + T*C + L*(12C^2 + 13C) + 2C`, plus `V*C` for an untied `lm_head`
//! (wte, wpe, blocks, ln_f, lm_head).
//!
//! FLOPs per token (forward) = 2 * (matmul weights: `12 L C^2 + V C`) + attention
//! `4 L T C`; training = 3x forward. This equals nanoGPT's `6N + 12 L H Q T` with N counted
//! as the matmul weights only (embedding lookups, biases and LayerNorms excluded); the
//! logits matmul `V C` counts once, tied or not (a lookup in the table costs nothing).

mod units;

use crate::config::GptConfig;
use crate::error::Result;
use crate::hf::{self, HfParam};
use crate::unit::{Model, Unit};

/// A GPT model: configuration plus its units. Holds no tensors, so even the largest preset
/// is cheap to build; materialise parameters with `init_into` / `init_unit_params`.
pub struct Gpt {
    cfg: GptConfig,
    units: Vec<Box<dyn Unit>>,
}

impl Gpt {
    /// Validate `cfg` and lay out the units and their parameter specs.
    pub fn new(cfg: GptConfig) -> Result<Gpt> {
        cfg.validate()?;
        let GptConfig {
            vocab_size: v,
            seq_len: t,
            n_layer: l,
            n_head,
            d_model: c,
            init_std: std,
            tied,
        } = cfg;
        let mut units: Vec<Box<dyn Unit>> = Vec::with_capacity(l as usize + 2);
        units.push(Box::new(units::Embed::new(v, t, c, std)));
        for i in 0..l {
            units.push(Box::new(units::Block::new(i, l, n_head, c, t, std)));
        }
        units.push(Box::new(units::Head::new(v, c, t, std, tied)));
        Ok(Gpt { cfg, units })
    }

    /// The configuration this model was built from.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }
}

impl Model for Gpt {
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

    /// `GPT2LMHeadModel`'s names; the Conv1D weights are transposed (see [`crate::hf`]).
    fn hf_params(&self) -> Vec<HfParam> {
        self.units
            .iter()
            .flat_map(|u| u.params())
            .map(|p| hf::gpt2_param(&p.name))
            .collect()
    }
}

#[cfg(test)]
mod tests;
