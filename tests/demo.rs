//! The demo config trains to within 5% of the synthetic data's exact loss floor, and the
//! run writes the metrics and summary files a user reads.

mod common;
use common::*;

#[test]
fn demo_config_reaches_the_loss_floor() {
    let d = scratch("demo");
    let dir = d.display().to_string();
    // As `make demo` runs it: 2 CPU ranks.
    let out = zrun(&[
        "--nproc",
        "2",
        "configs/tiny-cpu.toml",
        "--set",
        &format!("log.dir=\"{dir}\""),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("summary.json")).unwrap()).unwrap();
    let eval = summary["eval_loss"].as_f64().unwrap();
    let floor = summary["loss_floor"].as_f64().unwrap();
    assert!(floor > 0.5 && floor < (256f64).ln(), "floor {floor}");
    assert!(
        eval >= floor * 0.99,
        "eval {eval} below the floor {floor}: the floor or eval is wrong"
    );
    assert!(
        eval <= floor * 1.05,
        "eval {eval} not within 5% of the floor {floor}"
    );
    for key in ["final_loss", "tokens_per_s", "wall_time_s"] {
        assert!(summary[key].as_f64().unwrap() > 0.0, "{key}");
    }
    assert_eq!(summary["world_size"], 2);
    for r in 0..2 {
        assert!(summary["peak_rss_bytes"][r].as_i64().unwrap() > 0);
    }

    let lines: Vec<serde_json::Value> = std::fs::read_to_string(d.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines.len() >= 10);
    for key in [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "model_state_bytes",
        "peak_rss_bytes",
    ] {
        assert!(
            lines.iter().all(|l| l.get(key).is_some()),
            "metrics lack {key}"
        );
    }
    // From about ln(256) = 5.5 at init to near the floor.
    let first = lines[0]["loss"].as_f64().unwrap();
    let last = lines.last().unwrap()["loss"].as_f64().unwrap();
    assert!(
        last < first && last < 0.5 * 256f64.ln(),
        "loss did not fall: {first} -> {last}"
    );
    // The last stdout line states the figures.
    let text = stdout(&out);
    let last_line = text
        .lines()
        .rfind(|l| l.contains("final: eval_loss"))
        .unwrap_or_default();
    assert!(
        last_line.contains("floor") && last_line.contains("2 rank(s)"),
        "{text}"
    );
}
