//! zrun's GPT-2 and Llama against Hugging Face transformers, in fp32 on the CPU.
//!
//! One Python process (`tests/hf/tiny_model.py` with the project's `.venv`) builds tiny
//! random-weight models with transformers and saves them, loads models that zrun exported,
//! and records logits and greedy generations. Here the weights are read with
//! `Tensor::read_safetensors`, mapped with `Model::hf_params`, the config parsed with
//! `ArchConfig::from_hf_config`; logits must agree within 1e-5 (max abs difference over max
//! abs logit) and greedy generation through `forward_model_cached` must pick transformers'
//! tokens. Exported presets' `config.json` must give transformers the same parameter count
//! and rotary frequencies.
//!
//!     cargo test --release -p zrun-models --test transformers

zrun_torch_ext::end_tests_without_destructors!();

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use zrun_models::{
    forward_model, forward_model_cached, init_model_params, ArchConfig, KvCache, LlamaConfig,
    Model, RopeScaling,
};

const CPU: Device = Device::Cpu;

/// Largest allowed `max |zrun - transformers| / max |transformers|` of the logits.
const TOLERANCE: f64 = 1e-5;

/// Prompt length and number of generated tokens.
const PROMPT: i64 = 5;
const NEW_TOKENS: i64 = 12;

fn python() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf/tiny_model.py")
}

/// Fixed token ids below `v`: (rows, cols), from a small linear congruential sequence.
fn token_rows(rows: usize, cols: usize, v: i64, seed: i64) -> Vec<Vec<i64>> {
    let mut x = seed;
    (0..rows)
        .map(|_| {
            (0..cols)
                .map(|_| {
                    x = (x * 1_103_515_245 + 12345).rem_euclid(1 << 31);
                    x % v
                })
                .collect()
        })
        .collect()
}

fn to_tensor(rows: &[Vec<i64>]) -> Tensor {
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).reshape([rows.len() as i64, -1])
}

/// A case transformers builds (from its config) and zrun loads.
fn built(dir: &Path, config: Value, seed: u64) -> Value {
    let v = config["vocab_size"].as_i64().unwrap();
    json!({
        "dir": dir,
        "build": {"config": config, "seed": seed, "std": 0.25},
        "tokens": token_rows(2, 24, v, seed as i64),
        "prompt": token_rows(2, PROMPT as usize, v, seed as i64 + 1),
        "new_tokens": NEW_TOKENS,
    })
}

/// Read `dir`'s weights into one `Vec<Tensor>` per unit of `model`, through `hf_params`,
/// `hf_alias` and `hf_ignored`; every tensor of the file must be used or ignored.
fn load_weights(dir: &Path, cfg: &ArchConfig, model: &dyn Model) -> Result<Vec<Vec<Tensor>>> {
    let file = dir.join("model.safetensors");
    let mut by_name: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in Tensor::read_safetensors(&file).context("read_safetensors")? {
        if cfg.hf_ignored(&name) {
            continue;
        }
        by_name.insert(cfg.hf_alias(&name).unwrap_or(name), t);
    }
    let mut hf = model.hf_params().into_iter();
    let mut params = Vec::new();
    for unit in model.units() {
        let mut tensors = Vec::new();
        for spec in unit.params() {
            let p = hf.next().context("hf_params shorter than the parameters")?;
            ensure!(
                p.name == spec.name,
                "hf_params order: {} vs {}",
                p.name,
                spec.name
            );
            let t = by_name
                .remove(&p.hf_name)
                .with_context(|| format!("{} lacks {}", file.display(), p.hf_name))?;
            let t = if p.transpose { t.tr().contiguous() } else { t };
            ensure!(
                t.size() == spec.shape,
                "{}: {:?} vs {:?}",
                p.hf_name,
                t.size(),
                spec.shape
            );
            tensors.push(t.to_kind(Kind::Float));
        }
        params.push(tensors);
    }
    ensure!(by_name.is_empty(), "unused tensors: {:?}", by_name.keys());
    Ok(params)
}

/// Write `params` as a transformers checkpoint in `dir`: config.json and model.safetensors.
fn export(dir: &Path, cfg: &ArchConfig, model: &dyn Model, params: &[Vec<Tensor>]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let config = serde_json::to_string_pretty(&cfg.to_hf_config())?;
    std::fs::write(dir.join("config.json"), config)?;
    let flat: Vec<&Tensor> = params.iter().flatten().collect();
    let hf = model.hf_params();
    ensure!(hf.len() == flat.len());
    let named: Vec<(String, Tensor)> = hf
        .iter()
        .zip(flat)
        .map(|(p, t)| {
            let t = if p.transpose {
                t.tr()
            } else {
                t.shallow_clone()
            };
            (p.hf_name.clone(), t.contiguous())
        })
        .collect();
    Tensor::write_safetensors(&named, dir.join("model.safetensors"))?;
    Ok(())
}

/// Greedy generation with the KV cache: (B, P) -> (B, P + n).
fn generate(model: &dyn Model, params: &[Vec<Tensor>], prompt: &Tensor, n: i64) -> Result<Tensor> {
    let _guard = tch::no_grad_guard();
    let mut caches: Vec<KvCache> = model.units().iter().map(|_| KvCache::default()).collect();
    let mut out = prompt.shallow_clone();
    let mut logits = forward_model_cached(model, params, prompt, 0, &mut caches)?;
    for _ in 0..n {
        let last = logits.narrow(1, -1, 1); // (B, 1, V)
        let next = last.argmax(-1, false); // (B, 1)
        let pos = out.size()[1];
        out = Tensor::cat(&[&out, &next], 1);
        logits = forward_model_cached(model, params, &next, pos, &mut caches)?;
    }
    Ok(out)
}

/// Compare zrun's logits and generation with `dir`/expected.safetensors.
fn compare(case: &Value, model: &dyn Model, params: &[Vec<Tensor>]) -> Result<String> {
    let dir = Path::new(case["dir"].as_str().unwrap());
    let expected: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("expected.safetensors"))?
            .into_iter()
            .collect();
    let rows = |key: &str| -> Vec<Vec<i64>> { serde_json::from_value(case[key].clone()).unwrap() };
    let idx = to_tensor(&rows("tokens"));
    let ours = tch::no_grad(|| forward_model(model, params, &idx))?;
    let theirs = &expected["logits"];
    let scale = theirs.abs().max().double_value(&[]);
    let rel = (&ours - theirs).abs().max().double_value(&[]) / scale;
    ensure!(
        rel < TOLERANCE,
        "logits differ by {rel:.2e} of max |logit| {scale:.3}"
    );
    let prompt = to_tensor(&rows("prompt"));
    let generated = generate(model, params, &prompt, NEW_TOKENS)?;
    let want = &expected["generated"];
    ensure!(
        generated.size() == want.size() && generated.equal(want),
        "greedy tokens differ:\nzrun         {:?}\ntransformers {:?}",
        Vec::<i64>::try_from(generated.reshape([-1]))?,
        Vec::<i64>::try_from(want.reshape([-1]))?,
    );
    Ok(format!("logits within {rel:.1e}"))
}

/// A zrun model exported for transformers: random weights (norms around 1).
fn exported(dir: &Path, cfg: &ArchConfig, seed: u64) -> Result<(Value, Vec<Vec<Tensor>>)> {
    let model = cfg.build()?;
    let mut params = init_model_params(model.as_ref(), seed, Kind::Float, CPU)?;
    tch::manual_seed(seed as i64);
    for t in params.iter_mut().flatten() {
        if t.dim() == 1 {
            *t = &*t + Tensor::randn(t.size(), (Kind::Float, CPU)) * 0.1;
        }
    }
    export(dir, cfg, model.as_ref(), &params)?;
    let v = cfg.vocab_size();
    let case = json!({
        "dir": dir,
        "load": true,
        "tokens": token_rows(2, 24, v, seed as i64),
        "prompt": token_rows(2, PROMPT as usize, v, seed as i64 + 1),
        "new_tokens": NEW_TOKENS,
    });
    Ok((case, params))
}

fn llama_hf(extra: Value) -> Value {
    let mut c = json!({
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "bos_token_id": null,
        "eos_token_id": null,
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

#[test]
fn zrun_and_transformers_agree() -> Result<()> {
    let python = python();
    ensure!(
        python.exists(),
        "{} is missing: run scripts/setup.sh (it installs torch and transformers into .venv)",
        python.display()
    );
    let tmp = tempfile::tempdir()?;
    let d = |name: &str| tmp.path().join(name);

    // Built by transformers, loaded by zrun.
    let mut cases: Vec<(&str, Value)> = vec![
        (
            "gpt2 tied",
            built(
                &d("gpt2"),
                json!({"model_type": "gpt2", "vocab_size": 96, "n_positions": 32, "n_embd": 32,
                       "n_layer": 2, "n_head": 4, "bos_token_id": null, "eos_token_id": null}),
                1,
            ),
        ),
        (
            "llama gqa untied",
            built(&d("llama_gqa"), llama_hf(json!({})), 2),
        ),
        (
            "llama tied",
            built(
                &d("llama_tied"),
                llama_hf(json!({"tie_word_embeddings": true, "num_key_value_heads": 4})),
                3,
            ),
        ),
        (
            "llama3 rope scaling",
            built(
                &d("llama3_rope"),
                llama_hf(json!({
                    "head_dim": 16,
                    "rope_theta": 500000.0,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64},
                })),
                4,
            ),
        ),
        (
            "llama linear rope scaling",
            built(
                &d("linear_rope"),
                llama_hf(json!({"rope_scaling": {"type": "linear", "factor": 4.0}})),
                5,
            ),
        ),
    ];

    // Exported by zrun, loaded by transformers.
    let gpt_export = ArchConfig::from(zrun_models::GptConfig {
        vocab_size: 80,
        seq_len: 32,
        n_layer: 2,
        n_head: 2,
        d_model: 32,
        init_std: 0.25,
        tied: true,
    });
    let llama_export = ArchConfig::from(LlamaConfig {
        vocab_size: 80,
        seq_len: 64,
        max_position_embeddings: 128,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 1,
        d_model: 48,
        head_dim: 16,
        ffn_hidden: 96,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        }),
        tied: true,
        init_std: 0.25,
    });
    let (gpt_case, gpt_params) = exported(&d("export_gpt"), &gpt_export, 6)?;
    let (llama_case, llama_params) = exported(&d("export_llama"), &llama_export, 7)?;
    cases.push(("exported gpt2 tied", gpt_case));
    cases.push(("exported llama3 gqa tied", llama_case));

    // Presets' config.json: transformers counts the parameters (on the meta device).
    let presets = [
        ("gpt", "gpt2-small"),
        ("llama", "llama3.2-1b"),
        ("llama", "llama3.1-8b"),
        ("llama", "llama2-7b"),
    ];
    for (arch, name) in presets {
        let dir = d(name);
        std::fs::create_dir_all(&dir)?;
        let cfg = ArchConfig::preset(arch, name)?;
        std::fs::write(dir.join("config.json"), cfg.to_hf_config().to_string())?;
        cases.push((name, json!({"dir": dir, "inspect": true})));
    }

    let spec = d("spec.json");
    let all: Vec<&Value> = cases.iter().map(|(_, c)| c).collect();
    std::fs::write(&spec, json!({ "cases": all }).to_string())?;
    let out = Command::new(&python)
        .arg(script())
        .arg(&spec)
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed ({}); is transformers installed (scripts/setup.sh)?\n{}",
            python.display(),
            script().display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let mut failures = Vec::new();
    for (name, case) in &cases {
        let dir = PathBuf::from(case["dir"].as_str().unwrap());
        let result = (|| -> Result<String> {
            if case.get("inspect").is_some() {
                let cfg = ArchConfig::from_hf_config(&serde_json::from_str(
                    &std::fs::read_to_string(dir.join("config.json"))?,
                )?)?;
                let model = cfg.build()?;
                let expected: HashMap<String, Tensor> =
                    Tensor::read_safetensors(dir.join("expected.safetensors"))?
                        .into_iter()
                        .collect();
                let count = expected["param_count"].int64_value(&[0]);
                ensure!(
                    count == model.param_count(),
                    "transformers counts {count}, zrun {}",
                    model.param_count()
                );
                if let ArchConfig::Llama(l) = &cfg {
                    let ours = l.rope_inv_freq(CPU)?;
                    let theirs = &expected["inv_freq"];
                    let rel = ((&ours - theirs).abs() / theirs).max().double_value(&[]);
                    ensure!(rel < 1e-6, "inv_freq differs by {rel:.2e}");
                }
                return Ok(format!("{count} parameters"));
            }
            if case.get("load").is_some() {
                let (cfg, params) = if name.contains("gpt") {
                    (&gpt_export, &gpt_params)
                } else {
                    (&llama_export, &llama_params)
                };
                // What transformers loaded is what zrun wrote.
                let model = cfg.build()?;
                let back = load_weights(&dir, cfg, model.as_ref())?;
                let same = back
                    .iter()
                    .flatten()
                    .zip(params.iter().flatten())
                    .all(|(a, b)| a.equal(b));
                ensure!(same, "the weights read back differ from those written");
                return compare(case, model.as_ref(), params);
            }
            let json: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
            let cfg = ArchConfig::from_hf_config(&json)?;
            let model = cfg.build()?;
            let params = load_weights(&dir, &cfg, model.as_ref())?;
            compare(case, model.as_ref(), &params)
        })();
        match result {
            Ok(msg) => eprintln!("{name}: ok ({msg})"),
            Err(e) => failures.push(format!("{name}: {e:#}")),
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}
