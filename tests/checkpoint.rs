//! Checkpoints as a user meets them, through the real `zrun` binary on 2 CPU ranks: a rank
//! killed mid-run is restarted from the newest checkpoint and the job ends exactly as an
//! uninterrupted one; SIGTERM saves at one agreed step and exits 3, and resuming reproduces
//! the uninterrupted run bitwise; a rank killed while saving leaves the previous checkpoint
//! complete; damaged, foreign, newer-format and unwritable checkpoints are one-line errors (a
//! FIFO or a directory in place of a file too, refused without waiting on it); `zrun
//! consolidate` writes a file Python's safetensors loads, and refuses an output that would
//! overwrite the checkpoint or cannot be written.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{demo_sets as sets, rank_pid, rejects, scratch, signal, stderr, zrun, Job, Scratch};
use zrun_ckpt::Checkpoint;

const CONFIG: &str = "configs/tiny-cpu.toml";

/// `zrun --nproc 2 CONFIG` with `sets` and `extra` arguments before the config.
fn args(extra: &[&str], sets: &[String]) -> Vec<String> {
    let mut a: Vec<String> = ["--nproc", "2"].iter().map(|s| s.to_string()).collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a.push(CONFIG.into());
    a.extend(sets.iter().cloned());
    a
}

fn run(a: &[String]) -> std::process::Output {
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    zrun(&refs)
}

fn start(a: &[String], env: &[(&str, &str)]) -> Job {
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    Job::start(&refs, env)
}

/// 60 steps without interruption, saving every 5: the reference of the tests below.
fn reference() -> Scratch {
    let dir = scratch("ck-reference");
    let o = run(&args(&[], &sets(&dir, 60, 5)));
    assert!(o.status.success(), "reference run failed: {}", stderr(&o));
    dir
}

/// Asserts the two checkpoints hold the same master and moments, bit for bit.
fn assert_same_state(a: &Path, b: &Path) {
    let (ca, cb) = (Checkpoint::open(a).unwrap(), Checkpoint::open(b).unwrap());
    assert_eq!(ca.manifest.step, cb.manifest.step);
    let diff = ca.first_difference(&cb).unwrap();
    assert_eq!(diff, None, "differs from the uninterrupted run");
}

/// Waits until rank 0 has logged step `step`.
fn wait_for_step(job: &mut Job, step: u64, of: u64) {
    let line = format!("step {step}/{of} ");
    assert!(
        job.wait_for(Duration::from_secs(60), |t| t.contains(&line)),
        "step {step} never came:\n{}",
        job.text()
    );
}

#[test]
fn a_killed_rank_is_restarted_and_the_job_ends_as_if_uninterrupted() {
    let reference = reference();
    let want = reference.join("ckpt/step-00000060");
    let dir = scratch("ck-restart");
    let id = format!("ck-restart-{}", std::process::id());
    let mut s = sets(&dir, 60, 5);
    s.extend(["--set".into(), "checkpoint.keep=3".into()]);
    let mut job = start(&args(&["--max-restarts", "2"], &s), &[("ZRUN_RUN_ID", &id)]);
    wait_for_step(&mut job, 12, 60);
    signal(rank_pid(&id, 1), libc::SIGKILL);
    let status = job.exit_within(Duration::from_secs(120));
    let text = job.text();
    assert_eq!(status.code(), Some(0), "{text}");
    assert!(text.contains("restart 1 of 2"), "{text}");
    assert!(text.contains("resuming from"), "{text}");
    assert_same_state(&dir.join("ckpt/step-00000060"), &want);
    let kept: Vec<u64> = zrun_ckpt::complete(&dir.join("ckpt"))
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(kept, vec![50, 55, 60], "checkpoint.keep = 3");
}

#[test]
fn sigterm_saves_one_agreed_step_exits_3_and_the_resumed_run_matches() {
    let want = reference();
    let dir = scratch("ck-sigterm");
    // every = 1000: no save but the one the signal asks for and the final one.
    let a = args(&[], &sets(&dir, 60, 1000));
    let mut job = start(&a, &[]);
    wait_for_step(&mut job, 15, 60);
    signal(job.pid(), libc::SIGTERM);
    let status = job.exit_within(Duration::from_secs(60));
    let text = job.text();
    assert_eq!(status.code(), Some(3), "{text}");
    let saved = zrun_ckpt::complete(&dir.join("ckpt")).unwrap();
    assert_eq!(
        saved.len(),
        1,
        "one checkpoint, at the agreed step: {saved:?}"
    );
    let step = saved[0].0;
    assert!((15..60).contains(&step), "saved at step {step}");
    assert!(text.contains(&format!("(step {step})")), "{text}");
    // The same command resumes and finishes like the uninterrupted run.
    let o = run(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("resuming from {}", saved[0].1.display())));
    assert_same_state(
        &dir.join("ckpt/step-00000060"),
        &want.join("ckpt/step-00000060"),
    );
    // metrics.jsonl holds each step once, and the steps after the stop equal the reference's.
    let lines = |d: &Path| -> Vec<String> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                format!("{} {}", v["step"], v["loss"])
            })
            .collect()
    };
    assert_eq!(lines(&dir), lines(&want));
    // Once more: the newest checkpoint is at train.steps, so there is nothing to do.
    let o = run(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        common::stdout(&o).contains("nothing to train"),
        "{}",
        common::stdout(&o)
    );
}

#[test]
fn sigusr1_to_one_rank_alone_stops_every_rank_at_one_saved_step() {
    // As under Slurm without the launcher in the loop: only rank 1 hears the signal.
    let dir = scratch("ck-usr1");
    let id = format!("ck-usr1-{}", std::process::id());
    let mut job = start(&args(&[], &sets(&dir, 200, 0)), &[("ZRUN_RUN_ID", &id)]);
    wait_for_step(&mut job, 5, 200);
    signal(rank_pid(&id, 1), libc::SIGUSR1);
    let status = job.exit_within(Duration::from_secs(60));
    let text = job.text();
    assert_eq!(status.code(), Some(3), "{text}");
    let saved = zrun_ckpt::complete(&dir.join("ckpt")).unwrap();
    assert_eq!(saved.len(), 1, "{saved:?}\n{text}");
    assert!(
        text.contains("[rank 0] zrun: stopped by a stop on another rank after saving"),
        "{text}"
    );
    assert!(
        text.contains("[rank 1] zrun: stopped by SIGUSR1 after saving"),
        "{text}"
    );
}

/// A stop whose checkpoint cannot be saved within `checkpoint.signal_deadline_s` (rank 1 is
/// frozen with SIGSTOP, so no rank can complete the save) ends with SIGTERM's code and a
/// line saying that nothing was saved for it and which setting gives saves longer.
#[test]
fn a_stop_cut_short_by_its_deadline_says_no_checkpoint_was_saved() {
    let dir = scratch("ck-deadline");
    let id = format!("ck-deadline-{}", std::process::id());
    let mut s = sets(&dir, 400, 0);
    s.extend(["--set".into(), "checkpoint.signal_deadline_s=2".into()]);
    let mut job = start(&args(&[], &s), &[("ZRUN_RUN_ID", &id)]);
    wait_for_step(&mut job, 5, 400);
    signal(rank_pid(&id, 1), libc::SIGSTOP);
    signal(job.pid(), libc::SIGTERM);
    let status = job.exit_within(Duration::from_secs(60));
    let text = job.text();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("zrun: received SIGTERM"))
        .unwrap_or_else(|| panic!("{text}"));
    for needle in [
        "within 2 s",
        "no checkpoint was saved",
        "checkpoint.signal_deadline_s",
    ] {
        assert!(line.contains(needle), "{needle}: {text}");
    }
    assert!(zrun_ckpt::complete(&dir.join("ckpt")).unwrap().is_empty());
}

#[test]
fn a_rank_killed_while_saving_leaves_the_previous_checkpoint_complete() {
    let dir = scratch("ck-crash");
    let a = args(&[], &sets(&dir, 20, 5));
    let o = {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let mut job = Job::start(&refs, &[("ZRUN_TEST_KILL_IN_SAVE", "1:10")]);
        let s = job.exit_within(Duration::from_secs(60));
        (s, job.text())
    };
    assert_ne!(o.0.code(), Some(0), "{}", o.1);
    let ckpt = dir.join("ckpt");
    let done: Vec<u64> = zrun_ckpt::complete(&ckpt)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(done, vec![5], "{}", o.1);
    assert!(
        zrun_ckpt::tmp_dir(&ckpt, 10).exists(),
        "the interrupted save's directory"
    );
    Checkpoint::open(&zrun_ckpt::step_dir(&ckpt, 5)).unwrap();
    // The next start removes the leftover and resumes from step 5.
    let o = run(&a);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("step-00000010.tmp, left by a save that did not finish"),
        "{err}"
    );
    assert!(err.contains("at step 5"), "{err}");
    assert!(zrun_ckpt::step_dir(&ckpt, 20)
        .join("manifest.json")
        .exists());
}

/// A finished 10-step run with checkpoints at 5 and 10, copied to a fresh directory.
fn saved_run(name: &str) -> Scratch {
    let base = scratch(&format!("{name}-base"));
    let o = run(&args(&[], &sets(&base, 10, 5)));
    assert!(o.status.success(), "{}", stderr(&o));
    let dir = scratch(name);
    std::fs::rename(base.join("ckpt"), dir.join("ckpt")).unwrap();
    dir
}

/// The last line of stderr (the one-line error).
fn last_line(o: &std::process::Output) -> String {
    stderr(o).lines().last().unwrap_or_default().to_string()
}

#[test]
fn damaged_checkpoints_fall_back_under_auto_and_are_errors_when_named() {
    type Damage = (&'static str, fn(&Path));
    let damages: [Damage; 3] = [
        ("flipped", |f| {
            let mut b = std::fs::read(f).unwrap();
            let at = b.len() / 2;
            b[at] ^= 1;
            std::fs::write(f, b).unwrap();
        }),
        ("truncated", |f| {
            let b = std::fs::read(f).unwrap();
            std::fs::write(f, &b[..b.len() - 100]).unwrap();
        }),
        ("missing", |f| std::fs::remove_file(f).unwrap()),
    ];
    for (what, damage) in damages {
        let dir = saved_run(&format!("ck-{what}"));
        let newest = dir.join("ckpt/step-00000010");
        damage(&newest.join("rank-00001.safetensors"));
        let expect = match what {
            "flipped" => "content hash differs",
            "truncated" => "truncated",
            _ => "is missing",
        };
        // Named explicitly: exit 2, one line naming the file.
        let mut s = sets(&dir, 12, 0);
        s.extend([
            "--set".into(),
            format!("checkpoint.resume=\"{}\"", newest.display()),
        ]);
        let o = run(&args(&[], &s));
        let line = last_line(&o);
        assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(&o));
        assert!(
            line.contains("rank-00001.safetensors is damaged") && line.contains(expect),
            "{what}: {line}"
        );
        // auto: reported, and the previous checkpoint is used.
        let o = run(&args(&[], &sets(&dir, 12, 5)));
        let err = stderr(&o);
        assert!(o.status.success(), "{what}: {err}");
        assert!(
            err.contains(expect) && err.contains("trying the one before it"),
            "{err}"
        );
        assert!(err.contains("step-00000005 at step 5"), "{what}: {err}");
        // The damaged one was moved aside, and this run saved step 10 again in its place.
        assert!(dir.join("ckpt/step-00000010.damaged").is_dir(), "{what}");
        Checkpoint::open(&newest).unwrap();
    }
}

#[test]
fn foreign_newer_and_unwritable_checkpoints_are_one_line_errors() {
    // Another model: what differs in its config is named.
    let dir = saved_run("ck-foreign");
    let mut s = sets(&dir, 12, 0);
    s.extend(["--set".into(), "model.d_model=48".into()]);
    let o = run(&args(&[], &s));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let line = last_line(&o);
    assert!(
        line.contains("does not fit this model") && line.contains("n_embd 64 there, 48 here"),
        "{line}"
    );
    // A newer format.
    let dir = saved_run("ck-newer");
    let m = dir.join("ckpt/step-00000010/manifest.json");
    let text = std::fs::read_to_string(&m).unwrap();
    std::fs::write(
        &m,
        text.replace(
            &format!("\"format_version\": {}", zrun_ckpt::FORMAT_VERSION),
            "\"format_version\": 99",
        ),
    )
    .unwrap();
    let o = run(&args(&[], &sets(&dir, 12, 0)));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        last_line(&o).contains("written by a newer zrun"),
        "{}",
        last_line(&o)
    );
    // A directory that cannot be created (its parent is a file): caught before training.
    let dir = scratch("ck-unwritable");
    std::fs::write(dir.join("file"), b"x").unwrap();
    let mut s = sets(&dir, 12, 5);
    s.extend([
        "--set".into(),
        format!("checkpoint.dir=\"{}/file/ckpt\"", dir.display()),
    ]);
    let o = run(&args(&[], &s));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        last_line(&o).contains("checkpoint.dir"),
        "{}",
        last_line(&o)
    );
    assert!(!dir.join("metrics.jsonl").exists() || !stderr(&o).contains("step 1/"));
}

#[test]
fn a_disk_that_fills_during_the_save_damages_nothing_and_leaves_nothing() {
    let dir = saved_run("ck-full");
    // A 400 KiB file-size limit: the ranks' 800 KiB checkpoint files cannot be written.
    let mut a = vec![env!("CARGO_BIN_EXE_zrun").to_string()];
    a.extend(args(&[], &sets(&dir, 12, 2)));
    let cmd = format!("ulimit -f 400; exec {}", shell_words(&a));
    let o = std::process::Command::new("bash")
        .args(["-c", &cmd])
        .current_dir(common::root())
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("rank-0000") && err.contains("file-size limit"),
        "{err}"
    );
    let done: Vec<u64> = zrun_ckpt::complete(&dir.join("ckpt"))
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(done, vec![5, 10]);
    // The failed save removed its partial files: nothing but the checkpoints is left.
    let mut left: Vec<String> = std::fs::read_dir(dir.join("ckpt"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["step-00000005", "step-00000010"]);
    // Without the limit the run resumes from the last complete checkpoint and finishes.
    let o = run(&args(&[], &sets(&dir, 12, 2)));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("step-00000010 at step 10"),
        "{}",
        stderr(&o)
    );
}

/// `args` quoted for bash.
fn shell_words(a: &[String]) -> String {
    a.iter()
        .map(|s| format!("'{}'", s.replace('\'', "'\\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn consolidate_writes_a_file_python_loads() {
    let dir = saved_run("ck-consolidate");
    let out = dir.join("model.safetensors");
    let ckpt = dir.join("ckpt/step-00000010");
    let o = zrun(&[
        "consolidate",
        &ckpt.display().to_string(),
        "-o",
        &out.display().to_string(),
        "--dtype",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let script = "import json, sys\n\
        from safetensors.torch import load_file\n\
        t = load_file(sys.argv[1])\n\
        print(json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in t.items()}))\n";
    let py = std::env::var("VIRTUAL_ENV")
        .map(|v| format!("{v}/bin/python"))
        .unwrap_or_else(|_| "python3".into());
    let p = std::process::Command::new(&py)
        .args(["-c", script, &out.display().to_string()])
        .output()
        .unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let loaded: serde_json::Value = serde_json::from_slice(&p.stdout).unwrap();
    let m = Checkpoint::open(&ckpt).unwrap().manifest;
    let views: Vec<_> = m.units.iter().flat_map(|u| &u.views).collect();
    assert_eq!(loaded.as_object().unwrap().len(), views.len());
    for v in views {
        let t = &loaded[v.name.as_str()];
        assert_eq!(t[1], "torch.bfloat16", "{}", v.name);
        assert_eq!(t[0], serde_json::json!(v.shape), "{}", v.name);
    }
    // A damaged checkpoint: exit 2, one line.
    std::fs::remove_file(ckpt.join("rank-00000.safetensors")).unwrap();
    let o = zrun(&[
        "consolidate",
        &ckpt.display().to_string(),
        "-o",
        "/tmp/x.safetensors",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(last_line(&o).contains("rank-00000.safetensors is damaged: is missing"));
}

/// Copies the checkpoint directory `from` to `to` (made with its parents).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Replaces the file `path` by a FIFO.
fn fifo_in_place(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    std::fs::remove_file(path).unwrap();
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// `zrun args`: its exit code and stderr; killed and failed after 60 s (a read that blocks).
fn zrun_within(args: &[String]) -> (Option<i32>, String) {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut job = Job::start(&refs, &[]);
    let status = job.exit_within(Duration::from_secs(60));
    (status.code(), job.stderr())
}

#[test]
fn a_fifo_or_a_directory_in_place_of_a_checkpoint_file_is_refused_without_waiting() {
    let dir = saved_run("ck-fifo");
    let newest = dir.join("ckpt/step-00000010");
    type Swap = (&'static str, &'static str, fn(&Path));
    let swaps: [Swap; 4] = [
        (
            "rank-00001.safetensors",
            "it is a FIFO, not a regular file",
            fifo_in_place,
        ),
        (
            "manifest.json",
            "it is a FIFO, not a regular file",
            fifo_in_place,
        ),
        (
            "rank-00001.safetensors",
            "it is a directory, not a regular file",
            |f| {
                std::fs::remove_file(f).unwrap();
                std::fs::create_dir(f).unwrap();
            },
        ),
        ("rank-00001.safetensors", "(longer than saved", |f| {
            let mut b = std::fs::read(f).unwrap();
            b.extend([0u8; 8]);
            std::fs::write(f, b).unwrap();
        }),
    ];
    for (i, (file, expect, swap)) in swaps.into_iter().enumerate() {
        let copy = dir.join(format!("copy-{i}/step-00000010"));
        copy_dir(&newest, &copy);
        swap(&copy.join(file));
        let c = copy.display().to_string();
        let out = dir.join("model.safetensors").display().to_string();
        let hf = dir.join("hf").display().to_string();
        for cmd in [
            vec!["consolidate", &c, "-o", &out],
            vec!["export", &c, "--hf", &hf],
        ] {
            let cmd: Vec<String> = cmd.into_iter().map(String::from).collect();
            let (code, err) = zrun_within(&cmd);
            let line = err.lines().last().unwrap_or_default();
            assert_eq!(code, Some(2), "{cmd:?}: {err}");
            assert!(
                line.contains(&format!("{file} is damaged: ")) && line.contains(expect),
                "{cmd:?}: {line}"
            );
            assert!(!line.contains("truncated"), "{line}");
        }
    }
    // A resume from it, named: every rank refuses it at once (none waits in open()).
    fifo_in_place(&newest.join("rank-00001.safetensors"));
    let mut s = sets(&dir, 12, 0);
    s.extend([
        "--set".into(),
        format!("checkpoint.resume=\"{}\"", newest.display()),
    ]);
    let (code, err) = zrun_within(&args(&[], &s));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("rank-00001.safetensors is damaged: it is a FIFO, not a regular file"),
        "{err}"
    );
}

#[test]
fn consolidate_refuses_an_output_inside_the_checkpoint_a_directory_or_a_missing_one() {
    let dir = saved_run("ck-outputs");
    let ckpt = dir.join("ckpt/step-00000010");
    let c = ckpt.display().to_string();
    let read_all = || common::files_in(&ckpt);
    let before = read_all();
    let inside = "inside the checkpoint directory";
    for out in [
        ckpt.join("rank-00000.safetensors"),
        ckpt.join("manifest.json"),
        ckpt.join("model.safetensors"),
        dir.join("ckpt/step-00000005/../step-00000010/manifest.json"),
    ] {
        let o = out.display().to_string();
        rejects(&["consolidate", &c, "-o", &o], &[inside, &o]);
        // Given as a checkpoint.dir, whose newest checkpoint is the one above.
        let parent = dir.join("ckpt").display().to_string();
        rejects(&["consolidate", &parent, "-o", &o], &[inside]);
    }
    let hf = ckpt.join("hf").display().to_string();
    rejects(&["export", &c, "--hf", &hf], &[inside]);
    assert_eq!(read_all(), before, "the checkpoint is as it was");
    Checkpoint::open(&ckpt).unwrap();
    // An existing directory and a missing one are bad input too, saying what to give.
    let empty = dir.join("emptydir");
    std::fs::create_dir(&empty).unwrap();
    let e = empty.display().to_string();
    rejects(
        &["consolidate", &c, "-o", &e],
        &["is a directory", "give a file path"],
    );
    assert!(!dir.join("emptydir.tmp").exists());
    let absent = dir.join("absent/model.safetensors").display().to_string();
    rejects(
        &["consolidate", &c, "-o", &absent],
        &["does not exist", "mkdir -p"],
    );
}
