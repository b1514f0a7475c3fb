//! Pending collectives ([`Work`]) and the per-communicator thread that runs them in issue order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::Error;

/// A pending collective. It must be waited on; the tensors it uses belong to it until then.
#[must_use = "a collective must be waited on"]
pub struct Work {
    inner: Option<Pending>,
    /// Runs on the waiting thread once the collective is complete (copying a staged result
    /// back to the device).
    then: Option<Then>,
}

type Then = Box<dyn FnOnce() -> Result<(), Error> + Send>;

struct Pending {
    rx: Receiver<Result<(), Error>>,
    rank: usize,
    op: &'static str,
    bytes: usize,
    deadline: Instant,
    timeout: Duration,
}

impl Work {
    /// A work that is already complete (used where a collective has nothing to do).
    pub fn ready() -> Work {
        Work {
            inner: None,
            then: None,
        }
    }

    /// This work followed by `f`, which runs on the thread that waits, after the collective
    /// completed and only if it succeeded.
    pub(crate) fn then(mut self, f: impl FnOnce() -> Result<(), Error> + Send + 'static) -> Work {
        debug_assert!(self.then.is_none(), "one follow-up per work");
        self.then = Some(Box::new(f));
        self
    }

    /// Blocks until the collective is complete, or fails: with the collective's own error
    /// (naming this rank, the op, the bytes and the peer), or with [`Error::Timeout`] once the
    /// deadline (`dist.timeout_s` per queued collective) has passed. On CUDA "complete" is in
    /// stream order: nccl returns once libtorch's stream waits for the collective, tcp once
    /// the result's copy back to the device is queued; kernels queued after see the result.
    pub fn wait(self) -> Result<(), Error> {
        let then = self.then;
        if let Some(p) = self.inner {
            p.wait()?;
        }
        then.map_or(Ok(()), |f| f())
    }
}

impl Pending {
    fn wait(self) -> Result<(), Error> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(left) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(Error::Timeout {
                rank: self.rank,
                op: self.op,
                bytes: self.bytes,
                peer: "unknown (the communication thread is blocked)".into(),
                timeout: self.timeout,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(Error::Poisoned {
                rank: self.rank,
                op: self.op,
                first: "the communication thread stopped".into(),
            }),
        }
    }
}

type Job<S> = Box<dyn FnOnce(&mut S) -> Result<(), Error> + Send>;

/// Called on the communication thread every `.0` while no job arrives, and before each job:
/// a backend whose jobs only launch work (nccl) checks there that the launched work
/// completes in time. An error counts as the first failure.
pub(crate) type Watch<S> = (Duration, fn(&mut S) -> Result<(), Error>);

struct Queued<S> {
    job: Job<S>,
    op: &'static str,
    done: Sender<Result<(), Error>>,
}

/// Runs jobs on one background thread that owns the backend state `S`, in issue order.
/// After the first failure every later job is refused with [`Error::Poisoned`].
pub(crate) struct Executor<S> {
    tx: Mutex<Option<Sender<Queued<S>>>>,
    thread: Option<JoinHandle<()>>,
    /// Receives once when the thread ends (after the state is dropped).
    ended: Mutex<Receiver<()>>,
    pending: Arc<AtomicUsize>,
    /// The first failure's words, published before `on_error` runs.
    failure: Arc<OnceLock<String>>,
    rank: usize,
    timeout: Duration,
}

/// How long dropping an executor waits for its thread (which drops the state: for nccl,
/// draining or aborting the communicator) before leaving it to end with the process.
#[cfg(not(test))]
const JOIN_DEADLINE: Duration = Duration::from_secs(10);
#[cfg(test)]
const JOIN_DEADLINE: Duration = Duration::from_secs(1);

impl<S: 'static> Executor<S> {
    /// Starts the thread; `make` builds the state on it (so `S` need not be `Send`), `on_error`
    /// runs once on the state after the first failure (to abort connections).
    pub(crate) fn spawn(
        rank: usize,
        timeout: Duration,
        make: impl FnOnce() -> Result<S, Error> + Send + 'static,
        on_error: fn(&mut S),
    ) -> Result<Executor<S>, Error> {
        Self::start(
            rank,
            timeout,
            make,
            on_error,
            None::<(Duration, fn() -> Error)>,
            None,
        )
    }

    /// As [`Executor::spawn`], but fails with the error `late` makes when `make` has not
    /// finished within `within` (a library call that cannot be interrupted, such as
    /// `ncclCommInitRank` waiting for a peer). The thread is then left behind: it ends when
    /// `make` returns, or with the process. With `watch`, its function runs on the state
    /// between jobs ([`Watch`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the nccl backend's
    pub(crate) fn spawn_within(
        rank: usize,
        timeout: Duration,
        make: impl FnOnce() -> Result<S, Error> + Send + 'static,
        on_error: fn(&mut S),
        within: Duration,
        late: impl FnOnce() -> Error,
        watch: Option<Watch<S>>,
    ) -> Result<Executor<S>, Error> {
        Self::start(rank, timeout, make, on_error, Some((within, late)), watch)
    }

    fn start(
        rank: usize,
        timeout: Duration,
        make: impl FnOnce() -> Result<S, Error> + Send + 'static,
        on_error: fn(&mut S),
        within: Option<(Duration, impl FnOnce() -> Error)>,
        watch: Option<Watch<S>>,
    ) -> Result<Executor<S>, Error> {
        let (tx, rx) = mpsc::channel::<Queued<S>>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), Error>>();
        let pending = Arc::new(AtomicUsize::new(0));
        let pend = pending.clone();
        let failure = Arc::new(OnceLock::new());
        let failed = failure.clone();
        let (ended_tx, ended) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("zrun-comm-{rank}"))
            .spawn(move || {
                // Dropped last, after the state: the signal that the thread has ended.
                let _ended = Ended(ended_tx);
                // The first failure: published before `on_error` aborts the backend, so a
                // reader that saw an aborted collective end also sees the failure.
                let fail = |state: &mut S, first: &mut Option<String>, e: String| {
                    let _ = failed.set(e.clone());
                    *first = Some(e);
                    on_error(state);
                };
                let mut state = match make() {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let mut first: Option<String> = None;
                let check = |state: &mut S, first: &mut Option<String>| {
                    if let (Some((_, f)), None) = (watch, &first) {
                        if let Err(e) = f(state) {
                            tracing::error!("{e}");
                            fail(state, first, e.to_string());
                        }
                    }
                };
                loop {
                    let q = match watch {
                        None => match rx.recv() {
                            Ok(q) => q,
                            Err(_) => break,
                        },
                        Some((every, _)) => match rx.recv_timeout(every) {
                            Ok(q) => q,
                            Err(RecvTimeoutError::Timeout) => {
                                check(&mut state, &mut first);
                                continue;
                            }
                            Err(RecvTimeoutError::Disconnected) => break,
                        },
                    };
                    check(&mut state, &mut first);
                    let r = match &first {
                        Some(f) => Err(Error::Poisoned {
                            rank,
                            op: q.op,
                            first: f.clone(),
                        }),
                        None => {
                            let r = (q.job)(&mut state);
                            if let Err(e) = &r {
                                fail(&mut state, &mut first, e.to_string());
                            }
                            r
                        }
                    };
                    pend.fetch_sub(1, Ordering::SeqCst);
                    let _ = q.done.send(r);
                }
            })
            .map_err(|e| Error::Backend {
                rank,
                backend: "comm",
                op: "start communication thread",
                detail: e.to_string(),
            })?;
        let ready = match within {
            None => ready_rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some((d, late)) => match ready_rx.recv_timeout(d) {
                // Not joined: the thread is stuck in `make`; dropping `tx` on return ends it
                // as soon as `make` comes back.
                Err(RecvTimeoutError::Timeout) => return Err(late()),
                r => r,
            },
        };
        match ready {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(Error::Backend {
                    rank,
                    backend: "comm",
                    op: "start communication thread",
                    detail: "the thread panicked while connecting".into(),
                });
            }
        }
        Ok(Executor {
            tx: Mutex::new(Some(tx)),
            thread: Some(thread),
            ended: Mutex::new(ended),
            pending,
            failure,
            rank,
            timeout,
        })
    }

    /// The first failure of this executor's jobs or watch, if any: a collective that
    /// completed after it may have been cut short (an aborted NCCL kernel ends without
    /// finishing), so what it left in its buffers must not be trusted.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the nccl backend's
    pub(crate) fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    /// The cell [`Executor::failure`] reads, for a waiter that outlives this borrow.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the nccl backend's
    pub(crate) fn failure_handle(&self) -> Arc<OnceLock<String>> {
        self.failure.clone()
    }

    /// Queues `job`; the returned work's deadline allows `timeout` for it and for each job
    /// queued before it.
    pub(crate) fn submit(
        &self,
        op: &'static str,
        bytes: usize,
        job: impl FnOnce(&mut S) -> Result<(), Error> + Send + 'static,
    ) -> Result<Work, Error> {
        let (done, rx) = mpsc::channel();
        let ahead = self.pending.fetch_add(1, Ordering::SeqCst);
        let budget = self
            .timeout
            .saturating_mul(ahead as u32 + 1)
            .saturating_add(Duration::from_secs(1));
        let guard = self.tx.lock().map_err(|_| Error::Poisoned {
            rank: self.rank,
            op,
            first: "a thread panicked while issuing a collective".into(),
        })?;
        let sent = guard.as_ref().map(|tx| {
            tx.send(Queued {
                job: Box::new(job),
                op,
                done,
            })
        });
        if !matches!(sent, Some(Ok(()))) {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Poisoned {
                rank: self.rank,
                op,
                first: "the communication thread stopped".into(),
            });
        }
        Ok(Work {
            inner: Some(Pending {
                rx,
                rank: self.rank,
                op,
                bytes,
                deadline: crate::deadline_in(budget),
                timeout: self.timeout,
            }),
            then: None,
        })
    }
}

/// Sends once when dropped.
struct Ended(Sender<()>);

impl Drop for Ended {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

impl<S> Drop for Executor<S> {
    fn drop(&mut self) {
        if let Ok(mut g) = self.tx.lock() {
            g.take();
        }
        // A thread still inside a collective (a peer is stuck, or the MPI library cannot be
        // interrupted), or one whose state takes longer than JOIN_DEADLINE to drop (a
        // communicator waiting for a dead peer), is left behind rather than blocking the
        // caller; it ends with the process.
        if let Some(t) = self.thread.take() {
            if self.pending.load(Ordering::SeqCst) == 0
                && self
                    .ended
                    .lock()
                    .is_ok_and(|rx| rx.recv_timeout(JOIN_DEADLINE).is_ok())
            {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_in_order_and_failure_poisons_later_jobs() {
        let ex =
            Executor::spawn(3, Duration::from_secs(5), || Ok(Vec::<u32>::new()), |_| {}).unwrap();
        let w1 = ex.submit("a", 0, |s: &mut Vec<u32>| {
            s.push(1);
            Ok(())
        });
        let w2 = ex.submit("b", 0, |s: &mut Vec<u32>| {
            assert_eq!(s, &[1]);
            Err(Error::Connect {
                rank: 3,
                detail: "boom".into(),
            })
        });
        let w3 = ex.submit("c", 0, |_s: &mut Vec<u32>| Ok(()));
        w1.unwrap().wait().unwrap();
        assert!(w2.unwrap().wait().unwrap_err().to_string().contains("boom"));
        let e = w3.unwrap().wait().unwrap_err().to_string();
        assert!(e.contains("rank 3, c") && e.contains("boom"), "{e}");
    }

    #[test]
    fn a_follow_up_runs_on_the_waiting_thread_after_success_only() {
        let ex = Executor::spawn(4, Duration::from_secs(5), || Ok(0u32), |_| {}).unwrap();
        let seen = Arc::new(AtomicUsize::new(0));
        let s = seen.clone();
        let w = ex
            .submit("ok", 0, |n: &mut u32| {
                *n += 1;
                Ok(())
            })
            .unwrap()
            .then(move || {
                s.fetch_add(1, Ordering::SeqCst);
                Ok(())
            });
        assert_eq!(seen.load(Ordering::SeqCst), 0, "not before the wait");
        w.wait().unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 1);
        // a failed collective skips it and reports its own error
        let s = seen.clone();
        let e = ex
            .submit("bad", 0, |_| {
                Err(Error::Connect {
                    rank: 4,
                    detail: "peer gone".into(),
                })
            })
            .unwrap()
            .then(move || {
                s.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("peer gone"), "{e}");
        assert_eq!(seen.load(Ordering::SeqCst), 1);
        // a follow-up's own error is the wait's
        let e = Work::ready()
            .then(|| {
                Err(Error::Connect {
                    rank: 4,
                    detail: "copy back failed".into(),
                })
            })
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("copy back failed"), "{e}");
    }

    #[test]
    fn a_failed_watch_poisons_later_jobs_and_is_not_run_again() {
        // The state counts jobs run and aborts; the watch fails once two jobs have run,
        // between jobs, as nccl's does when launched work misses its deadline.
        let ex = Executor::spawn_within(
            3,
            Duration::from_secs(5),
            || Ok((0u32, 0u32)),
            |s: &mut (u32, u32)| s.1 += 1,
            Duration::from_secs(5),
            || unreachable!("made in time"),
            Some((Duration::from_millis(10), |s: &mut (u32, u32)| {
                assert_eq!(s.1, 0, "no watch after the first failure");
                if s.0 >= 2 {
                    Err(Error::Connect {
                        rank: 3,
                        detail: "launched work missed its deadline".into(),
                    })
                } else {
                    Ok(())
                }
            })),
        )
        .unwrap();
        for _ in 0..2 {
            ex.submit("job", 0, |s: &mut (u32, u32)| {
                s.0 += 1;
                Ok(())
            })
            .unwrap()
            .wait()
            .unwrap();
        }
        // the watch fails while the thread is idle; the next job is refused with its words
        std::thread::sleep(Duration::from_millis(100));
        let e = ex
            .submit("later", 0, |_| Ok(()))
            .unwrap()
            .wait()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missed its deadline") && e.contains("later"),
            "{e}"
        );
    }

    #[test]
    fn a_state_that_is_not_made_in_time_fails_with_the_late_error() {
        let t = Instant::now();
        let e = Executor::<()>::spawn_within(
            2,
            Duration::from_secs(5),
            || {
                std::thread::sleep(Duration::from_millis(1500));
                Ok(())
            },
            |_| {},
            Duration::from_millis(100),
            || Error::Connect {
                rank: 2,
                detail: "init did not return".into(),
            },
            None,
        )
        .err()
        .expect("too late");
        assert!(t.elapsed() < Duration::from_millis(1400), "waited for make");
        assert!(e.to_string().contains("init did not return"), "{e}");
        // in time: as spawn
        let ex = Executor::spawn_within(
            2,
            Duration::from_secs(5),
            || Ok(7u32),
            |_| {},
            Duration::from_secs(5),
            || unreachable!("made in time"),
            None,
        )
        .unwrap();
        ex.submit("x", 0, |s: &mut u32| {
            assert_eq!(*s, 7);
            Ok(())
        })
        .unwrap()
        .wait()
        .unwrap();
    }

    /// A state whose drop blocks (a communicator that waits for a dead peer) does not block
    /// the executor's drop past its deadline.
    #[test]
    fn dropping_an_executor_whose_state_hangs_returns_within_the_deadline() {
        struct Stuck;
        impl Drop for Stuck {
            fn drop(&mut self) {
                std::thread::sleep(JOIN_DEADLINE * 3);
            }
        }
        let ex = Executor::spawn(0, Duration::from_secs(5), || Ok(Stuck), |_| {}).unwrap();
        ex.submit("x", 0, |_| Ok(())).unwrap().wait().unwrap();
        let t = Instant::now();
        drop(ex);
        assert!(t.elapsed() < JOIN_DEADLINE * 2, "{:?}", t.elapsed());
    }

    #[test]
    fn the_first_failure_is_published_before_on_error_runs() {
        static SEEN: std::sync::Mutex<Option<bool>> = std::sync::Mutex::new(None);
        let ex = Arc::new(
            Executor::spawn(
                1,
                Duration::from_secs(5),
                || Ok(()),
                |_| *SEEN.lock().unwrap() = Some(true),
            )
            .unwrap(),
        );
        assert!(ex.failure().is_none());
        let e = ex
            .submit("all_reduce", 4, |_| {
                Err(Error::Connect {
                    rank: 1,
                    detail: "peer died".into(),
                })
            })
            .unwrap()
            .wait();
        assert!(e.is_err());
        assert_eq!(*SEEN.lock().unwrap(), Some(true));
        assert!(ex.failure().is_some_and(|f| f.contains("peer died")));
    }

    #[test]
    fn wait_times_out_when_the_thread_is_stuck() {
        let ex = Executor::spawn(0, Duration::from_millis(100), || Ok(()), |_| {}).unwrap();
        let w = ex
            .submit("all_gather", 64, |_| {
                std::thread::sleep(Duration::from_millis(1500));
                Ok(())
            })
            .unwrap();
        let t = Instant::now();
        let e = w.wait().unwrap_err().to_string();
        assert!(t.elapsed() < Duration::from_millis(1400));
        assert!(e.contains("rank 0, all_gather of 64 bytes"), "{e}");
    }
}
