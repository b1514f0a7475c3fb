//! CPU offload. With one micro-step a step each unit's gradient shard goes to the host as it
//! is made and the ranks keep none of their own; `train.on_oom = "shrink"` keeps the gradient
//! shard (a step out of memory is dropped with its gradients), so it is the baseline: both
//! train bitwise alike, on 2 real ranks over tcp, and on one rank in bf16, whose host copy is
//! then bf16 (autograd's values, nothing summed).

mod common;
use common::*;

/// Summary of `nproc` ranks at `stage` with the optimizer offloaded, and `sets` on top.
fn run(nproc: &str, stage: u8, sets: &[&str]) -> serde_json::Value {
    let d = scratch(&format!("offload-{nproc}-{stage}-{}", sets.len()));
    let base = [
        "train.steps=6".to_string(),
        "train.micro_batch=4".into(),
        "train.eval_batches=1".into(),
        "train.grad_clip=0".into(),
        format!("zero.stage={stage}"),
        "zero.offload_optimizer=\"cpu\"".into(),
        format!("log.dir=\"{}\"", d.display()),
    ];
    let mut args = vec!["--nproc", nproc, "configs/tiny-cpu.toml"];
    for s in base.iter().map(String::as_str).chain(sets.iter().copied()) {
        args.extend(["--set", s]);
    }
    let out = zrun(&args);
    assert!(
        out.status.success(),
        "stage {stage} {sets:?}: {}",
        stderr(&out)
    );
    serde_json::from_str(&std::fs::read_to_string(d.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn gradients_on_the_host_train_as_the_ranks_own_gradient_shard_does() {
    for stage in [2, 3] {
        let host = run("2", stage, &[]);
        let device = run("2", stage, &["train.on_oom=\"shrink\""]);
        for r in 0..2 {
            let grads = |s: &serde_json::Value| s["ranks"][r]["memory"]["grads"].as_i64().unwrap();
            assert_eq!(grads(&host), 0, "stage {stage} rank {r}: {host}");
            assert!(grads(&device) > 0, "stage {stage} rank {r}: {device}");
        }
        for key in ["final_loss", "eval_loss"] {
            assert_eq!(host[key], device[key], "stage {stage}: {key}");
        }
    }
}

#[test]
fn one_bf16_rank_keeps_bf16_gradients_on_the_host_and_trains_the_same() {
    let bf16 = "zero.precision=\"bf16\"";
    let host = run("1", 3, &[bf16]);
    let device = run("1", 3, &[bf16, "train.on_oom=\"shrink\""]);
    let memory = |s: &serde_json::Value, key: &str| s["ranks"][0]["memory"][key].as_i64().unwrap();
    assert_eq!(memory(&host, "grads"), 0, "{host}");
    // The host's copy: 2 bytes an element where the shard's own gradients are 4.
    assert_eq!(
        2 * memory(&host, "buffers"),
        memory(&device, "grads"),
        "{host}\n{device}"
    );
    for key in ["final_loss", "eval_loss"] {
        assert_eq!(host[key], device[key], "{key}");
    }
}
