//! Hugging Face models through the trainer, against transformers in fp32 on the CPU:
//! `model.init_from` at one rank (stage 0) and two real processes (stage 3) gives
//! transformers' logits, and one training step gives its loss and, with
//! `torch.optim.AdamW`, its updated parameters; a checkpoint saved right after the import
//! exports (`zrun_train::hf::export`) to the very tensors imported, which transformers loads
//! to the same logits. Cases: GPT-2 (tied), Llama with grouped-query attention (untied), and
//! a tied Llama with Llama 3 rotary scaling.
//!
//! Python (`.venv`, `tests/hf/tiny_model.py` and `tests/hf/train_step.py`) builds the models
//! with random weights and computes the reference; nothing is downloaded.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use serde_json::{json, Value};
use tch::Tensor;
use zrun_ckpt::{HfDir, OutDtype};
use zrun_train::checkpoint::Position;
use zrun_train::config::Config;
use zrun_train::trainer::Run;

/// Sequences per step (split over the ranks) and their length.
const BATCH: usize = 4;
const SEQ: usize = 16;
const LR: f64 = 1e-3;
const WEIGHT_DECAY: f64 = 0.1;
/// AdamW's epsilon, above the rounding noise of gradients that are zero in exact arithmetic
/// (attention's key bias: softmax ignores a shift shared by all keys), which AdamW's first
/// step would otherwise blow up to +-lr on either side.
const EPS: f64 = 1e-5;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs a script of tests/hf with the project's Python on a JSON spec.
fn python(script: &str, spec: &Value, dir: &Path) {
    let file = dir.join(format!("{script}.json"));
    std::fs::write(&file, spec.to_string()).unwrap();
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/hf").join(script))
        .arg(&file)
        .output()
        .expect("the project's .venv python runs (make setup)");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Token ids below `v`, (rows, cols), from a linear congruential sequence.
fn tokens(rows: usize, cols: usize, v: i64, seed: i64) -> Vec<Vec<i64>> {
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

fn tensor(rows: &[Vec<i64>]) -> Tensor {
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).reshape([rows.len() as i64, -1])
}

/// The test's cases: name and transformers config.
fn cases() -> Vec<(&'static str, Value)> {
    vec![
        (
            "gpt2",
            json!({"model_type": "gpt2", "vocab_size": 96, "n_positions": 32, "n_embd": 32,
                   "n_layer": 2, "n_head": 4}),
        ),
        (
            "llama-gqa",
            json!({"model_type": "llama", "vocab_size": 80, "hidden_size": 32,
                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 64,
                   "rms_norm_eps": 1e-5, "tie_word_embeddings": false}),
        ),
        (
            "llama-tied-rope3",
            json!({"model_type": "llama", "vocab_size": 72, "hidden_size": 32,
                   "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64,
                   "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "tie_word_embeddings": true,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}}),
        ),
    ]
}

/// Inputs and shifted targets of the training step.
fn batch(v: i64, seed: i64) -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
    let rows = tokens(BATCH, SEQ + 1, v, seed);
    let x = rows.iter().map(|r| r[..SEQ].to_vec()).collect();
    let y = rows.iter().map(|r| r[1..].to_vec()).collect();
    (x, y)
}

const CONFIG: &str = r#"
[data]
branching = 2
[train]
steps = 1
lr = 1e-3
weight_decay = 0.1
eps = 1e-5
grad_clip = 0.0
threads = 1
eval_batches = 1
[checkpoint]
every = 0
"#;

/// One rank: import, logits of the case's tokens, a checkpoint of the import, then one
/// training step on this rank's rows of the batch. Rank 0 writes the logits and the
/// parameters; every rank its loss.
fn rank_job(comm: Arc<dyn zrun_comm::Communicator>) -> anyhow::Result<()> {
    let dir = PathBuf::from(std::env::var("ZRUN_HF_DIR")?);
    let out = PathBuf::from(std::env::var("ZRUN_HF_OUT")?);
    let stage: u8 = std::env::var("ZRUN_HF_STAGE")?.parse()?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let config = out.join("train.toml");
    let sets = vec![
        format!("model.init_from=\"{}\"", dir.display()),
        format!("zero.stage={stage}"),
        format!("train.micro_batch={}", BATCH / world),
        format!("log.dir=\"{}\"", out.display()),
    ];
    let cfg = Config::load(&config, &sets)?;
    let mut run = Run::new(&cfg, comm, &zrun_comm::Topology::single())?;
    run.restore()?;
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("case.json"))?)?;
    let rows = |k: &str| -> Vec<Vec<i64>> { serde_json::from_value(spec[k].clone()).unwrap() };
    let logits = run.engine_mut().logits(&tensor(&rows("tokens")))?;
    run.save(&Position {
        step: 0,
        next_sample: 0,
        lr: 0.0,
    })?;
    let per = BATCH / world;
    let mine = |k: &str| rows(k)[rank * per..(rank + 1) * per].to_vec();
    let e = run.engine_mut();
    let loss = e.forward_backward(&tensor(&mine("inputs")), &tensor(&mine("targets")), 1.0)?;
    let stats = e.step(LR, 0.0)?;
    anyhow::ensure!(stats.applied, "the step was skipped");
    std::fs::write(out.join(format!("loss-{rank}")), loss.to_string())?;
    let params = e.full_parameters()?;
    if rank == 0 {
        let mut named: Vec<(String, Tensor)> = params;
        named.push(("logits".into(), logits));
        let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&refs, out.join("zrun.safetensors"))?;
    }
    Ok(())
}

#[test]
#[ignore = "one rank of transformers_equivalence"]
fn hf_rank() {
    if common::is_rank() {
        common::end_rank(rank_job(common::rank_comm()));
    }
}

fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).abs().max().double_value(&[]);
    d / b.abs().max().double_value(&[]).max(1e-30)
}

fn read(file: &Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(file)
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn transformers_equivalence() {
    let base = common::scratch("hf", "eq");
    let mut builds = Vec::new();
    let mut steps = Vec::new();
    for (i, (name, config)) in cases().into_iter().enumerate() {
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let v = config["vocab_size"].as_i64().unwrap();
        let (x, y) = batch(v, 100 + i as i64);
        let case = json!({
            "dir": dir, "build": {"config": config, "seed": i, "std": 0.25},
            "tokens": tokens(2, SEQ, v, i as i64), "prompt": tokens(1, 3, v, 7),
            "new_tokens": 1, "inputs": x, "targets": y,
        });
        std::fs::write(dir.join("case.json"), case.to_string()).unwrap();
        builds.push(case);
        steps.push(json!({"dir": dir, "inputs": x, "targets": y, "lr": LR,
                          "betas": [0.9, 0.95], "eps": EPS, "weight_decay": WEIGHT_DECAY}));
    }
    python("tiny_model.py", &json!({ "cases": builds }), &base);
    python("train_step.py", &json!({ "cases": steps }), &base);

    let mut exports = Vec::new();
    for (name, _) in cases() {
        let dir = base.join(name);
        let want = read(&dir.join("expected.safetensors"));
        let step = read(&dir.join("step.safetensors"));
        let model = zrun_train::hf::load_full(&dir).unwrap().model;
        for (world, stage) in [(1, 0), (2, 3)] {
            let what = format!("{name} at {world} rank(s), stage {stage}");
            let out = base.join(format!("{name}-w{world}"));
            std::fs::create_dir_all(&out).unwrap();
            std::fs::write(out.join("train.toml"), CONFIG).unwrap();
            let env = [
                ("ZRUN_HF_DIR", dir.display().to_string()),
                ("ZRUN_HF_OUT", out.display().to_string()),
                ("ZRUN_HF_STAGE", stage.to_string()),
            ];
            common::spawn_ranks("hf_rank", &what, world, &env);
            let got = read(&out.join("zrun.safetensors"));
            let err = max_rel(&got["logits"], &want["logits"]);
            assert!(err <= 1e-5, "{what}: logits differ by {err:e} (relative)");
            let loss: f64 = (0..world)
                .map(|r| {
                    let s = std::fs::read_to_string(out.join(format!("loss-{r}"))).unwrap();
                    s.parse::<f64>().unwrap()
                })
                .sum::<f64>()
                / world as f64;
            let want_loss = step["loss"].double_value(&[0]);
            let rel = (loss - want_loss).abs() / want_loss;
            assert!(rel <= 1e-5, "{what}: loss {loss} vs {want_loss}");
            let mut worst = 0f64;
            for p in model.hf_params() {
                let theirs = &step[&p.hf_name];
                let mine = if p.transpose {
                    got[&p.name].tr()
                } else {
                    got[&p.name].shallow_clone()
                };
                let d = (&mine - theirs).abs().max().double_value(&[]);
                if d > 1e-5 {
                    eprintln!("{what}: {} differs by {d:e}", p.name);
                }
                worst = worst.max(d);
            }
            assert!(
                worst <= 1e-5,
                "{what}: updated parameters differ by {worst:e}"
            );
        }
        // The checkpoint of the import (two ranks, stage 3) exported: the tensors imported.
        let ckpt = base.join(format!("{name}-w2/ckpt/step-00000000"));
        let export = base.join(format!("{name}-export"));
        zrun_train::hf::export(&ckpt, &export, OutDtype::F32, 1 << 30).unwrap();
        let (src, dst) = (HfDir::open(&dir).unwrap(), HfDir::open(&export).unwrap());
        assert_eq!(src.names(), dst.names(), "{name}: exported tensor names");
        for t in dst.names() {
            let n: usize = dst.info(t).unwrap().shape.iter().product();
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            src.read(t, 0, &mut a).unwrap();
            dst.read(t, 0, &mut b).unwrap();
            assert!(a == b, "{name}: exported {t} differs from the imported one");
        }
        let mut case: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).unwrap()).unwrap();
        case["dir"] = json!(export);
        case.as_object_mut().unwrap().remove("build");
        case["load"] = json!(true);
        exports.push(case);
    }
    // transformers loads every export and computes the imported model's logits.
    python("tiny_model.py", &json!({ "cases": exports }), &base);
    for (name, _) in cases() {
        let want = read(&base.join(name).join("expected.safetensors"));
        let got = read(&base.join(format!("{name}-export/expected.safetensors")));
        let err = max_rel(&got["logits"], &want["logits"]);
        assert!(err == 0.0, "{name}: the export's logits differ by {err:e}");
    }
}
