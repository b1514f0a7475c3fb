//! Memory fit as a user meets it, through the real `zrun` binary on 2 CPU ranks: `zrun
//! estimate` predicts what a run then holds; under `dist.memory_limit` a config the estimate
//! says does not fit ends with exit code 4 and one diagnosis (phase, memory by kind, `--set`
//! fixes) within seconds, even when only one rank runs out while the other waits in a
//! collective; and the config `zrun plan` picks for the same limit trains.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use std::time::{Duration, Instant};

use common::{assert_job_gone, read_json, scratch, stderr, stdout, zrun, Job};

/// A small GPT (3.5M parameters), 2 ranks at stage 2, micro-batch 8 of 128 tokens.
const CONFIG: &str = "configs/bench-cpu.toml";

/// The overrides of every run here.
fn sets(dir: &std::path::Path, steps: u64) -> Vec<String> {
    vec![
        format!("log.dir=\"{}\"", dir.display()),
        format!("train.steps={steps}"),
        "train.eval_batches=1".into(),
        "dist.timeout_s=60".into(),
    ]
}

fn args<'a>(head: &[&'a str], sets: &'a [String]) -> Vec<&'a str> {
    let mut a = head.to_vec();
    for s in sets {
        a.extend(["--set", s.as_str()]);
    }
    a
}

/// `zrun estimate --json` for 2 ranks: one object per rank.
fn estimate(sets: &[String]) -> Vec<serde_json::Value> {
    let out = zrun(&args(&["estimate", CONFIG, "--nproc", "2", "--json"], sets));
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn the_estimate_names_its_terms_and_predicts_what_the_ranks_hold() {
    let d = scratch("fit-estimate");
    let mut s = sets(&d, 4);
    s.push("log.every=1".into());
    let ranks = estimate(&s);
    assert_eq!(ranks.len(), 2);
    for (r, e) in ranks.iter().enumerate() {
        assert_eq!(e["rank"], r);
        assert!(e["fixed_bytes"].as_i64().unwrap() > 0, "{e}");
        assert_eq!(e["fits"], true, "no limit: {e}");
        for term in ["model_states", "activations_kept", "allocator_heap"] {
            assert!(e["terms"][term].as_i64().unwrap() > 0, "{term}: {e}");
        }
        let sum: i64 = e["terms"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_i64().unwrap())
            .sum();
        assert_eq!(sum, e["peak_bytes"].as_i64().unwrap(), "{e}");
        assert!(e["phase"].as_str().unwrap().starts_with("backward of unit"));
    }
    // The human table: every rank, the terms, and a row per stage with the config marked.
    let text = stdout(&zrun(&args(&["estimate", CONFIG, "--nproc", "2"], &s)));
    for want in [
        "ranks 0-1: peak",
        "model states: parameters",
        "activations per unit: embed",
        "<- the config",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    let out = zrun(&args(&["--nproc", "2", CONFIG], &s));
    assert!(out.status.success(), "{}", stderr(&out));
    let summary = read_json(&d.join("summary.json"));
    for (r, e) in ranks.iter().enumerate() {
        let predicted = e["peak_bytes"].as_i64().unwrap();
        assert_eq!(summary["estimated_peak_bytes"][r].as_i64(), Some(predicted));
        let measured = summary["peak_rss_bytes"][r].as_i64().unwrap()
            - summary["base_rss_bytes"][r].as_i64().unwrap();
        // Loose here (benches/memory_fit.py holds the 0.95-1.10 target): a broken term
        // moves the ratio far outside this.
        let ratio = predicted as f64 / measured as f64;
        assert!((0.85..1.25).contains(&ratio), "rank {r}: {ratio}");
        // The caching CPU allocator (the default) holds its tensors' peak with little over:
        // freed blocks merge and serve requests of other sizes.
        let allocated = summary["cpu_allocated_peak_bytes"][r].as_i64().unwrap();
        let reserved = summary["cpu_reserved_peak_bytes"][r].as_i64().unwrap();
        assert!(
            allocated <= reserved && reserved as f64 <= 1.05 * allocated as f64,
            "rank {r}: allocated {allocated}, reserved {reserved}"
        );
    }
    // After its first steps a step takes no more blocks from the system: rank 0's reserved
    // peak after step 3 is that after step 2, but for the C heap's small blocks (below the
    // 64 KiB the cached blocks start at; step 4 ends with the evaluation).
    let metrics = std::fs::read_to_string(d.join("metrics.jsonl")).unwrap();
    let reserved: Vec<i64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|m| m["cpu_reserved_peak_bytes"].as_i64())
        .collect();
    assert_eq!(reserved.len(), 4, "{metrics}");
    assert!(
        (0..64 << 10).contains(&(reserved[2] - reserved[1])),
        "{metrics}"
    );
}

#[test]
fn the_chunked_loss_holds_less_than_the_logits_and_the_estimate_follows_both() {
    // A vocabulary of 8192 at micro-batch 4 x 128: 4.2M logits, 16 MiB in fp32 per copy.
    let run = |chunk: u64| {
        let d = scratch(&format!("fit-loss-chunk-{chunk}"));
        let mut s = sets(&d, 2);
        s.extend([
            "model.vocab_size=8192".to_string(),
            "train.micro_batch=4".to_string(),
            format!("train.loss_chunk={chunk}"),
        ]);
        let out = zrun(&args(&["--nproc", "2", CONFIG], &s));
        assert!(out.status.success(), "{}", stderr(&out));
        let summary = read_json(&d.join("summary.json"));
        let rank0 = |k: &str| summary[k][0].as_i64().unwrap();
        let measured = rank0("peak_rss_bytes") - rank0("base_rss_bytes");
        let ratio = rank0("estimated_peak_bytes") as f64 / measured as f64;
        assert!((0.9..1.1).contains(&ratio), "loss_chunk {chunk}: {ratio}");
        rank0("cpu_allocated_peak_bytes")
    };
    // In chunks of 2^20 logits (4 MiB, 4 of them) against the full logits, which keep their
    // fp32 log-probabilities and make two gradients of that size in the backward (the
    // allocated peaks measured 32 MiB apart).
    let (chunked, full) = (run(1 << 20), run(0));
    assert!(
        chunked + (24 << 20) < full,
        "tensor peaks: chunked {chunked}, full logits {full}"
    );
}

/// A limit that the config does not fit and a cheaper alternative does: the runtime's fixed
/// cost plus 85 MiB (the config needs ~115 MiB above it; micro-batch 2 x 4 ~60 MiB).
fn tight_limit() -> String {
    let fixed = estimate(&[])[0]["fixed_bytes"].as_i64().unwrap();
    format!("dist.memory_limit=\"{}\"", fixed + (85 << 20))
}

#[test]
fn a_config_that_does_not_fit_stops_with_one_diagnosis_and_the_plan_trains() {
    let d = scratch("fit-oom");
    let mut s = sets(&d, 3);
    s.push(tight_limit());
    let e = estimate(&s);
    assert_eq!(e[0]["fits"], false, "{}", e[0]);
    let t = Instant::now();
    let id = format!("test-fit-oom-{}", std::process::id());
    let mut job = Job::start(&args(&["--nproc", "2", "--run-id", &id, CONFIG], &s), &[]);
    let status = job.exit_within(Duration::from_secs(60));
    let err = job.stderr();
    assert_eq!(status.code(), Some(4), "{}", job.text());
    assert_job_gone(&id);
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert_eq!(err.matches("ran out of memory in").count(), 1, "{err}");
    for want in [
        "failed first: exited with code",
        "held by kind: parameters",
        "activations and temporaries",
        "a rank may use dist.memory_limit",
        "estimate for this config: peak",
        "(predicted not to fit)",
        "predicted to fit, cheapest first:",
        "--set zero.stage=",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    let phase = [
        "forward of unit",
        "backward of unit",
        "loss",
        "optimizer step",
    ];
    assert!(
        phase
            .iter()
            .any(|p| err.contains(&format!("out of memory in {p}"))),
        "{err}"
    );

    // The plan for the same limit trains under it.
    let plan = zrun(&args(&["plan", CONFIG, "--nproc", "2", "--json"], &s));
    assert!(plan.status.success(), "{}", stderr(&plan));
    let choice: serde_json::Value = serde_json::from_str(stdout(&plan).trim()).unwrap();
    let d2 = scratch("fit-plan");
    let mut s2 = sets(&d2, 3);
    s2.push(tight_limit());
    for o in choice["set"].as_array().unwrap() {
        s2.push(o.as_str().unwrap().to_string());
    }
    let out = zrun(&args(&["--nproc", "2", CONFIG], &s2));
    assert!(out.status.success(), "{s2:?}: {}", stderr(&out));
    let summary = read_json(&d2.join("summary.json"));
    assert_eq!(summary["steps"], 3);
}

#[test]
fn one_rank_out_of_memory_ends_the_other_waiting_in_a_collective() {
    // Stage 3 gathers every unit: rank 0, with no limit, waits for rank 1 in an all-gather or
    // a reduce-scatter when rank 1 (limited) fails.
    let d = scratch("fit-one-rank");
    let mut s = sets(&d, 3);
    s.push("zero.stage=3".into());
    let exe = env!("CARGO_BIN_EXE_zrun");
    let mut common_sets = String::new();
    for o in &s {
        common_sets.push_str(&format!(" --set '{o}'"));
    }
    let script = format!(
        "if [ $RANK = 1 ]; then exec {exe} {CONFIG}{common_sets} --set '{}'; else exec {exe} {CONFIG}{common_sets}; fi",
        tight_limit()
    );
    let t = Instant::now();
    let mut job = Job::start(&["exec", "--nproc", "2", "--", "sh", "-c", &script], &[]);
    let status = job.exit_within(Duration::from_secs(60));
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let err = job.stderr();
    // Either rank may be reaped first: rank 1 with its 4, or rank 0, which lost its peer.
    assert!(err.contains("rank 1: out of memory in"), "{err}");
    assert_ne!(status.code(), Some(0), "{}", job.text());
}

/// A limit that fits micro-batch 2 but not 4 or 8 at stage 2 (~60, ~78 and ~115 MiB above the
/// runtime's fixed cost).
fn limit_for_micro_batch_2() -> String {
    let fixed = estimate(&[])[0]["fixed_bytes"].as_i64().unwrap();
    format!("dist.memory_limit=\"{}\"", fixed + (70 << 20))
}

/// Per-step losses of a run's metrics.jsonl.
fn losses(dir: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// The step-1 checkpoint's parameters, consolidated, by name.
fn params_after_step_1(dir: &std::path::Path) -> Vec<(String, tch::Tensor)> {
    let out_file = dir.join("step-1.safetensors");
    let ckpt = dir.join("ckpt/step-00000001");
    let o = zrun(&[
        "consolidate",
        ckpt.to_str().unwrap(),
        "-o",
        out_file.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut t = tch::Tensor::read_safetensors(&out_file).unwrap();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

/// The shrunk run against one started at the micro-batch it shrank to: same losses, same
/// parameters.
fn assert_same_run(shrunk: &std::path::Path, baseline: &[String]) {
    let summary = read_json(&shrunk.join("summary.json"));
    let to = &summary["shrinks"].as_array().unwrap().last().unwrap()["to"];
    let d = scratch(&format!(
        "fit-baseline-{}",
        shrunk.file_name().unwrap().to_string_lossy()
    ));
    let mut s = sets(&d, 2);
    s.extend(baseline.iter().cloned());
    s.extend([
        format!("train.micro_batch={}", to[0]),
        format!("train.grad_accum={}", to[1]),
        "checkpoint.every=1".to_string(),
        "log.every=1".to_string(),
    ]);
    let out = zrun(&args(&["--nproc", "2", CONFIG], &s));
    assert!(out.status.success(), "{}", stderr(&out));
    let (a, b) = (losses(shrunk), losses(&d));
    assert_eq!(a.len(), 2);
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "losses {a:?} against {b:?}"
        );
    }
    let (pa, pb) = (params_after_step_1(shrunk), params_after_step_1(&d));
    assert_eq!(pa.len(), pb.len());
    for ((na, ta), (nb, tb)) in pa.iter().zip(&pb) {
        assert_eq!(na, nb);
        assert!(ta.allclose(tb, 1e-5, 1e-7, false), "{na} differs");
    }
}

#[test]
fn shrink_drops_the_step_halves_the_micro_batch_and_trains_as_micro_batch_2() {
    let d = scratch("fit-shrink");
    let mut s = sets(&d, 2);
    s.extend([
        limit_for_micro_batch_2(),
        "train.on_oom=\"shrink\"".to_string(),
        "checkpoint.every=1".to_string(),
        "log.every=1".to_string(),
    ]);
    let out = zrun(&args(&["--nproc", "2", CONFIG], &s));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("out of memory at micro-batch 8 x grad_accum 1 (rank"),
        "{err}"
    );
    let summary = read_json(&d.join("summary.json"));
    let shrinks = summary["shrinks"].as_array().unwrap();
    assert_eq!(
        shrinks.last().unwrap()["to"],
        serde_json::json!([2, 4]),
        "{shrinks:?}"
    );
    assert!(shrinks.iter().all(|s| s["step"] == 1), "{shrinks:?}");
    assert_same_run(&d, &[]);
}

#[test]
fn shrink_when_one_rank_runs_out_in_backward_while_the_other_waits_in_a_collective() {
    // Only rank 1 is limited. With activation checkpointing its forward keeps only unit
    // inputs (~57 MiB at the peak) and its backward recomputes each unit (~71 MiB): a limit
    // of 62 MiB above the runtime fails in backward, where at stage 3 rank 0 is inside an
    // all-gather or a reduce-scatter that waits for rank 1.
    let d = scratch("fit-shrink-one");
    let stage = [
        "zero.stage=3".to_string(),
        "zero.activation_checkpointing=true".to_string(),
    ];
    let mut s = sets(&d, 2);
    s.extend(stage.iter().cloned());
    s.extend([
        "train.on_oom=\"shrink\"".to_string(),
        "checkpoint.every=1".to_string(),
        "log.every=1".to_string(),
    ]);
    let fixed = estimate(&[])[0]["fixed_bytes"].as_i64().unwrap();
    let limit = format!("dist.memory_limit=\"{}\"", fixed + (62 << 20));
    let exe = env!("CARGO_BIN_EXE_zrun");
    let mut all = String::new();
    for o in &s {
        all.push_str(&format!(" --set '{o}'"));
    }
    let script = format!(
        "if [ $RANK = 1 ]; then exec {exe} {CONFIG}{all} --set '{limit}'; else exec {exe} {CONFIG}{all}; fi"
    );
    let t = Instant::now();
    let mut job = Job::start(&["exec", "--nproc", "2", "--", "sh", "-c", &script], &[]);
    let status = job.exit_within(Duration::from_secs(120));
    assert_eq!(status.code(), Some(0), "{}", job.text());
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    let summary = read_json(&d.join("summary.json"));
    let shrinks = summary["shrinks"].as_array().unwrap();
    assert!(!shrinks.is_empty(), "{}", job.text());
    assert!(
        shrinks.iter().all(|s| s["ranks"] == serde_json::json!([1])),
        "{shrinks:?}"
    );
    let in_backward = shrinks.iter().any(|s| {
        s["phases"][0]
            .as_str()
            .unwrap()
            .starts_with("backward of unit")
    });
    assert!(in_backward, "{shrinks:?}");
    assert_same_run(&d, &stage);
}

#[test]
fn auto_stage_and_micro_batch_take_the_plans_choice() {
    let d = scratch("fit-auto");
    let mut s = sets(&d, 2);
    s.extend([
        tight_limit(),
        "zero.stage=\"auto\"".to_string(),
        "train.micro_batch=\"auto\"".to_string(),
        "train.global_batch=16".to_string(),
        "log.every=1".to_string(),
    ]);
    let plan = zrun(&args(&["plan", CONFIG, "--nproc", "2", "--json"], &s));
    assert!(plan.status.success(), "{}", stderr(&plan));
    let text = stdout(&plan);
    let choice: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let out = zrun(&args(&["--nproc", "2", CONFIG], &s));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let want: Vec<&str> = choice["set"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        err.contains(&format!("\"auto\": {}", want.join(" "))),
        "{want:?}: {err}"
    );
    let mb = choice["choice"]["micro_batch"].as_u64().unwrap();
    let line: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(line["micro_batch"].as_u64(), Some(mb));
    // "auto" micro-batches need the global batch.
    let o = zrun(&[
        "--nproc",
        "2",
        CONFIG,
        "--set",
        "train.micro_batch=\"auto\"",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("needs train.global_batch"),
        "{}",
        stderr(&o)
    );
}

/// `train.loss_chunk = "auto"` (the default) as `zrun estimate` resolves it for a GPU config:
/// the full logits where the estimate with them fits the device memory, chunks where only
/// the chunked loss does; on CPU ranks it stays chunked and says nothing.
#[test]
fn the_estimate_resolves_an_auto_loss_chunk_against_the_gpu_memory() {
    let vocab = ["--set", "model.vocab_size=50304"];
    let gpu = |mem: &str| {
        let mut a = vec!["estimate", CONFIG, "--device-mem", mem];
        a.extend(["--set", "dist.device=\"cuda\""]);
        a.extend(vocab);
        let out = zrun(&a);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let text = gpu("64GiB");
    assert!(
        text.contains("train.loss_chunk = \"auto\": the full logits"),
        "{text}"
    );
    // Between the two: the largest chunk that fits, here 2^25 (bench-cpu's micro-batch is
    // 8 x 128 x 50304 logits, about 2^25.6; in fp32 a chunk of 2^26 would hold more than
    // the fused loss on the full logits, which keeps only their gradient).
    let text = gpu("1800MiB");
    assert!(
        text.contains(
            "train.loss_chunk = \"auto\": chunks of 33554432 logits, the largest that fits"
        ),
        "{text}"
    );
    let small = gpu("1500MiB");
    assert!(
        small.contains("train.loss_chunk = \"auto\": chunks of 16777216 logits"),
        "{small}"
    );
    // The chunked estimate is the one printed then: lower than the full logits'.
    let peak = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("rank 0: peak"))
            .map(str::to_string)
    };
    assert_ne!(peak(&gpu("64GiB")), peak(&text), "{text}");
    let mut a = vec!["estimate", CONFIG];
    a.extend(vocab);
    let cpu = stdout(&zrun(&a));
    assert!(!cpu.contains("loss_chunk"), "{cpu}");
}

/// The full logits' loss on a GPU in bf16 or fp32 is the fused one: the estimate's loss
/// temporaries at the head's backward are the logits' gradient alone in the compute dtype
/// (n x V x e), where PyTorch's cross-entropy (fp16, CPU ranks, or `ZRUN_FUSED_LOSS=0`) holds
/// the fp32 log-probabilities, their gradient and the logits' in fp32 and the compute dtype.
#[test]
fn the_estimate_counts_the_fused_loss_on_a_gpu() {
    // bench-cpu: micro-batch 8 x 128 tokens over 50304 vocabulary entries.
    let (n, v) = (8 * 128, 50304i64);
    let loss = |prec: &str, device: &str, env: &[(&str, &str)]| -> i64 {
        let p = format!("zero.precision=\"{prec}\"");
        let d = format!("dist.device=\"{device}\"");
        let vocab = format!("model.vocab_size={v}");
        let args = [
            "estimate",
            CONFIG,
            "--json",
            "--device-mem",
            "64GiB",
            "--set",
            &p,
            "--set",
            &d,
            "--set",
            "train.loss_chunk=0",
            "--set",
            &vocab,
        ];
        let out = common::zrun_child(&args, env).wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        let j: serde_json::Value =
            serde_json::from_str(stdout(&out).lines().find(|l| l.starts_with('{')).unwrap())
                .unwrap();
        assert_eq!(j["phase"], "backward of unit head", "{j}");
        j["terms"]["loss_temporaries"].as_i64().unwrap()
    };
    assert_eq!(loss("bf16", "cuda", &[]), n * v * 2);
    assert_eq!(loss("fp32", "cuda", &[]), n * v * 4);
    // PyTorch's: 4nV kept, 8nV of fp32 gradients and nV x e in the backward.
    let unfused = n * v * (4 + 8 + 2);
    assert_eq!(loss("bf16", "cuda", &[("ZRUN_FUSED_LOSS", "0")]), unfused);
    assert_eq!(loss("fp16", "cuda", &[]), unfused);
}

#[test]
fn the_estimate_names_bf16_gradients_where_they_are_exact() {
    // One rank, one micro-step a step, no tied parameter, bf16 compute: bf16 gradients train
    // exactly as fp32 ones (docs/config.md) in half the bytes, and the estimate says so;
    // with two micro-steps (summed in the gradients), or a tied head, they would round.
    let hint = "--set zero.reduce_dtype=\"bf16\" trains exactly";
    let text = |extra: &[&str]| {
        let mut args = vec![
            "estimate",
            CONFIG,
            "--nproc",
            "1",
            "--set",
            "zero.precision=\"bf16\"",
        ];
        for s in extra {
            args.extend(["--set", s]);
        }
        let out = zrun(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let untied = "model.tie_embeddings=false";
    let exact = text(&[untied, "train.grad_accum=1"]);
    assert!(exact.contains(hint), "{exact}");
    for extra in [
        &[untied, "train.grad_accum=2"][..],
        &["model.tie_embeddings=true", "train.grad_accum=1"],
        &[untied, "train.grad_accum=1", "zero.reduce_dtype=\"bf16\""],
    ] {
        let t = text(extra);
        assert!(!t.contains(hint), "{extra:?}: {t}");
    }
}
