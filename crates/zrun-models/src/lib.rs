//! GPT-2 and Llama as ordered lists of units with named parameter shapes; no parallelism
//! inside.
//!
//! A [`Model`] is an ordered list of [`Unit`]s (embedding, each transformer block, final norm
//! and head); [`ArchConfig`] names either family and builds it. A unit is a pure function of
//! its parameter tensors and its input, plus the list of its named [`ParamSpec`]s; sharding,
//! gathering and checkpointing are applied from outside (`zrun-shard`), unit by unit.
//! Parameters are initialised by a counter-based generator ([`ParamSpec::init_into`]), so
//! any rank can build exactly its shard. The [`hf`] module holds what zrun knows about
//! Hugging Face checkpoints: parameter names and layouts, and `config.json` both ways.
//!
//! ```
//! use zrun_models::{forward_model, init_model_params, lm_loss, Gpt, GptConfig, Model};
//! use tch::{Device, Kind, Tensor};
//!
//! let gpt = Gpt::new(GptConfig::preset("tiny")?)?;
//! let params = init_model_params(&gpt, 0, Kind::Float, Device::Cpu)?;
//! let idx = Tensor::zeros([2, 16], (Kind::Int64, Device::Cpu));
//! let logits = forward_model(&gpt, &params, &idx)?; // (2, 16, 256)
//! let loss = lm_loss(&logits, &idx)?; // scalar, about ln(256) at init
//! assert!((loss.double_value(&[]) - 256f64.ln()).abs() < 0.5);
//! assert_eq!(logits.size(), [2, 16, gpt.vocab_size()]);
//! # Ok::<(), zrun_models::Error>(())
//! ```

mod activation;
mod config;
mod error;
mod gpt;
pub mod hf;
mod llama;
mod loss;
mod param;
mod unit;

pub use activation::{Activations, LossBytes};
pub use config::{ArchConfig, GptConfig};
pub use error::{Error, Result};
pub use gpt::Gpt;
pub use hf::HfParam;
pub use llama::{Llama, LlamaConfig, RopeScaling};
pub use loss::{
    fused_lm_loss, fused_loss_applies, fused_loss_on, linear_lm_loss, lm_loss, IGNORE_INDEX,
    LOSS_CHUNK,
};
pub use param::{Init, ParamSpec};
pub use unit::{
    forward_model, forward_model_cached, init_model_params, init_unit_params, unit_inputs, KvCache,
    Model, Tied, Unit,
};
