//! `zrun plot` end to end: charts of synthetic run directories, compared; runs without the
//! optional fields; bad input; writes that fail (a file-size limit standing in for a full
//! disk, a directory in the way, an output directory that cannot be made).

mod common;

use std::path::Path;

use common::{files_in, root, scratch, stderr, stdout, zrun, zrun_file_limit};
use serde_json::json;

/// What a synthetic run has.
#[derive(Clone, Copy)]
struct Has {
    eval: bool,
    mfu: bool,
    /// `tokens` and `ranks` in metrics.jsonl, `ranks` and `stragglers` in summary.json.
    ranks: bool,
    summary: bool,
}

const FULL: Has = Has {
    eval: true,
    mfu: true,
    ranks: true,
    summary: true,
};

const BARE: Has = Has {
    eval: false,
    mfu: false,
    ranks: false,
    summary: true,
};

fn memory(rank: u64, step: u64) -> serde_json::Value {
    let mib = 1u64 << 20;
    json!({"params": 4 * mib, "grads": 4 * mib, "master": 0, "optimizer": 8 * mib, "host": 0,
           "buffers": mib, "gathered": 0, "activations": (20 + step + rank) * mib,
           "rss": (150 + step) * mib, "rss_peak": (160 + step) * mib})
}

fn breakdown(rank: u64) -> serde_json::Value {
    let comm = 0.01 + 0.01 * rank as f64;
    json!({"step_time_s": 0.1 + comm, "data_s": 0.005, "forward_s": 0.03, "backward_s": 0.05,
           "comm_wait_s": comm, "optimizer_s": 0.01, "other_s": 0.005})
}

/// Writes a two-rank run of 5 logged steps (every 10) into `dir`.
fn write_run(dir: &Path, has: Has, slower: f64) {
    std::fs::create_dir_all(dir).unwrap();
    let mut lines = String::new();
    for i in 1..=5u64 {
        let step = 10 * i;
        let mut m = json!({"step": step, "loss": 5.0 / i as f64, "lr": 1e-3, "grad_norm": 1.0,
            "tokens_per_s": 20000.0 / slower, "step_time_s": 0.1 * slower,
            "model_state_bytes": 16 << 20, "engine_bytes": 17 << 20,
            "rss_bytes": 150 << 20, "peak_rss_bytes": 160 << 20});
        if has.eval && i % 2 == 0 {
            m["eval_loss"] = json!(5.2 / i as f64);
        }
        if has.mfu {
            m["mfu"] = json!(0.3 / slower);
        }
        if has.ranks {
            m["tokens"] = json!(step * 2048);
            let ranks: Vec<_> = (0..2u64)
                .map(|r| {
                    let mut o = breakdown(r);
                    o["rank"] = json!(r);
                    o["memory"] = memory(r, step);
                    o
                })
                .collect();
            m["ranks"] = json!(ranks);
        }
        lines.push_str(&m.to_string());
        lines.push('\n');
    }
    std::fs::write(dir.join("metrics.jsonl"), lines).unwrap();
    if has.summary {
        let mut s = json!({"steps": 50, "final_loss": 1.0, "eval_loss": 1.04, "loss_floor": 0.9,
            "tokens_per_s": 20000.0, "peak_rss_bytes": [1, 1], "base_rss_bytes": [1, 1],
            "model_state_bytes": [1, 1], "params": 100, "world_size": 2, "wall_time_s": 5.0});
        if has.ranks {
            let ranks: Vec<_> = (0..2u64)
                .map(|r| {
                    let mut o = breakdown(r);
                    o["rank"] = json!(r);
                    o["memory"] = memory(r, 50);
                    o
                })
                .collect();
            s["ranks"] = json!(ranks);
            s["stragglers"] = json!([1]);
        }
        std::fs::write(dir.join("summary.json"), s.to_string()).unwrap();
    }
}

/// Asserts `out/NAME.png` is a PNG and returns `out/NAME.svg`'s text.
fn chart(out: &Path, name: &str) -> String {
    let png = std::fs::read(out.join(format!("{name}.png")))
        .unwrap_or_else(|e| panic!("{name}.png: {e}"));
    assert!(
        png.len() > 5000 && png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{name}.png: {} bytes",
        png.len()
    );
    let svg = std::fs::read_to_string(out.join(format!("{name}.svg")))
        .unwrap_or_else(|e| panic!("{name}.svg: {e}"));
    assert!(
        svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
        "{name}.svg"
    );
    svg
}

#[test]
fn two_runs_are_compared_on_every_chart() {
    let dir = scratch("plot-two");
    let (a, b, out) = (dir.join("stage0"), dir.join("stage3"), dir.join("out"));
    write_run(&a, FULL, 1.0);
    write_run(&b, FULL, 1.5);
    let o = zrun(&[
        "plot",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let labels: [(&str, &[&str]); 5] = [
        (
            "loss",
            &["step", "loss (nats)", "stage0 eval", "loss floor"],
        ),
        ("loss_tokens", &["tokens", "loss (nats)", "stage3 train"]),
        ("throughput", &["step", "tokens/s", "MFU (%)"]),
        ("memory", &["step", "MiB", "activations", "peak RSS"]),
        (
            "breakdown",
            &["rank", "s per step", "comm wait", "rank 1*", "straggler"],
        ),
    ];
    for (name, want) in labels {
        let svg = chart(&out, name);
        for w in want.iter().chain(&["stage0", "stage3"]) {
            assert!(svg.contains(w), "{name}.svg lacks {w:?}");
        }
    }
    let text = stdout(&o);
    let wrote = text.lines().filter(|l| l.starts_with("wrote ")).count();
    assert_eq!(wrote, 10, "{text}");
    assert!(text.contains(&format!("wrote {}", out.join("breakdown.svg").display())));
}

#[test]
fn a_run_without_optional_fields_plots_the_rest() {
    let dir = scratch("plot-bare");
    let run = dir.join("old");
    write_run(&run, BARE, 1.0);
    // One run: the charts go to RUN_DIR/plots.
    let o = zrun(&["plot", run.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let out = run.join("plots");
    for name in ["loss", "loss_tokens", "throughput", "memory"] {
        let svg = chart(&out, name);
        assert!(svg.contains("old"), "{name}.svg lacks the run's name");
    }
    assert!(!chart(&out, "throughput").contains("MFU"));
    assert!(
        !out.join("breakdown.png").exists(),
        "breakdown without per-rank figures"
    );
    let err = stderr(&o);
    for note in [
        "no eval_loss",
        "no mfu",
        "tokens estimated",
        "no per-rank memory",
        "breakdown: skipped",
    ] {
        assert!(err.contains(note), "no note {note:?} in:\n{err}");
    }
    // A run still going: no summary.json, a half-written last line.
    let running = dir.join("running");
    write_run(
        &running,
        Has {
            summary: false,
            ..FULL
        },
        1.0,
    );
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(running.join("metrics.jsonl"))
        .unwrap();
    std::io::Write::write_all(&mut f, br#"{"step":60,"loss":0.8,"#).unwrap();
    let o = zrun(&["plot", running.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stderr(&o).contains("unfinished last line"),
        "{}",
        stderr(&o)
    );
    chart(&running.join("plots"), "breakdown");
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let dir = scratch("plot-bad");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let o = zrun(&["plot", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains(&empty.join("metrics.jsonl").display().to_string()),
        "{err}"
    );

    // A file given for a run directory (the config, say) is named as such.
    let cfg = root().join("configs/tiny-cpu.toml");
    let o = zrun(&["plot", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("a file, not a run directory"),
        "{}",
        stderr(&o)
    );

    let bad = dir.join("bad");
    write_run(&bad, FULL, 1.0);
    let text = std::fs::read_to_string(bad.join("metrics.jsonl")).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[2] = r#"{"step": 30, "loss": }"#;
    std::fs::write(bad.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    let o = zrun(&["plot", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("{}:3:", bad.join("metrics.jsonl").display())),
        "{err}"
    );
    assert!(
        !bad.join("plots").exists(),
        "nothing is written for bad input"
    );

    std::fs::write(bad.join("metrics.jsonl"), text).unwrap();
    std::fs::write(bad.join("summary.json"), "{\"steps\": 5,").unwrap();
    let o = zrun(&["plot", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("summary.json:1:") && stderr(&o).contains("move it away"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_missing_font_names_the_fix() {
    let dir = scratch("plot-font");
    write_run(&dir.join("r"), FULL, 1.0);
    let o = common::zrun_child(
        &["plot", dir.join("r").to_str().unwrap()],
        &[("ZRUN_FONT", "/nonexistent/font.ttf")],
    )
    .wait_with_output()
    .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("ZRUN_FONT=/nonexistent/font.ttf"),
        "{}",
        stderr(&o)
    );
}

/// Losses whose range is wider than the largest float (or a flat one near it) are drawn in a
/// moment: the infinite axis span once sent the tick search into an endless loop.
#[test]
fn losses_too_far_apart_for_a_float_still_plot() {
    let dir = scratch("plot-huge");
    for (name, lines) in [
        (
            "apart",
            "{\"step\":1,\"loss\":1e308}\n{\"step\":2,\"loss\":-1e308}\n",
        ),
        (
            "flat",
            "{\"step\":1,\"loss\":1.7e308}\n{\"step\":2,\"loss\":1.7e308}\n",
        ),
    ] {
        let run = dir.join(name);
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("metrics.jsonl"), lines).unwrap();
        let mut child = common::zrun_child(&["plot", run.to_str().unwrap()], &[]);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("{name}: zrun plot still ran after 30 s");
        }
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        chart(&run.join("plots"), "loss");
    }
}

/// The charts of a run with every field, in the order `zrun plot` draws them.
const CHARTS: [&str; 5] = ["loss", "loss_tokens", "throughput", "memory", "breakdown"];

/// Asserts `dir` holds exactly the ten charts, each complete (a PNG up to its IEND chunk, an
/// SVG up to `</svg>`): no truncated chart, no temporary left behind.
fn whole_charts(dir: &Path) {
    let files = files_in(dir);
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    let mut want: Vec<String> = CHARTS
        .iter()
        .flat_map(|c| [format!("{c}.png"), format!("{c}.svg")])
        .collect();
    want.sort();
    assert_eq!(names, want, "only the charts, no temporaries");
    const IEND: &[u8] = b"\0\0\0\0IEND\xae\x42\x60\x82";
    for (name, bytes) in &files {
        let whole = if name.ends_with(".png") {
            bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.ends_with(IEND)
        } else {
            bytes.starts_with(b"<svg") && bytes.trim_ascii_end().ends_with(b"</svg>")
        };
        assert!(whole, "{name} is truncated ({} bytes)", bytes.len());
    }
}

/// A second plot whose writes fail partway (past a file-size limit, as on a full disk) leaves
/// the first plot's charts as they were, every one whole, and no temporary; the error is one
/// line naming the chart and what to do. So does a directory where a chart goes.
#[test]
fn a_failed_write_leaves_every_chart_whole_and_as_it_was() {
    let dir = scratch("plot-fail");
    let (old, new, out, probe) = (
        dir.join("old"),
        dir.join("new"),
        dir.join("out"),
        dir.join("probe"),
    );
    write_run(&old, FULL, 1.0);
    write_run(&new, FULL, 2.0);
    let [old, new, out_s, probe] = [old, new, out.clone(), probe].map(|p| p.display().to_string());
    let o = zrun(&["plot", &old, "-o", &out_s]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    whole_charts(&out);
    let before = files_in(&out);

    // The new run's charts, to choose a limit under the largest and above the rest: the
    // charts before the largest are written, then its write fails.
    let o = zrun(&["plot", &new, "-o", &probe]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (largest, bytes) = files_in(Path::new(&probe))
        .into_iter()
        .max_by_key(|(_, b)| b.len())
        .unwrap();
    let o = zrun_file_limit(&["plot", &new, "-o", &out_s], bytes.len() as u64 - 1, true);
    whole_charts(&out);
    assert!(files_in(&out) == before, "the first plot's charts are kept");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let path = out.join(&largest).display().to_string();
    assert!(
        err.contains(&format!("cannot write {path}: ")) && err.contains("ulimit -f"),
        "{err}"
    );
    assert!(!stdout(&o).contains("wrote"), "{}", stdout(&o));

    // A directory where the last chart goes: refused before any chart is replaced.
    let last = out.join("breakdown.svg");
    std::fs::remove_file(&last).unwrap();
    std::fs::create_dir(&last).unwrap();
    let o = zrun(&["plot", &new, "-o", &out_s]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!(
            "cannot write {}: it is a directory",
            last.display()
        )),
        "{err}"
    );
    std::fs::remove_dir(&last).unwrap();
    let kept: Vec<_> = before
        .into_iter()
        .filter(|(n, _)| n != "breakdown.svg")
        .collect();
    assert!(
        files_in(&out) == kept,
        "no chart replaced, no temporary left"
    );
}

/// The default output, RUN_DIR/plots, that cannot be made (a file in the way; a read-only run
/// directory when not root) is one line naming it and -o.
#[test]
fn an_output_directory_that_cannot_be_made_names_o() {
    let dir = scratch("plot-noout");
    let run = dir.join("run");
    write_run(&run, FULL, 1.0);
    std::fs::write(run.join("plots"), "not a directory").unwrap();
    let o = zrun(&["plot", run.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let want = format!(
        "cannot create the output directory {}: ",
        run.join("plots").display()
    );
    assert!(err.contains(&want) && err.contains("give -o DIR"), "{err}");

    // A read-only run directory (root writes there anyway: then there is nothing to see).
    std::fs::remove_file(run.join("plots")).unwrap();
    let perm = |mode| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    perm(0o555);
    let probe = run.join("probe");
    if std::fs::create_dir(&probe).is_ok() {
        std::fs::remove_dir(&probe).unwrap();
    } else {
        let o = zrun(&["plot", run.to_str().unwrap()]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("Permission denied") && err.contains("give -o DIR"),
            "{err}"
        );
    }
    perm(0o755);
}
