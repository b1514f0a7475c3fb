//! Malformed configs: each is rejected with one line naming the file or override, the key,
//! the value and what is allowed.

zrun_torch_ext::end_tests_without_destructors!();

use std::path::PathBuf;
use zrun_train::config::Config;

/// Writes `text` to a file `name` in a fresh directory (removed when the first value drops).
fn write(name: &str, text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

fn error_of(name: &str, text: &str, overrides: &[&str]) -> String {
    let (_path_dir, path) = write(name, text);
    let sets: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let err = Config::load(&path, &sets)
        .expect_err("config should be rejected")
        .to_string();
    assert!(!err.contains('\n'), "error is not one line: {err:?}");
    err
}

#[test]
fn malformed_configs_each_get_their_own_message() {
    // (file name, contents, overrides, substrings the message must contain)
    let cases: &[(&str, &str, &[&str], &[&str])] = &[
        (
            "unknown-section.toml",
            "[modle]\npreset = \"tiny\"\n",
            &[],
            &["unknown-section.toml", "modle", "unknown field", "`model`"],
        ),
        (
            "unknown-key.toml",
            "[train]\nstepz = 5\n",
            &[],
            &["unknown-key.toml", "train", "stepz", "`steps`"],
        ),
        (
            "wrong-type.toml",
            "[train]\nsteps = \"ten\"\n",
            &[],
            &[
                "wrong-type.toml",
                "train.steps",
                "\"ten\"",
                "invalid type",
                "u64",
            ],
        ),
        (
            "negative-steps.toml",
            "[train]\nsteps = -5\n",
            &[],
            &["train.steps", "-5"],
        ),
        (
            "zero-steps.toml",
            "[train]\nsteps = 0\n",
            &[],
            &["train.steps = 0", "at least 1"],
        ),
        (
            "tiny-eps.toml",
            "[train]\neps = 1e-300\n",
            &[],
            &["train.eps = 1e-300", "smallest normal"],
        ),
        (
            "bad-stage.toml",
            "[zero]\nstage = 5\n",
            &[],
            &["zero.stage = 5", "allowed: 0, 1, 2 or 3"],
        ),
        (
            "bad-precision.toml",
            "[zero]\nprecision = \"fp8\"\n",
            &[],
            &["zero.precision", "fp8", "`fp32`, `bf16`, `fp16`"],
        ),
        (
            "bad-preset.toml",
            "[model]\npreset = \"gpt5\"\n",
            &[],
            &["model.preset", "gpt5", "tiny, gpt2-small"],
        ),
        (
            "bad-heads.toml",
            "[model]\nd_model = 65\nn_head = 4\n",
            &[],
            &["model.n_head = 4", "multiple of model.n_head"],
        ),
        (
            "zero-layers.toml",
            "[model]\nn_layer = 0\n",
            &[],
            &["model.n_layer = 0", "at least 1"],
        ),
        (
            "bad-lr.toml",
            "[train]\nlr = -0.1\n",
            &[],
            &["train.lr = -0.1", "> 0"],
        ),
        (
            "bad-beta.toml",
            "[train]\nbeta2 = 1.5\n",
            &[],
            &["train.beta2 = 1.5", "[0, 1)"],
        ),
        (
            "bad-minlr.toml",
            "[train]\nlr = 1e-3\nmin_lr = 1e-2\n",
            &[],
            &["train.min_lr = 0.01", "between 0 and train.lr"],
        ),
        (
            "bad-source.toml",
            "[data]\nsource = \"csv\"\n",
            &[],
            &["data.source", "csv", "`synthetic`, `tokens`, `text`"],
        ),
        (
            "missing-path.toml",
            "[data]\nsource = \"tokens\"\n",
            &[],
            &["data.path", "required when data.source"],
        ),
        (
            "bad-fraction.toml",
            "[data]\neval_fraction = 0.9\n",
            &[],
            &["data.eval_fraction = 0.9", "(0, 0.5]"],
        ),
        (
            "bad-backend.toml",
            "[dist]\nbackend = \"gloo\"\n",
            &[],
            &["dist.backend", "gloo", "`tcp`"],
        ),
        (
            "bad-timeout.toml",
            "[dist]\ntimeout_s = 0\n",
            &[],
            &["dist.timeout_s = 0", "1 to 31536000 seconds"],
        ),
        (
            // Past a year, adding the deadline to the clock overflowed in every rank.
            "huge-timeout.toml",
            "[dist]\ntimeout_s = 9223372036854775807\n",
            &[],
            &[
                "dist.timeout_s = 9223372036854775807",
                "1 to 31536000 seconds (a year)",
            ],
        ),
        (
            "huge-signal-deadline.toml",
            "[checkpoint]\nsignal_deadline_s = 9223372036854775807\n",
            &[],
            &[
                "checkpoint.signal_deadline_s = 9223372036854775807",
                "1 to 31536000",
            ],
        ),
        (
            "bad-log-every.toml",
            "[log]\nevery = 0\n",
            &[],
            &["log.every = 0", "at least 1"],
        ),
        (
            "bad-threads.toml",
            "[train]\nthreads = 100000\n",
            &[],
            &[
                "train.threads = 100000",
                "0 (the rank's share of the cores) to 1024",
            ],
        ),
        (
            "bad-micro-batch.toml",
            "[train]\nmicro_batch = 2000000\n",
            &[],
            &["train.micro_batch = 2000000", "1 to 1048576"],
        ),
        (
            "empty-log-dir.toml",
            "[log]\ndir = \"\"\n",
            &[],
            &["log.dir", "must name a directory"],
        ),
        (
            "huge-d-model.toml",
            "[model]\npreset = \"tiny\"\nd_model = 4000000000\nn_head = 1\n",
            &[],
            &["model.d_model = 4000000000", "at most 131072"],
        ),
        (
            "bad-profile-step.toml",
            "[train]\nsteps = 10\n[log]\nprofile_step = 11\n",
            &[],
            &["log.profile_step = 11", "past train.steps = 10"],
        ),
        (
            "syntax.toml",
            "[train]\nsteps = = 3\n",
            &[],
            &["syntax.toml:2:", "invalid TOML"],
        ),
        (
            "ok-file-bad-set.toml",
            "[train]\nsteps = 3\n",
            &["train.steps=abc"],
            &["--set train.steps", "train.steps = \"abc\"", "invalid type"],
        ),
        (
            "ok-file-unknown-set.toml",
            "",
            &["model.n_layr=6"],
            &["--set model.n_layr", "n_layr", "unknown field"],
        ),
        (
            "ok-file-bad-set-syntax.toml",
            "",
            &["train.steps"],
            &["--set train.steps", "expected key=value"],
        ),
        (
            "section-is-value.toml",
            "",
            &["train=3", "train.steps=4"],
            &["--set train.steps=4", "`train` is a value, not a section"],
        ),
        (
            "set-empty-part.toml",
            "",
            &["train..steps=5"],
            &["--set train..steps=5", "`train..steps` is not a key"],
        ),
        (
            "set-unknown-section.toml",
            "",
            &["TRAIN.STEPS=2"],
            &["--set TRAIN.STEPS", "unknown field `TRAIN`"],
        ),
        (
            "set-overflow.toml",
            "",
            &["train.steps=99999999999999999999"],
            &["--set train.steps=", "out of range", "9223372036854775807"],
        ),
        (
            "file-unknown-beside-set.toml",
            "[train]\nbogus = 1\n",
            &["train.steps=2"],
            &["file-unknown-beside-set.toml: train.bogus", "unknown field"],
        ),
        (
            "bad-branching.toml",
            "[data]\nbranching = 0\n",
            &[],
            &["data.branching = 0", "below model.vocab_size"],
        ),
    ];
    assert!(cases.len() >= 15);
    for (name, text, sets, needles) in cases {
        let err = error_of(name, text, sets);
        for n in *needles {
            assert!(err.contains(n), "{name}: message {err:?} lacks {n:?}");
        }
    }
}

#[test]
fn missing_file_names_the_file_and_the_fix() {
    let err = Config::load(std::path::Path::new("/nonexistent/train.toml"), &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("/nonexistent/train.toml") && err.contains("configs/tiny-cpu.toml"),
        "{err}"
    );
}

#[test]
fn defaults_overrides_and_presets_resolve() {
    let (_path_dir, path) = write(
        "good.toml",
        "[model]\npreset = \"gpt2-small\"\n[train]\nsteps = 7\n",
    );
    let sets = vec![
        "train.steps=50".to_string(),
        "model.n_layer=6".to_string(),
        "log.dir=/tmp/x".to_string(),
    ];
    let cfg = Config::load(&path, &sets).unwrap();
    assert_eq!(cfg.train.steps, 50);
    assert_eq!(cfg.log.dir, PathBuf::from("/tmp/x"));
    let zrun_models::ArchConfig::Gpt(g) = cfg.arch().unwrap() else {
        panic!("a GPT preset")
    };
    assert_eq!((g.n_layer, g.n_head, g.d_model), (6, 12, 768));
    assert_eq!(cfg.train.micro_batch, 8); // default
                                          // A table given for a section sets the keys it names and keeps the file's others.
    let sets = vec!["train={micro_batch=3}".to_string()];
    let cfg = Config::load(&path, &sets).unwrap();
    assert_eq!((cfg.train.steps, cfg.train.micro_batch), (7, 3));
    assert!((cfg.min_lr() - cfg.train.lr / 10.0).abs() < 1e-18);
}

#[test]
fn shipped_configs_parse() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            Config::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 1);
}

#[test]
fn a_warmup_longer_than_the_run_is_shortened_with_a_note() {
    let (_p_dir, p) = write(
        "long-warmup.toml",
        "[train]\nsteps = 30\nwarmup_steps = 20\n",
    );
    let cfg = Config::load(&p, &["train.steps=3".into()]).unwrap();
    assert_eq!((cfg.train.steps, cfg.train.warmup_steps), (3, 3));
    assert_eq!(cfg.notes.len(), 1);
    assert!(
        cfg.notes[0].contains("train.warmup_steps = 20 is more than train.steps = 3"),
        "{:?}",
        cfg.notes
    );
    let cfg = Config::load(&p, &[]).unwrap();
    assert_eq!(cfg.train.warmup_steps, 20);
    assert!(cfg.notes.is_empty());
}

#[test]
fn llama_presets_and_their_keys_resolve() {
    let (_path_dir, path) = write(
        "llama.toml",
        "[model]\narch = \"llama\"\npreset = \"llama-tiny\"\nn_kv_head = 1\nffn_hidden = 96\n",
    );
    let cfg = Config::load(&path, &[]).unwrap();
    let zrun_models::ArchConfig::Llama(l) = cfg.arch().unwrap() else {
        panic!("a Llama preset")
    };
    assert_eq!((l.n_kv_head, l.ffn_hidden, l.head_dim), (1, 96, 16));
    // Width and heads set: the head width follows.
    let sets = [
        "model.d_model=128".to_string(),
        "model.n_head=2".to_string(),
    ];
    let zrun_models::ArchConfig::Llama(l) = Config::load(&path, &sets).unwrap().arch().unwrap()
    else {
        panic!("a Llama preset")
    };
    assert_eq!(l.head_dim, 64);
    let (_big_dir, big) = write(
        "llama-8b.toml",
        "[model]\narch = \"llama\"\npreset = \"llama3.1-8b\"\n",
    );
    let m = Config::load(&big, &[]).unwrap().build_model().unwrap();
    assert_eq!(m.param_count(), 8_030_261_248);
}

#[test]
fn model_key_errors_name_the_key_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}"#,
    )
    .unwrap();
    let from = format!("[model]\ninit_from = \"{}\"\n", dir.display());
    let cases: Vec<(String, &[&str])> = vec![
        (
            "[model]\narch = \"llama\"\npreset = \"tiny\"\n".into(),
            &["model.preset", "allowed Llama presets", "llama3.2-1b"],
        ),
        (
            "[model]\nn_kv_head = 2\n".into(),
            &["model.n_kv_head", "Llama key", "model.arch"],
        ),
        (
            "[model]\ninit_from = \"/nonexistent/model\"\n".into(),
            &[
                "model.init_from",
                "/nonexistent/model/config.json",
                "cannot read",
            ],
        ),
        (
            format!("{from}n_layer = 4\n"),
            &["model.n_layer = 4", "conflicts with 2", "config.json"],
        ),
        (
            format!("{from}arch = \"gpt\"\n"),
            &["model.arch = gpt", "Llama model"],
        ),
        (
            format!("{from}preset = \"llama-tiny\"\n"),
            &["model.preset", "remove model.preset"],
        ),
        (
            format!("{from}seq_len = 256\n"),
            &["model.seq_len = 256", "max_position_embeddings = 128"],
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let err = error_of(&format!("model-{i}.toml"), text, &[]);
        for w in *want {
            assert!(err.contains(w), "{text:?}: {err:?} lacks {w:?}");
        }
    }
    // Keys a GPT-2 directory cannot honour.
    let gdir = dir.join("gpt2");
    std::fs::create_dir_all(&gdir).unwrap();
    std::fs::write(
        gdir.join("config.json"),
        r#"{"model_type": "gpt2", "vocab_size": 64, "n_positions": 32, "n_embd": 32,
            "n_layer": 2, "n_head": 4}"#,
    )
    .unwrap();
    let g = format!("[model]\ninit_from = \"{}\"\n", gdir.display());
    for (text, want) in [
        (
            format!("{g}n_kv_head = 2\n"),
            ["model.n_kv_head", "Llama key"],
        ),
        (
            format!("{g}tie_embeddings = false\n"),
            ["model.tie_embeddings = false", "tie_word_embeddings = true"],
        ),
    ] {
        let err = error_of("gpt2-from.toml", &text, &[]);
        for w in want {
            assert!(err.contains(w), "{text:?}: {err:?} lacks {w:?}");
        }
    }
    // The file's architecture, with a shorter training sequence.
    let (_ok_dir, ok) = write("from.toml", &format!("{from}seq_len = 32\n"));
    let arch = Config::load(&ok, &[]).unwrap().arch().unwrap();
    assert_eq!(
        (arch.arch(), arch.seq_len(), arch.vocab_size()),
        ("llama", 32, 64)
    );
}

#[test]
fn the_delay_switches_on_after_the_learning_rate_warm_up_unless_told() {
    let (_p_dir, p) = write(
        "delay.toml",
        "[train]\nsteps = 200\nwarmup_steps = 50\n[zero]\nstage = 2\noffload_optimizer = \"cpu\"\n",
    );
    let delay = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::load(&p, &sets).unwrap().delay()
    };
    assert_eq!(delay(&[]), None, "off unless zero.offload_delay = 1");
    assert_eq!(delay(&["zero.offload_delay=1"]), Some(50));
    // At least 10 updates, however short the learning-rate warm-up.
    assert_eq!(
        delay(&["zero.offload_delay=1", "train.warmup_steps=3"]),
        Some(10)
    );
    // A warm-up of its own wins, 0 included.
    for w in [0, 7, 80] {
        let set = format!("zero.offload_delay_warmup={w}");
        assert_eq!(delay(&["zero.offload_delay=1", &set]), Some(w));
    }
}

#[test]
fn a_delayed_update_is_split_unless_told_otherwise() {
    let (_p_dir, p) = write(
        "delay.toml",
        "[zero]\nstage = 2\noffload_optimizer = \"cpu\"\noffload_delay = 1\n",
    );
    let split = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let cfg = Config::load(&p, &sets).unwrap();
        let est = zrun_train::memory::estimate_config(&cfg).unwrap();
        assert_eq!(cfg.delay_fresh(), est.offload_delay_fresh, "{sets:?}");
        est.offload_delay_fresh
    };
    assert!(split(&[]), "the split is the default");
    assert!(split(&["zero.offload_delay_fresh=true"]));
    assert!(
        !split(&["zero.offload_delay_fresh=false"]),
        "the plain delay"
    );
    // Without the delay there is nothing to split; asking for it is refused.
    assert!(!split(&["zero.offload_delay=0"]));
}
