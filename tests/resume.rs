//! Resume rules through the real `zrun` binary on CPU ranks: a running job holds its
//! checkpoint directory; a resume that changes the data order says what changed and stops;
//! `resume = "none"` and an explicit path continue only what their own run wrote; ranks that
//! see different checkpoint directories are stopped with their names; a commit that not
//! every rank can see keeps the last good checkpoint; a stop asked for during a save stops
//! at that save.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{demo_sets as sets, free_port, root, scratch, signal, stderr, zrun, Job, Scratch};

const CONFIG: &str = "configs/tiny-cpu.toml";

/// `zrun --nproc N CONFIG` with `sets`.
fn args(nproc: usize, sets: &[String]) -> Vec<String> {
    let mut a = vec!["--nproc".to_string(), nproc.to_string(), CONFIG.into()];
    a.extend(sets.iter().cloned());
    a
}

fn set(key_value: String) -> [String; 2] {
    ["--set".into(), key_value]
}

fn run(a: &[String], env: &[(&str, &str)]) -> std::process::Output {
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    if env.is_empty() {
        return zrun(&refs);
    }
    common::zrun_child(&refs, env).wait_with_output().unwrap()
}

/// The last line of stderr (the one-line error).
fn last_line(o: &std::process::Output) -> String {
    stderr(o).lines().last().unwrap_or_default().to_string()
}

fn steps_in(dir: &Path) -> Vec<u64> {
    zrun_ckpt::complete(dir)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect()
}

/// A finished 10-step run on 2 ranks with checkpoints at 5 and 10, copied to a fresh
/// directory (its checkpoints are another run's to every run below).
fn saved_run(name: &str) -> Scratch {
    let base = scratch(&format!("{name}-base"));
    let o = run(&args(2, &sets(&base, 10, 5)), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let dir = scratch(name);
    std::fs::rename(base.join("ckpt"), dir.join("ckpt")).unwrap();
    dir
}

#[test]
fn a_second_job_on_a_running_jobs_directory_is_refused_and_harms_nothing() {
    let dir = scratch("rs-held");
    let a = args(2, &sets(&dir, 40, 4));
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let mut first = Job::start(&refs, &[]);
    assert!(
        first.wait_for(Duration::from_secs(60), |t| t.contains("step 6/40 ")),
        "{}",
        first.text()
    );
    // The same command again, as a second job would run it.
    let o = run(&a, &[]);
    let line = last_line(&o);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        line.contains("is in use by run") && line.contains("another checkpoint.dir"),
        "{line}"
    );
    assert!(!stderr(&o).contains("left by a save that did not finish"));
    let status = first.exit_within(Duration::from_secs(120));
    assert_eq!(status.code(), Some(0), "{}", first.text());
    assert_eq!(steps_in(&dir.join("ckpt")).last(), Some(&40));
    assert!(!dir.join("ckpt").join(zrun_ckpt::LOCK_FILE).exists());
}

#[test]
fn resuming_with_other_data_settings_is_refused_unless_allowed() {
    let dir = saved_run("rs-data");
    let mut s = sets(&dir, 12, 0);
    s.extend(set("data.seed=5".into()));
    s.extend(set("train.micro_batch=4".into()));
    let o = run(&args(2, &s), &[]);
    let line = last_line(&o);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        line.contains("data.seed was 0, now 5")
            && line
                .contains("global batch (micro_batch x grad_accum x ranks) was 16 samples, now 8")
            && line.contains("checkpoint.resume_changed = \"allow\""),
        "{line}"
    );
    s.extend(set("checkpoint.resume_changed=\"allow\"".into()));
    let o = run(&args(2, &s), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("data.seed was 0, now 5"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("at step 10"), "{}", stderr(&o));
    // The same global batch on another world size is the same data order.
    let dir = saved_run("rs-reshard");
    let mut s = sets(&dir, 12, 0);
    s.extend(set("train.micro_batch=16".into()));
    let o = run(&args(1, &s), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn resuming_another_model_or_a_missing_path_is_refused() {
    // 8 heads instead of 4 over the same 64 channels: every tensor has the shape it had,
    // but the model computes something else.
    let dir = saved_run("rs-model");
    let mut s = sets(&dir, 12, 0);
    s.extend(set("model.n_head=8".into()));
    let o = run(&args(2, &s), &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let line = last_line(&o);
    assert!(
        line.contains("step-00000010 does not fit this model")
            && line.contains("n_head 4 there, 8 here")
            && line.contains("use the same [model] settings"),
        "{line}"
    );
    // Every rank met it: shown once.
    let shown = err
        .lines()
        .filter(|l| l.contains("n_head 4 there") && !l.starts_with("    |"))
        .count();
    assert_eq!(shown, 1, "{err}");
    // A path that does not exist is said to be one, not a checkpoint without a manifest.
    let mut s = sets(&dir, 12, 0);
    let gone = dir.join("ckpt/step-00000099");
    s.extend(set(format!("checkpoint.resume=\"{}\"", gone.display())));
    let o = run(&args(2, &s), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let line = last_line(&o);
    assert!(
        line.contains("step-00000099") && line.contains("there is no such directory"),
        "{line}"
    );
}

/// The run id of the checkpoint `dir`.
fn writer(dir: &Path) -> String {
    let m = common::read_json(&dir.join("manifest.json"));
    m["run"]["id"].as_str().unwrap().to_string()
}

#[test]
fn resume_none_continues_only_what_its_own_run_wrote() {
    let dir = saved_run("rs-none");
    let ckpt = dir.join("ckpt");
    let mut s = sets(&dir, 12, 0);
    s.extend(set("checkpoint.resume=\"none\"".into()));
    // One rank with the global batch of the two that saved.
    s.extend(set("train.micro_batch=16".into()));
    let one = |env: &[(&str, &str)]| {
        // One rank under a launcher that restarted it (as torchrun or a requeue does).
        let mut e = vec![("RANK", "0"), ("WORLD_SIZE", "1")];
        e.extend_from_slice(env);
        let mut a = vec![CONFIG.to_string()];
        a.extend(s.iter().cloned());
        run(&a, &e)
    };
    // A restart of a run that never saved: the checkpoints are another run's.
    let o = one(&[
        ("TORCHELASTIC_RESTART_COUNT", "1"),
        ("ZRUN_RUN_ID", "rs-other"),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        last_line(&o).contains("checkpoints of another run"),
        "{}",
        last_line(&o)
    );
    // The run that wrote them, restarted: it continues from its newest.
    let id = writer(&ckpt.join("step-00000010"));
    let o = one(&[("TORCHELASTIC_RESTART_COUNT", "1"), ("ZRUN_RUN_ID", &id)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("step-00000010 at step 10 (written by this run"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn an_explicit_resume_is_not_replaced_by_another_runs_newer_checkpoint() {
    let dir = saved_run("rs-path");
    let five = dir.join("ckpt/step-00000005");
    let resume = set(format!("checkpoint.resume=\"{}\"", five.display()));
    let mut s = sets(&dir, 30, 0);
    s.extend(resume.clone());
    let o = run(&args(2, &s), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let line = last_line(&o);
    assert!(
        line.contains("names step 5") && line.contains("(step 10) of another run"),
        "{line}"
    );
    // Into a directory of its own, it resumes at the step it names.
    let mut s = sets(&dir, 12, 0);
    s.extend(resume);
    s.extend(set(format!(
        "checkpoint.dir=\"{}\"",
        dir.join("fresh").display()
    )));
    let o = run(&args(2, &s), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("step-00000005 at step 5"),
        "{}",
        stderr(&o)
    );
}

/// Starts node `node` of a two-node job (one rank each) in `cwd`, where the relative
/// `checkpoint.dir = "ckpt"` is that node's own directory.
fn node(node: usize, port: u16, cwd: &Path, sets: &[String]) -> Job {
    Job::spawn(node_command(node, port, cwd, sets))
}

fn node_command(node: usize, port: u16, cwd: &Path, sets: &[String]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zrun"));
    cmd.current_dir(cwd)
        .env("RUST_BACKTRACE", "0")
        .env("ZRUN_JOB_TOKEN", format!("rs-token-{port}"))
        .args(["--nnodes", "2", "--node-rank", &node.to_string()])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
        ])
        .args(["--nproc", "1"])
        .arg(root().join(CONFIG))
        .args(sets)
        .args(["--set", "checkpoint.dir=\"ckpt\""]);
    cmd
}

/// Copies the base run's checkpoints into `to/ckpt`.
fn copy_checkpoints(from: &Path, to: &Path) {
    let o = Command::new("cp")
        .args(["-r"])
        .arg(from)
        .arg(to.join("ckpt"))
        .output()
        .unwrap();
    assert!(o.status.success());
}

#[test]
fn ranks_that_see_different_checkpoint_directories_are_stopped() {
    let src = saved_run("rs-split-src");
    let dir = scratch("rs-split");
    // Node 0 sees checkpoints 5 and 10, node 1 only 5.
    for n in ["node0", "node1"] {
        std::fs::create_dir_all(dir.join(n)).unwrap();
        copy_checkpoints(&src.join("ckpt"), &dir.join(n));
    }
    std::fs::remove_dir_all(dir.join("node1/ckpt/step-00000010")).unwrap();
    let s = sets(&dir, 12, 0);
    let port = free_port();
    let mut jobs = [
        node(0, port, &dir.join("node0"), &s),
        node(1, port, &dir.join("node1"), &s),
    ];
    for j in &mut jobs {
        let status = j.exit_within(Duration::from_secs(60));
        assert_ne!(status.code(), Some(0), "{}", j.text());
    }
    // Both ranks see the mismatch and fail with bad input (2); whichever node ends first
    // stops the other's rank, which may then end with the launcher's code for that instead.
    let codes: Vec<Option<i32>> = jobs
        .iter_mut()
        .map(|j| j.child.wait().unwrap().code())
        .collect();
    assert!(codes.contains(&Some(2)), "{codes:?}");
    let text = jobs[0].text() + &jobs[1].text();
    assert!(
        text.contains("ranks [1] see other checkpoints in checkpoint.dir")
            && text.contains(
                "rank 0: 2 checkpoint(s), newest step 10; rank 1: 1 checkpoint(s), newest step 5"
            ),
        "{text}"
    );
}

#[test]
fn a_commit_not_every_rank_sees_keeps_the_last_good_checkpoint() {
    let src = saved_run("rs-commit-src");
    let keep_one = ["--set".to_string(), "checkpoint.keep=1".into()];
    let (dir, mut jobs) = {
        let dir = scratch("rs-commit");
        for n in ["node0", "node1"] {
            std::fs::create_dir_all(dir.join(n)).unwrap();
            copy_checkpoints(&src.join("ckpt"), &dir.join(n));
            std::fs::remove_dir_all(dir.join(n).join("ckpt/step-00000005")).unwrap();
        }
        let mut s = sets(&dir, 14, 2);
        s.extend(keep_one);
        let port = free_port();
        let jobs = [
            node(0, port, &dir.join("node0"), &s),
            node(1, port, &dir.join("node1"), &s),
        ];
        (dir, jobs)
    };
    for j in &mut jobs {
        let status = j.exit_within(Duration::from_secs(60));
        assert_ne!(status.code(), Some(0), "{}", j.text());
    }
    let text = jobs[0].text();
    assert!(
        text.contains("do not see their files in it after rank 0 committed it"),
        "{text}"
    );
    // Node 0's directory: the step-10 checkpoint it resumed from is still there, whole; the
    // commit rank 1 could not see is set aside.
    let ckpt = dir.join("node0/ckpt");
    assert_eq!(steps_in(&ckpt), vec![10], "{text}");
    zrun_ckpt::Checkpoint::open(&ckpt.join("step-00000010")).unwrap();
    assert!(ckpt.join("step-00000012.incomplete").is_dir());
}

#[test]
fn a_stop_asked_for_during_a_save_stops_at_that_save() {
    let dir = scratch("rs-stop-in-save");
    let a = args(2, &sets(&dir, 30, 5));
    let o = run(&a, &[("ZRUN_TEST_SIGNAL_IN_SAVE", "1:10")]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert_eq!(steps_in(&dir.join("ckpt")), vec![5, 10], "{err}");
    assert!(err.contains("(step 10)"), "{err}");
    // The same through a signal from outside during an evaluation: one save, at that step.
    let dir = scratch("rs-stop-in-eval");
    let mut s = sets(&dir, 400, 0);
    s.extend(set("train.eval_every=1".into()));
    s.extend(set("train.eval_batches=200".into()));
    let a = args(2, &s);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let mut job = Job::start(&refs, &[]);
    assert!(
        job.wait_for(Duration::from_secs(60), |t| t.contains("step 3/400 ")),
        "{}",
        job.text()
    );
    signal(job.pid(), libc::SIGTERM);
    let status = job.exit_within(Duration::from_secs(60));
    assert_eq!(status.code(), Some(3), "{}", job.text());
    assert_eq!(steps_in(&dir.join("ckpt")).len(), 1, "{}", job.text());
}

/// `ZRUN_RUN_ID` as each rank of a two-node `zrun exec` job (one rank a node) on `port`
/// sees it, with no run id given.
fn default_run_ids(port: u16, secret: &Path) -> Vec<String> {
    let start = |node: usize| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_zrun"));
        cmd.current_dir(root())
            .env("RUST_BACKTRACE", "0")
            .env_remove("ZRUN_RUN_ID")
            .env_remove("ZRUN_JOB_TOKEN")
            .env("ZRUN_SECRET_FILE", secret)
            .args(["exec", "--nnodes", "2", "--node-rank", &node.to_string()])
            .args([
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port.to_string(),
            ])
            .args(["--nproc", "1", "--", "sh", "-c", "echo id=$ZRUN_RUN_ID"]);
        Job::spawn(cmd)
    };
    let mut jobs = [start(0), start(1)];
    jobs.iter_mut()
        .map(|j| {
            let status = j.exit_within(Duration::from_secs(60));
            assert_eq!(status.code(), Some(0), "{}", j.text());
            let text = j.stdout();
            let line = text.lines().find_map(|l| l.split("id=").nth(1));
            line.unwrap_or_else(|| panic!("{text}")).trim().to_string()
        })
        .collect()
}

#[test]
fn a_default_multi_node_run_id_is_the_jobs_own() {
    let dir = scratch("rs-run-id");
    let secret = dir.join("secret");
    let port = free_port();
    let first = default_run_ids(port, &secret);
    assert_eq!(first[0], first[1], "both nodes run one job");
    assert!(
        first[0].starts_with(&format!("127.0.0.1-{port}-")),
        "{first:?}"
    );
    // Another job on the same address and port is another run.
    let second = default_run_ids(port, &secret);
    assert_eq!(second[0], second[1]);
    assert_ne!(first[0], second[0]);
}

#[test]
fn identical_runs_write_identical_checkpoints() {
    // Every byte of a rank file (random-generator states included) follows from the config.
    let files = |name: &str| {
        let dir = scratch(name);
        let o = run(&args(2, &sets(&dir, 4, 4)), &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        common::read_json(&dir.join("ckpt/step-00000004/manifest.json"))["files"].clone()
    };
    assert_eq!(files("rs-same-a"), files("rs-same-b"));
}

#[test]
fn a_disk_full_at_the_start_stops_every_node_alike() {
    // Node 0's rank cannot write a byte into checkpoint.dir (a file-size limit of 0, as a
    // full disk): it fails with exit 1, which a restart may get past, and node 1's rank,
    // which only learns of it, must stop with the same code, not as bad input (2), or the
    // nodes would disagree on restarting.
    use std::os::unix::process::CommandExt;
    let dir = scratch("rs-full-start");
    for n in ["node0", "node1"] {
        std::fs::create_dir_all(dir.join(n)).unwrap();
    }
    let s = sets(&dir, 6, 2);
    let port = free_port();
    let mut full = node_command(0, port, &dir.join("node0"), &s);
    // SAFETY: setrlimit is async-signal-safe and touches only the child being started.
    unsafe {
        full.pre_exec(|| {
            let none = libc::rlimit {
                rlim_cur: 0,
                rlim_max: libc::RLIM_INFINITY,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &none) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut jobs = [Job::spawn(full), node(1, port, &dir.join("node1"), &s)];
    let codes: Vec<Option<i32>> = jobs
        .iter_mut()
        .map(|j| j.exit_within(Duration::from_secs(60)).code())
        .collect();
    let text = format!("{}\n{}", jobs[0].text(), jobs[1].text());
    assert_eq!(codes, [Some(1), Some(1)], "{text}");
    assert!(text.contains("file-size limit"), "{text}");
    assert!(
        jobs[1].text().contains("rank 0 cannot use checkpoint.dir"),
        "{text}"
    );
}

/// Rank 0's metrics.jsonl on a full disk (here /dev/full, which fails every write so): every
/// rank saves a checkpoint of that step before the run ends with the error, so nothing trained
/// is lost, and the same command resumes from it once there is room.
#[test]
fn a_log_the_disk_cannot_take_ends_the_run_only_after_every_rank_saved() {
    let dir = scratch("rs-log-full");
    std::fs::create_dir_all(&*dir).unwrap();
    std::os::unix::fs::symlink("/dev/full", dir.join("metrics.jsonl")).unwrap();
    let a = args(2, &sets(&dir, 6, 0));
    let o = run(&a, &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let line = last_line(&o);
    for needle in [
        "metrics.jsonl",
        "is full",
        "every rank saved checkpoint",
        "(step 1)",
    ] {
        assert!(line.contains(needle), "{needle}: {err}");
    }
    assert_eq!(steps_in(&dir.join("ckpt")), [1], "{err}");
    // Room again: the same command resumes from the saved step and finishes.
    std::fs::remove_file(dir.join("metrics.jsonl")).unwrap();
    let o = run(&a, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming from"), "{}", stderr(&o));
    let steps: Vec<u64> = losses_after(&dir, 0).iter().map(|s| s.0).collect();
    assert_eq!(steps, [2, 3, 4, 5, 6]);
}

/// `sets` of a 2-rank run with offload at stage 2 and the delayed update on after 2 updates.
fn delayed_sets(dir: &Path, steps: u64, every: u64) -> Vec<String> {
    let mut s = sets(dir, steps, every);
    for kv in [
        "zero.stage=2",
        "zero.offload_optimizer=\"cpu\"",
        "zero.offload_delay=1",
        "zero.offload_delay_warmup=2",
        // the plain delay (the split, its default, is a_split_delayed_update_resumes_bitwise's)
        "zero.offload_delay_fresh=false",
    ] {
        s.extend(set(kv.into()));
    }
    s
}

/// `(step, loss)` of every line of `dir`'s metrics.jsonl from step `after + 1`.
fn losses_after(dir: &Path, after: u64) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["step"].as_u64().unwrap() > after)
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// Resumes the checkpoint `ckpt` (alone in a fresh directory `name`) to step 10 on `nproc`
/// ranks with `extra` settings; returns the run's directory.
fn resume_delayed(ckpt: &Path, name: &str, nproc: usize, extra: &[&str]) -> Scratch {
    let dir = scratch(name);
    std::fs::create_dir_all(dir.join("ckpt")).unwrap();
    let o = Command::new("cp")
        .arg("-r")
        .arg(ckpt)
        .arg(dir.join("ckpt"))
        .output()
        .unwrap();
    assert!(o.status.success());
    let mut a = args(nproc, &delayed_sets(&dir, 10, 5));
    for kv in extra {
        a.extend(set(kv.to_string()));
    }
    let o = run(&a, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming from"), "{}", stderr(&o));
    dir
}

#[test]
fn a_checkpoint_taken_with_a_delayed_update_pending_resumes_bitwise() {
    // Uninterrupted: 10 steps, saving at 5 and 10; updates 3.. are delayed.
    let whole = scratch("rs-delay-whole");
    let o = run(&args(2, &delayed_sets(&whole, 10, 5)), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt5 = whole.join("ckpt/step-00000005");
    let m = common::read_json(&ckpt5.join("manifest.json"));
    assert_eq!(
        m["delayed_params"], true,
        "update 5 was pending at the save"
    );
    let want = losses_after(&whole, 5);
    assert_eq!(want.len(), 5);
    // Resumed from step 5 alone (asynchronous saves this time): steps 6-10 run on the same
    // stale parameters and end in the same files, bit for bit.
    let same = resume_delayed(&ckpt5, "rs-delay-resumed", 2, &["checkpoint.async=true"]);
    assert_eq!(losses_after(&same, 5), want);
    let files =
        |d: &Path| common::read_json(&d.join("ckpt/step-00000010/manifest.json"))["files"].clone();
    assert_eq!(files(&same), files(&whole));
    // With the delay off, the same checkpoint resumes from its newest model (the pending
    // update applied at once): step 6 runs on other parameters.
    let off = resume_delayed(&ckpt5, "rs-delay-off", 2, &["zero.offload_delay=0"]);
    let off_by = (losses_after(&off, 5)[0].1 - want[0].1).abs();
    assert!(
        off_by > 1e-5,
        "step 6 ran on the stale parameters: {off_by:e}"
    );
    // At stage 3, and on one rank with the same global batch, the stale parameters are
    // resharded like the master: the same run up to rounding.
    for (name, nproc, extra) in [
        ("rs-delay-stage3", 2, vec!["zero.stage=3"]),
        ("rs-delay-one-rank", 1, vec!["train.grad_accum=2"]),
    ] {
        let got = losses_after(&resume_delayed(&ckpt5, name, nproc, &extra), 5);
        for ((s, g), (_, w)) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "{name}: step {s} loss {g}, uninterrupted {w}"
            );
        }
        assert!((got[0].1 - want[0].1).abs() * 10.0 < off_by, "{name}");
    }
}

#[test]
fn a_split_delayed_update_resumes_bitwise() {
    // As above with zero.offload_delay_fresh: the resumed run rebuilds the base of update 6
    // from the loaded state and step 6's learning rate, as the job of update 5 wrote it.
    let fresh = ["zero.offload_delay_fresh=true"];
    let with_fresh = |dir: &Path| {
        let mut a = args(2, &delayed_sets(dir, 10, 5));
        a.extend(set(fresh[0].to_string()));
        a
    };
    let whole = scratch("rs-fresh-whole");
    let o = run(&with_fresh(&whole), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt5 = whole.join("ckpt/step-00000005");
    let m = common::read_json(&ckpt5.join("manifest.json"));
    assert_eq!(m["delayed_params"], true);
    let want = losses_after(&whole, 5);
    let same = resume_delayed(&ckpt5, "rs-fresh-resumed", 2, &fresh);
    assert_eq!(losses_after(&same, 5), want);
    let files =
        |d: &Path| common::read_json(&d.join("ckpt/step-00000010/manifest.json"))["files"].clone();
    assert_eq!(files(&same), files(&whole));
    // The split is in effect: the plain delay's run differs from step 4 on.
    let plain = scratch("rs-fresh-plain");
    let o = run(&args(2, &delayed_sets(&plain, 5, 5)), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (p, f) = (losses_after(&plain, 3), losses_after(&whole, 3));
    assert!((p[0].1 - f[0].1).abs() > 1e-6, "{p:?} {f:?}");
}
