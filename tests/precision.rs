//! bf16 and fp16 runs of the tiny config reach within 3% of the fp32 eval loss. 200 steps of
//! 16 sequences: on a CPU without AVX-512 16-bit matmuls run ~10x slower than fp32, and these
//! two runs are most of the test suite's time there.

mod common;
use common::*;

fn eval_loss(precision: &str) -> f64 {
    let d = scratch(&format!("precision-{precision}"));
    let out = zrun(&[
        "configs/tiny-cpu.toml",
        "--set",
        "train.steps=200",
        "--set",
        "train.micro_batch=16",
        "--set",
        &format!("zero.precision=\"{precision}\""),
        "--set",
        &format!("log.dir=\"{}\"", d.display()),
    ]);
    assert!(out.status.success(), "{precision}: {}", stderr(&out));
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("summary.json")).unwrap()).unwrap();
    s["eval_loss"].as_f64().unwrap()
}

#[test]
fn bf16_and_fp16_train_as_well_as_fp32() {
    let fp32 = eval_loss("fp32");
    for p in ["bf16", "fp16"] {
        let got = eval_loss(p);
        let rel = (got - fp32) / fp32;
        assert!(
            rel.abs() <= 0.03,
            "{p}: eval loss {got} vs fp32 {fp32} ({:+.2}%)",
            100.0 * rel
        );
    }
}
