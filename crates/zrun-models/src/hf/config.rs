//! transformers' `config.json` for GPT-2 and Llama, read into an [`ArchConfig`] and written
//! from one.

use serde_json::{json, Map, Value};

use crate::config::{ArchConfig, GptConfig};
use crate::error::{Error, Result};
use crate::llama::{LlamaConfig, RopeScaling};

/// `seq_len` of a Llama read from a Hugging Face config: its `max_position_embeddings`, at
/// most this (Llama 3's 131072 would size every activation estimate for sequences nobody
/// trains on here); the trainer's config may set another.
pub const HF_LLAMA_SEQ_LEN: i64 = 2048;

/// The `model_type`s [`ArchConfig::from_hf_config`] reads.
const MODEL_TYPES: &str = "gpt2, llama";

/// The rotary `rope_type`s zrun implements.
const ROPE_TYPES: &str = "default, linear, llama3";

/// The error for `key`.
fn bad(key: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::HfConfig {
        key: key.into(),
        reason: reason.into(),
    }
}

/// A JSON object whose keys are read with their full dotted names in errors. A key holding
/// `null` counts as absent, as transformers treats it.
struct Keys<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'static str,
}

impl<'a> Keys<'a> {
    /// The object `v`, named `prefix` (empty at the top, `rope_scaling.` below it).
    fn new(v: &'a Value, prefix: &'static str) -> Result<Keys<'a>> {
        match v.as_object() {
            Some(obj) => Ok(Keys { obj, prefix }),
            None => Err(bad(
                prefix.trim_end_matches('.'),
                format!("expected an object, got {v}"),
            )),
        }
    }

    /// The full name of `key`.
    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value of `key`, None when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// An integer (also written as an integral float).
    fn opt_int(&self, key: &str) -> Result<Option<i64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let int = v.as_i64().or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                .map(|f| f as i64)
        });
        int.map(Some)
            .ok_or_else(|| bad(self.key(key), format!("expected an integer, got {v}")))
    }

    /// A required integer.
    fn int(&self, key: &str) -> Result<i64> {
        self.opt_int(key)?
            .ok_or_else(|| bad(self.key(key), "missing (an integer is required)"))
    }

    /// A number.
    fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_f64()
            .map(Some)
            .ok_or_else(|| bad(self.key(key), format!("expected a number, got {v}")))
    }

    /// A required number.
    fn float(&self, key: &str) -> Result<f64> {
        self.opt_float(key)?
            .ok_or_else(|| bad(self.key(key), "missing (a number is required)"))
    }

    /// A boolean.
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| bad(self.key(key), format!("expected true or false, got {v}")))
    }

    /// A string.
    fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| bad(self.key(key), format!("expected a string, got {v}")))
    }
}

impl ArchConfig {
    /// The architecture a transformers `config.json` describes, for `model_type` "gpt2"
    /// (`GPT2LMHeadModel`) or "llama" (`LlamaForCausalLM`). Errors name the key
    /// ([`Error::HfConfig`]; the caller adds the file's path) for a missing or malformed
    /// value and for a model zrun would not reproduce exactly (biases in Llama, another
    /// activation, LayerNorm epsilon or rotary type, ...).
    ///
    /// - gpt2: `vocab_size`, `n_positions` (also `seq_len`), `n_embd`, `n_layer`, `n_head`;
    ///   `layer_norm_epsilon` 1e-5, `activation_function` gelu_new (or gelu_pytorch_tanh,
    ///   the same function), `n_inner` null or 4 `n_embd`; `tie_word_embeddings` defaults
    ///   to true.
    /// - llama: `vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
    ///   `num_attention_heads`; `num_key_value_heads` defaults to the heads, `head_dim` to
    ///   `hidden_size / num_attention_heads`, `rms_norm_eps` to 1e-6 and
    ///   `max_position_embeddings` to 2048 (transformers' defaults), `tie_word_embeddings`
    ///   to false; `hidden_act` silu, no `attention_bias` or `mlp_bias`. Rotary parameters
    ///   come from transformers 4's `rope_theta` (default 10000) and `rope_scaling`
    ///   (`rope_type`, or the older `type`) or 5's `rope_parameters`; where both are given
    ///   they must agree. `seq_len` is `max_position_embeddings` capped at
    ///   [`HF_LLAMA_SEQ_LEN`].
    ///
    /// `initializer_range` (default 0.02) becomes `init_std`. Other keys are ignored.
    pub fn from_hf_config(json: &Value) -> Result<ArchConfig> {
        let j = Keys::new(json, "")?;
        match j.opt_str("model_type")? {
            Some("gpt2") => gpt2_from(&j),
            Some("llama") => llama_from(&j),
            Some(other) => Err(bad(
                "model_type",
                format!("`{other}` is not supported; supported: {MODEL_TYPES}"),
            )),
            None => Err(bad(
                "model_type",
                format!("missing; supported: {MODEL_TYPES}"),
            )),
        }
    }

    /// A transformers `config.json` for this architecture, which
    /// `AutoModelForCausalLM.from_pretrained` loads as `GPT2LMHeadModel` or
    /// `LlamaForCausalLM`. Rotary parameters are written as transformers 4's `rope_theta`
    /// and `rope_scaling`, which transformers 5 reads too. `torch_dtype` is "float32": whoever
    /// writes the weights in another dtype sets it. Token ids (`bos_token_id`,
    /// `eos_token_id`) belong to the tokenizer and are written as null.
    pub fn to_hf_config(&self) -> Value {
        match self {
            ArchConfig::Gpt(c) => json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": c.vocab_size,
                "n_positions": c.seq_len,
                "n_embd": c.d_model,
                "n_layer": c.n_layer,
                "n_head": c.n_head,
                "n_inner": null,
                "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "scale_attn_weights": true,
                "scale_attn_by_inverse_layer_idx": false,
                "reorder_and_upcast_attn": false,
                "initializer_range": c.init_std,
                "tie_word_embeddings": c.tied,
                "bos_token_id": null,
                "eos_token_id": null,
                "use_cache": true,
                "torch_dtype": "float32",
            }),
            ArchConfig::Llama(c) => json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.d_model,
                "intermediate_size": c.ffn_hidden,
                "num_hidden_layers": c.n_layer,
                "num_attention_heads": c.n_head,
                "num_key_value_heads": c.n_kv_head,
                "head_dim": c.head_dim,
                "hidden_act": "silu",
                "max_position_embeddings": c.max_position_embeddings,
                "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": c.rope_theta,
                "rope_scaling": rope_scaling_json(c.rope_scaling.as_ref()),
                "attention_bias": false,
                "attention_dropout": 0.0,
                "mlp_bias": false,
                "initializer_range": c.init_std,
                "tie_word_embeddings": c.tied,
                "bos_token_id": null,
                "eos_token_id": null,
                "use_cache": true,
                "torch_dtype": "float32",
            }),
        }
    }
}

/// transformers 4's `rope_scaling` object (null without scaling).
fn rope_scaling_json(scaling: Option<&RopeScaling>) -> Value {
    match scaling {
        None => Value::Null,
        Some(RopeScaling::Linear { factor }) => json!({"rope_type": "linear", "factor": factor}),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
    }
}

/// `cfg` validated, with an invalid field reported under its Hugging Face key.
fn validated(cfg: ArchConfig) -> Result<ArchConfig> {
    match cfg.validate() {
        Ok(()) => Ok(cfg),
        Err(Error::InvalidConfig {
            field,
            value,
            reason,
        }) => {
            let key = match (&cfg, field) {
                (ArchConfig::Gpt(_), "seq_len") => "n_positions",
                (ArchConfig::Gpt(_), "d_model") => "n_embd",
                (ArchConfig::Llama(_), "seq_len") => "max_position_embeddings",
                (ArchConfig::Llama(_), "n_layer") => "num_hidden_layers",
                (ArchConfig::Llama(_), "n_head") => "num_attention_heads",
                (ArchConfig::Llama(_), "n_kv_head") => "num_key_value_heads",
                (ArchConfig::Llama(_), "d_model") => "hidden_size",
                (ArchConfig::Llama(_), "ffn_hidden") => "intermediate_size",
                (_, "init_std") => "initializer_range",
                (_, f) => f,
            };
            Err(bad(key, format!("{value}: {reason}")))
        }
        Err(e) => Err(e),
    }
}

/// GPT-2's keys.
fn gpt2_from(j: &Keys) -> Result<ArchConfig> {
    let d_model = j.int("n_embd")?;
    let eps = j.opt_float("layer_norm_epsilon")?.unwrap_or(1e-5);
    if (eps - 1e-5).abs() > 1e-12 {
        return Err(bad(
            "layer_norm_epsilon",
            format!("{eps}: zrun's GPT uses LayerNorm epsilon 1e-5"),
        ));
    }
    let act = j.opt_str("activation_function")?.unwrap_or("gelu_new");
    if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
        return Err(bad(
            "activation_function",
            format!("`{act}`: zrun's GPT uses the tanh GELU (gelu_new)"),
        ));
    }
    if let Some(inner) = j.opt_int("n_inner")? {
        if inner != 4 * d_model {
            return Err(bad(
                "n_inner",
                format!(
                    "{inner}: zrun's GPT MLP is 4 * n_embd = {} wide (null means that)",
                    4 * d_model
                ),
            ));
        }
    }
    let flags = [
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
        ("add_cross_attention", false),
    ];
    for (key, want) in flags {
        if let Some(got) = j.opt_bool(key)? {
            if got != want {
                return Err(bad(key, format!("{got}: zrun's GPT needs {want}")));
            }
        }
    }
    validated(ArchConfig::Gpt(GptConfig {
        vocab_size: j.int("vocab_size")?,
        seq_len: j.int("n_positions")?,
        n_layer: j.int("n_layer")?,
        n_head: j.int("n_head")?,
        d_model,
        init_std: j.opt_float("initializer_range")?.unwrap_or(0.02),
        tied: j.opt_bool("tie_word_embeddings")?.unwrap_or(true),
    }))
}

/// Llama's keys.
fn llama_from(j: &Keys) -> Result<ArchConfig> {
    let hidden = j.int("hidden_size")?;
    let n_head = j.int("num_attention_heads")?;
    let head_dim = match j.opt_int("head_dim")? {
        Some(h) => h,
        None if n_head > 0 && hidden % n_head == 0 => hidden / n_head,
        None => {
            return Err(bad(
                "head_dim",
                format!(
                    "missing, and hidden_size {hidden} is not a multiple of \
                     num_attention_heads {n_head}"
                ),
            ))
        }
    };
    let act = j.opt_str("hidden_act")?.unwrap_or("silu");
    if act != "silu" {
        return Err(bad(
            "hidden_act",
            format!("`{act}`: zrun's Llama MLP uses silu"),
        ));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if j.opt_bool(key)? == Some(true) {
            return Err(bad(key, "true: zrun's Llama has no biases"));
        }
    }
    let max_pos = j.opt_int("max_position_embeddings")?.unwrap_or(2048);
    let (rope_theta, rope_scaling) = rope_from(j, max_pos)?;
    validated(ArchConfig::Llama(LlamaConfig {
        vocab_size: j.int("vocab_size")?,
        seq_len: max_pos.min(HF_LLAMA_SEQ_LEN),
        max_position_embeddings: max_pos,
        n_layer: j.int("num_hidden_layers")?,
        n_head,
        n_kv_head: j.opt_int("num_key_value_heads")?.unwrap_or(n_head),
        d_model: hidden,
        head_dim,
        ffn_hidden: j.int("intermediate_size")?,
        rms_norm_eps: j.opt_float("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        tied: j.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        init_std: j.opt_float("initializer_range")?.unwrap_or(0.02),
    }))
}

/// Theta and scaling from transformers 4's `rope_theta` + `rope_scaling` and 5's
/// `rope_parameters`; an error where both are given and disagree.
fn rope_from(j: &Keys, max_pos: i64) -> Result<(f64, Option<RopeScaling>)> {
    let theta4 = j.opt_float("rope_theta")?;
    let scaling4 = match j.get("rope_scaling") {
        Some(v) => Some(scaling_from(&Keys::new(v, "rope_scaling.")?, max_pos)?),
        None => None,
    };
    let Some(v5) = j.get("rope_parameters") else {
        return Ok((theta4.unwrap_or(10_000.0), scaling4.flatten()));
    };
    let p = Keys::new(v5, "rope_parameters.")?;
    let theta5 = p.opt_float("rope_theta")?;
    let scaling5 = scaling_from(&p, max_pos)?;
    if let (Some(a), Some(b)) = (theta4, theta5) {
        if a != b {
            return Err(bad(
                "rope_theta",
                format!("rope_theta = {a} but rope_parameters.rope_theta = {b}; keep one"),
            ));
        }
    }
    if let Some(s4) = &scaling4 {
        if *s4 != scaling5 {
            let show = |s: &Option<RopeScaling>| match s {
                None => "no scaling (default)".to_string(),
                Some(s) => format!("{s:?}"),
            };
            return Err(bad(
                "rope_scaling",
                format!(
                    "rope_scaling = {} but rope_parameters = {}; keep one",
                    show(s4),
                    show(&scaling5)
                ),
            ));
        }
    }
    Ok((theta5.or(theta4).unwrap_or(10_000.0), scaling5))
}

/// One rotary scaling object (`rope_scaling` or `rope_parameters`); None for "default".
fn scaling_from(p: &Keys, max_pos: i64) -> Result<Option<RopeScaling>> {
    let (type_key, rope_type) = match p.opt_str("rope_type")? {
        Some(t) => ("rope_type", t),
        None => ("type", p.opt_str("type")?.unwrap_or("default")),
    };
    if let Some(f) = p.opt_float("partial_rotary_factor")? {
        if f != 1.0 {
            return Err(bad(
                p.key("partial_rotary_factor"),
                format!("{f}: zrun rotates whole heads (1.0)"),
            ));
        }
    }
    match rope_type {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: p.float("factor")?,
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: p.float("factor")?,
            low_freq_factor: p.float("low_freq_factor")?,
            high_freq_factor: p.float("high_freq_factor")?,
            original_max_position_embeddings: p
                .opt_int("original_max_position_embeddings")?
                .unwrap_or(max_pos),
        })),
        other => Err(bad(
            p.key(type_key),
            format!("rotary type `{other}` is not supported; zrun implements {ROPE_TYPES}"),
        )),
    }
}

#[cfg(test)]
mod tests;
