//! Hugging Face model directories: `config.json` beside `model.safetensors`, or beside
//! `model-00001-of-0000N.safetensors` shards and `model.safetensors.index.json`.
//!
//! [`HfDir`] memory-maps every weights file and parses only the headers, so a rank that reads
//! its slices touches only their pages. [`HfWriter`] streams tensors into shards that
//! `transformers.AutoModelForCausalLM.from_pretrained` loads, each written under a temporary
//! name and renamed into place at the end, the index last. Nothing here knows a model: callers
//! pass tensor names, shapes and dtypes, and decide the name mapping and transposes.

mod read;
mod write;

pub use read::{HfDir, HfDtype, TensorInfo};
pub use write::{parse_size, write_json, HfWriter};

/// The single weights file of an unsharded model.
const WEIGHTS: &str = "model.safetensors";
/// The index of a sharded model: `weight_map` names each tensor's shard.
const INDEX: &str = "model.safetensors.index.json";
/// The model's configuration.
const CONFIG: &str = "config.json";
