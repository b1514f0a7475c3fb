//! Interrupting a running `zrun` at a chosen point of its work, without depending on timing:
//! the process is frozen (SIGSTOP) where its files show it has begun writing and has most of
//! the work still ahead, checked again while frozen, sent the signal and let go on (SIGCONT).
//! The signal is then recorded before the command can reach the end of its work, however
//! slowly this test runs beside it. Shared by tests/prepare.rs and tests/hf.rs (which includes
//! this file by path).

use std::process::Output;
use std::time::{Duration, Instant};

/// Where a command's work stands, as its files show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Its output has not started yet.
    NotYet,
    /// Its output has started, and most of the work is still ahead.
    Early,
    /// Too far on to be interrupted for sure.
    Late,
}

/// The scheduling state letters of every thread of `pid` (`R`, `S`, `T`, ...).
fn thread_states(pid: u32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .filter_map(|s| s.rsplit_once(')')?.1.trim_start().chars().next())
        .collect()
}

/// Sends `sig` to `pid` (a process that may have ended: then nothing happens).
fn kill(pid: u32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// Runs `zrun args`, and once `look` (given its process id) sees it [`Seen::Early`], freezes
/// it; if `look` still says so with every thread stopped, sends `sig` and lets it go on.
/// Returns its output and the process id it had. A run first seen [`Seen::Late`], or that
/// ends before, is waited for and started again, up to 20 times.
pub fn interrupt_early(args: &[&str], sig: i32, look: impl Fn(u32) -> Seen) -> (Output, u32) {
    for _ in 0..20 {
        let mut child = crate::common::zrun_child(args, &[]);
        let pid = child.id();
        let start = Instant::now();
        let sent = loop {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "{args:?} never started"
            );
            if child.try_wait().unwrap().is_some() {
                break false;
            }
            match look(pid) {
                Seen::NotYet => std::thread::sleep(Duration::from_micros(500)),
                Seen::Late => break false,
                Seen::Early => {
                    kill(pid, libc::SIGSTOP);
                    let frozen = Instant::now();
                    loop {
                        let states = thread_states(pid);
                        // Stopped, or ended meanwhile (then `look` no longer says early).
                        let ended = states.is_empty() || states.contains(&'Z');
                        if ended || states.iter().all(|&s| s == 'T' || s == 't') {
                            break;
                        }
                        assert!(frozen.elapsed() < Duration::from_secs(10), "not stopped");
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    let early = look(pid) == Seen::Early;
                    if early {
                        kill(pid, sig);
                    }
                    kill(pid, libc::SIGCONT);
                    break early;
                }
            }
        };
        let out = child.wait_with_output().unwrap();
        if sent {
            return (out, pid);
        }
    }
    panic!("{args:?}: no run of 20 was caught before the end of its work");
}
