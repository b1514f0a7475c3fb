//! Watching the workers: the first failure, a signal to the launcher or news from another
//! node ends the job; stopping is SIGTERM (or the signal received) to every worker's process
//! group, then SIGKILL after the grace period.

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

/// Why the job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every worker on this node exited 0.
    Success,
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
    grace: Duration,
}

impl Supervisor {
    /// Supervises `workers`, whose waiters send to `exits`.
    pub fn new(workers: Vec<Worker>, exits: Receiver<Exit>, grace: Duration) -> Supervisor {
        let exited = vec![None; workers.len()];
        Supervisor {
            workers,
            exits,
            exited,
            grace,
        }
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

    /// Waits until all workers succeed, one fails, a signal arrives, or `remote` has news.
    pub fn watch(&mut self, remote: Option<&Receiver<Remote>>) -> Outcome {
        loop {
            match self.exits.recv_timeout(POLL) {
                Ok(e) => {
                    self.record(&e);
                    if !e.status.success() {
                        return Outcome::Failed {
                            rank: e.rank,
                            status: e.status,
                        };
                    }
                    if self.running() == 0 {
                        return Outcome::Success;
                    }
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    if self.running() == 0 {
                        return Outcome::Success;
                    }
                }
            }
            if let Some((sig, _)) = signals::received() {
                return Outcome::Signalled(sig);
            }
            if let Some(news) = remote.and_then(|r| r.try_recv().ok()) {
                return Outcome::Remote(news);
            }
        }
    }

    /// Stops every worker still running: `first` (SIGTERM, or the signal the launcher got) to
    /// each process group, SIGKILL after the grace period or at a second signal to the
    /// launcher; then waits for them and their output. Returns how many had to be stopped.
    pub fn stop_all(&mut self, first: i32) -> usize {
        let to_stop: Vec<usize> = (0..self.workers.len())
            .filter(|&i| self.exited[i].is_none())
            .collect();
        for &i in &to_stop {
            self.workers[i].signal(first);
        }
        let signals_before = signals::received().map_or(0, |(_, n)| n);
        let deadline = Instant::now() + self.grace;
        let mut killed = false;
        while self.running() > 0 {
            let now = Instant::now();
            let again = signals::received().is_some_and(|(_, n)| n > signals_before);
            if !killed && (now >= deadline || again) {
                for i in 0..self.workers.len() {
                    if self.exited[i].is_none() {
                        self.workers[i].signal(libc::SIGKILL);
                    }
                }
                killed = true;
            }
            let wait = if killed {
                DRAIN
            } else {
                POLL.min(deadline.saturating_duration_since(now))
            };
            match self.exits.recv_timeout(wait) {
                Ok(e) => {
                    self.record(&e);
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
