//! The fault-injection soak's short mode (`scripts/chaos.py --short`): a 2-node job on
//! loopback under `--max-restarts`, with a rank killed, a preemption, a byte flipped in the
//! newest checkpoint, a rank stopped past `dist.timeout_s` and a full checkpoint disk. No run
//! may hang, leave a process behind, end with an error that names no fault, or finish with
//! parameters other than an uninterrupted run's. The long mode (`--long`, 200+ faults) is run
//! by hand; see the README's "Fault-injection soak".

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The project's Python, else the system's (the driver needs only the standard library).
fn python() -> PathBuf {
    let venv = root().join(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// Well above the short mode's 30-45 s, so only a real hang of the driver trips it.
const LIMIT: Duration = Duration::from_secs(360);

#[test]
fn short_soak_has_no_hang_divergence_orphan_or_unnamed_error() {
    let work = std::env::temp_dir().join(format!("zrun-chaos-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let mut child = Command::new(python())
        .arg(root().join("scripts/chaos.py"))
        .args([
            "--short",
            "--json",
            "--seed",
            "1",
            "--zrun",
            env!("CARGO_BIN_EXE_zrun"),
        ])
        .arg("--workdir")
        .arg(&work)
        .current_dir(root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("scripts/chaos.py starts");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut s).unwrap();
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > LIMIT {
            // SIGTERM lets the driver kill its jobs and unmount; then make sure.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(10));
            let _ = child.kill();
            let _ = child.wait();
            panic!("scripts/chaos.py --short ran past {LIMIT:?}; its runs are in {work:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = reader.join().unwrap();
    let rep: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("report is not JSON ({e}), exit {status:?}:\n{out}"));
    let n = |k: &str| rep[k].as_u64().unwrap_or_else(|| panic!("no {k} in {out}"));
    let findings = serde_json::to_string_pretty(&rep["findings"]).unwrap();
    let ctx = format!("findings: {findings}\nruns in {work:?}");
    assert!(n("faults_injected") >= 4, "too few faults injected: {out}");
    assert_eq!(n("hangs"), 0, "{ctx}");
    assert_eq!(n("divergences"), 0, "{ctx}");
    assert_eq!(n("orphans"), 0, "{ctx}");
    assert_eq!(n("wrong_error"), 0, "{ctx}");
    assert_eq!(n("unexplained_errors"), 0, "{ctx}");
    assert_eq!(n("bitwise_equal") + n("correct_error"), n("runs"), "{ctx}");
    assert!(status.success(), "exit {status:?}: {ctx}");
    let _ = std::fs::remove_dir_all(&work);
}
