//! Starting one worker: its own process group, a parent-death signal, and its output copied
//! line by line to the launcher's stdout/stderr (tagged with the rank, through
//! [`super::output`]), to a per-rank log file, and into a ring of its last lines for the
//! failure report.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::Context;

/// Lines of each worker kept for the failure report.
pub const TAIL_LINES: usize = 20;

/// What a worker runs: the program and its arguments.
#[derive(Clone, Debug)]
pub struct Program {
    /// The executable.
    pub exe: std::ffi::OsString,
    /// Its arguments.
    pub args: Vec<std::ffi::OsString>,
}

/// A worker that exited: its rank and how.
#[derive(Debug)]
pub struct Exit {
    /// Global rank.
    pub rank: usize,
    /// Exit code or signal.
    pub status: ExitStatus,
}

/// A running (or finished, not yet collected) worker.
pub struct Worker {
    /// Global rank.
    pub rank: usize,
    /// Process id, which is also its process group id.
    pub pid: i32,
    /// Its last lines, stdout and stderr interleaved as they arrived.
    pub tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<JoinHandle<()>>,
    waiter: Option<JoinHandle<()>>,
}

/// Where a worker's lines go.
#[derive(Clone)]
struct Sink {
    rank: usize,
    /// Tag the lines `[rank R] ` (human format).
    prefix: bool,
    to_stderr: bool,
    log: Option<Arc<Mutex<LogFile>>>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

/// A rank's `--log-dir` file; `None` once a write failed (said once, then the lines go to the
/// terminal only).
struct LogFile {
    file: Option<File>,
    path: std::path::PathBuf,
}

impl LogFile {
    fn line(&mut self, text: &str) {
        let Some(f) = &mut self.file else { return };
        if let Err(e) = writeln!(f, "{text}") {
            self.file = None;
            let fix = match e.raw_os_error() {
                Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => {
                    "the disk (or a quota or file-size limit) is full: free room there or give --log-dir another disk"
                }
                _ => "check that --log-dir is writable",
            };
            super::output::say(
                super::output::Level::Warn,
                &format!(
                    "warning: cannot write the log file {} ({e}): {fix}; the rest of this rank's output is on the terminal only",
                    self.path.display()
                ),
            );
        }
    }
}

impl Sink {
    fn line(&self, raw: &[u8]) {
        let text = String::from_utf8_lossy(raw);
        let text = text.trim_end_matches(['\n', '\r']);
        super::output::relay(self.rank, self.prefix, self.to_stderr, text);
        if let Some(log) = &self.log {
            log.lock().unwrap_or_else(|p| p.into_inner()).line(text);
        }
        let mut t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        if t.len() == TAIL_LINES {
            t.pop_front();
        }
        t.push_back(text.to_string());
    }
}

fn pump(stream: impl Read + Send + 'static, sink: Sink) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("zrun-output".into())
        .spawn(move || {
            let mut r = BufReader::new(stream);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match r.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => sink.line(&buf),
                }
            }
        })
}

/// Starts global rank `rank` with `env` added to the launcher's environment; `restart` is the
/// round (0 for the first start): a restarted rank's lines are appended to its log file after
/// a `--- zrun: restart K ---` line.
///
/// Must be called from the thread that lives as long as the launcher (the main thread): the
/// parent-death signal fires when the thread that forked the child exits. The child is waited
/// on by a thread that sends its [`Exit`] to `exits`.
pub fn spawn(
    program: &Program,
    rank: usize,
    env: &[(String, String)],
    prefix: bool,
    log_dir: Option<&Path>,
    restart: u32,
    exits: Sender<Exit>,
) -> anyhow::Result<Worker> {
    let mut cmd = Command::new(&program.exe);
    // The launcher's output settings reach the workers only as `env` gives them.
    // Nor do Slurm's rank variables: inside an allocation they describe the batch script,
    // not these ranks, whose place is in `env`.
    for k in [
        super::output::FORMAT_ENV,
        super::output::QUIET_ENV,
        super::output::PROGRESS_ENV,
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
        "SLURM_NODEID",
    ] {
        cmd.env_remove(k);
    }
    cmd.args(&program.args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: getpid is async-signal-safe; called before forking.
    let launcher = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (setpgid, prctl, getppid, raise); it allocates nothing
    // except the error value on the failure path, which std's pre_exec contract permits.
    unsafe {
        cmd.pre_exec(move || {
            // Own process group: the terminal's Ctrl-C reaches only the launcher, which
            // forwards it, and a signal to the group also reaches the worker's children.
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Die with the launcher, however it ends.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl.
            if libc::getppid() != launcher {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        });
    }
    let mut child: Child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(super::BadInput(format!(
                "starting rank {rank}: program {} not found; give a path or a program on PATH",
                Path::new(&program.exe).display()
            ))
            .into())
        }
        // Not executable (no x bit, a directory): the command line is wrong, as for a
        // program not found.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(super::BadInput(format!(
                "starting rank {rank}: program {} cannot be run ({e}); give an executable file",
                Path::new(&program.exe).display()
            ))
            .into())
        }
        Err(e) => {
            return Err(e).with_context(|| {
                format!(
                    "starting rank {rank}: {}",
                    Path::new(&program.exe).display()
                )
            })
        }
    };
    let pid = i32::try_from(child.id()).context("process id out of range")?;
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    let log = match log_dir {
        Some(dir) => {
            let path = dir.join(format!("rank-{rank}.log"));
            let opened = if restart == 0 {
                File::create(&path)
            } else {
                std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(&path)
                    .and_then(|mut f| writeln!(f, "--- zrun: restart {restart} ---").map(|()| f))
            };
            let f = opened.with_context(|| format!("creating the log file {}", path.display()))?;
            Some(Arc::new(Mutex::new(LogFile {
                file: Some(f),
                path,
            })))
        }
        None => None,
    };
    let sink = |to_stderr| Sink {
        rank,
        prefix,
        to_stderr,
        log: log.clone(),
        tail: tail.clone(),
    };
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        pumps.push(pump(out, sink(false))?);
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(pump(err, sink(true))?);
    }
    let waiter = std::thread::Builder::new()
        .name("zrun-wait".into())
        .spawn(move || {
            use std::os::unix::process::ExitStatusExt;
            // A failed wait (it should not happen) counts as exit code 1, so the
            // supervisor never waits for a worker it cannot see.
            let status = child
                .wait()
                .unwrap_or_else(|_| ExitStatus::from_raw(1 << 8));
            let _ = exits.send(Exit { rank, status });
        })?;
    Ok(Worker {
        rank,
        pid,
        tail,
        pumps,
        waiter: Some(waiter),
    })
}

impl Worker {
    /// Sends `sig` to the worker's process group (the worker and anything it started).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill has no memory-safety preconditions; a negative pid names the process
        // group this worker leads. Failure (already gone) is harmless.
        unsafe {
            libc::kill(-self.pid, sig);
        }
    }

    /// Waits until `deadline` for the output threads to drain (the pipes close when the
    /// worker and its children are gone) and for the waiter thread; a thread still running
    /// then (a grandchild holding the pipe) is left detached.
    pub fn join_until(&mut self, deadline: Instant) {
        let mut threads: Vec<JoinHandle<()>> = self.pumps.drain(..).collect();
        threads.extend(self.waiter.take());
        for t in threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }

    /// The last lines, oldest first.
    pub fn last_lines(&self) -> Vec<String> {
        let t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        t.iter().cloned().collect()
    }
}

/// "exited with code 3" or "killed by signal 9 (SIGKILL)".
pub fn describe(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("killed by signal {s} ({})", super::signals::name(s)),
        _ => format!("ended with {status}"),
    }
}

/// What a SIGKILL the launcher did not send most often is, for the failure line; `None` for
/// any other status.
pub fn sigkill_hint(status: &ExitStatus) -> Option<&'static str> {
    use std::os::unix::process::ExitStatusExt;
    (status.signal() == Some(libc::SIGKILL)).then_some(
        "a SIGKILL zrun did not send, most often the kernel's out-of-memory killer when the \
         machine's memory ran out (see dmesg)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    fn sh(script: &str) -> Program {
        Program {
            exe: "sh".into(),
            args: vec!["-c".into(), script.into()],
        }
    }

    #[test]
    fn output_tail_log_and_exit_code_are_captured() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, rx) = channel();
        let script =
            "i=0; while [ $i -lt 30 ]; do echo line$i; i=$((i+1)); done; sleep 0.3; echo oops >&2; exit 3";
        let mut w = spawn(&sh(script), 4, &[], true, Some(dir.path()), 0, tx).unwrap();
        let e = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        w.join_until(Instant::now() + Duration::from_secs(10));
        assert_eq!((e.rank, e.status.code()), (4, Some(3)));
        assert_eq!(describe(&e.status), "exited with code 3");
        let tail = w.last_lines();
        assert_eq!(tail.len(), TAIL_LINES);
        // stdout and stderr are separate pipes: the pause orders them
        assert_eq!(tail.last().map(String::as_str), Some("oops"));
        assert!(tail.contains(&"line29".to_string()));
        assert!(
            !tail.contains(&"line5".to_string()),
            "older lines are dropped"
        );
        let log = std::fs::read_to_string(dir.path().join("rank-4.log")).unwrap();
        assert_eq!(log.lines().filter(|l| l.starts_with("line")).count(), 30);
    }

    #[test]
    fn worker_leads_its_own_process_group_and_a_group_signal_kills_it() {
        let (tx, rx) = channel();
        let w = spawn(&sh("exec sleep 30"), 0, &[], false, None, 0, tx).unwrap();
        // SAFETY: getpgid has no memory-safety preconditions.
        let pgid = unsafe { libc::getpgid(w.pid) };
        assert_eq!(pgid, w.pid);
        w.signal(libc::SIGKILL);
        let e = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(describe(&e.status), "killed by signal 9 (SIGKILL)");
    }
}
