//! Memory fit as a user meets it, through the real `zrun` binary on 2 CPU ranks: `zrun
//! estimate` predicts what a run then holds; under `dist.memory_limit` a config the estimate
//! says does not fit ends with exit code 4 and one diagnosis (phase, memory by kind, `--set`
//! fixes) within seconds, even when only one rank runs out while the other waits in a
//! collective; and the config `zrun plan` picks for the same limit trains.

mod common;

use std::time::{Duration, Instant};

use common::{read_json, scratch, stderr, stdout, zrun, Job};

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
    let s = sets(&d, 2);
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
    }
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
    let mut job = Job::start(&args(&["--nproc", "2", CONFIG], &s), &[]);
    let status = job.exit_within(Duration::from_secs(60));
    let err = job.stderr();
    assert_eq!(status.code(), Some(4), "{}", job.text());
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert_eq!(err.matches("ran out of memory in").count(), 1, "{err}");
    for want in [
        "failed first: exited with code 4",
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
    assert!(
        err.contains("rank 1 failed first: exited with code 4"),
        "{}",
        job.text()
    );
    assert!(err.contains("rank 1: out of memory in"), "{err}");
    assert_ne!(status.code(), Some(0), "{}", job.text());
}
