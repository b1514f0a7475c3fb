//! Bad input to the real binary: a one-line error naming the file or key and the fix,
//! exit code 2, never a panic.

mod common;
use common::*;

/// Runs zrun, expects exit code 2 and a single `zrun: error:` line containing `needles`.
fn rejects(args: &[&str], needles: &[&str]) {
    let out = zrun(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: stderr {err}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("zrun: error:")).collect();
    assert_eq!(lines.len(), 1, "expected one error line: {err}");
    for n in needles {
        assert!(
            lines[0].contains(n),
            "error line {:?} lacks {n:?}",
            lines[0]
        );
    }
}

fn tokens(values: &[u16]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A usage error is one line: clap's message, its list and tip, and the help to read; an
/// argument that is not UTF-8 does not make it panic.
#[test]
fn usage_errors_are_one_line_naming_the_help() {
    use std::os::unix::ffi::OsStrExt;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zrun"))
        .args([
            "--nproc".as_ref(),
            "x".as_ref(),
            std::ffi::OsStr::from_bytes(b"\xff.toml"),
        ])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("zrun: error: invalid value 'x'") && !err.contains("panicked"),
        "{err}"
    );
    for (args, needles) in [
        (
            &["--nproc", "abc", "t.toml"][..],
            &["'--nproc <N>'", "see zrun --help"][..],
        ),
        (
            &["prepare", "--bogus", "x"],
            &["'--bogus'", "use '-- --bogus'", "see zrun prepare --help"],
        ),
        (
            &["prepare"],
            &[
                "provided: --tokenizer <FILE>, --output <DIR>",
                "see zrun prepare --help",
            ],
        ),
        (
            &["bench", "comm", "--nproc", "x"],
            &["invalid value 'x'", "see zrun bench comm --help"],
        ),
    ] {
        let out = zrun(args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("zrun: error: "), "{err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {err} lacks {n:?}");
        }
    }
}

/// A timeout or grace period past a year is refused by name: converting it to a `Duration`
/// or adding it to the clock once panicked (the launcher, or every rank).
#[test]
fn timeouts_past_a_year_are_refused_not_a_panic() {
    let tiny = root().join("configs/tiny-cpu.toml");
    let tiny = tiny.to_str().unwrap();
    let huge = "18446744073709551615";
    rejects(
        &["--grace-s", "1e20", tiny],
        &["--grace-s", "0 to 31536000"],
    );
    rejects(&["--grace-s", huge, tiny], &["--grace-s", "0 to 31536000"]);
    rejects(
        &[
            "--rdzv-timeout-s",
            huge,
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
            "--nproc",
            "1",
            tiny,
        ],
        &["--rdzv-timeout-s 18446744073709551615", "1 to 31536000"],
    );
    rejects(
        &[
            "--nproc",
            "2",
            tiny,
            "--set",
            "dist.timeout_s=9223372036854775807",
        ],
        &[
            "dist.timeout_s = 9223372036854775807",
            "1 to 31536000 seconds",
        ],
    );
    rejects(
        &[
            "bench",
            "comm",
            "--nproc",
            "2",
            "--sizes",
            "1K",
            "--timeout-s",
            huge,
        ],
        &["--timeout-s", "not in 1..=31536000"],
    );
}

#[test]
fn missing_config_file() {
    rejects(
        &["/nonexistent/dir/train.toml"],
        &["/nonexistent/dir/train.toml", "cannot read"],
    );
}

#[test]
fn unknown_key_and_wrong_type() {
    let d = scratch("keys");
    let unknown = write(&d, "unknown.toml", b"[train]\nstep = 3\n");
    rejects(
        &[&unknown],
        &["unknown.toml", "train", "step", "unknown field"],
    );
    let wrong = write(&d, "wrong.toml", b"[train]\nsteps = 2.5\n");
    rejects(
        &[&wrong],
        &["wrong.toml", "train.steps = 2.5", "invalid type"],
    );
    let ok = write(&d, "ok.toml", b"");
    rejects(
        &[&ok, "--set", "zero.stage=7"],
        &["--set zero.stage", "7", "0, 1, 2 or 3"],
    );
}

#[test]
fn data_path_that_does_not_exist() {
    let d = scratch("nopath");
    let cfg = write(
        &d,
        "c.toml",
        b"[data]\nsource = \"tokens\"\npath = \"/nonexistent/tokens.bin\"\n",
    );
    rejects(&[&cfg], &["/nonexistent/tokens.bin"]);
}

#[test]
fn token_file_with_odd_size() {
    let d = scratch("odd");
    let mut bytes = tokens(&(0..500).map(|i| (i % 200) as u16).collect::<Vec<_>>());
    bytes.push(7);
    let bin = write(&d, "odd.bin", &bytes);
    let cfg = write(
        &d,
        "c.toml",
        format!("[data]\nsource = \"tokens\"\npath = \"{bin}\"\n").as_bytes(),
    );
    rejects(&[&cfg], &["odd.bin", "1001", "uint16"]);
}

#[test]
fn vocabulary_smaller_than_the_largest_token() {
    let d = scratch("vocab");
    let mut values: Vec<u16> = (0..2000).map(|i| (i % 200) as u16).collect();
    values[777] = 50256;
    let bin = write(&d, "big.bin", &tokens(&values));
    let cfg = write(
        &d,
        "c.toml",
        format!("[data]\nsource = \"tokens\"\npath = \"{bin}\"\n").as_bytes(),
    );
    rejects(&[&cfg], &["big.bin", "50256", "model.vocab_size", "50257"]);
}

#[test]
fn dry_run_prints_the_layout_without_training() {
    let d = scratch("dry");
    let out = zrun(&[
        "--dry-run",
        "configs/tiny-cpu.toml",
        "--set",
        &format!("log.dir=\"{}\"", d.display()),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    // tiny preset: V=256, T=64, C=64, L=2: embeddings + blocks + final norm + head.
    let (v, t, c, l) = (256i64, 64i64, 64i64, 2i64);
    let params = v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c + v * c;
    assert!(text.contains(&format!("parameters: {params}")), "{text}");
    assert!(
        text.contains("unit h.1") && text.contains("model states"),
        "{text}"
    );
    assert!(
        !d.join("metrics.jsonl").exists(),
        "a dry run must not train"
    );
}

#[test]
fn settings_that_cannot_work_are_refused_before_any_rank_starts_and_by_a_dry_run() {
    let cfg = "configs/tiny-cpu.toml";
    let set = |kv: &[&str]| -> Vec<String> {
        kv.iter()
            .flat_map(|s| ["--set".to_string(), s.to_string()])
            .collect()
    };
    // A dry run refuses what the launch refuses.
    let run = |kv: &[&str], needles: &[&str]| {
        for dry in [false, true] {
            let mut args = vec!["--nproc".to_string(), "2".into(), cfg.into()];
            if dry {
                args.insert(0, "--dry-run".into());
            }
            args.extend(set(kv));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            rejects(&args, needles);
        }
    };
    // A global batch the ranks would not train at (16 x 1 x 2 = 32) is not ignored.
    run(
        &["train.global_batch=64"],
        &[
            "train.global_batch = 64",
            "x 2 rank(s) is 32",
            "set train.grad_accum = 2",
        ],
    );
    run(
        &["dist.backend=\"nccl\"", "dist.device=\"cpu\""],
        &[
            "dist.backend = \"nccl\" with dist.device = \"cpu\"",
            "set dist.device = \"cuda\"",
            "dist.backend = \"tcp\"",
        ],
    );
    run(
        &["dist.backend=\"mpi\"", "dist.device=\"cuda\""],
        &[
            "dist.backend = \"mpi\" with dist.device = \"cuda\"",
            "CPU tensors only",
            "dist.backend = \"nccl\"",
        ],
    );
    // tcp stages CUDA tensors: refused here only for want of a GPU or of a CUDA build
    run(
        &["dist.backend=\"tcp\"", "dist.device=\"cuda\""],
        &["dist.device = \"cuda\""],
    );
    if !cfg!(feature = "mpi") {
        run(
            &["dist.backend=\"mpi\""],
            &["dist.backend = \"mpi\"", "without MPI", "--features mpi"],
        );
    }
    if !cfg!(feature = "cuda") {
        run(
            &["dist.backend=\"nccl\"", "dist.device=\"auto\""],
            &["dist.backend = \"nccl\"", "without CUDA", "--features cuda"],
        );
    }
}

#[test]
fn a_rank_started_by_another_launcher_refuses_the_same_way() {
    // Under torchrun, mpirun or srun each rank is the first to check (exit 2, one line).
    let child = zrun_child(
        &[
            "configs/tiny-cpu.toml",
            "--set",
            "dist.backend=\"nccl\"",
            "--set",
            "dist.device=\"cpu\"",
        ],
        &[("RANK", "0"), ("WORLD_SIZE", "1")],
    );
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("zrun: error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("dist.backend = \"nccl\" with dist.device = \"cpu\""),
        "{err}"
    );
}

#[test]
fn offload_delay_without_offload_or_out_of_range_is_refused() {
    let c = "configs/tiny-cpu.toml";
    rejects(
        &[c, "--set", "zero.offload_delay=1"],
        &["zero.offload_delay", "zero.offload_optimizer = \"cpu\""],
    );
    rejects(
        &[
            c,
            "--set",
            "zero.stage=2",
            "--set",
            "zero.offload_optimizer=\"cpu\"",
            "--set",
            "zero.offload_delay=2",
        ],
        &["zero.offload_delay", "2", "must be 0 (off) or 1"],
    );
    rejects(
        &[
            c,
            "--set",
            "zero.stage=2",
            "--set",
            "zero.offload_optimizer=\"cpu\"",
            "--set",
            "zero.offload_delay=1",
            "--set",
            "train.on_oom=\"shrink\"",
        ],
        &["zero.offload_delay", "train.on_oom = \"shrink\""],
    );
    rejects(
        &[
            c,
            "--set",
            "zero.stage=2",
            "--set",
            "zero.offload_optimizer=\"cpu\"",
            "--set",
            "zero.offload_delay_fresh=true",
        ],
        &["zero.offload_delay_fresh", "set zero.offload_delay = 1"],
    );
}

#[test]
fn a_shard_group_that_does_not_fit_the_job_is_refused_before_any_rank_starts() {
    let c = "configs/tiny-cpu.toml";
    // Does not divide the world size: both numbers named.
    rejects(
        &["--nproc", "4", c, "--set", "zero.shard_group=3"],
        &["zero.shard_group = 3", "world size 4"],
    );
    // Splits the nodes of 2 ranks unevenly (groups of 3 over 3 nodes of 2).
    rejects(
        &[
            "--nnodes",
            "3",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
            "--nproc",
            "2",
            c,
            "--set",
            "zero.shard_group=3",
        ],
        &["zero.shard_group = 3", "nodes of 2 ranks"],
    );
    rejects(
        &[c, "--set", "zero.shard_group=\"nodes\""],
        &["zero.shard_group", "\"nodes\"", "\"node\""],
    );
    rejects(
        &[c, "--set", "zero.shard_group=0"],
        &["zero.shard_group", "at least 1"],
    );
}

#[test]
fn a_dry_run_shows_the_shard_groups() {
    let d = scratch("dry-hybrid");
    let dry = |extra: &[&str]| {
        let log = format!("log.dir=\"{}\"", d.display());
        let mut args = vec!["--dry-run", "--nproc", "4", "configs/tiny-cpu.toml"];
        args.extend(["--set", "zero.stage=3", "--set", &log]);
        args.extend(extra);
        let out = zrun(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    // Rank r's model-state MiB as the dry run prints it.
    let states = |text: &str, r: usize| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("rank {r}: model states")))
            .unwrap_or_else(|| panic!("no rank {r} line: {text}"));
        line.split_whitespace().nth(4).unwrap().parse().unwrap()
    };
    let full = dry(&[]);
    let hybrid = dry(&["--set", "zero.shard_group=2"]);
    assert!(hybrid.contains("shard groups: 2 of 2 ranks"), "{hybrid}");
    assert!(!full.contains("shard groups"), "{full}");
    // Groups of 2 hold twice the model states per rank of 4 ranks sharding over all (a
    // little less: padding to 4 ranks rounds up more), and ranks 0 and 2 hold the same.
    let ratio = states(&hybrid, 0) / states(&full, 0);
    assert!((1.9..=2.01).contains(&ratio), "{ratio}: {hybrid}\n{full}");
    assert_eq!(states(&hybrid, 0), states(&hybrid, 2));
}

/// `zrun bench kernels` on CPU: every case runs, interleaved, and prints its row; zrun's
/// fused and chunked losses equal PyTorch's cross-entropy (fp32), the fused one holding less
/// at its peak, the SwiGLU, rotary, bias-gradient, GELU-and-bias-gradient, LayerNorm,
/// AdamW and gradient-layout sides equal the ops they replace bitwise (on CPU the last two
/// run ATen's ops, as a rank there does), and the fresh share's ATen path (its arithmetic
/// rearranged) equals the formula written out within fp32 roundings, holding less at its peak.
#[test]
fn bench_kernels_compares_the_fused_ops_with_pytorchs() {
    let out = zrun(&[
        "bench", "kernels", "--device", "cpu", "--shapes", "small", "--rounds", "1", "--dtype",
        "fp32", "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<serde_json::Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 10, "{rows:?}");
    let (loss, chunked, swiglu, rope) = (&rows[0], &rows[1], &rows[2], &rows[3]);
    let cases: Vec<_> = rows.iter().map(|r| r["case"].as_str()).collect();
    assert_eq!(
        cases,
        [
            Some("loss"),
            Some("loss_chunked"),
            Some("swiglu"),
            Some("rope"),
            Some("bias_grad"),
            Some("gelu_bias_grad"),
            Some("layer_norm"),
            Some("adamw"),
            Some("grad_layout"),
            Some("fresh_share")
        ]
    );
    for r in [rope, &rows[4], &rows[5], &rows[6], &rows[7], &rows[8]] {
        assert_eq!(r["apart"].as_f64(), Some(0.0), "{r}");
    }
    assert!(loss["apart"].as_f64().unwrap() < 1e-5, "{loss}");
    assert!(chunked["apart"].as_f64().unwrap() < 1e-5, "{chunked}");
    assert_eq!(swiglu["apart"].as_f64(), Some(0.0), "{swiglu}");
    let peak = |r: &serde_json::Value, k: &str| r[k].as_u64().unwrap();
    assert!(
        peak(loss, "zrun_peak_bytes") < peak(loss, "torch_peak_bytes"),
        "{loss}"
    );
    assert!(
        peak(swiglu, "zrun_peak_bytes") < peak(swiglu, "torch_peak_bytes"),
        "{swiglu}"
    );
    let share = &rows[9];
    assert!(share["apart"].as_f64().unwrap() < 1e-6, "{share}");
    assert!(
        peak(share, "zrun_peak_bytes") < peak(share, "torch_peak_bytes"),
        "{share}"
    );
}

/// `zrun bench adam --grads fp32,bf16` times both gradient dtypes, one row each, and names
/// a dtype it does not know.
#[test]
fn bench_adam_times_both_gradient_dtypes() {
    let out = zrun(&[
        "bench",
        "adam",
        "--params",
        "100K",
        "--threads",
        "1",
        "--iters",
        "1",
        "--grads",
        "fp32,bf16",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<serde_json::Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let grads: Vec<_> = rows.iter().map(|r| r["grads"].as_str()).collect();
    assert_eq!(grads, [Some("fp32"), Some("bf16")], "{rows:?}");
    assert!(rows
        .iter()
        .all(|r| r["gparams_per_s"].as_f64().unwrap() > 0.0));
    let bad = zrun(&["bench", "adam", "--grads", "fp16"]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("--grads: `fp16`"), "{}", stderr(&bad));
}

/// Sizes past the machine's memory end the benchmarks with an error naming the flag, not a
/// panic (tch's scalar arguments) or an abort (a failed Rust allocation).
#[test]
fn bench_sizes_past_the_memory_are_errors_naming_the_flag() {
    let adam = zrun(&["bench", "adam", "--params", "99999G", "--threads", "1"]);
    assert_eq!(adam.status.code(), Some(2), "{}", stderr(&adam));
    assert!(
        stderr(&adam).contains("--params 99999G"),
        "{}",
        stderr(&adam)
    );
    let comm = zrun(&["bench", "comm", "--nproc", "1", "--sizes", "99999G"]);
    let err = stderr(&comm);
    assert_eq!(comm.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot make a") && err.contains("(--sizes)"),
        "{err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("frame #"),
        "{err}"
    );
}

/// Counts that mean nothing (0 iterations, rounds or ranks), flags that are not one of their
/// choices, more ranks than a job runs and a `--save` that could not be written are usage
/// errors (exit 2, one line naming the flag) before anything runs.
#[test]
fn meaningless_bench_and_estimate_flags_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let unwritable = dir.path().join("no/such/dir/cluster.toml");
    let not_toml = dir.path().join("cluster.toml");
    std::fs::write(&not_toml, "intra = [").unwrap();
    let unknown_key = dir.path().join("unknown.toml");
    std::fs::write(&unknown_key, "[cluster]\ngpus = 8\n").unwrap();
    // A FIFO in place of a cluster file would block the read forever.
    let fifo = dir.path().join("fifo.toml");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let plan = |file: &std::path::Path| -> Vec<String> {
        vec![
            "plan".into(),
            "configs/tiny-cpu.toml".into(),
            "--cluster".into(),
            file.display().to_string(),
        ]
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (plan(&unknown_key), "line 2, column 1: unknown field `gpus`"),
        (plan(&fifo), "not a regular file"),
        (plan(&not_toml), "invalid TOML at line 1"),
        (
            vec!["bench".into(), "comm".into(), "--iters".into(), "0".into()],
            "--iters",
        ),
        (
            vec!["bench".into(), "comm".into(), "--nproc".into(), "0".into()],
            "--nproc",
        ),
        (
            vec![
                "bench".into(),
                "comm".into(),
                "--sizes".into(),
                "abc".into(),
            ],
            "--sizes",
        ),
        (
            vec![
                "bench".into(),
                "comm".into(),
                "--save".into(),
                unwritable.display().to_string(),
            ],
            "cannot create it",
        ),
        (
            vec![
                "bench".into(),
                "comm".into(),
                "--save".into(),
                not_toml.display().to_string(),
            ],
            "not a cluster file",
        ),
        (
            vec![
                "bench".into(),
                "kernels".into(),
                "--device".into(),
                "tpu".into(),
            ],
            "--device tpu",
        ),
        (
            vec![
                "estimate".into(),
                "configs/tiny-cpu.toml".into(),
                "--nproc".into(),
                "100000".into(),
            ],
            "--nproc 100000",
        ),
        (
            vec![
                "estimate".into(),
                "configs/tiny-cpu.toml".into(),
                "--nproc".into(),
                "8".into(),
                "--nnodes".into(),
                "1000000".into(),
            ],
            "at most 131072",
        ),
        (
            vec![
                "plan".into(),
                "configs/tiny-cpu.toml".into(),
                "--cluster".into(),
                "h100-8x".into(),
                "--nodes".into(),
                "1000000000".into(),
            ],
            "--nodes 1000000000 x 8 rank(s) per node: more ranks than one job runs",
        ),
    ];
    for (args, needle) in cases {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = zrun(&refs);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(stdout(&o).is_empty(), "{args:?} ran: {}", stdout(&o));
    }
    assert_eq!(std::fs::read_to_string(&not_toml).unwrap(), "intra = [");
    // A backend this build lacks: one line before any rank starts.
    if !cfg!(feature = "cuda") {
        rejects(
            &[
                "bench",
                "comm",
                "--nproc",
                "2",
                "--sizes",
                "1K",
                "--backend",
                "nccl",
            ],
            &["--backend nccl", "without CUDA"],
        );
    }
}

/// `bench comm --save` fits each collective and merges [intra] into the cluster file, keeping
/// the file's other tables.
#[test]
fn bench_comm_save_fits_each_collective_and_keeps_the_files_other_tables() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    std::fs::write(&file, "[inter]\nrails = 4\n").unwrap();
    let f = file.display().to_string();
    let o = zrun(&[
        "bench",
        "comm",
        "--nproc",
        "2",
        "--sizes",
        "64K,1M,4M",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--save",
        &f,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let saved: toml::Table = std::fs::read_to_string(&file).unwrap().parse().unwrap();
    assert_eq!(saved["inter"]["rails"].as_integer(), Some(4), "{saved}");
    let intra = &saved["intra"];
    assert_eq!(intra["ranks"].as_integer(), Some(2), "{saved}");
    for op in ["all_gather", "reduce_scatter", "all_reduce"] {
        let busbw = intra[op]["busbw"].as_float().unwrap();
        assert!(busbw > 0.0 && busbw.is_finite(), "{op}: {saved}");
    }
}
