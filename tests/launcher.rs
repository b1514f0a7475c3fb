//! The launcher end to end: ranks start with torchrun's variables, train, and never outlive
//! zrun; a failure, a signal or a lost node stops the whole job. Whether a job's processes
//! are gone is checked by walking /proc for its run id, not by trusting exit codes.

mod common;
use common::*;

// A rank that fails or is killed: which rank is named, what of its output is shown.
mod launcher_failures;
// --max-restarts and the stop signals (SIGTERM, SIGUSR1, exit code 3).
mod launcher_restarts;

use std::collections::HashMap;
use std::io::Read;
use std::time::{Duration, Instant};

fn run_id(name: &str) -> String {
    format!("test-{name}-{}", std::process::id())
}

fn log_dir_set(dir: &std::path::Path) -> String {
    format!("log.dir=\"{}\"", dir.display())
}

fn summary(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// Trains the demo for 20 steps on `n` ranks; with `bare`, from an environment without
/// `LD_LIBRARY_PATH` (the binary finds libtorch through its RUNPATH, launcher and ranks).
fn trains_on(n: usize, bare: bool) {
    let d = scratch(&format!("ranks{n}"));
    let nproc = n.to_string();
    let set = log_dir_set(&d);
    let args = [
        "--nproc",
        &nproc,
        "configs/tiny-cpu.toml",
        "--set",
        "train.steps=20",
        "--set",
        &set,
    ];
    let out = if bare {
        std::process::Command::new(env!("CARGO_BIN_EXE_zrun"))
            .args(args)
            .current_dir(root())
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("VIRTUAL_ENV")
            .output()
            .unwrap()
    } else {
        zrun(&args)
    };
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{o}{e}");
    let s = summary(&d);
    assert_eq!(s["world_size"].as_u64(), Some(n as u64), "{s}");
    assert_eq!(s["steps"].as_u64(), Some(20));
    assert_eq!(s["peak_rss_bytes"].as_array().unwrap().len(), n);
    // every rank's lines carry its prefix; only rank 0 prints the final line
    for r in 0..n {
        assert!(
            e.contains(&format!("[rank {r}] ")),
            "no output of rank {r}: {e}"
        );
    }
    let finals: Vec<&str> = o
        .lines()
        .filter(|l| l.contains("final: eval_loss"))
        .collect();
    assert_eq!(finals.len(), 1, "{o}");
    assert!(finals[0].starts_with("[rank 0] final:"), "{o}");
}

#[test]
fn two_cpu_ranks_train_and_exit_0() {
    trains_on(2, true);
}

#[test]
fn four_cpu_ranks_train_and_exit_0() {
    trains_on(4, false);
}

#[test]
fn workers_see_the_env_contract_and_log_files() {
    let d = scratch("env");
    let id = run_id("env");
    let logs = d.display().to_string();
    let script = "echo \"vars RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT OMP_NUM_THREADS=$OMP_NUM_THREADS ZRUN_JOB_TOKEN=$ZRUN_JOB_TOKEN ZRUN_RUN_ID=$ZRUN_RUN_ID\"; echo to-stderr >&2";
    let args = [
        "exec",
        "--nproc",
        "3",
        "--run-id",
        &id,
        "--log-dir",
        &logs,
        "--",
        "sh",
        "-c",
        script,
    ];
    let out = zrun(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let cores = std::thread::available_parallelism().unwrap().get();
    let share = (cores / 3).max(1).to_string();
    let mut tokens = Vec::new();
    let mut ports = Vec::new();
    for r in 0..3 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("[rank {r}] vars ")))
            .unwrap_or_else(|| panic!("no line of rank {r}: {text}"));
        let vars: HashMap<&str, &str> = line
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let rs = r.to_string();
        for (k, v) in [
            ("RANK", rs.as_str()),
            ("LOCAL_RANK", &rs),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("OMP_NUM_THREADS", &share),
            ("ZRUN_RUN_ID", &id),
        ] {
            assert_eq!(vars.get(k).copied(), Some(v), "{k} of rank {r}: {line}");
        }
        let port: u16 = vars["MASTER_PORT"].parse().unwrap();
        assert!(port > 0);
        ports.push(port);
        let tok = vars["ZRUN_JOB_TOKEN"];
        assert!(tok.len() >= 16, "token {tok:?}");
        tokens.push(tok.to_string());
        // the log file holds the rank's lines without the prefix, stderr included
        let log = std::fs::read_to_string(d.join(format!("rank-{r}.log"))).unwrap();
        assert!(log.contains(&format!("vars RANK={r} ")), "{log}");
        assert!(log.lines().any(|l| l == "to-stderr"), "{log}");
    }
    assert!(tokens.iter().all(|t| t == &tokens[0]) && ports.iter().all(|p| *p == ports[0]));
    assert!(stderr(&out).contains("[rank 2] to-stderr"));

    // A user's OMP_NUM_THREADS is kept; a second job gets another token.
    let mut c = zrun_child(
        &[
            "exec",
            "--nproc",
            "2",
            "--",
            "sh",
            "-c",
            "echo omp=$OMP_NUM_THREADS tok=$ZRUN_JOB_TOKEN",
        ],
        &[("OMP_NUM_THREADS", "7")],
    );
    let mut o = String::new();
    c.stdout.take().unwrap().read_to_string(&mut o).unwrap();
    assert!(c.wait().unwrap().success());
    assert_eq!(o.matches("omp=7").count(), 2, "{o}");
    assert!(!o.contains(&tokens[0]), "tokens must differ between jobs");
}

/// A log file that cannot be written (here rank 1's is /dev/full, which fails every write as a
/// full disk does) is said once, naming the file and what to do; every line still reaches the
/// terminal and the other rank's log, and the job's outcome is the ranks'.
#[test]
fn a_log_file_the_disk_cannot_take_is_said_once_and_the_lines_still_reach_the_terminal() {
    let d = scratch("log-full");
    std::os::unix::fs::symlink("/dev/full", d.join("rank-1.log")).unwrap();
    let logs = d.display().to_string();
    let out = zrun(&[
        "exec",
        "--nproc",
        "2",
        "--log-dir",
        &logs,
        "--",
        "sh",
        "-c",
        "seq 1 50",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("cannot write the log file"))
        .collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains("rank-1.log") && warnings[0].contains("disk"),
        "{err}"
    );
    let text = stdout(&out);
    assert!(text.lines().any(|l| l == "[rank 1] 50"), "{text}");
    let log0 = std::fs::read_to_string(d.join("rank-0.log")).unwrap();
    assert_eq!(log0.lines().filter(|l| !l.is_empty()).count(), 50, "{log0}");
}

#[test]
fn every_line_a_rank_prints_before_it_exits_is_relayed() {
    // Each rank ends the moment its last line is written: the launcher must relay all of them
    // before zrun's own last line and before it exits.
    let out = zrun(&["exec", "--nproc", "2", "--", "sh", "-c", "seq 1 20000"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    for r in 0..2 {
        let tag = format!("[rank {r}] ");
        let n = text.lines().filter(|l| l.starts_with(&tag)).count();
        assert_eq!(n, 20000, "{n} of rank {r}'s 20000 lines relayed");
        assert!(text.contains(&format!("{tag}20000\n")), "rank {r}");
    }
}

/// ZRUN_NCCL_SHARE_GPU=1: each rank gets its own NCCL host id (NCCL's duplicate-GPU check
/// keys on it) with sockets over loopback; without it the ranks get no NCCL variables.
#[test]
fn ranks_sharing_one_gpu_over_nccl_get_a_host_id_each() {
    let script =
        "echo \"nccl $RANK ${NCCL_HOSTID:-none} ${NCCL_NET:-none} ${NCCL_SOCKET_IFNAME:-none}\"";
    let run = |env: &[(&str, &str)]| {
        let mut c = zrun_child(&["exec", "--nproc", "2", "--", "sh", "-c", script], env);
        let mut o = String::new();
        c.stdout.take().unwrap().read_to_string(&mut o).unwrap();
        assert!(c.wait().unwrap().success(), "{o}");
        o
    };
    let o = run(&[("ZRUN_NCCL_SHARE_GPU", "1")]);
    let ids: Vec<&str> = (0..2)
        .map(|r| {
            let line = o
                .lines()
                .find(|l| l.starts_with(&format!("[rank {r}] nccl {r} ")))
                .unwrap_or_else(|| panic!("no line of rank {r}: {o}"));
            assert!(line.ends_with(" Socket lo"), "{line}");
            line.split_whitespace().nth(4).unwrap()
        })
        .collect();
    assert!(ids[0] != "none" && ids[0] != ids[1], "{o}");
    let o = run(&[]);
    assert_eq!(o.matches(" none none none").count(), 2, "{o}");
}

#[test]
fn sigterm_to_zrun_stops_all_workers_within_the_grace_period() {
    // Workers that honour SIGTERM (the trainer) end at once.
    let d = scratch("term");
    let id = run_id("term");
    let set = log_dir_set(&d);
    let mut job = Job::start(
        &[
            "--nproc",
            "2",
            "--grace-s",
            "5",
            "--run-id",
            &id,
            "configs/tiny-cpu.toml",
            "--set",
            "train.steps=100000",
            "--set",
            &set,
        ],
        &[],
    );
    rank_pid(&id, 0);
    rank_pid(&id, 1);
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    signal(job.pid(), libc::SIGTERM);
    let status = job.exit_within(Duration::from_secs(15));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    // A trainer that saves a checkpoint on SIGTERM exits 3, and so does zrun; one that
    // does not is stopped by the signal.
    let want = match status.code() {
        Some(3) => "zrun: received SIGTERM; every rank saved a checkpoint and stopped",
        _ => "zrun: received SIGTERM; stopped 2 ranks",
    };
    assert!(
        matches!(status.code(), Some(3 | 143)),
        "{status:?}: {}",
        job.text()
    );
    assert!(job.stderr().contains(want), "{}", job.text());
    assert_job_gone(&id);

    // Workers that ignore SIGTERM are killed when the grace period ends.
    let id = run_id("term-ignored");
    let mut job = Job::start(
        &[
            "exec",
            "--nproc",
            "2",
            "--grace-s",
            "1",
            "--run-id",
            &id,
            "--",
            "sh",
            "-c",
            "trap '' TERM; echo ready; while :; do sleep 0.1; done",
        ],
        &[],
    );
    assert!(job.wait_for(Duration::from_secs(10), |t| t.matches("ready").count() == 2));
    let t = Instant::now();
    signal(job.pid(), libc::SIGTERM);
    job.exit_within(Duration::from_secs(10));
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "SIGKILL should follow 1 s after SIGTERM, took {took:?}"
    );
    assert_job_gone(&id);
}

#[test]
fn workers_die_with_a_killed_zrun() {
    let id = run_id("orphans");
    let mut job = Job::start(
        &[
            "exec",
            "--nproc",
            "2",
            "--run-id",
            &id,
            "--",
            "sh",
            "-c",
            "echo ready; exec sleep 60",
        ],
        &[],
    );
    assert!(job.wait_for(Duration::from_secs(10), |t| t.matches("ready").count() == 2));
    signal(job.pid(), libc::SIGKILL);
    job.exit_within(Duration::from_secs(5));
    assert_job_gone(&id);
}

fn node_args<'a>(node: &'a str, port: &'a str, id: &'a str) -> Vec<&'a str> {
    vec![
        "--nnodes",
        "2",
        "--node-rank",
        node,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--nproc",
        "2",
        "--run-id",
        id,
    ]
}

#[test]
fn two_nodes_on_loopback_form_one_four_rank_job() {
    let d = scratch("nodes");
    let port = free_port().to_string();
    let id = run_id("nodes");
    let set = log_dir_set(&d);
    let tail = [
        "configs/tiny-cpu.toml",
        "--set",
        "train.steps=20",
        "--set",
        &set,
    ];
    let mut a1 = node_args("1", &port, &id);
    a1.extend(tail);
    let mut a0 = node_args("0", &port, &id);
    a0.extend(tail);
    // node 1 first: it waits for node 0's store
    let mut n1 = Job::start(&a1, &[]);
    std::thread::sleep(Duration::from_millis(300));
    let mut n0 = Job::start(&a0, &[]);
    assert!(
        n0.exit_within(Duration::from_secs(120)).success(),
        "{}",
        n0.text()
    );
    assert!(
        n1.exit_within(Duration::from_secs(30)).success(),
        "{}",
        n1.text()
    );
    assert_eq!(summary(&d)["world_size"].as_u64(), Some(4));
    assert!(n0.stdout().contains("[rank 0] final:"), "{}", n0.text());
    let e1 = n1.stderr();
    assert!(e1.contains("[rank 2] ") && e1.contains("[rank 3] "), "{e1}");
    assert!(!e1.contains("[rank 0] "), "{e1}");
}

#[test]
fn killing_one_node_mid_training_ends_the_other() {
    let d = scratch("nodekill");
    let port = free_port().to_string();
    let id = run_id("nodekill");
    let set = log_dir_set(&d);
    let tail = [
        "configs/tiny-cpu.toml",
        "--set",
        "train.steps=100000",
        "--set",
        &set,
    ];
    let mut a0 = node_args("0", &port, &id);
    a0.extend(tail);
    let mut a1 = node_args("1", &port, &id);
    a1.extend(tail);
    let mut n0 = Job::start(&a0, &[]);
    let mut n1 = Job::start(&a1, &[]);
    for r in 0..4 {
        rank_pid(&id, r);
    }
    assert!(n0.wait_for(Duration::from_secs(60), |t| t.contains("training")));
    std::thread::sleep(Duration::from_millis(1000));
    signal(n1.pid(), libc::SIGKILL);
    n1.exit_within(Duration::from_secs(5));
    let status = n0.exit_within(Duration::from_secs(20));
    assert!(!status.success());
    assert_job_gone(&id);
}

#[test]
fn a_node_learns_through_the_store_that_the_other_stopped() {
    // The ranks only sleep, so no collective notices anything: the launchers must.
    let script = "echo ready; exec sleep 60";
    let cmd = ["--", "sh", "-c", script];
    // SIGTERM to node 1: its report reaches node 0 through the store.
    let port = free_port().to_string();
    let id = run_id("store-term");
    let mut a0 = vec!["exec"];
    a0.extend(node_args("0", &port, &id));
    a0.extend(cmd);
    let mut a1 = vec!["exec"];
    a1.extend(node_args("1", &port, &id));
    a1.extend(cmd);
    let mut n0 = Job::start(&a0, &[]);
    let mut n1 = Job::start(&a1, &[]);
    assert!(n1.wait_for(Duration::from_secs(20), |t| t.matches("ready").count() == 2));
    assert!(n0.wait_for(Duration::from_secs(20), |t| t.matches("ready").count() == 2));
    let t = Instant::now();
    signal(n1.pid(), libc::SIGTERM);
    n1.exit_within(Duration::from_secs(15));
    assert!(!n0.exit_within(Duration::from_secs(15)).success());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        n0.stderr().contains("node 1's zrun received SIGTERM"),
        "{}",
        n0.text()
    );
    assert_job_gone(&id);

    // SIGKILL to node 1: node 0 notices the stalled heartbeat.
    let port = free_port().to_string();
    let id = run_id("store-kill");
    let mut a0 = vec!["exec"];
    a0.extend(node_args("0", &port, &id));
    a0.extend(cmd);
    let mut a1 = vec!["exec"];
    a1.extend(node_args("1", &port, &id));
    a1.extend(cmd);
    let mut n0 = Job::start(&a0, &[]);
    let mut n1 = Job::start(&a1, &[]);
    assert!(n1.wait_for(Duration::from_secs(20), |t| t.matches("ready").count() == 2));
    signal(n1.pid(), libc::SIGKILL);
    assert!(!n0.exit_within(Duration::from_secs(25)).success());
    assert!(
        n0.stderr().contains("node 1's zrun stopped answering"),
        "{}",
        n0.text()
    );
    assert_job_gone(&id);
}

/// Runs zrun, expects exit code 2 and one `zrun: error:` line containing `needles`.
fn rejects(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let mut c = zrun_child(args, env);
    let mut err = String::new();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = c.wait().unwrap();
    assert_eq!(status.code(), Some(2), "args {args:?}: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line: {err}");
    assert!(lines[0].starts_with("zrun: error: "), "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "{:?} lacks {n:?}", lines[0]);
    }
}

#[test]
fn bad_layouts_are_one_line_errors_with_exit_code_2() {
    let cfg = "configs/tiny-cpu.toml";
    rejects(&["--nproc", "0", cfg], &[], &["--nproc 0"]);
    rejects(
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--master-addr",
            "127.0.0.1",
            cfg,
        ],
        &[],
        &["--node-rank 2", "--nnodes 2"],
    );
    rejects(
        &["--master-addr", "no-such-host.invalid", cfg],
        &[],
        &["no-such-host.invalid", "does not resolve"],
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    rejects(&["--master-port", &port, cfg], &[], &[&port, "in use"]);
    // rank variables and layout flags together are ambiguous
    rejects(
        &["--nproc", "2", cfg],
        &[("RANK", "0"), ("WORLD_SIZE", "1")],
        &["already is rank 0 of 1", "--nproc"],
    );
}

#[test]
fn dry_run_prints_every_rank_without_starting_any() {
    let d = scratch("dry4");
    let set = log_dir_set(&d);
    let out = zrun(&[
        "--dry-run",
        "--nproc",
        "4",
        "configs/tiny-cpu.toml",
        "--set",
        &set,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let (v, t, c, l) = (256i64, 64i64, 64i64, 2i64);
    let params = v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c + v * c;
    assert!(text.contains(&format!("parameters: {params}")), "{text}");
    assert!(text.contains("world size: 4"), "{text}");
    assert!(
        text.contains("rank 3") && !text.contains("rank 4"),
        "{text}"
    );
    assert!(!text.contains("[rank"), "a dry run starts no ranks: {text}");
    assert!(!d.join("metrics.jsonl").exists());
}

#[test]
fn mpirun_runs_each_process_as_one_rank() {
    if std::process::Command::new("mpirun")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: mpirun is not installed (apt-get install openmpi-bin)");
        return;
    }
    let d = scratch("mpirun");
    let set = log_dir_set(&d);
    let port = free_port().to_string();
    let mut backends = vec!["tcp"];
    if cfg!(feature = "mpi") {
        backends.push("mpi");
    } else {
        eprintln!("mpi backend part skipped: build with `--features mpi` to run it");
    }
    for backend in backends {
        let be = format!("dist.backend=\"{backend}\"");
        let out = std::process::Command::new("mpirun")
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                "2",
                "-x",
                "MASTER_PORT",
            ])
            .arg(env!("CARGO_BIN_EXE_zrun"))
            .args([
                "configs/tiny-cpu.toml",
                "--set",
                "train.steps=20",
                "--set",
                &set,
            ])
            .args(["--set", &be])
            .env("MASTER_PORT", &port)
            .current_dir(root())
            .output()
            .unwrap();
        let (o, e) = (stdout(&out), stderr(&out));
        assert!(out.status.success(), "{backend}: {o}{e}");
        assert_eq!(summary(&d)["world_size"].as_u64(), Some(2), "{backend}");
        // no supervision layer: no rank prefixes
        assert!(o.lines().any(|l| l.starts_with("final: eval_loss")), "{o}");
        assert!(!o.contains("[rank "), "{o}");
    }
}

/// Per-step losses of a run's metrics.jsonl.
fn losses(dir: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v["loss"].as_f64())
        .collect()
}

#[test]
fn mpirun_hybrid_sharding_on_mpi_sub_communicators_trains_like_tcp() {
    if !cfg!(feature = "mpi") {
        eprintln!("skipped: build with `--features mpi` to run it");
        return;
    }
    let hybrid = [
        "--set",
        "zero.stage=3",
        "--set",
        "zero.shard_group=2",
        "--set",
        "train.steps=10",
        "--set",
        "log.every=1",
    ];
    let tcp = scratch("hybrid-tcp");
    let set = log_dir_set(&tcp);
    let mut args = vec!["--nproc", "4", "configs/tiny-cpu.toml", "--set", &set];
    args.extend(hybrid);
    let out = zrun(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let mpi = scratch("hybrid-mpi");
    let set = log_dir_set(&mpi);
    let out = std::process::Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "4"])
        .arg(env!("CARGO_BIN_EXE_zrun"))
        .args(["configs/tiny-cpu.toml", "--set", &set])
        .args(hybrid)
        .args(["--set", "dist.backend=\"mpi\""])
        .env("MASTER_PORT", free_port().to_string())
        .current_dir(root())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let (want, got) = (losses(&tcp), losses(&mpi));
    assert_eq!(got.len(), 10);
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "mpi {a} vs tcp {b}");
    }
}

#[test]
fn an_sbatch_script_without_a_task_count_launches_and_its_ranks_see_their_own_place() {
    // sbatch sets SLURM_PROCID but no SLURM_NTASKS when no task count was asked for.
    let id = run_id("sbatch-no-ntasks");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zrun"))
        .args([
            "exec",
            "--nproc",
            "2",
            "--run-id",
            &id,
            "--",
            "sh",
            "-c",
            "echo \"rank=$RANK world=$WORLD_SIZE slurm=${SLURM_PROCID-none}\"",
        ])
        .env("SLURM_PROCID", "0")
        .env("SLURM_LOCALID", "0")
        .env("SLURM_NNODES", "1")
        .env_remove("SLURM_NTASKS")
        .env_remove("SLURM_NPROCS")
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    for r in 0..2 {
        assert!(
            out.contains(&format!("rank={r} world=2 slurm=none")),
            "{out}"
        );
    }
}
