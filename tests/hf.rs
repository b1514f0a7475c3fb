//! Hugging Face models through the `zrun` binary: greedy `zrun sample` picks transformers'
//! `generate(do_sample=False)` tokens (GPT-2 and Llama); a Llama fine-tuned for 5 steps on 2
//! ranks at stage 3, exported with `zrun export --hf`, loads in transformers with the logits
//! zrun computes from the checkpoint; and bad model directories are one-line errors with
//! exit code 2 naming the file and the key or tensor.

zrun_torch_ext::end_tests_without_destructors!();

mod common;
/// Stopping a zrun run at a chosen point of its work (shared with tests/prepare.rs).
#[path = "prepare/interrupt.rs"]
mod interrupt;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{scratch, stderr, stdout, zrun, zrun_file_limit, Scratch};
use interrupt::{interrupt_early, Seen};
use serde_json::{json, Value};
use tch::Tensor;

fn root() -> PathBuf {
    common::root()
}

/// Builds (or loads, for exports) models with transformers: `tests/hf/tiny_model.py`.
fn tiny_models(cases: Vec<Value>, dir: &Path) {
    let spec = dir.join("spec.json");
    std::fs::write(&spec, json!({ "cases": cases }).to_string()).unwrap();
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/hf/tiny_model.py"))
        .arg(&spec)
        .output()
        .expect("the project's .venv python runs (make setup)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn gpt2() -> Value {
    json!({"model_type": "gpt2", "vocab_size": 96, "n_positions": 64, "n_embd": 32,
           "n_layer": 2, "n_head": 4})
}

fn llama() -> Value {
    json!({"model_type": "llama", "vocab_size": 80, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": true})
}

fn case(dir: &Path, config: Value, seed: u64) -> Value {
    json!({
        "dir": dir, "build": {"config": config, "seed": seed, "std": 0.3},
        "tokens": [[1, 5, 9, 3, 7, 2, 11, 4], [6, 0, 8, 10, 12, 3, 1, 9]],
        "prompt": [[3, 14, 15, 9, 2]], "new_tokens": 10,
    })
}

fn read(file: &Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(file)
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn greedy_sample_is_transformers_generate() {
    let base = scratch("hf-sample");
    let (g, l) = (base.join("gpt2"), base.join("llama"));
    tiny_models(vec![case(&g, gpt2(), 1), case(&l, llama(), 2)], &base);
    for dir in [&g, &l] {
        let want = read(&dir.join("expected.safetensors"))["generated"].shallow_clone();
        let want: Vec<i64> = Vec::try_from(want.flatten(0, -1)).unwrap();
        let d = dir.display().to_string();
        let o = zrun(&[
            "sample",
            &d,
            "--prompt-ids",
            "3,14,15,9,2",
            "--max-new-tokens",
            "10",
            "--greedy",
            "--ignore-eos",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        let tokens: Vec<i64> = serde_json::from_value(got["tokens"].clone()).unwrap();
        assert_eq!(
            tokens,
            want[5..],
            "{d}: zrun sample against transformers' generate"
        );
    }
}

#[test]
fn a_fine_tuned_export_loads_in_transformers_with_zruns_logits() {
    let base = scratch("hf-finetune");
    let model = base.join("llama");
    tiny_models(vec![case(&model, llama(), 3)], &base);
    let config = common::write(
        &base,
        "train.toml",
        format!(
            "[model]\ninit_from = \"{}\"\nseq_len = 16\n[data]\nbranching = 4\n\
             [train]\nsteps = 5\nmicro_batch = 2\nlr = 1e-2\nthreads = 1\neval_batches = 1\n\
             [zero]\nstage = 3\n[checkpoint]\nevery = 5\n[log]\ndir = \"{}\"\n",
            model.display(),
            base.join("run").display()
        )
        .as_bytes(),
    );
    let o = zrun(&["--nproc", "2", &config]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = base.join("run/ckpt/step-00000005");
    let out = base.join("export");
    let o = zrun(&[
        "export",
        &ckpt.display().to_string(),
        "--hf",
        &out.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("tensors"), "{}", stdout(&o));
    // The original model's special tokens travel with the export.
    let config = |d: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
    };
    let (src, dst) = (config(&model), config(&out));
    assert!(!src["eos_token_id"].is_null(), "{src}");
    assert_eq!(dst["eos_token_id"], src["eos_token_id"]);
    assert_eq!(dst["bos_token_id"], src["bos_token_id"]);
    // transformers loads the export (no missing or unexpected keys, or it fails) ...
    let mut load = case(&out, Value::Null, 0);
    load.as_object_mut().unwrap().remove("build");
    load["load"] = json!(true);
    tiny_models(vec![load], &base);
    let theirs = read(&out.join("expected.safetensors"))["logits"].shallow_clone();
    // ... and computes the logits zrun computes from the checkpoint.
    let m = zrun_train::hf::load_full(&ckpt).unwrap();
    let idx =
        Tensor::from_slice(&[1i64, 5, 9, 3, 7, 2, 11, 4, 6, 0, 8, 10, 12, 3, 1, 9]).reshape([2, 8]);
    let ours = zrun_models::forward_model(m.model.as_ref(), &m.params, &idx).unwrap();
    let err =
        (&ours - &theirs).abs().max().double_value(&[]) / theirs.abs().max().double_value(&[]);
    assert!(err <= 1e-5, "exported logits differ by {err:e} (relative)");
    // Training moved the weights: the export is not the imported model.
    let before = read(&model.join("expected.safetensors"))["logits"].shallow_clone();
    assert!((&ours - &before).abs().max().double_value(&[]) > 1e-3);
}

/// A copy of a model directory with `edit` applied, trained for one step: exit code 2 and
/// one line containing `want`.
fn refused(base: &Path, model: &Path, name: &str, edit: impl Fn(&Path), want: &[&str]) {
    let dir = base.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(model).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    edit(&dir);
    let config = common::write(
        base,
        &format!("{name}.toml"),
        format!(
            "[model]\ninit_from = \"{}\"\n[train]\nsteps = 1\nmicro_batch = 1\nthreads = 1\n\
             [log]\ndir = \"{}\"\n",
            dir.display(),
            base.join(format!("run-{name}")).display()
        )
        .as_bytes(),
    );
    let o = zrun(&[&config]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{name}: {err}");
    let line = err.lines().find(|l| l.contains("error")).unwrap_or("");
    for w in want {
        assert!(
            line.contains(w),
            "{name}: {line:?} lacks {w:?} (stderr: {err})"
        );
    }
}

#[test]
fn bad_model_directories_are_one_line_errors() {
    let base = scratch("hf-bad");
    let model = base.join("gpt2");
    tiny_models(vec![case(&model, gpt2(), 4)], &base);
    let json_edit = |f: &'static str, key: &'static str, v: Value| {
        move |d: &Path| {
            let p = d.join(f);
            let mut j: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            j[key] = v.clone();
            std::fs::write(&p, j.to_string()).unwrap();
        }
    };
    refused(
        &base,
        &model,
        "no-config",
        |d| std::fs::remove_file(d.join("config.json")).unwrap(),
        &["config.json", "model.init_from"],
    );
    refused(
        &base,
        &model,
        "model-type",
        json_edit("config.json", "model_type", json!("mamba")),
        &["config.json", "model_type", "mamba"],
    );
    refused(
        &base,
        &model,
        "shape",
        json_edit("config.json", "vocab_size", json!(100)),
        &[
            "model.safetensors",
            "transformer.wte.weight",
            "[96, 32]",
            "[100, 32]",
        ],
    );
    // A tensor missing: the weights rewritten without the last block's MLP output.
    refused(
        &base,
        &model,
        "missing",
        |d| {
            let f = d.join("model.safetensors");
            let mut t = read(&f);
            assert!(t.remove("transformer.h.1.mlp.c_proj.weight").is_some());
            let refs: Vec<(&str, &Tensor)> = t.iter().map(|(n, t)| (n.as_str(), t)).collect();
            Tensor::write_safetensors(&refs, &f).unwrap();
        },
        &["transformer.h.1.mlp.c_proj.weight", "missing"],
    );
    refused(
        &base,
        &model,
        "unexpected",
        |d| {
            let f = d.join("model.safetensors");
            let mut t = read(&f);
            t.insert(
                "transformer.h.0.attn.q_norm.weight".into(),
                Tensor::ones([8], tch::kind::FLOAT_CPU),
            );
            let refs: Vec<(&str, &Tensor)> = t.iter().map(|(n, t)| (n.as_str(), t)).collect();
            Tensor::write_safetensors(&refs, &f).unwrap();
        },
        &[
            "model.safetensors",
            "transformer.h.0.attn.q_norm.weight",
            "not part of",
        ],
    );
    refused(
        &base,
        &model,
        "index",
        |d| {
            std::fs::rename(d.join("model.safetensors"), d.join("part-1.safetensors")).unwrap();
            let t = read(&d.join("part-1.safetensors"));
            let map: serde_json::Map<String, Value> = t
                .keys()
                .map(|k| (k.clone(), json!("part-2.safetensors")))
                .collect();
            std::fs::write(
                d.join("model.safetensors.index.json"),
                json!({"metadata": {}, "weight_map": map}).to_string(),
            )
            .unwrap();
        },
        &["model.safetensors.index.json", "part-2.safetensors"],
    );
}

/// A checkpoint of the demo's tiny GPT after 2 steps on 1 rank, alone in `scratch(name)`:
/// that directory (removed when it drops) and the checkpoint's.
fn tiny_checkpoint(name: &str) -> (Scratch, PathBuf) {
    let dir = scratch(name);
    let train = dir.join("train");
    let o = train_tiny(&train, 2, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = dir.join("step-00000002");
    std::fs::rename(train.join("ckpt/step-00000002"), &ckpt).unwrap();
    std::fs::remove_dir_all(&train).unwrap();
    (dir, ckpt)
}

/// Trains the demo's tiny GPT on 1 rank for `steps` steps into `log_dir`, saving the last
/// step, with `more` overrides.
fn train_tiny(log_dir: &Path, steps: u64, more: &[String]) -> std::process::Output {
    let mut sets = vec![
        format!("log.dir=\"{}\"", log_dir.display()),
        format!("train.steps={steps}"),
        format!("checkpoint.every={steps}"),
        "train.eval_every=0".into(),
        "train.micro_batch=2".into(),
        "train.threads=1".into(),
    ];
    sets.extend_from_slice(more);
    let mut a = vec!["configs/tiny-cpu.toml".to_string()];
    a.extend(sets.into_iter().flat_map(|s| ["--set".to_string(), s]));
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    zrun(&refs)
}

/// The one error line of a refused command: exit code 2, exactly one line saying `error`.
fn one_error_line(o: &std::process::Output) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("error"), "{err}");
    lines[0].to_string()
}

/// Entries of `dir` whose names start with `prefix`.
fn entries_like(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Rewrites `ckpt`'s manifest after `edit`, as format version 1 (before manifests carried
/// their own hash), so only the edited tables stand between the reader and the files.
fn edit_manifest(ckpt: &Path, edit: impl FnOnce(&mut Value)) {
    let path = ckpt.join("manifest.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("manifest_hash");
    v["format_version"] = json!(1);
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

#[test]
fn export_verifies_every_hash_before_its_directory_appears() {
    let (_dir, ckpt) = tiny_checkpoint("hf-flipped");
    let base = ckpt.parent().unwrap().to_path_buf();
    let f = ckpt.join("rank-00000.safetensors");
    let good = std::fs::read(&f).unwrap();
    let mut bad = good.clone();
    let at = bad.len() - 100;
    bad[at] ^= 0x04;
    std::fs::write(&f, &bad).unwrap();
    let out = base.join("export");
    let (c, o) = (ckpt.display().to_string(), out.display().to_string());
    let line = one_error_line(&zrun(&["export", &c, "--hf", &o]));
    assert!(
        line.contains("rank-00000.safetensors") && line.contains("hash"),
        "{line}"
    );
    assert!(!out.exists(), "a damaged checkpoint left {o}");
    assert!(
        entries_like(&base, "export").is_empty(),
        "temporary files left"
    );
    // Sampling from the damaged checkpoint is refused the same way.
    let line = one_error_line(&zrun(&[
        "sample",
        &c,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ]));
    assert!(line.contains("hash"), "{line}");
    // Repaired: the export appears whole; a second export into it is refused, it untouched.
    std::fs::write(&f, &good).unwrap();
    let ok = zrun(&["export", &c, "--hf", &o]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert!(out.join("model.safetensors").is_file() && out.join("config.json").is_file());
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    let line = one_error_line(&zrun(&["export", &c, "--hf", &o]));
    assert!(line.contains("already exists"), "{line}");
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        before
    );
    assert_eq!(entries_like(&base, "export"), vec!["export".to_string()]);
}

#[test]
fn a_file_given_as_the_checkpoint_is_one_line_of_bad_input() {
    let d = scratch("hf-file-as-checkpoint");
    let file = d.join("train.toml");
    std::fs::write(&file, "[model]\npreset = \"tiny\"\n").unwrap();
    let (f, o) = (
        file.display().to_string(),
        d.join("out").display().to_string(),
    );
    for args in [
        vec!["consolidate", &f, "-o", &o],
        vec!["export", &f, "--hf", &o],
        vec!["sample", &f, "--prompt-ids", "1"],
    ] {
        let line = one_error_line(&zrun(&args));
        assert!(line.contains("a file, not a directory"), "{args:?}: {line}");
    }
    assert!(!d.join("out").exists());
}

#[test]
fn consolidate_refuses_a_rank_file_outside_the_checkpoint() {
    let (_dir, ckpt) = tiny_checkpoint("hf-outside");
    let base = ckpt.parent().unwrap().to_path_buf();
    // The rank file moved next to the checkpoint, size and hash intact, and named there.
    std::fs::rename(
        ckpt.join("rank-00000.safetensors"),
        base.join("outside.safetensors"),
    )
    .unwrap();
    edit_manifest(&ckpt, |v| {
        v["ranks"][0]["file"] = json!("../outside.safetensors");
        v["files"][0]["name"] = json!("../outside.safetensors");
    });
    let out = base.join("model.safetensors");
    let (c, o) = (ckpt.display().to_string(), out.display().to_string());
    let line = one_error_line(&zrun(&["consolidate", &c, "-o", &o]));
    assert!(
        line.contains("ranks[0].file") && line.contains("../outside.safetensors"),
        "{line}"
    );
    assert!(!out.exists());
    assert!(entries_like(&base, "model.safetensors").is_empty());
}

#[test]
fn a_recorded_tokenizer_that_is_not_one_is_not_exported() {
    for (i, name) in ["secret.json", "notes.txt"].iter().enumerate() {
        let (_dir, ckpt) = tiny_checkpoint(&format!("hf-tokenizer-{i}"));
        let base = ckpt.parent().unwrap().to_path_buf();
        let secrets = base.join("private");
        std::fs::create_dir_all(&secrets).unwrap();
        let secret = secrets.join(name);
        std::fs::write(&secret, br#"{"password": "hunter2"}"#).unwrap();
        std::fs::write(
            secrets.join("tokenizer_config.json"),
            br#"{"password": "hunter2"}"#,
        )
        .unwrap();
        edit_manifest(&ckpt, |v| {
            v["model"]["tokenizer"] = json!(secret.display().to_string());
        });
        let out = base.join("export");
        let o = zrun(&[
            "export",
            &ckpt.display().to_string(),
            "--hf",
            &out.display().to_string(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        for e in std::fs::read_dir(&out).unwrap() {
            let p = e.unwrap().path();
            let text = String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned();
            assert!(!text.contains("hunter2"), "{} was copied", p.display());
        }
        assert!(!out.join("tokenizer.json").exists());
        assert!(
            stderr(&o).contains(&secret.display().to_string()),
            "the skipped tokenizer is named: {}",
            stderr(&o)
        );
        assert!(stdout(&o).contains("no tokenizer"), "{}", stdout(&o));
    }
}

#[test]
fn an_export_or_a_consolidation_refuses_view_tables_that_are_not_its_models() {
    // A view renamed in the manifest: the tables no longer describe the model its hf_config
    // does, so reading or transposing by them would go wrong.
    let (_dir, ckpt) = tiny_checkpoint("hf-views");
    edit_manifest(&ckpt, |v| {
        v["units"][1]["views"][0]["name"] = json!("h.0.renamed.weight");
    });
    let out = ckpt.parent().unwrap().join("export");
    let c = ckpt.display().to_string();
    let line = one_error_line(&zrun(&["export", &c, "--hf", &out.display().to_string()]));
    assert!(
        line.contains("does not fit this model") && line.contains("h.0.renamed.weight"),
        "{line}"
    );
    assert!(!out.exists());
    // consolidate needs no model, but names and shapes its tensors by the same tables.
    let file = ckpt.parent().unwrap().join("model.safetensors");
    let line = one_error_line(&zrun(&[
        "consolidate",
        &c,
        "-o",
        &file.display().to_string(),
    ]));
    assert!(
        line.contains("does not fit this model") && line.contains("the manifest was altered"),
        "{line}"
    );
    assert!(!file.exists());
}

#[test]
fn a_manifest_without_its_own_hash_is_read_with_a_warning() {
    let (_dir, ckpt) = tiny_checkpoint("hf-unsealed");
    let base = ckpt.parent().unwrap().to_path_buf();
    let c = ckpt.display().to_string();
    let warned = |o: &std::process::Output| stderr(o).contains("carries no hash of itself");
    let out = base.join("model.safetensors").display().to_string();
    let o = zrun(&["consolidate", &c, "-o", &out]);
    assert!(o.status.success() && !warned(&o), "{}", stderr(&o));
    // The same checkpoint with its manifest in format version 1: read, and said so.
    edit_manifest(&ckpt, |_| {});
    std::fs::remove_file(&out).unwrap();
    let o = zrun(&["consolidate", &c, "-o", &out]);
    assert!(o.status.success() && warned(&o), "{}", stderr(&o));
    // A resume from it says so once, and saves a sealed checkpoint.
    let run = base.join("resumed");
    let o = train_tiny(&run, 3, &[format!("checkpoint.resume=\"{c}\"")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.matches("carries no hash of itself").count(), 1, "{err}");
    let saved = run.join("ckpt/step-00000003/manifest.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(saved).unwrap()).unwrap();
    assert!(v["format_version"].as_u64() >= Some(2) && v["manifest_hash"].is_string());
}

/// Entries of `dir` whose names end with `suffix` (none when `dir` is missing).
fn count_ending(dir: &Path, suffix: &str) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(suffix))
        })
        .count()
    })
}

/// The lines of stderr that say something.
fn said(o: &std::process::Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(String::from)
        .collect()
}

#[test]
fn an_interrupted_export_or_consolidation_removes_its_partial_output() {
    let dir = scratch("hf-interrupted");
    let train = dir.join("train");
    let bigger = ["model.n_layer=4".to_string(), "model.d_model=256".into()];
    let o = train_tiny(&train, 1, &bigger);
    assert!(o.status.success(), "{}", stderr(&o));
    let c = train.join("ckpt/step-00000001").display().to_string();
    let export = |out: &Path| {
        let o = out.display().to_string();
        let a = [
            "export",
            &c,
            "--hf",
            &o,
            "--dtype",
            "bf16",
            "--max-shard-size",
            "200KB",
        ];
        a.map(String::from)
    };
    // A whole export: how many weights files it has.
    let whole = dir.join("whole");
    let o = zrun(&export(&whole).each_ref().map(String::as_str));
    assert!(o.status.success(), "{}", stderr(&o));
    let shards = count_ending(&whole, ".safetensors");
    assert!(shards >= 10, "{shards} weights files");
    let out = dir.join("export");
    let look = |pid: u32| {
        let written = count_ending(&dir.join(format!("export.tmp-{pid}")), ".safetensors.tmp");
        match written {
            _ if out.exists() => Seen::Late,
            0 => Seen::NotYet,
            n if n <= shards / 2 => Seen::Early,
            _ => Seen::Late,
        }
    };
    let args = export(&out);
    let args = args.each_ref().map(String::as_str);
    for (sig, name) in [
        (libc::SIGINT, "SIGINT"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGHUP, "SIGHUP"),
    ] {
        let (o, pid) = interrupt_early(&args, sig, look);
        assert_eq!(o.status.code(), Some(128 + sig), "{}", stderr(&o));
        let tmp = dir.join(format!("export.tmp-{pid}"));
        let want = format!(
            "zrun: export interrupted by {name}; removed the partial output {}",
            tmp.display()
        );
        assert_eq!(said(&o), [want]);
        assert!(entries_like(&dir, "export").is_empty(), "nothing is left");
    }
    // Killed: nothing can clean up then, but the next export removes what was left, saying so.
    let (o, pid) = interrupt_early(&args, libc::SIGKILL, look);
    assert_eq!(o.status.signal(), Some(libc::SIGKILL));
    let left = dir.join(format!("export.tmp-{pid}"));
    assert!(left.is_dir());
    let o = zrun(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let note = format!(
        "zrun: note: removed {}, left by an export (process {pid}) that no longer runs",
        left.display()
    );
    assert_eq!(said(&o), [note]);
    assert_eq!(entries_like(&dir, "export"), ["export"]);

    // consolidate: the file is written at its end (bf16, smaller than the write buffer), so
    // an empty FILE.tmp means the work is ahead.
    let file = dir.join("model.safetensors");
    let f = file.display().to_string();
    let args = ["consolidate", &c, "-o", &f, "--dtype", "bf16"];
    let look = |_| match std::fs::metadata(dir.join("model.safetensors.tmp")) {
        _ if file.exists() => Seen::Late,
        Err(_) => Seen::NotYet,
        Ok(m) if m.len() == 0 => Seen::Early,
        Ok(_) => Seen::Late,
    };
    let (o, _) = interrupt_early(&args, libc::SIGINT, look);
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let want =
        format!("zrun: consolidate interrupted by SIGINT; removed the partial output {f}.tmp");
    assert_eq!(said(&o), [want]);
    assert!(entries_like(&dir, "model.safetensors").is_empty());
}

#[test]
fn a_failed_write_of_an_export_or_consolidation_names_its_flag() {
    let (_dir, ckpt) = tiny_checkpoint("hf-full");
    let base = ckpt.parent().unwrap().to_path_buf();
    let c = ckpt.display().to_string();
    // Exit code 1, one line naming the flag and the file, with the limit's advice and none of
    // checkpoint.dir's or log.dir's; nothing left.
    let failed = |o: &std::process::Output, flag: &str, file: &str| {
        let lines = said(o);
        assert_eq!(o.status.code(), Some(1), "{lines:?}");
        assert_eq!(lines.len(), 1, "{lines:?}");
        let l = &lines[0];
        assert!(l.starts_with(&format!("zrun: error: {flag} ")), "{l}");
        assert!(l.contains(file) && l.contains("ulimit -f"), "{l}");
        assert!(l.contains(&format!("give {flag} a path")), "{l}");
        assert!(
            !l.contains("checkpoint.dir") && !l.contains("log.dir"),
            "{l}"
        );
    };
    let out = base.join("export").display().to_string();
    let o = zrun_file_limit(&["export", &c, "--hf", &out], 64 << 10, false);
    failed(&o, "--hf", "/model.safetensors.tmp: File too large");
    // The tokenizer is the file too large (the weights in shards that fit).
    let tokenizer = base.join("tokenizer.json");
    let padded = format!(
        "{}{}",
        String::from_utf8_lossy(WORDS),
        " ".repeat(300 << 10)
    );
    std::fs::write(&tokenizer, padded).unwrap();
    edit_manifest(&ckpt, |v| {
        v["model"]["tokenizer"] = json!(tokenizer.display().to_string());
    });
    let small = ["export", &c, "--hf", &out, "--max-shard-size", "64KB"];
    let o = zrun_file_limit(&small, 256 << 10, false);
    failed(&o, "--hf", "/tokenizer.json: File too large");
    assert_eq!(entries_like(&base, "export"), Vec::<String>::new());
    let f = base.join("model.safetensors").display().to_string();
    let o = zrun_file_limit(&["consolidate", &c, "-o", &f], 64 << 10, false);
    failed(&o, "-o", "model.safetensors.tmp: File too large");
    assert!(entries_like(&base, "model.safetensors").is_empty());
}

/// A word-level tokenizer: "hello" is token 0, anything else 1.
const WORDS: &[u8] = br#"{"version": "1.0", "added_tokens": [], "normalizer": null,
    "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
    "truncation": null, "padding": null,
    "model": {"type": "WordLevel", "vocab": {"hello": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}"#;

#[test]
fn consolidate_replaces_only_a_safetensors_file() {
    let (_dir, ckpt) = tiny_checkpoint("hf-replace");
    let base = ckpt.parent().unwrap().to_path_buf();
    let c = ckpt.display().to_string();
    // Any other file is left as it was: a config is not turned into weights by a typo.
    let victim = common::write(&base, "victim.json", b"{\"lr\": 3e-4}\n");
    let line = one_error_line(&zrun(&["consolidate", &c, "-o", &victim]));
    assert!(
        line.contains(&victim)
            && line.contains("is a file of 13 bytes, not a safetensors file")
            && line.contains("remove it or give another path"),
        "{line}"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"{\"lr\": 3e-4}\n");
    assert!(entries_like(&base, "victim.json.").is_empty());
    // An earlier consolidation is replaced (docs/config.md), also over the empty FILE.tmp a
    // consolidation killed before its first write leaves; a FILE.tmp of anything else is not.
    let file = base.join("model.safetensors");
    let f = file.display().to_string();
    for _ in 0..2 {
        std::fs::write(base.join("model.safetensors.tmp"), b"").unwrap();
        let o = zrun(&["consolidate", &c, "-o", &f, "--dtype", "bf16"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            entries_like(&base, "model.safetensors"),
            ["model.safetensors"]
        );
    }
    let bf16 = std::fs::read(&file).unwrap();
    std::fs::write(base.join("model.safetensors.tmp"), b"notes").unwrap();
    let line = one_error_line(&zrun(&["consolidate", &c, "-o", &f]));
    assert!(
        line.contains(
            "model.safetensors.tmp exists and is a file of 5 bytes, not the partial file"
        ),
        "{line}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), bf16);
    assert_eq!(
        std::fs::read(base.join("model.safetensors.tmp")).unwrap(),
        b"notes"
    );
}
