//! A rank that fails or is killed, end to end: the launcher names the rank that failed first
//! (not one that only lost it as a peer), stops the others, quotes the failing rank's last
//! lines, shows an error every rank printed once, and refuses a missing data path before any
//! rank starts.

use super::*;
use std::path::Path;

#[test]
fn sigkill_to_a_worker_mid_training_ends_the_job() {
    let d = scratch("kill");
    let id = run_id("kill");
    let set = log_dir_set(&d);
    let mut job = Job::start(
        &[
            "--nproc",
            "2",
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
    // both ranks are in the training loop
    assert!(
        job.wait_for(Duration::from_secs(60), |t| {
            t.contains("[rank 0]") && t.contains("[rank 1]") && t.contains("training")
        }),
        "{}",
        job.text()
    );
    std::thread::sleep(Duration::from_millis(1500));
    let victim = rank_pid(&id, 1);
    let t = Instant::now();
    signal(victim, libc::SIGKILL);
    let status = job.exit_within(Duration::from_secs(15));
    assert!(t.elapsed() < Duration::from_secs(15));
    assert!(!status.success());
    let err = job.stderr();
    assert!(
        err.contains("zrun: rank 1 failed first: killed by signal 9 (SIGKILL)"),
        "{err}"
    );
    // A SIGKILL zrun did not send is most often the out-of-memory killer: said so.
    assert!(
        err.contains("out-of-memory killer") && err.contains("zrun estimate predicts"),
        "{err}"
    );
    assert_job_gone(&id);
}

#[test]
fn a_failing_worker_is_named_and_the_others_are_stopped() {
    let id = run_id("exit4");
    // Ranks 0 and 2 would sleep for a minute; rank 1 exits 4 once they run.
    let script = "if [ \"$RANK\" = 1 ]; then sleep 0.5; echo giving up; exit 4; fi; exec sleep 60";
    let mut job = Job::start(
        &[
            "exec", "--nproc", "3", "--run-id", &id, "--", "sh", "-c", script,
        ],
        &[],
    );
    let t = Instant::now();
    let status = job.exit_within(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the others were not stopped"
    );
    let err = job.stderr();
    assert!(
        err.contains("zrun: rank 1 failed first: exited with code 4; stopped the other 2 ranks"),
        "{err}"
    );
    assert!(
        err.contains("last 1 lines of rank 1") && err.contains("| giving up"),
        "{err}"
    );
    assert_job_gone(&id);
}

#[test]
fn an_error_every_rank_prints_is_shown_once() {
    // Every rank meets the same bad input and says so; rank 0 exits 2 once all have.
    let id = run_id("same");
    let script = "echo 'zrun: error: data.path x: not found' >&2; sleep 1; \
                  if [ \"$RANK\" = 0 ]; then exit 2; fi; exec sleep 60";
    let mut job = Job::start(
        &[
            "exec", "--nproc", "3", "--run-id", &id, "--", "sh", "-c", script,
        ],
        &[],
    );
    let status = job.exit_within(Duration::from_secs(30));
    assert_eq!(status.code(), Some(2));
    let err = job.stderr();
    let shown = err
        .lines()
        .filter(|l| l.starts_with("[rank ") && l.ends_with("] zrun: error: data.path x: not found"))
        .count();
    assert_eq!(shown, 1, "{err}");
    let first = err
        .lines()
        .find_map(|l| l.strip_suffix("] zrun: error: data.path x: not found"))
        .and_then(|l| l.strip_prefix("[rank "))
        .unwrap_or_default()
        .to_string();
    let others: Vec<&str> = ["0", "1", "2"]
        .into_iter()
        .filter(|r| *r != first)
        .collect();
    let want = format!(
        "zrun: ranks {} and {} printed the same error as rank {first} (shown once)",
        others[0], others[1]
    );
    assert!(err.contains(&want), "{want}: {err}");
    // The failing rank's own last lines still hold it.
    assert!(
        err.contains("    | zrun: error: data.path x: not found"),
        "{err}"
    );
    assert_job_gone(&id);
}

/// A config in `d` training on the token file `bin`, logging to `d`.
fn tokens_config(d: &Path, bin: &Path) -> String {
    write(
        d,
        "c.toml",
        format!(
            "[data]\nsource = \"tokens\"\npath = \"{}\"\n[log]\ndir = \"{}\"\n",
            bin.display(),
            d.display()
        )
        .as_bytes(),
    )
}

#[test]
fn a_worker_failing_in_training_reports_its_last_lines() {
    // The data file is there but not a token file (an odd number of bytes): every rank
    // fails at start with a bad-input error, and zrun passes exit code 2 on.
    let d = scratch("fail");
    let bin = d.join("odd.bin");
    std::fs::write(&bin, [1u8, 2, 3]).unwrap();
    let out = zrun(&["--nproc", "2", &tokens_config(&d, &bin)]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("failed first: exited with code 2"), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("    | ") && l.contains("odd.bin")),
        "the failing rank's last lines are quoted: {err}"
    );
}

#[test]
fn a_missing_data_path_is_refused_before_any_rank_starts() {
    let d = scratch("nodata");
    let bin = d.join("gone.bin");
    let out = zrun(&["--nproc", "2", &tokens_config(&d, &bin)]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("zrun: error: data.path ") && err.contains("gone.bin: not found"),
        "{err}"
    );
}

#[test]
fn a_program_that_cannot_be_run_is_bad_input() {
    rejects(
        &["exec", "--nproc", "2", "--", "/nonexistent/prog"],
        &[],
        &["/nonexistent/prog", "not found"],
    );
    // A directory cannot be run (as root, any file with an x bit can).
    let dir = std::env::temp_dir().display().to_string();
    rejects(
        &["exec", "--", &dir],
        &[],
        &[&dir, "cannot be run", "give an executable file"],
    );
}

/// Two ranks started without zrun's launcher (torchrun's variables) with another learning
/// rate on one of them: both stop before training, exit 2, each naming the key and its own
/// value (they trained on, each with its own setting, and exited 0).
#[test]
fn ranks_given_different_configs_are_refused_before_training() {
    let d = scratch("differ");
    let port = free_port().to_string();
    let start = |rank: &str, extra: &[&str]| {
        let dir = format!("log.dir=\"{}\"", d.join(rank).display());
        let mut a = vec![
            "configs/tiny-cpu.toml",
            "--set",
            "train.steps=4",
            "--set",
            &dir,
        ];
        a.extend(extra);
        let env = [
            ("RANK", rank),
            ("LOCAL_RANK", rank),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
        ];
        zrun_child(&a, &env)
    };
    let ranks = [start("0", &[]), start("1", &["--set", "train.lr=0.5"])];
    for (r, c) in ranks.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "rank {r}: {err}");
        let line = err.lines().last().unwrap_or_default();
        let value = if r == 0 { "0.003" } else { "0.5" };
        assert!(
            line.contains("different configs")
                && line.contains(&format!("train.lr = {value} here")),
            "rank {r}: {err}"
        );
        assert!(!d.join(r.to_string()).join("metrics.jsonl").exists());
    }
}

/// A rank started without zrun's launcher that is waiting for its peers ends at SIGTERM:
/// there is nothing to save yet (it waited out dist.timeout_s, 600 s by default).
#[test]
fn a_rank_waiting_for_its_peers_ends_at_sigterm() {
    use std::os::unix::process::ExitStatusExt;
    let d = scratch("rdzv-term");
    let port = free_port().to_string();
    let dir = format!("log.dir=\"{}\"", d.display());
    let env = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port.as_str()),
    ];
    let args = [
        "configs/tiny-cpu.toml",
        "--set",
        &dir,
        "--set",
        "dist.timeout_s=120",
    ];
    let mut c = zrun_child(&args, &env);
    // Rank 0 hosts the store: once its port answers, the rank is waiting for rank 1.
    let up = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_err() {
        assert!(up.elapsed().as_secs() < 60, "the store never listened");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    signal(c.id() as i32, libc::SIGTERM);
    let sent = std::time::Instant::now();
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        assert!(sent.elapsed().as_secs() < 20, "still waiting after SIGTERM");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
}

/// mpirun's variables for ranks on two hosts without MASTER_ADDR: bad input (exit 2) with
/// mpirun's hint, before the rank waits for anyone.
#[test]
fn an_mpirun_job_on_two_hosts_without_master_addr_is_bad_input() {
    let d = scratch("mpi-no-addr");
    let dir = format!("log.dir=\"{}\"", d.display());
    let env = [
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ];
    let c = zrun_child(&["configs/tiny-cpu.toml", "--set", &dir], &env);
    let o = c.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("MASTER_ADDR is not set") && err.contains("mpirun -x"),
        "{err}"
    );
}
