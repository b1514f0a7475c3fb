//! Watching the workers of one round: the first failure, a signal to the launcher or news from
//! another node ends the round; stopping is SIGTERM (or the signal received) to every worker's
//! process group, then SIGKILL when the given time is up.
//!
//! A trainer that exits with code 3 stopped after a signal and saved a checkpoint: that is not
//! a failure, and the round waits for the other workers. Another program's 3 (`zrun exec`)
//! is an exit code like any other.

use std::process::ExitStatus;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::rendezvous::Remote;
use super::signals;
use super::spawn::{Exit, Worker};

/// How often the loop looks at signals and remote news between worker exits.
const POLL: Duration = Duration::from_millis(50);
/// How long to wait for killed workers to be reaped and their output to drain.
const DRAIN: Duration = Duration::from_secs(5);
/// The exit code of a rank that was stopped by a signal after saving a checkpoint.
pub const STOPPED: i32 = 3;

/// Why the round ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every worker on this node exited 0.
    Success,
    /// Every worker on this node exited 0 or 3, at least one 3, without a signal to the
    /// launcher (another node got it, or the ranks were signalled directly).
    Stopped,
    /// A local worker failed first.
    Failed {
        /// Its global rank.
        rank: usize,
        /// How it ended.
        status: ExitStatus,
    },
    /// The launcher received this signal.
    Signalled(i32),
    /// Another node failed or the store went away.
    Remote(Remote),
}

/// The workers of this node and the channel their exits arrive on.
pub struct Supervisor {
    /// The workers, in local-rank order.
    pub workers: Vec<Worker>,
    exits: Receiver<Exit>,
    /// Exits seen so far, by index into `workers`.
    exited: Vec<Option<ExitStatus>>,
    /// A worker exited 3 while being watched (not while being stopped).
    saw_stop: bool,
    /// [`STOPPED`] when the workers save a checkpoint and exit with it on a stop signal (the
    /// trainer); `None` when no exit code means a stop (`zrun exec`).
    stop_code: Option<i32>,
    /// Why the last [`Supervisor::stop_all`] sent SIGKILL, if it did.
    pub killed: Option<Killed>,
}

/// Why workers being stopped were killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Killed {
    /// Their time (the stop deadline, or `--grace-s`) was up.
    TimeUp,
    /// The launcher got a further signal.
    SignalledAgain,
    /// Another worker failed meanwhile, so theirs could not complete.
    AfterFailure,
}

impl Supervisor {
    /// Supervises `workers`, whose waiters send to `exits`; `stop_code` is the exit code of a
    /// worker that stopped after saving a checkpoint ([`STOPPED`]), if the workers have one.
    pub fn new(workers: Vec<Worker>, exits: Receiver<Exit>, stop_code: Option<i32>) -> Supervisor {
        let exited = vec![None; workers.len()];
        Supervisor {
            workers,
            exits,
            exited,
            saw_stop: false,
            stop_code,
            killed: None,
        }
    }

    /// True when `code` is the workers' stop code.
    fn is_stop(&self, code: Option<i32>) -> bool {
        code.is_some() && code == self.stop_code
    }

    fn record(&mut self, e: &Exit) -> usize {
        let i = self
            .workers
            .iter()
            .position(|w| w.rank == e.rank)
            .unwrap_or(0);
        self.exited[i] = Some(e.status);
        i
    }

    fn running(&self) -> usize {
        self.exited.iter().filter(|e| e.is_none()).count()
    }

    /// The ranks that have exited with `code`, lowest first.
    pub fn exited_with(&self, code: i32) -> Vec<usize> {
        let mut ranks: Vec<usize> = self
            .workers
            .iter()
            .zip(&self.exited)
            .filter(|(_, e)| e.and_then(|s| s.code()) == Some(code))
            .map(|(w, _)| w.rank)
            .collect();
        ranks.sort_unstable();
        ranks
    }

    /// True when a worker exited 3 on its own while the round ran: the job is stopping, so a
    /// later failure in this round is not restarted.
    pub fn saw_stop(&self) -> bool {
        self.saw_stop
    }

    /// True when every worker has exited with 0 or the stop code, at least one with the stop
    /// code: the ranks saved a checkpoint and stopped. Never without a stop code.
    pub fn stopped_cleanly(&self) -> bool {
        let codes: Vec<Option<i32>> = self
            .exited
            .iter()
            .map(|e| e.and_then(|s| s.code()))
            .collect();
        codes.iter().all(|&c| c == Some(0) || self.is_stop(c))
            && codes.iter().any(|&c| self.is_stop(c))
    }

    /// Waits until all workers end well, one fails, a signal arrives, or `news` has some.
    pub fn watch(&mut self, mut news: impl FnMut() -> Option<Remote>) -> Outcome {
        loop {
            match self.exits.recv_timeout(POLL) {
                Ok(e) => {
                    self.record(&e);
                    match e.status.code() {
                        Some(0) => {}
                        c if self.is_stop(c) => self.saw_stop = true,
                        _ => {
                            return Outcome::Failed {
                                rank: e.rank,
                                status: e.status,
                            }
                        }
                    }
                    if self.running() == 0 {
                        return self.ended_well();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    if self.running() == 0 {
                        return self.ended_well();
                    }
                }
            }
            if let Some((sig, _)) = signals::received() {
                return Outcome::Signalled(sig);
            }
            if let Some(n) = news() {
                return Outcome::Remote(n);
            }
        }
    }

    fn ended_well(&self) -> Outcome {
        if self.saw_stop {
            Outcome::Stopped
        } else {
            Outcome::Success
        }
    }

    /// Stops every worker still running: `first` (SIGTERM, or the signal the launcher got) to
    /// each process group, SIGKILL after `wait` or at a further signal to the launcher; a
    /// worker that fails meanwhile (not 0 or 3: the ranks' checkpoint cannot complete without
    /// it) leaves the others at most `after_failure`. Then waits for them and their output.
    /// Returns how many had to be stopped.
    pub fn stop_all(&mut self, first: i32, wait: Duration, after_failure: Duration) -> usize {
        let to_stop: Vec<usize> = (0..self.workers.len())
            .filter(|&i| self.exited[i].is_none())
            .collect();
        for &i in &to_stop {
            self.workers[i].signal(first);
        }
        let signals_before = signals::count();
        let mut deadline = zrun_comm::deadline_in(wait);
        let mut killed = false;
        let mut failed = false;
        self.killed = None;
        while self.running() > 0 {
            let now = Instant::now();
            let again = signals::count() > signals_before;
            if !killed && (now >= deadline || again) {
                for i in 0..self.workers.len() {
                    if self.exited[i].is_none() {
                        self.workers[i].signal(libc::SIGKILL);
                    }
                }
                killed = true;
                self.killed = Some(match (again, failed) {
                    (true, _) => Killed::SignalledAgain,
                    (false, true) => Killed::AfterFailure,
                    (false, false) => Killed::TimeUp,
                });
            }
            let wait = if killed {
                DRAIN
            } else {
                POLL.min(deadline.saturating_duration_since(now))
            };
            match self.exits.recv_timeout(wait) {
                Ok(e) => {
                    self.record(&e);
                    let code = e.status.code();
                    if code != Some(0) && !self.is_stop(code) {
                        deadline = deadline.min(zrun_comm::deadline_in(after_failure));
                        failed = true;
                    }
                }
                Err(RecvTimeoutError::Timeout) if killed => break,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        to_stop.len()
    }

    /// Waits (a bounded time) for the output threads, so the last lines are complete.
    pub fn drain(&mut self) {
        let deadline = Instant::now() + DRAIN;
        for w in &mut self.workers {
            w.join_until(deadline);
        }
    }
}
