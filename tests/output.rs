//! What zrun prints, end to end: the live progress line in a pseudo-terminal, plain lines in a
//! pipe, `--quiet`, `--log-format json`, the environment the workers get for it, the usage of
//! a bare `zrun`, and the trace `log.profile_step` leaves.

mod common;
use common::*;

use std::process::{Command, Stdio};

/// A short training job on 2 ranks that logs every 5 of its 40 steps into `dir`.
fn tiny_args(dir: &std::path::Path) -> Vec<String> {
    [
        "--nproc",
        "2",
        "configs/tiny-cpu.toml",
        "--set",
        "train.steps=40",
        "--set",
        "train.warmup_steps=4",
        "--set",
        "log.every=5",
        "--set",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("log.dir=\"{}\"", dir.display())])
    .collect()
}

fn run(args: &[String]) -> std::process::Output {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    zrun(&a)
}

/// `s` quoted for sh.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The screen a terminal would show after `raw`: text, carriage returns, newlines, and the
/// CSI sequences a progress line uses (erase line, cursor up/down/column, erase below).
fn screen(raw: &str) -> Vec<String> {
    let mut rows: Vec<Vec<char>> = vec![Vec::new()];
    let (mut row, mut col) = (0usize, 0usize);
    let mut it = raw.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '\r' => col = 0,
            '\n' => {
                row += 1;
                if rows.len() <= row {
                    rows.push(Vec::new());
                }
            }
            '\x1b' if it.peek() == Some(&'[') => {
                it.next();
                let mut param = String::new();
                let mut fin = ' ';
                for d in it.by_ref() {
                    if d.is_ascii_digit() || d == ';' || d == '?' {
                        param.push(d);
                    } else {
                        fin = d;
                        break;
                    }
                }
                let n: usize = param.parse().unwrap_or(0);
                match fin {
                    'K' if n == 2 => rows[row].clear(),
                    'K' => rows[row].truncate(col),
                    'A' => row = row.saturating_sub(n.max(1)),
                    'B' => row = (row + n.max(1)).min(rows.len() - 1),
                    'G' => col = n.saturating_sub(1),
                    'J' => {
                        rows[row].truncate(col);
                        rows.truncate(row + 1);
                    }
                    _ => {}
                }
            }
            c if c.is_control() => {}
            c => {
                let r = &mut rows[row];
                if r.len() <= col {
                    r.resize(col, ' ');
                    r.push(c);
                } else {
                    r[col] = c;
                }
                col += 1;
            }
        }
    }
    rows.into_iter()
        .map(|r| r.into_iter().collect::<String>().trim_end().to_string())
        .collect()
}

/// True when `text` has a time with a fractional second, such as `02:17:34.375720`.
fn has_subsecond_time(text: &str) -> bool {
    let b = text.as_bytes();
    b.windows(12).any(|w| {
        let d = |i: usize| w[i].is_ascii_digit();
        d(0) && d(1)
            && w[2] == b':'
            && d(3)
            && d(4)
            && w[5] == b':'
            && d(6)
            && d(7)
            && w[8] == b'.'
            && d(9)
            && d(10)
            && d(11)
    })
}

#[test]
fn the_live_line_in_a_terminal_shows_progress_and_the_final_line_stays_last() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: `script` (util-linux) is not installed");
        return;
    }
    let d = scratch("pty");
    let zrun_cmd: Vec<String> = std::iter::once(env!("CARGO_BIN_EXE_zrun").to_string())
        .chain(tiny_args(&d))
        .map(|a| quote(&a))
        .collect();
    // A pty of 0 rows reads as no size at all: give it one.
    let cmd = format!("stty rows 40 cols 200; exec {}", zrun_cmd.join(" "));
    let out = Command::new("script")
        .args(["-q", "-e", "-c", &cmd, "/dev/null"])
        .current_dir(root())
        .env("TERM", "xterm")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .output()
        .expect("script runs");
    let raw = stdout(&out);
    assert!(out.status.success(), "{raw}{}", stderr(&out));
    assert!(raw.contains('\x1b'), "no progress line drawn: {raw}");
    // The line as drawn: every figure it has, at a logged step of the 40.
    let drawn: Vec<&str> = raw
        .split(['\r', '\n'])
        .filter(|l| l.contains("/40 [") && l.contains("loss "))
        .collect();
    let complete = |l: &&str| {
        let at_a_logged_step = (1..=8).any(|k| l.contains(&format!("step {}/40 [", 5 * k)));
        let figures = ["tok/s", "ETA ", "rss "].iter().all(|f| l.contains(f));
        at_a_logged_step && figures && !l.contains("ETA --")
    };
    assert!(
        drawn.iter().any(complete),
        "no complete progress line: {drawn:#?}"
    );
    // What stays on the screen: the ranks' lines above, the final line last, no bar.
    let lines = screen(&raw);
    let shown: Vec<&String> = lines.iter().filter(|l| !l.is_empty()).collect();
    let last = shown.last().map_or("", |l| l.as_str());
    assert!(last.starts_with("[rank 0] final: eval_loss"), "{lines:#?}");
    assert!(!lines.iter().any(|l| l.contains("/40 [")), "{lines:#?}");
    assert!(
        shown
            .iter()
            .any(|l| l.starts_with("[rank 1] ") && l.contains("training steps")),
        "{lines:#?}"
    );
    // rank 0 leaves its per-step lines to the progress line (ZRUN_PROGRESS=launcher)
    assert!(
        !shown.iter().any(|l| l.contains("INFO step 5/40")),
        "{lines:#?}"
    );
}

#[test]
fn plain_lines_in_a_pipe_have_no_control_characters_and_second_timestamps() {
    let d = scratch("plain");
    let out = run(&tiny_args(&d));
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{o}{e}");
    for text in [&o, &e] {
        assert!(!text.contains('\x1b') && !text.contains('\r'), "{text:?}");
        assert!(!has_subsecond_time(text), "{text}");
    }
    // every `log.every` steps a line of rank 0, stamped with the time of day
    let step = e
        .lines()
        .find(|l| l.contains("INFO step 5/40 loss"))
        .unwrap_or_else(|| panic!("{e}"));
    let stamp = step
        .strip_prefix("[rank 0] ")
        .unwrap_or_else(|| panic!("{step}"));
    let b = stamp.as_bytes();
    assert!(b[2] == b':' && b[5] == b':' && b[8] == b' ', "{step}");
    assert!(e.contains("INFO step 40/40"), "{e}");
    let last = o.lines().last().unwrap_or_default();
    assert!(last.starts_with("[rank 0] final: eval_loss"), "{o}");
}

#[test]
fn quiet_prints_the_final_line_and_nothing_at_info() {
    let d = scratch("quiet");
    let mut args = vec!["--quiet".to_string()];
    args.extend(tiny_args(&d));
    let out = run(&args);
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{o}{e}");
    let text = format!("{o}{e}");
    assert!(
        !text.contains("INFO") && !text.contains("step 5/40"),
        "{text}"
    );
    let last = o.lines().last().unwrap_or_default();
    assert!(last.starts_with("[rank 0] final: eval_loss"), "{o}");
    assert!(d.join("summary.json").exists(), "it trained");
}

/// Every line of `text` as a JSON object (indexing a missing key gives null).
fn objects(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|l| match serde_json::from_str(l) {
            Ok(v @ serde_json::Value::Object(_)) => v,
            _ => panic!("not a JSON object: {l:?}\nin:\n{text}"),
        })
        .collect()
}

#[test]
fn json_format_makes_every_line_an_object_and_worker_lines_carry_their_rank() {
    let d = scratch("json");
    let mut args = vec!["--log-format".to_string(), "json".to_string()];
    args.extend(tiny_args(&d));
    let out = run(&args);
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{o}{e}");
    let (outs, errs) = (objects(&o), objects(&e));
    for m in outs.iter().chain(&errs) {
        assert!(m["rank"].is_u64() && m["level"].is_string(), "{m:?}");
        assert!(m["message"].is_string(), "{m:?}");
    }
    // the ranks' tracing fields stay fields
    let start = errs
        .iter()
        .find(|m| m["rank"] == 1 && m["message"].as_str().unwrap().contains("training steps"))
        .unwrap_or_else(|| panic!("{e}"));
    assert!(
        start["params"].is_u64() && start["timestamp"].is_string(),
        "{start:?}"
    );
    let step = errs
        .iter()
        .find(|m| m["message"].as_str().unwrap().starts_with("step 5/40"))
        .unwrap_or_else(|| panic!("{e}"));
    assert_eq!((&step["rank"], &step["level"]), (&0.into(), &"INFO".into()));
    // the final line, printed as text by rank 0, wrapped
    let last = outs.last().unwrap();
    assert_eq!((&last["rank"], &last["level"]), (&0.into(), &"INFO".into()));
    assert!(last["message"]
        .as_str()
        .unwrap()
        .starts_with("final: eval_loss"));

    // zrun's own messages are objects too: a failure, with the rank's last lines
    let script = "if [ $RANK = 1 ]; then echo '{\"level\":\"ERROR\",\"message\":\"x\"}'; echo gone >&2; exit 4; fi; echo hi; exec sleep 30";
    let out = zrun(&[
        "exec",
        "--log-format",
        "json",
        "--nproc",
        "2",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let (o, e) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{o}{e}");
    let outs = objects(&o);
    assert!(
        outs.iter()
            .any(|m| m["rank"] == 1 && m["level"] == "ERROR" && m["message"] == "x"),
        "{o}"
    );
    let errs = objects(&e);
    assert!(
        errs.iter()
            .any(|m| m["rank"] == 1 && m["message"] == "gone" && m["stream"] == "stderr"),
        "{e}"
    );
    let failed = errs
        .iter()
        .find(|m| m["rank"].is_null())
        .unwrap_or_else(|| panic!("{e}"));
    assert_eq!(failed["level"], "ERROR", "{failed:?}");
    let msg = failed["message"].as_str().unwrap();
    assert!(
        msg.starts_with("rank 1 failed first: exited with code 4"),
        "{msg}"
    );
    assert!(
        failed["last_lines"]
            .as_array()
            .unwrap()
            .contains(&"gone".into()),
        "{failed:?}"
    );
}

/// Under mpirun, srun or torchrun a rank has no zrun launcher to wrap its lines: its report
/// (tables, final line) follows `--log-format json` and `-q` itself.
#[test]
fn a_rank_started_by_another_launcher_follows_the_output_flags_too() {
    let d = scratch("rank-json");
    let port = free_port().to_string();
    let env = [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port.as_str()),
    ];
    let args = |flag: &str, dir: &str| {
        let mut a = vec![flag.to_string()];
        a.extend(tiny_args(&d.join(dir)).into_iter().skip(2));
        a
    };
    let rank = |a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        zrun_child(&refs, &env).wait_with_output().unwrap()
    };
    let mut json = args("--log-format", "json");
    json.insert(1, "json".into());
    let out = rank(json);
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{o}{e}");
    let outs = objects(&o);
    assert!(outs.len() > 5, "the tables: {o}");
    let last = outs.last().unwrap();
    assert!(
        last["message"]
            .as_str()
            .unwrap()
            .starts_with("final: eval_loss"),
        "{o}"
    );
    objects(&e);
    let out = rank(args("-q", "quiet"));
    let o = stdout(&out);
    assert!(out.status.success(), "{o}{}", stderr(&out));
    assert_eq!(o.lines().count(), 1, "{o}");
    assert!(o.starts_with("final: eval_loss"), "{o}");
}

#[test]
fn workers_get_the_output_settings_and_nothing_else_leaks() {
    let script = "echo \"f=$ZRUN_LOG_FORMAT q=$ZRUN_QUIET p=$ZRUN_PROGRESS\"";
    let run = |flags: &[&str]| {
        let mut args = vec!["exec", "--nproc", "2"];
        args.extend(flags);
        args.extend(["--", "sh", "-c", script]);
        // a launcher's own ZRUN_PROGRESS must not reach its workers
        let c = zrun_child(&args, &[("ZRUN_PROGRESS", "launcher")]);
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let o = run(&[]);
    assert_eq!(o.matches("f=human q=0 p=\n").count(), 2, "{o}");
    let o = run(&["--quiet"]);
    assert_eq!(o.matches("f=human q=1 p=\n").count(), 2, "{o}");
    let o = run(&["-q", "--log-format", "json"]);
    assert_eq!(o.matches("\"message\":\"f=json q=1 p=\"").count(), 2, "{o}");
}

/// `zrun --version` names the backends this build has (what a bug report needs first).
#[test]
fn version_names_the_backends_built_in() {
    let out = zrun(&["--version"]);
    let v = stdout(&out);
    assert!(out.status.success(), "{}", stderr(&out));
    let head = format!("zrun {} (backends: tcp", env!("CARGO_PKG_VERSION"));
    assert!(v.starts_with(&head), "{v}");
    assert_eq!(v.contains(", mpi"), cfg!(feature = "mpi"), "{v}");
    assert_eq!(v.contains(", nccl; CUDA"), cfg!(feature = "cuda"), "{v}");
    assert_eq!(v.contains("; CPU only"), !cfg!(feature = "cuda"), "{v}");
}

#[test]
fn zrun_alone_prints_the_usage_and_exits_2() {
    let out = zrun(&[]);
    let e = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(e.starts_with("zrun: "), "{e}");
    for needle in [
        "Usage: zrun",
        "--nproc",
        "--set",
        "--dry-run",
        "zrun exec",
        "zrun consolidate",
        "zrun bench",
        "zrun plot",
        "--quiet",
        "--log-format json",
        "zrun --help",
    ] {
        assert!(e.contains(needle), "usage lacks {needle:?}: {e}");
    }
    assert!(e.lines().count() < 25, "short: {e}");
}

/// `log.profile_step` leaves one Chrome trace per rank, of that step alone, and
/// benches/profile_table.py sums it by kind: the step's matmuls, attention and loss are in it.
#[test]
fn a_profiled_step_leaves_a_trace_per_rank_that_the_table_reads() {
    let dir = scratch("profile");
    let mut args = tiny_args(&dir);
    for s in ["train.steps=3", "log.every=1", "log.profile_step=2"] {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dir.join("profile-rank1.json").exists());
    let trace = dir.join("profile-rank0.json");
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("benches/profile_table.py"))
        .arg(&trace)
        .arg("--json")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for kind in ["matmuls", "attention", "loss"] {
        assert!(
            v["by_kind_ms"][kind].as_f64().unwrap_or(0.0) > 0.0,
            "{kind}: {v}"
        );
    }
    // The window is the profiled step's, not the run's.
    let step_ms = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|m| m["step"] == 2)
        .map(|m| m["step_time_s"].as_f64().unwrap() * 1e3)
        .unwrap();
    let window = v["window_ms"].as_f64().unwrap();
    // Not the run's (at most the step's), and not a sliver of the step; the step's time also
    // holds what the window does not (writing the trace), which a loaded machine stretches
    // (47 ms against a 23.5 ms window once in a full parallel test run).
    assert!(
        window > 0.2 * step_ms && window < 1.2 * step_ms + 5.0,
        "window {window} ms, step 2 took {step_ms} ms"
    );
}
