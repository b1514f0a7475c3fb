//! `config.json` parsing against configs as published on the Hub, and the round trip.

use serde_json::{json, Value};

use super::*;

/// `openai-community/gpt2`'s config.json, as published.
fn hub_gpt2() -> Value {
    json!({
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 12,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "summary_activation": null,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": true,
        "summary_type": "cls_index",
        "summary_use_proj": true,
        "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
        "vocab_size": 50257
    })
}

/// `meta-llama/Llama-3.2-1B`'s config.json, as published.
fn hub_llama32_1b() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3"
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": true,
        "vocab_size": 128256
    })
}

/// `meta-llama/Llama-2-7b-hf`'s config.json, as published.
fn hub_llama2_7b() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": null,
        "tie_word_embeddings": false,
        "torch_dtype": "float16",
        "transformers_version": "4.31.0.dev0",
        "use_cache": true,
        "vocab_size": 32000
    })
}

/// `json` with `key` set to `value` (or removed for null).
fn with(mut json: Value, key: &str, value: Value) -> Value {
    let obj = json.as_object_mut().unwrap();
    if value.is_null() {
        obj.remove(key);
    } else {
        obj.insert(key.to_string(), value);
    }
    json
}

/// The key of an `HfConfig` error, and its message.
fn err_key(json: &Value) -> (String, String) {
    match ArchConfig::from_hf_config(json) {
        Err(e @ Error::HfConfig { .. }) => {
            let msg = e.to_string();
            let Error::HfConfig { key, .. } = e else {
                unreachable!()
            };
            (key, msg)
        }
        other => panic!("expected HfConfig, got {other:?}"),
    }
}

#[test]
fn hub_configs_give_the_released_shapes() {
    let gpt2 = ArchConfig::from_hf_config(&hub_gpt2()).unwrap();
    assert_eq!(
        gpt2,
        ArchConfig::Gpt(GptConfig {
            vocab_size: 50257,
            seq_len: 1024,
            n_layer: 12,
            n_head: 12,
            d_model: 768,
            init_std: 0.02,
            tied: true,
        })
    );
    let llama = ArchConfig::from_hf_config(&hub_llama32_1b()).unwrap();
    assert_eq!(
        llama,
        ArchConfig::Llama(LlamaConfig::preset("llama3.2-1b").unwrap())
    );
    assert_eq!(llama.seq_len(), HF_LLAMA_SEQ_LEN);
    let llama2 = ArchConfig::from_hf_config(&hub_llama2_7b()).unwrap();
    assert_eq!(
        llama2,
        ArchConfig::Llama(LlamaConfig::preset("llama2-7b").unwrap())
    );
}

#[test]
fn every_preset_survives_the_round_trip() {
    for (arch, names) in [("gpt", GptConfig::PRESETS), ("llama", LlamaConfig::PRESETS)] {
        for name in names {
            for tied in [false, true] {
                let mut cfg = ArchConfig::preset(arch, name).unwrap();
                match &mut cfg {
                    ArchConfig::Gpt(c) => c.tied = tied,
                    ArchConfig::Llama(c) => c.tied = tied,
                }
                let json = cfg.to_hf_config();
                let back = ArchConfig::from_hf_config(&json).unwrap();
                assert_eq!(back, cfg, "{name}: {json}");
            }
        }
    }
    let linear = ArchConfig::Llama(LlamaConfig {
        rope_scaling: Some(RopeScaling::Linear { factor: 4.0 }),
        ..LlamaConfig::preset("llama-tiny").unwrap()
    });
    let json = linear.to_hf_config();
    assert_eq!(
        json["rope_scaling"],
        json!({"rope_type": "linear", "factor": 4.0})
    );
    assert_eq!(ArchConfig::from_hf_config(&json).unwrap(), linear);
    let gpt = ArchConfig::preset("gpt", "gpt2-small")
        .unwrap()
        .to_hf_config();
    assert_eq!(gpt["architectures"], json!(["GPT2LMHeadModel"]));
    assert_eq!(gpt["n_positions"], json!(1024));
}

#[test]
fn rope_from_transformers_4_and_5_agree() {
    let want = ArchConfig::from_hf_config(&hub_llama32_1b()).unwrap();
    // transformers 5 writes rope_parameters only.
    let params = json!({
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192
    });
    let v5 = with(hub_llama32_1b(), "rope_scaling", Value::Null);
    let v5 = with(v5, "rope_theta", Value::Null);
    let v5 = with(v5, "rope_parameters", params.clone());
    assert_eq!(ArchConfig::from_hf_config(&v5).unwrap(), want);
    // Both, agreeing.
    let both = with(hub_llama32_1b(), "rope_parameters", params.clone());
    assert_eq!(ArchConfig::from_hf_config(&both).unwrap(), want);
    // Both, disagreeing: the error names both values.
    let theta = with(both.clone(), "rope_theta", json!(10000.0));
    let (key, msg) = err_key(&theta);
    assert_eq!(key, "rope_theta");
    assert!(msg.contains("10000") && msg.contains("500000"), "{msg}");
    let mut other = params;
    other["factor"] = json!(8.0);
    let scaling = with(hub_llama32_1b(), "rope_parameters", other);
    let (key, msg) = err_key(&scaling);
    assert_eq!(key, "rope_scaling");
    assert!(msg.contains("32.0") && msg.contains("8.0"), "{msg}");
    // transformers 4's legacy `type`, and the default rope_type.
    let legacy = with(
        hub_llama2_7b(),
        "rope_scaling",
        json!({"type": "linear", "factor": 2.0}),
    );
    match ArchConfig::from_hf_config(&legacy).unwrap() {
        ArchConfig::Llama(c) => {
            assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
            assert_eq!(c.rope_theta, 10000.0);
        }
        other => panic!("{other:?}"),
    }
    let default = with(
        hub_llama2_7b(),
        "rope_parameters",
        json!({"rope_type": "default", "rope_theta": 10000.0}),
    );
    assert_eq!(
        ArchConfig::from_hf_config(&default).unwrap(),
        ArchConfig::from_hf_config(&hub_llama2_7b()).unwrap()
    );
    // llama3 without original_max_position_embeddings takes max_position_embeddings.
    let mut no_orig = hub_llama32_1b();
    no_orig["rope_scaling"]
        .as_object_mut()
        .unwrap()
        .remove("original_max_position_embeddings");
    match ArchConfig::from_hf_config(&no_orig).unwrap() {
        ArchConfig::Llama(LlamaConfig {
            rope_scaling:
                Some(RopeScaling::Llama3 {
                    original_max_position_embeddings,
                    ..
                }),
            ..
        }) => assert_eq!(original_max_position_embeddings, 131072),
        other => panic!("{other:?}"),
    }
}

#[test]
fn defaults_follow_transformers() {
    let mut minimal = json!({
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4
    });
    let ArchConfig::Llama(c) = ArchConfig::from_hf_config(&minimal).unwrap() else {
        panic!("not a Llama")
    };
    assert_eq!(
        (c.n_kv_head, c.head_dim, c.max_position_embeddings),
        (4, 16, 2048)
    );
    assert_eq!(
        (c.rms_norm_eps, c.rope_theta, c.tied),
        (1e-6, 10000.0, false)
    );
    assert_eq!((c.rope_scaling, c.init_std, c.seq_len), (None, 0.02, 2048));
    minimal["head_dim"] = Value::Null;
    minimal["num_key_value_heads"] = Value::Null;
    assert!(ArchConfig::from_hf_config(&minimal).is_ok());
    let gpt = json!({"model_type": "gpt2", "vocab_size": 64, "n_positions": 32,
                     "n_embd": 16, "n_layer": 1, "n_head": 2});
    let ArchConfig::Gpt(g) = ArchConfig::from_hf_config(&gpt).unwrap() else {
        panic!("not a GPT")
    };
    assert!(g.tied);
}

#[test]
fn errors_name_the_key() {
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            with(hub_gpt2(), "model_type", json!("mistral")),
            "model_type",
            "gpt2, llama",
        ),
        (
            with(hub_gpt2(), "model_type", Value::Null),
            "model_type",
            "gpt2, llama",
        ),
        (with(hub_gpt2(), "n_embd", Value::Null), "n_embd", "missing"),
        (
            with(hub_gpt2(), "n_layer", json!("twelve")),
            "n_layer",
            "integer",
        ),
        (
            with(hub_gpt2(), "n_head", json!(7)),
            "n_embd",
            "multiple of n_head = 7",
        ),
        (
            with(hub_gpt2(), "layer_norm_epsilon", json!(1e-6)),
            "layer_norm_epsilon",
            "1e-5",
        ),
        (
            with(hub_gpt2(), "activation_function", json!("relu")),
            "activation_function",
            "relu",
        ),
        (with(hub_gpt2(), "n_inner", json!(1000)), "n_inner", "3072"),
        (
            with(hub_gpt2(), "scale_attn_by_inverse_layer_idx", json!(true)),
            "scale_attn_by_inverse_layer_idx",
            "false",
        ),
        (
            with(hub_gpt2(), "n_positions", json!(0)),
            "n_positions",
            "> 0",
        ),
        (
            with(hub_llama32_1b(), "attention_bias", json!(true)),
            "attention_bias",
            "biases",
        ),
        (
            with(hub_llama32_1b(), "mlp_bias", json!(true)),
            "mlp_bias",
            "biases",
        ),
        (
            with(hub_llama32_1b(), "hidden_act", json!("gelu")),
            "hidden_act",
            "silu",
        ),
        (
            with(hub_llama32_1b(), "num_key_value_heads", json!(5)),
            "num_key_value_heads",
            "divide",
        ),
        (
            with(hub_llama32_1b(), "intermediate_size", json!(0)),
            "intermediate_size",
            "> 0",
        ),
        (
            with(
                hub_llama2_7b(),
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 4.0}),
            ),
            "rope_scaling.rope_type",
            "yarn",
        ),
        (
            with(
                hub_llama2_7b(),
                "rope_scaling",
                json!({"type": "dynamic", "factor": 2.0}),
            ),
            "rope_scaling.type",
            "dynamic",
        ),
        (
            with(
                hub_llama2_7b(),
                "rope_scaling",
                json!({"rope_type": "linear"}),
            ),
            "rope_scaling.factor",
            "missing",
        ),
        (
            with(
                hub_llama2_7b(),
                "rope_parameters",
                json!({"rope_type": "default", "rope_theta": 10000.0,
                       "partial_rotary_factor": 0.5}),
            ),
            "rope_parameters.partial_rotary_factor",
            "0.5",
        ),
        (
            with(hub_llama2_7b(), "rope_scaling", json!("linear")),
            "rope_scaling",
            "object",
        ),
        (
            with(
                with(hub_llama2_7b(), "hidden_size", json!(100)),
                "head_dim",
                Value::Null,
            ),
            "head_dim",
            "multiple",
        ),
    ];
    for (json, key, words) in cases {
        let (got, msg) = err_key(&json);
        assert_eq!(got, key, "{msg}");
        assert!(msg.contains(words), "{key}: {msg} lacks {words:?}");
    }
    assert!(ArchConfig::from_hf_config(&json!([1, 2])).is_err());
}
