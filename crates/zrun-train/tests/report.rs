//! Every rank's figures as a 2-rank job over tcp reports them: each metrics line carries
//! both ranks' step-time breakdowns, whose parts sum to the step time, and their memory by
//! kind, whose model-state kinds are the engine's ledger for that rank; summary.json keeps
//! the run's means, the memory at the end and the stragglers.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use std::path::Path;

use zrun_shard::{MemoryLedger, Precision, ReduceDtype, ShardLayout, Stage};
use zrun_train::config::Config;
use zrun_train::trainer::Run;

const CONFIG: &str = r#"
[model]
preset = "tiny"
vocab_size = 64
seq_len = 16
n_layer = 2
n_head = 4
d_model = 32
[train]
steps = 12
micro_batch = 4
grad_accum = 2
warmup_steps = 2
eval_batches = 1
threads = 1
[zero]
stage = 3
precision = "bf16"
[log]
every = 4
"#;

#[test]
fn every_line_carries_each_ranks_breakdown_and_memory_by_kind() {
    let dir = common::scratch("report", "two-ranks");
    let config = dir.join("train.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let env = [
        ("ZRUN_RP_CONFIG", config.display().to_string()),
        ("ZRUN_RP_DIR", dir.display().to_string()),
    ];
    common::spawn_ranks("rank_process", "report", 2, &env);
    let cfg = Config::load(&config, &[]).unwrap();
    let gpt = cfg.build_model().unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "steps 4, 8 and 12");
    for line in &lines {
        let step = &line["step"];
        assert_eq!(line["tokens"], step.as_u64().unwrap() * 16 * 4 * 2 * 2);
        let ranks = line["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2, "{line}");
        for (r, fig) in ranks.iter().enumerate() {
            assert_eq!(fig["rank"], r);
            let f = |k: &str| fig[k].as_f64().unwrap();
            let parts = [
                "data_s",
                "forward_s",
                "backward_s",
                "comm_wait_s",
                "optimizer_s",
                "other_s",
            ];
            let sum: f64 = parts.iter().map(|k| f(k)).sum();
            let step_time = f("step_time_s");
            assert!(
                (sum - step_time).abs() <= 0.05 * step_time,
                "step {step} rank {r}: parts sum to {sum}, the step took {step_time}"
            );
            assert!(f("forward_s") > 0.0 && f("backward_s") > 0.0 && f("comm_wait_s") >= 0.0);
            // The model-state kinds are the ledger's for this rank's layout.
            let layout = ShardLayout::new(gpt.units(), r as i64, 2);
            let want =
                MemoryLedger::plan(&layout, Stage::Zero3, Precision::Bf16, ReduceDtype::Fp32);
            let m = &fig["memory"];
            for (kind, bytes) in [
                ("params", want.params),
                ("grads", want.grads),
                ("master", want.master),
                ("optimizer", want.optimizer),
            ] {
                assert_eq!(
                    m[kind].as_i64().unwrap(),
                    bytes,
                    "step {step} rank {r} {kind}"
                );
            }
            assert!(m["gathered"].as_i64().unwrap() > 0, "stage 3 gathers units");
            assert!(m["rss_peak"].as_i64().unwrap() >= m["rss"].as_i64().unwrap());
        }
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let ranks = summary["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    assert!(ranks[1]["step_time_s"].as_f64().unwrap() > 0.0);
    assert!(summary["stragglers"].is_array());
}

/// One rank of the job above (started by it, not on its own).
#[test]
#[ignore = "entry point of the rank processes the report test starts"]
fn rank_process() {
    if !common::is_rank() {
        return;
    }
    let env = |k: &str| std::env::var(k).unwrap();
    let dir = env("ZRUN_RP_DIR");
    let sets = vec![format!("log.dir=\"{dir}\"")];
    let cfg = Config::load(Path::new(&env("ZRUN_RP_CONFIG")), &sets).unwrap();
    let mut run = Run::new(&cfg, common::rank_comm(), &zrun_comm::Topology::single()).unwrap();
    let trained = run.train().map(drop).map_err(anyhow::Error::from);
    drop(run);
    common::end_rank(trained);
}
