//! `--max-restarts` and the stop signals, end to end with `zrun exec` shell scripts (so they do
//! not depend on training): which failures restart the group, on one node and on two; what
//! SIGTERM and SIGUSR1 do; and the exit codes (0, 1, 2, 128+N; 3, a trainer's stop, with a
//! two-node training job).

use super::*;

/// `zrun exec` with `flags`, running `script` under `sh -c` as every rank.
fn exec_args<'a>(flags: &[&'a str], script: &'a str) -> Vec<&'a str> {
    let mut a = vec!["exec"];
    a.extend_from_slice(flags);
    a.extend(["--", "sh", "-c", script]);
    a
}

/// Every line `[rank R] start count=C max=M` as (R, C, M).
fn starts(stdout: &str) -> Vec<(usize, u32, u32)> {
    let mut v: Vec<(usize, u32, u32)> = stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("[rank ")?;
            let (r, rest) = rest.split_once("] start count=")?;
            let (c, m) = rest.split_once(" max=")?;
            Some((r.parse().ok()?, c.parse().ok()?, m.trim().parse().ok()?))
        })
        .collect();
    v.sort_unstable();
    v
}

/// Prints the rank's restart variables, as every script here does first.
const START: &str =
    "echo \"start count=$TORCHELASTIC_RESTART_COUNT max=$TORCHELASTIC_MAX_RESTARTS\"; ";

/// [`START`], then waits (up to 10 s) until every rank of this round has printed its start line,
/// so a rank that fails at once cannot stop the others before they print theirs.
fn start_together(gate: &std::path::Path) -> String {
    let g = gate.display();
    format!(
        "{START}touch {g}/$RANK.$TORCHELASTIC_RESTART_COUNT; n=0; \
         while [ $(ls {g} | grep -c \"\\.$TORCHELASTIC_RESTART_COUNT\\$\") -lt $WORLD_SIZE ] && [ $n -lt 200 ]; \
         do sleep 0.05; n=$((n+1)); done; "
    )
}

#[test]
fn a_failed_rank_restarts_the_group_until_it_succeeds() {
    let d = scratch("restart-ok");
    let id = run_id("restart-ok");
    let logs = d.display().to_string();
    // Rank 1 fails in rounds 0 and 1 while rank 0 still runs; round 2 succeeds.
    let gate = scratch("restart-ok-gate");
    let start = start_together(&gate);
    let script = format!(
        "{start}if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then echo failing; exit 1; fi; sleep 0.5"
    );
    let flags = [
        "--nproc",
        "2",
        "--max-restarts",
        "2",
        "--run-id",
        &id,
        "--log-dir",
        &logs,
    ];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    let status = job.exit_within(Duration::from_secs(30));
    let err = job.stderr();
    assert_eq!(status.code(), Some(0), "{}", job.text());
    for k in 1..=2 {
        assert!(
            err.contains(&format!(
                "zrun: rank 1 failed first: exited with code 1; stopped the other rank; restarting the group (restart {k} of 2)"
            )),
            "{err}"
        );
    }
    assert!(!err.contains("restart 3"), "{err}");
    let want: Vec<(usize, u32, u32)> = (0..2)
        .flat_map(|r| (0..3).map(move |c| (r, c, 2)))
        .collect();
    assert_eq!(starts(&job.stdout()), want, "{}", job.text());
    // A restarted rank's log file keeps the earlier rounds.
    let log = std::fs::read_to_string(d.join("rank-1.log")).unwrap();
    assert_eq!(log.matches("failing").count(), 2, "{log}");
    assert!(log.contains("--- zrun: restart 2 ---"), "{log}");
    assert_job_gone(&id);
}

#[test]
fn restarts_run_out_and_the_failure_counts_them() {
    let gate = scratch("restart-out");
    let start = start_together(&gate);
    let script = format!("{start}if [ $RANK = 1 ]; then exit 1; fi; sleep 0.5");
    let flags = ["--nproc", "2", "--max-restarts", "1"];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    let status = job.exit_within(Duration::from_secs(30));
    let err = job.stderr();
    assert_eq!(status.code(), Some(1), "{}", job.text());
    assert!(
        err.contains("restarting the group (restart 1 of 1)"),
        "{err}"
    );
    assert!(
        err.contains(
            "zrun: rank 1 failed first: exited with code 1; stopped the other rank; not restarted: no restarts left (restarts used: 1 of 1)"
        ),
        "{err}"
    );
    assert_eq!(
        starts(&job.stdout()),
        vec![(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    );
}

#[test]
fn a_rank_exiting_2_is_not_restarted() {
    let gate = scratch("restart-exit-2");
    let start = start_together(&gate);
    let script = format!("{start}if [ $RANK = 1 ]; then exit 2; fi; sleep 0.5");
    let flags = ["--nproc", "2", "--max-restarts", "3"];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    let status = job.exit_within(Duration::from_secs(30));
    let err = job.stderr();
    assert_eq!(status.code(), Some(2), "{}", job.text());
    assert!(
        err.contains("exited with code 2; stopped the other rank; not restarted: exit code 2 means bad input, which a restart cannot fix (restarts used: 0 of 3)"),
        "{err}"
    );
    assert_eq!(starts(&job.stdout()), vec![(0, 0, 3), (1, 0, 3)]);
}

#[test]
fn a_sigkilled_rank_is_restarted() {
    let id = run_id("restart-kill");
    // Round 0 sleeps until killed; round 1 ends at once.
    let script =
        format!("{START}if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exec sleep 60; fi; sleep 0.2");
    let flags = ["--nproc", "2", "--max-restarts", "1", "--run-id", &id];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    assert!(job.wait_for(Duration::from_secs(10), |t| t
        .matches("start count=0")
        .count()
        == 2));
    signal(rank_pid(&id, 1), libc::SIGKILL);
    let status = job.exit_within(Duration::from_secs(30));
    let err = job.stderr();
    assert_eq!(status.code(), Some(0), "{}", job.text());
    assert!(
        err.contains(
            "zrun: rank 1 failed first: killed by signal 9 (SIGKILL) (a SIGKILL zrun did not send"
        ) && err.contains(
            "(see dmesg)); stopped the other rank; restarting the group (restart 1 of 1)"
        ),
        "{err}"
    );
    assert_eq!(
        starts(&job.stdout()),
        vec![(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    );
    assert_job_gone(&id);
}

/// Starts node 0 and node 1 of a two-node `zrun exec` job (2 ranks each) running `script`.
fn two_nodes(name: &str, extra: &[&str], script: &str) -> (Job, Job, String) {
    let port = free_port().to_string();
    let id = run_id(name);
    let start = |node: &str| {
        let mut flags = node_args(node, &port, &id);
        flags.extend_from_slice(extra);
        Job::start(&exec_args(&flags, script), &[])
    };
    let n0 = start("0");
    let n1 = start("1");
    (n0, n1, id)
}

#[test]
fn two_nodes_restart_together_when_a_rank_fails_after_the_other_node_finished() {
    // Round 0: node 0's ranks finish at once (node 0 waits for node 1), rank 2 sleeps, and
    // rank 3 fails; round 1: every rank finishes.
    let script = format!(
        "{START}if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then case $RANK in 0|1) exit 0;; 2) exec sleep 60;; 3) sleep 1; echo boom; exit 1;; esac; fi; sleep 0.3"
    );
    let (mut n0, mut n1, id) = two_nodes("restart-nodes1", &["--max-restarts", "1"], &script);
    let s1 = n1.exit_within(Duration::from_secs(40));
    let s0 = n0.exit_within(Duration::from_secs(20));
    assert_eq!(
        (s0.code(), s1.code()),
        (Some(0), Some(0)),
        "{}\n{}",
        n0.text(),
        n1.text()
    );
    let (e0, e1) = (n0.stderr(), n1.stderr());
    assert!(
        e1.contains("zrun: rank 3 on node 1 failed first: exited with code 1; stopped the other rank on node 1; restarting the group (restart 1 of 1)"),
        "{e1}"
    );
    assert!(
        e0.contains("zrun: this node's ranks finished, but another node failed: rank 3 on node 1 failed first: exited with code 1"),
        "{e0}"
    );
    assert!(
        e0.contains("zrun: restarting the group (restart 1 of 1)"),
        "{e0}"
    );
    assert_eq!(
        starts(&n0.stdout()),
        vec![(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    );
    assert_eq!(
        starts(&n1.stdout()),
        vec![(2, 0, 1), (2, 1, 1), (3, 0, 1), (3, 1, 1)]
    );
    assert_job_gone(&id);
}

#[test]
fn two_nodes_restart_together_when_node_1_learns_of_the_failure_through_the_store() {
    // Round 0: rank 0 fails; node 1's ranks only sleep, so its launcher must learn of the
    // failure through the store, stop them and restart them.
    let script = format!(
        "{START}if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then if [ $RANK = 0 ]; then sleep 1; exit 1; fi; exec sleep 60; fi; sleep 0.3"
    );
    let (mut n0, mut n1, id) = two_nodes("restart-nodes0", &["--max-restarts", "2"], &script);
    let s0 = n0.exit_within(Duration::from_secs(40));
    let s1 = n1.exit_within(Duration::from_secs(20));
    assert_eq!(
        (s0.code(), s1.code()),
        (Some(0), Some(0)),
        "{}\n{}",
        n0.text(),
        n1.text()
    );
    let (e0, e1) = (n0.stderr(), n1.stderr());
    assert!(
        e0.contains("zrun: rank 0 on node 0 failed first: exited with code 1; stopped the other rank on node 0; restarting the group (restart 1 of 2)"),
        "{e0}"
    );
    assert!(
        e1.contains("zrun: another node failed: rank 0 on node 0 failed first"),
        "{e1}"
    );
    assert!(
        e1.contains("zrun: stopped 2 rank(s) on node 1; restarting the group (restart 1 of 2)"),
        "{e1}"
    );
    assert_eq!(
        starts(&n1.stdout()),
        vec![(2, 0, 2), (2, 1, 2), (3, 0, 2), (3, 1, 2)]
    );
    assert_job_gone(&id);
}

#[test]
fn nodes_with_different_max_restarts_are_refused() {
    let port = free_port().to_string();
    let id = run_id("restart-mismatch");
    let mut a0 = node_args("0", &port, &id);
    a0.extend(["--max-restarts", "1"]);
    let a1 = node_args("1", &port, &id);
    let mut n0 = Job::start(&exec_args(&a0, "true"), &[]);
    let mut n1 = Job::start(&exec_args(&a1, "true"), &[]);
    assert_eq!(n0.exit_within(Duration::from_secs(20)).code(), Some(2));
    assert_eq!(n1.exit_within(Duration::from_secs(20)).code(), Some(2));
    assert!(
        n1.stderr()
            .contains("zrun: error: --max-restarts 0 on node 1 but 1 on node 0"),
        "{}",
        n1.text()
    );
    assert!(
        n0.stderr()
            .contains("give every node the same --max-restarts"),
        "{}",
        n0.text()
    );
}

#[test]
fn nodes_with_different_nnodes_are_refused_at_once_on_every_node() {
    // Node 0 with --nnodes 2 once started its ranks with a world of 2 (which failed only at
    // dist.timeout_s) while node 1 with --nnodes 3 waited --rdzv-timeout-s for a node 2.
    for (n0, n1) in [("2", "3"), ("3", "2")] {
        let port = free_port().to_string();
        let id = run_id(&format!("nnodes-mismatch-{n0}"));
        let args = |nnodes: &'static str, node: &'static str| {
            let mut a = node_args(node, &port, &id);
            a[1] = nnodes;
            exec_args(&a, "true")
        };
        let t = std::time::Instant::now();
        let mut j0 = Job::start(&args(n0, "0"), &[]);
        let mut j1 = Job::start(&args(n1, "1"), &[]);
        let (s0, s1) = (
            j0.exit_within(Duration::from_secs(20)),
            j1.exit_within(Duration::from_secs(20)),
        );
        assert_eq!(
            (s0.code(), s1.code()),
            (Some(2), Some(2)),
            "{}\n{}",
            j0.text(),
            j1.text()
        );
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "took {:?}",
            t.elapsed()
        );
        for (job, text) in [
            (&j0, format!("--nnodes {n0} on node 0 but {n1} on node 1")),
            (&j1, format!("--nnodes {n1} on node 1 but {n0} on node 0")),
        ] {
            let e = job.stderr();
            assert!(e.contains(&format!("zrun: error: {text}")), "{e}");
            assert!(e.contains("give every node the same --nnodes"), "{e}");
            assert_eq!(
                e.lines().filter(|l| l.starts_with("zrun: error")).count(),
                1,
                "{e}"
            );
        }
        assert!(!j0.stdout().contains("[rank"), "{}", j0.text());
        assert_job_gone(&id);
    }
}

#[test]
fn a_node_beyond_node_0_s_nnodes_is_refused_on_both_nodes() {
    let port = free_port().to_string();
    let id = run_id("nnodes-beyond");
    let a0 = node_args("0", &port, &id);
    let mut a2 = node_args("2", &port, &id);
    a2[1] = "3";
    let mut j0 = Job::start(&exec_args(&a0, "true"), &[]);
    let mut j2 = Job::start(&exec_args(&a2, "true"), &[]);
    assert_eq!(
        j2.exit_within(Duration::from_secs(20)).code(),
        Some(2),
        "{}",
        j2.text()
    );
    assert_eq!(
        j0.exit_within(Duration::from_secs(20)).code(),
        Some(2),
        "{}",
        j0.text()
    );
    let want = "--nnodes 3 on node 2 but 2 on node 0";
    assert!(
        j2.stderr().contains(&format!("zrun: error: {want}")),
        "{}",
        j2.text()
    );
    assert!(j0.stderr().contains(want), "{}", j0.text());
}

/// A rank that traps `sig` (TERM or USR1), runs `on_signal`, and otherwise waits.
fn trapping(sig: &str, on_signal: &str) -> String {
    format!("trap '{on_signal}' {sig}; echo ready; while :; do sleep 0.1; done")
}

#[test]
fn sigterm_is_forwarded_and_a_program_exiting_3_after_it_is_no_checkpointed_stop() {
    // A trainer's 3 after a stop signal means a checkpoint (tests/checkpoint.rs); another
    // program's means nothing to zrun: the job ends with the signal's code.
    let id = run_id("stop-term");
    let script = trapping("TERM", "echo stopped; exit 3");
    // --max-restarts does not apply to a signal.
    let flags = [
        "--nproc",
        "2",
        "--grace-s",
        "5",
        "--max-restarts",
        "2",
        "--run-id",
        &id,
    ];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    assert!(job.wait_for(Duration::from_secs(10), |t| t.matches("ready").count() == 2));
    let t = Instant::now();
    signal(job.pid(), libc::SIGTERM);
    let status = job.exit_within(Duration::from_secs(15));
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{}", job.text());
    assert_eq!(job.stdout().matches("stopped").count(), 2, "{}", job.text());
    let err = job.stderr();
    assert!(
        err.contains("zrun: received SIGTERM; stopped 2 ranks"),
        "{err}"
    );
    assert!(
        !err.contains("checkpoint") && !err.contains("restart"),
        "{err}"
    );
    assert_job_gone(&id);
}

#[test]
fn ranks_ignoring_sigterm_are_killed_at_the_deadline_and_not_restarted() {
    let id = run_id("stop-ignored");
    let script = trapping("TERM", "");
    let flags = [
        "--nproc",
        "2",
        "--grace-s",
        "1",
        "--max-restarts",
        "2",
        "--run-id",
        &id,
    ];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    assert!(job.wait_for(Duration::from_secs(10), |t| t.matches("ready").count() == 2));
    let t = Instant::now();
    signal(job.pid(), libc::SIGTERM);
    let status = job.exit_within(Duration::from_secs(15));
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "SIGKILL should follow 1 s (--grace-s) after SIGTERM, took {took:?}"
    );
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{}", job.text());
    let err = job.stderr();
    assert!(
        err.contains("zrun: received SIGTERM; stopped 2 ranks"),
        "{err}"
    );
    assert!(!err.contains("restarting"), "{err}");
    assert_job_gone(&id);
}

#[test]
fn sigusr1_is_forwarded_and_does_not_kill_zrun() {
    let d = scratch("stop-usr1");
    let id = run_id("stop-usr1");
    let script = trapping("USR1", &format!("touch {}/usr1-$RANK; exit 3", d.display()));
    let flags = ["--nproc", "2", "--grace-s", "5", "--run-id", &id];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    assert!(job.wait_for(Duration::from_secs(10), |t| t.matches("ready").count() == 2));
    signal(job.pid(), libc::SIGUSR1);
    let status = job.exit_within(Duration::from_secs(15));
    assert_eq!(status.code(), Some(128 + libc::SIGUSR1), "{}", job.text());
    assert!(d.join("usr1-0").exists() && d.join("usr1-1").exists());
    assert!(
        job.stderr()
            .contains("zrun: received SIGUSR1; stopped 2 ranks"),
        "{}",
        job.text()
    );
    assert_job_gone(&id);
}

#[test]
fn a_program_exiting_3_is_a_failure_not_a_checkpointed_stop() {
    // No signal, and `zrun exec` runs any program: its 3 is an exit code like 1, restarted
    // with --max-restarts, never "stopped after saving a checkpoint".
    let script = format!("{START}exit 3");
    let flags = ["--nproc", "2", "--max-restarts", "1"];
    let mut job = Job::start(&exec_args(&flags, &script), &[]);
    let status = job.exit_within(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "{}", job.text());
    let err = job.stderr();
    assert!(err.contains("failed first: exited with code 3"), "{err}");
    assert!(
        err.contains("restarting the group (restart 1 of 1)"),
        "{err}"
    );
    assert!(
        !err.contains("checkpoint") && !err.contains("resume"),
        "{err}"
    );
    assert!(starts(&job.stdout()).contains(&(0, 1, 1)), "{}", job.text());
}

#[test]
fn sigterm_to_one_node_stops_both_nodes_with_exit_3() {
    // Node 1's ranks save on SIGTERM; node 0's ranks learn of the stop through their
    // collectives and save at the same step. Node 1's zrun must not report a failure to node 0
    // meanwhile. Trainers: exit code 3 means a saved checkpoint only for them.
    let d = scratch("stop-nodes");
    let port = free_port().to_string();
    let id = run_id("stop-nodes");
    let sets = common::demo_sets(&d, 100_000, 100_000);
    let start = |node: &str| {
        let mut a = node_args(node, &port, &id);
        a.push("configs/tiny-cpu.toml");
        a.extend(sets.iter().map(String::as_str));
        Job::start(&a, &[])
    };
    let (mut n0, mut n1) = (start("0"), start("1"));
    assert!(
        n0.wait_for(Duration::from_secs(90), |t| t.contains("step 3/")),
        "{}",
        n0.text()
    );
    signal(n1.pid(), libc::SIGTERM);
    let s1 = n1.exit_within(Duration::from_secs(60));
    let s0 = n0.exit_within(Duration::from_secs(30));
    assert_eq!(
        (s0.code(), s1.code()),
        (Some(3), Some(3)),
        "{}\n{}",
        n0.text(),
        n1.text()
    );
    assert!(
        n1.stderr()
            .contains("zrun: received SIGTERM; every rank saved a checkpoint and stopped"),
        "{}",
        n1.text()
    );
    assert!(
        n0.stderr()
            .contains("zrun: the ranks on node 0 stopped after saving a checkpoint (exit code 3)"),
        "{}",
        n0.text()
    );
    assert!(!n0.stderr().contains("failed"), "{}", n0.text());
    assert_eq!(zrun_ckpt::complete(&d.join("ckpt")).unwrap().len(), 1);
    assert_job_gone(&id);
}

/// True once `pid` catches SIGINT, SIGTERM, SIGHUP and SIGUSR1 (the launcher's handler is
/// installed), from the `SigCgt` mask in /proc/PID/status.
fn catches_stop_signals(pid: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap_or(0);
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1]
        .iter()
        .all(|&s| mask & (1 << (s - 1)) != 0)
}

/// A signal while the nodes meet ends zrun with 128+N, as it does once the ranks run: node 0
/// waiting for node 1 to join, and node 1 of `zrun exec` waiting for node 0's store.
#[test]
fn a_signal_while_the_nodes_meet_exits_128_plus_n() {
    let id = run_id("meet-signal");
    let cases = [
        (
            "0",
            libc::SIGTERM,
            "zrun: stopped by SIGTERM while waiting for the other nodes",
        ),
        (
            "1",
            libc::SIGINT,
            "zrun: stopped by SIGINT while connecting to node 0's store",
        ),
    ];
    for (node, sig, said) in cases {
        // Nobody else joins on this port: the node waits until the signal.
        let port = free_port().to_string();
        let flags = node_args(node, &port, &id);
        let mut job = Job::start(&exec_args(&flags, "true"), &[]);
        let t = Instant::now();
        while !catches_stop_signals(job.pid()) && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
        }
        // The handler is installed just before the nodes meet; let the wait begin.
        std::thread::sleep(Duration::from_millis(300));
        signal(job.pid(), sig);
        let status = job.exit_within(Duration::from_secs(20));
        assert_eq!(
            status.code(),
            Some(128 + sig),
            "node {node}: {}",
            job.text()
        );
        assert!(job.stderr().contains(said), "node {node}: {}", job.text());
        assert!(
            !job.stderr().contains("error"),
            "node {node}: {}",
            job.text()
        );
    }
}
