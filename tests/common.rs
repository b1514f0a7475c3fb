//! Helpers shared by the end-to-end tests: run the real `zrun` binary.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "scratch.rs"]
mod scratch;
pub use scratch::Scratch;

/// Every file directly in `dir` with its bytes, sorted by name: a directory's whole state,
/// to compare before and after something that must not change it.
pub fn files_in(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A fresh scratch directory (see [`Scratch`]).
pub fn scratch(name: &str) -> Scratch {
    Scratch::fresh(std::env::temp_dir().join(format!("zrun-e2e-{}-{name}", std::process::id())))
}

/// Runs `zrun` with `args` in the repository root.
pub fn zrun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zrun"))
        .args(args)
        .current_dir(root())
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("zrun runs")
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Writes a file and returns its path as a string.
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.display().to_string()
}

/// Starts `zrun` with `args` in the repository root, stdout and stderr piped, extra `env` set.
pub fn zrun_child(args: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_zrun"))
        .args(args)
        .current_dir(root())
        .env("RUST_BACKTRACE", "0")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("zrun starts")
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running zrun whose stdout and stderr are collected as they arrive.
pub struct Job {
    /// The zrun process.
    pub child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

fn collect(mut r: impl Read + Send + 'static) -> (Arc<Mutex<String>>, std::thread::JoinHandle<()>) {
    let buf = Arc::new(Mutex::new(String::new()));
    let b = buf.clone();
    let reader = std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n) = r.read(&mut chunk) {
            if n == 0 {
                break;
            }
            b.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&chunk[..n]));
        }
    });
    (buf, reader)
}

/// A test that fails midway must not leave its job running: kill zrun (its ranks follow
/// through their parent-death signal).
impl Drop for Job {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Job {
    /// Starts `zrun` with `args` and extra `env`.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Job {
        let mut child = zrun_child(args, env);
        let (out, r1) = collect(child.stdout.take().unwrap());
        let (err, r2) = collect(child.stderr.take().unwrap());
        Job {
            child,
            out,
            err,
            readers: vec![r1, r2],
        }
    }

    /// zrun's process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// stdout followed by stderr, as far as they have arrived.
    pub fn text(&self) -> String {
        format!("{}{}", self.out.lock().unwrap(), self.err.lock().unwrap())
    }

    /// stderr so far.
    pub fn stderr(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    /// stdout so far.
    pub fn stdout(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Waits until `pred` holds on stdout+stderr; false after `timeout`.
    pub fn wait_for(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> bool {
        let t = Instant::now();
        while t.elapsed() < timeout {
            if pred(&self.text()) {
                return true;
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                return pred(&self.text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// The exit status, or kills zrun and panics after `timeout`.
    pub fn exit_within(&mut self, timeout: Duration) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // zrun's pipes close with it (its workers write to zrun, not to us)
                for r in self.readers.drain(..) {
                    let _ = r.join();
                }
                return s;
            }
            if t.elapsed() > timeout {
                let _ = self.child.kill();
                panic!("zrun did not exit within {timeout:?}:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Sends `sig` to `pid`.
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// Live processes whose environment has `ZRUN_RUN_ID=run_id`, with their environments.
pub fn job_processes(run_id: &str) -> Vec<(i32, HashMap<String, String>)> {
    let want = format!("ZRUN_RUN_ID={run_id}");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // A zombie or a process that just ended has no readable environment.
        let Ok(raw) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        if vars.iter().any(|v| v == &want) {
            let env = vars
                .iter()
                .filter_map(|v| v.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            found.push((pid, env));
        }
    }
    found
}

/// Asserts that no process of the job is left (allowing a moment for the kernel to finish
/// tearing down processes that were just killed).
pub fn assert_job_gone(run_id: &str) {
    let t = Instant::now();
    loop {
        let left = job_processes(run_id);
        if left.is_empty() {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "processes of job {run_id} outlived zrun: {:?}",
            left.iter().map(|(p, _)| *p).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pid of global rank `rank` of the job, once it runs.
pub fn rank_pid(run_id: &str, rank: usize) -> i32 {
    let t = Instant::now();
    loop {
        let procs = job_processes(run_id);
        if let Some((pid, _)) = procs
            .iter()
            .find(|(_, env)| env.get("RANK") == Some(&rank.to_string()))
        {
            return *pid;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "rank {rank} never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Job {
    /// Starts `cmd` (stdin closed, stdout and stderr collected) in a process group of its own,
    /// so that [`Script`] can end it with everything it started.
    pub fn spawn(mut cmd: Command) -> Job {
        use std::os::unix::process::CommandExt;
        let mut child = cmd
            .process_group(0)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the command starts");
        let (out, r1) = collect(child.stdout.take().unwrap());
        let (err, r2) = collect(child.stderr.take().unwrap());
        Job {
            child,
            out,
            err,
            readers: vec![r1, r2],
        }
    }
}

/// A shell script (an example's run.sh or sbatch file) running under bash in the repository
/// root with `ZRUN` set to the binary under test. A test that fails midway kills the script's
/// whole process group (zrun's ranks follow zrun through their parent-death signal).
pub struct Script {
    /// The bash process and its collected output.
    pub job: Job,
    /// Its group was killed after bash exited: the id may be reused from then on.
    ended: bool,
}

impl Script {
    /// Starts `bash script args` with extra `env` (on top of `ZRUN`).
    pub fn start(script: &str, args: &[&str], env: &[(&str, &str)]) -> Script {
        let mut cmd = Command::new("bash");
        cmd.arg(script)
            .args(args)
            .current_dir(root())
            .env("ZRUN", env!("CARGO_BIN_EXE_zrun"))
            .env("RUST_BACKTRACE", "0")
            .envs(env.iter().copied());
        Script {
            job: Job::spawn(cmd),
            ended: false,
        }
    }

    /// Waits for bash to exit and returns its exit code (-1 when ended by a signal); panics
    /// with the output after `timeout`. Whatever the script left running in its group (say a
    /// zrun it started in the background and never waited for) is killed then, so that its
    /// output pipes close.
    pub fn code_within(&mut self, timeout: Duration) -> i32 {
        let t = Instant::now();
        while self.job.child.try_wait().unwrap().is_none() {
            if t.elapsed() > timeout {
                self.kill_group();
                panic!(
                    "{timeout:?} passed and the script still runs:\n{}",
                    self.job.text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill_group();
        self.ended = true;
        self.job.exit_within(timeout).code().unwrap_or(-1)
    }

    /// SIGKILL to the script's process group; a no-op (ESRCH) once the group is empty.
    fn kill_group(&self) {
        // SAFETY: kill has no memory-safety preconditions; the group is the script's own.
        unsafe { libc::kill(-(self.job.child.id() as i32), libc::SIGKILL) };
    }

    /// stdout followed by stderr so far.
    pub fn text(&self) -> String {
        self.job.text()
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        // a test that failed midway: end the script and everything it started
        if !self.ended {
            self.kill_group();
        }
    }
}

/// A JSON file, parsed.
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `--set` overrides of the checkpoint tests' runs of configs/tiny-cpu.toml: `steps` steps
/// logged each step, a save every `every`, no evaluation, a micro-batch of 8, logs in `dir`.
pub fn demo_sets(dir: &Path, steps: u64, every: u64) -> Vec<String> {
    [
        format!("log.dir=\"{}\"", dir.display()),
        format!("train.steps={steps}"),
        format!("checkpoint.every={every}"),
        "train.eval_every=0".into(),
        "train.eval_batches=2".into(),
        "train.micro_batch=8".into(),
        "train.warmup_steps=4".into(),
        "log.every=1".into(),
        "dist.timeout_s=60".into(),
    ]
    .into_iter()
    .flat_map(|s| ["--set".to_string(), s])
    .collect()
}

/// Every token of a token file, read through the data loader: with T = 1 and one train
/// window, window 0 is the train split and windows 1.. the eval split, in file order.
pub fn read_by_loader(path: PathBuf, vocab_size: usize) -> Vec<u32> {
    let ds = zrun_train::data::Dataset::open(&zrun_train::data::DataOptions {
        source: zrun_train::data::DataSource::Tokens {
            path,
            tokenizer: None,
        },
        seq_len: 1,
        vocab_size,
        seed: 0,
        eval_fraction: 0.999_999,
    })
    .unwrap();
    assert_eq!(ds.len(zrun_train::data::Split::Train), Some(1));
    let n = ds.len(zrun_train::data::Split::Eval).unwrap();
    let (x0, _) = ds.samples(zrun_train::data::Split::Train, &[0]).unwrap();
    let (x, y) = ds
        .samples(zrun_train::data::Split::Eval, &(0..n).collect::<Vec<u64>>())
        .unwrap();
    let mut all = Vec::<i64>::try_from(x0.flatten(0, -1)).unwrap();
    all.extend(Vec::<i64>::try_from(x.flatten(0, -1)).unwrap());
    all.push(Vec::<i64>::try_from(y.flatten(0, -1)).unwrap()[n as usize - 1]);
    all.into_iter().map(|t| t as u32).collect()
}

/// Runs zrun, expects exit code 2 and one `zrun: error:` line holding every needle.
pub fn rejects(args: &[&str], needles: &[&str]) {
    let out = zrun(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("zrun: error:")).collect();
    assert_eq!(lines.len(), 1, "expected one error line: {err}");
    for n in needles {
        assert!(lines[0].contains(n), "{:?} lacks {n:?}", lines[0]);
    }
}

/// `zrun args` in a process that may write no file beyond `max_file` bytes (RLIMIT_FSIZE,
/// `ulimit -f`): a longer write fails with EFBIG, as one on a full disk fails with ENOSPC.
/// With `ignore_sigxfsz` the process starts with SIGXFSZ ignored; without, SIGXFSZ keeps its
/// default action (ending the process) unless zrun itself ignores it.
pub fn zrun_file_limit(args: &[&str], max_file: u64, ignore_sigxfsz: bool) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zrun"));
    cmd.args(args)
        .current_dir(root())
        .env("RUST_BACKTRACE", "0")
        .stdin(std::process::Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if ignore_sigxfsz {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            }
            let lim = libc::rlimit {
                rlim_cur: max_file,
                rlim_max: max_file,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().unwrap()
}
