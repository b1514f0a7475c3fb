//! Two nodes on one machine (scripts/testbed.sh: network namespaces on a rate-limited veth
//! pair, a hostname each): a job of 2 nodes x 2 ranks sharding within each node
//! (`zero.shard_group = "node"`) trains like one node of 4 ranks sharding over all of them,
//! with the node-to-node traffic on the link. Skipped, with the testbed's one-line reason,
//! where network namespaces cannot be made.

mod common;

use std::path::Path;
use std::process::Command;

use common::{root, scratch, stderr, zrun};

/// Per-step (step, loss) of a run's metrics.jsonl.
fn losses(dir: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["loss"].is_number())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

fn sets(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut s = vec![
        "zero.stage=3".to_string(),
        "train.steps=12".into(),
        "train.micro_batch=4".into(),
        "train.eval_every=0".into(),
        "log.every=1".into(),
        "checkpoint.every=0".into(),
        format!("log.dir=\"{}\"", dir.display()),
    ];
    s.extend(extra.iter().map(|x| x.to_string()));
    s.into_iter()
        .flat_map(|kv| ["--set".to_string(), kv])
        .collect()
}

#[test]
fn two_nodes_sharding_within_each_node_train_like_one_node() {
    let one = scratch("tb-one-node");
    let mut args = vec![
        "--nproc".to_string(),
        "4".into(),
        "configs/tiny-cpu.toml".into(),
    ];
    args.extend(sets(&one, &[]));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = zrun(&refs);
    assert!(o.status.success(), "one node: {}", stderr(&o));

    let two = scratch("tb-two-nodes");
    let o = Command::new(root().join("scripts/testbed.sh"))
        .args([
            "--rate",
            "1gbit",
            "--nproc",
            "2",
            "--",
            "configs/tiny-cpu.toml",
        ])
        .args(sets(&two, &["zero.shard_group=\"node\""]))
        .current_dir(root())
        .env("ZRUN", env!("CARGO_BIN_EXE_zrun"))
        .env("TESTBED_LOG_DIR", two.join("testbed"))
        .output()
        .unwrap();
    if o.status.code() == Some(77) {
        eprintln!("{}", stderr(&o).trim());
        return;
    }
    let node1 = std::fs::read_to_string(two.join("testbed/node1.log")).unwrap_or_default();
    assert!(
        o.status.success(),
        "testbed: {}\nnode 1: {node1}",
        stderr(&o)
    );
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(&o);
    assert!(text.contains("4 rank(s)"), "{text}");
    let (want, got) = (losses(&one), losses(&two));
    assert_eq!(got.len(), 12, "{text}");
    for ((step, a), (_, b)) in got.iter().zip(&want) {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "step {step}: two nodes {a} vs one node {b}"
        );
    }
}
