//! One round of a job on this node: start the ranks, watch them, stop them, report, and decide
//! whether the job ends (with which exit code) or the group starts again.
//!
//! Exit codes: 0 when every rank finished; 1 on a failure (2 when the first failing rank
//! exited 2, bad input); 3 when the ranks stopped after a signal and saved a checkpoint (the
//! trainer only: a `zrun exec` program's 3 is a failure like any other code); 128+N when the
//! launcher got signal N and the ranks did not all stop that way.

use std::process::ExitStatus;
use std::sync::mpsc::channel;
use std::time::Duration;

use super::output::{self, Level};
use super::plan::{omp_threads_for, Plan};
use super::rendezvous::{Remote, Rendezvous, Waited};
use super::signals;
use super::spawn::{self, Program};
use super::supervise::{Killed, Outcome, Supervisor, STOPPED};

/// What follows a round.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// The launcher exits with this code.
    Exit(u8),
    /// Every rank starts again, in the next round.
    Restart,
}

/// The exit code of a rank that ran out of memory, and of zrun then.
pub const OUT_OF_MEMORY: i32 = 4;

/// The diagnosis a rank that ran out of memory wrote in `dir` during this job: `rank`'s own,
/// else (a rank that stopped because another ran out) the lowest rank's.
fn oom_report(
    dir: &std::path::Path,
    rank: usize,
    started: std::time::SystemTime,
) -> Option<String> {
    let fresh = |p: &std::path::Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= started)
    };
    let own = dir.join(format!("oom-rank-{rank}.txt"));
    if fresh(&own) {
        return std::fs::read_to_string(own).ok();
    }
    let mut found: Vec<(usize, std::path::PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| {
            let p = e.ok()?.path();
            let name = p.file_name()?.to_str()?;
            let r = name
                .strip_prefix("oom-rank-")?
                .strip_suffix(".txt")?
                .parse()
                .ok()?;
            fresh(&p).then_some((r, p))
        })
        .collect();
    found.sort();
    std::fs::read_to_string(&found.first()?.1).ok()
}

/// What a round needs: the plan, the program, the store and the stop deadline.
pub struct Job<'a> {
    /// The validated launch.
    pub plan: &'a Plan,
    /// What each rank runs.
    pub program: &'a Program,
    /// This node's connection to the job.
    pub rdzv: &'a Rendezvous,
    /// Time between forwarding SIGTERM/SIGUSR1 and SIGKILL.
    pub stop_deadline: Duration,
    /// The ranks' exit code after a stop signal with a checkpoint saved (the trainer's 3);
    /// `None` for a program without that convention (`zrun exec`).
    pub stop_code: Option<i32>,
    /// Variables every worker gets besides the plan's (output format, progress line).
    pub env: Vec<(String, String)>,
    /// Where ranks write an out-of-memory diagnosis (see `Options::reports`).
    pub reports: Option<std::path::PathBuf>,
    /// When the launch began (a diagnosis older than that is from an earlier job).
    pub started: std::time::SystemTime,
}

impl Job<'_> {
    /// Runs round `round` (0 for the first start) on this node.
    pub fn round(&self, round: u32) -> anyhow::Result<Next> {
        self.rdzv.set_round(round);
        let mut sup = self.start(round)?;
        let r = Round { job: self, round };
        let next = match sup.watch(|| self.rdzv.news()) {
            // The ranks' last lines are printed before zrun's own and before it exits.
            Outcome::Success => {
                sup.drain();
                r.finished(false)
            }
            Outcome::Stopped => {
                sup.drain();
                r.finished(true)
            }
            Outcome::Failed { rank, status } => r.failed(&mut sup, rank, status),
            Outcome::Signalled(sig) => r.signalled(&mut sup, sig),
            Outcome::Remote(news) => r.remote(&mut sup, news),
        };
        // After any other end (a signal, another node's failure); said once.
        output::say_repeats();
        Ok(next)
    }

    /// Starts this node's ranks; when one cannot start, stops the others and tells the
    /// other nodes that the job ends.
    fn start(&self, round: u32) -> anyhow::Result<Supervisor> {
        let (plan, layout) = (self.plan, self.rdzv.layout);
        let omp = omp_threads_for(plan.nproc);
        let (tx, rx) = channel();
        let mut workers = Vec::with_capacity(plan.nproc);
        for local in 0..plan.nproc {
            if signals::received().is_some() {
                // Stopped while starting: the supervisor stops the ranks started so far.
                break;
            }
            let mut env = plan.worker_env(&layout, local, omp, round);
            env.extend(self.env.iter().cloned());
            let rank = layout.rank_offset + local;
            let log_dir = plan.log_dir.as_deref();
            let prefix = layout.world_size > 1;
            match spawn::spawn(self.program, rank, &env, prefix, log_dir, round, tx.clone()) {
                Ok(w) => workers.push(w),
                Err(e) => {
                    let mut sup = Supervisor::new(workers, rx, self.stop_code);
                    sup.stop_all(libc::SIGTERM, plan.grace, plan.grace);
                    let msg = format!("node {}: {e:#}", plan.node_rank);
                    self.rdzv.publish_failure(&msg, true);
                    return Err(e);
                }
            }
        }
        Ok(Supervisor::new(workers, rx, self.stop_code))
    }
}

/// One round's bookkeeping and reports.
struct Round<'a> {
    job: &'a Job<'a>,
    round: u32,
}

impl Round<'_> {
    fn plan(&self) -> &Plan {
        self.job.plan
    }

    /// " on node K" on a multi-node job.
    fn here(&self) -> String {
        if self.plan().nnodes > 1 {
            format!(" on node {}", self.plan().node_rank)
        } else {
            String::new()
        }
    }

    /// "restart K of N", for the round that would follow.
    fn next(&self) -> String {
        format!("restart {} of {}", self.round + 1, self.plan().max_restarts)
    }

    /// Why the group is not started again after a failure, or `None` to restart it.
    /// `cause` is a reason found by the caller (exit code 2, a rank that had stopped).
    fn why_not_restart(&self, cause: Option<&str>) -> Option<String> {
        if let Some((sig, _)) = signals::received() {
            return Some(format!("zrun received {}", signals::name(sig)));
        }
        if self.round >= self.plan().max_restarts {
            return Some("no restarts left".into());
        }
        if let Some(c) = cause {
            return Some(c.to_string());
        }
        self.job
            .rdzv
            .aborted()
            .map(|m| format!("another node ended the job: {m}"))
    }

    /// "; not restarted: WHY (restarts used: K of N)" when restarts were asked for.
    fn not_restarted(&self, why: &str) -> String {
        let n = self.plan().max_restarts;
        if n == 0 {
            return String::new();
        }
        format!(
            "; not restarted: {why} (restarts used: {} of {n})",
            self.round
        )
    }

    /// This node's ranks all ended with 0, or with 0 and 3 (`stopped`), without a signal to
    /// the launcher.
    fn finished(&self, stopped: bool) -> Next {
        let rdzv = self.job.rdzv;
        let left = self.round < self.plan().max_restarts;
        let how = if stopped { "stopped" } else { "ok" };
        let waited = rdzv.finish(how, left, None, signals::count());
        let msg = match waited {
            Waited::Done if stopped => {
                output::say(Level::Warn, &format!(
                    "the ranks{} stopped after saving a checkpoint (exit code 3); run the same command to resume",
                    self.here()
                ));
                return Next::Exit(STOPPED as u8);
            }
            Waited::Done => return Next::Exit(0),
            Waited::Failed(m) => {
                let cause = stopped.then_some("this node's ranks had stopped (exit code 3)");
                let why = self.why_not_restart(cause);
                if why.is_none() {
                    output::say(
                        Level::Error,
                        &format!("this node's ranks finished, but another node failed: {m}"),
                    );
                    output::say(
                        Level::Warn,
                        &format!("restarting the group ({})", self.next()),
                    );
                    return Next::Restart;
                }
                format!(
                    "{m}{}",
                    self.not_restarted(why.as_deref().unwrap_or_default())
                )
            }
            Waited::Ended(m) => m,
        };
        rdzv.publish_failure(
            &format!("node {} ended the job: {msg}", self.plan().node_rank),
            true,
        );
        output::say(
            Level::Error,
            &format!("this node's ranks finished, but the job failed: {msg}"),
        );
        Next::Exit(signals::received().map_or(1, |(sig, _)| signals::exit_code(sig)))
    }

    /// A local rank failed first: stop the others, report, and restart when allowed.
    fn failed(&self, sup: &mut Supervisor, rank: usize, status: ExitStatus) -> Next {
        let plan = self.plan();
        let stopped = sup.stop_all(libc::SIGTERM, plan.grace, plan.grace);
        sup.drain();
        let mut how = spawn::describe(&status);
        if let Some(hint) = spawn::sigkill_hint(&status) {
            how.push_str(&format!(" ({hint}"));
            // Training: the estimate says what a rank needs.
            if self.job.reports.is_some() {
                how.push_str(
                    "; zrun estimate predicts each rank's peak, zrun plan a config that fits",
                );
            }
            how.push(')');
        }
        let tail = sup
            .workers
            .iter()
            .find(|w| w.rank == rank)
            .map(|w| w.last_lines())
            .unwrap_or_default();
        // Exit code 4 is zrun's own out-of-memory (another program's 4 is any failure). The
        // first rank to end may be one that lost its peer to it: any rank's 4 decides.
        let out_of_memory = self.job.reports.is_some()
            && (status.code() == Some(OUT_OF_MEMORY) || !sup.exited_with(OUT_OF_MEMORY).is_empty());
        let code = match status.code() {
            Some(2) => 2,
            _ if out_of_memory => OUT_OF_MEMORY as u8,
            _ => 1,
        };
        let cause = if code == 2 {
            Some("exit code 2 means bad input, which a restart cannot fix")
        } else if code == OUT_OF_MEMORY as u8 {
            Some(
                "exit code 4 means out of memory, which a restart with the same config meets again",
            )
        } else if sup.saw_stop() {
            Some("another rank had stopped after saving a checkpoint (exit code 3)")
        } else {
            None
        };
        let why = self.why_not_restart(cause);
        let here = self.here();
        let first = if self.job.rdzv.layout.world_size > 1 {
            " first"
        } else {
            ""
        };
        let others = match stopped {
            0 => String::new(),
            1 => format!("; stopped the other rank{here}"),
            n => format!("; stopped the other {n} ranks{here}"),
        };
        let then = match &why {
            None => format!("; restarting the group ({})", self.next()),
            Some(w) => self.not_restarted(w),
        };
        let failed = format!("rank {rank}{here} failed{first}: {how}{others}{then}");
        // Before the failure, so that the failing rank's last lines stay the last ones.
        output::say_repeats();
        if self.job.rdzv.layout.world_size > 1 && !tail.is_empty() {
            match output::style().format {
                output::LogFormat::Human => {
                    output::say(Level::Error, &failed);
                    let last = format!("last {} lines of rank {rank}:", tail.len());
                    output::say_with(Level::Error, &last, &tail);
                }
                output::LogFormat::Json => output::say_with(Level::Error, &failed, &tail),
            }
        } else {
            output::say(Level::Error, &failed);
        }
        if code == OUT_OF_MEMORY as u8 {
            if let Some(text) = self
                .job
                .reports
                .as_deref()
                .and_then(|d| oom_report(d, rank, self.job.started))
            {
                let lines: Vec<String> = text.lines().map(str::to_string).collect();
                output::say_with(Level::Error, "out of memory:", &lines);
            }
        }
        if plan.nnodes > 1 {
            let mut msg = format!("rank {rank} on node {} failed first: {how}", plan.node_rank);
            for l in &tail {
                msg.push_str("\n    | ");
                msg.push_str(l);
            }
            self.job.rdzv.publish_failure(&msg, why.is_some());
        }
        match why {
            None => Next::Restart,
            Some(_) => Next::Exit(code),
        }
    }

    /// The launcher got `sig`: forward it, give the ranks the stop deadline (SIGTERM,
    /// SIGUSR1) or `--grace-s` (SIGINT, SIGHUP), and exit 3 when they all saved and stopped.
    fn signalled(&self, sup: &mut Supervisor, sig: i32) -> Next {
        let plan = self.plan();
        let wait = if signals::is_stop(sig) {
            self.job.stop_deadline
        } else {
            plan.grace
        };
        let seen = signals::count();
        // The ranks got the signal already: once one fails, the others cannot complete their
        // checkpoint, so they get a moment, not the whole deadline.
        let stopped = sup.stop_all(sig, wait, plan.grace.min(Duration::from_secs(1)));
        sup.drain();
        let name = signals::name(sig);
        let here = self.here();
        let mut report = format!("node {}'s zrun received {name}", plan.node_rank);
        if sup.stopped_cleanly() {
            // The other nodes' ranks stop at the same step; wait for them as long again.
            match self
                .job
                .rdzv
                .finish("stopped", true, Some(zrun_comm::deadline_in(wait)), seen)
            {
                Waited::Done => {
                    output::say(Level::Warn, &format!(
                        "received {name}; every rank saved a checkpoint and stopped; run the same command to resume"
                    ));
                    return Next::Exit(STOPPED as u8);
                }
                Waited::Failed(m) | Waited::Ended(m) => {
                    output::say(Level::Error, &format!(
                        "received {name}; the ranks{here} saved a checkpoint and stopped, but the job failed: {m}"
                    ));
                    report.push_str(&format!("; {m}"));
                }
            }
        } else {
            let ranks = match stopped {
                0 => String::new(),
                n => format!("; stopped {n} rank{}{here}", if n == 1 { "" } else { "s" }),
            };
            // A stop the ranks were to save a checkpoint for, cut short: say that nothing
            // was saved now and why, since a resume starts from an older step.
            let unsaved =
                "no checkpoint was saved for this stop; a resume starts from the last complete one";
            let cut = match sup.killed {
                _ if !(signals::is_stop(sig) && self.job.stop_code.is_some()) => String::new(),
                Some(Killed::TimeUp) => format!(
                    ": the ranks had not saved their checkpoint within {} s (checkpoint.signal_deadline_s) and were killed; {unsaved}; raise checkpoint.signal_deadline_s where a save takes longer",
                    wait.as_secs_f64()
                ),
                Some(Killed::SignalledAgain) => format!(
                    ": a further signal killed the ranks while they saved their checkpoint; {unsaved}"
                ),
                Some(Killed::AfterFailure) => format!(
                    ": a rank failed while the ranks saved their checkpoint; {unsaved}"
                ),
                None => String::new(),
            };
            output::say(Level::Warn, &format!("received {name}{ranks}{cut}"));
        }
        self.job.rdzv.publish_failure(&report, true);
        Next::Exit(signals::exit_code(sig))
    }

    /// Another node failed, or the store is gone: stop this node's ranks, restart when the
    /// failure allows it.
    fn remote(&self, sup: &mut Supervisor, news: Remote) -> Next {
        let plan = self.plan();
        let stopped = sup.stop_all(libc::SIGTERM, plan.grace, plan.grace);
        sup.drain();
        let ranks = format!("stopped {stopped} rank(s){}", self.here());
        let why = match news {
            Remote::Failed(msg) => {
                output::say(Level::Error, &format!("another node failed: {msg}"));
                let cause = sup
                    .saw_stop()
                    .then_some("a rank had stopped after saving a checkpoint (exit code 3)");
                match self.why_not_restart(cause) {
                    None => {
                        output::say(
                            Level::Warn,
                            &format!("{ranks}; restarting the group ({})", self.next()),
                        );
                        return Next::Restart;
                    }
                    Some(why) => {
                        output::say(
                            Level::Error,
                            &format!("{ranks}{}", self.not_restarted(&why)),
                        );
                        format!("node {} does not restart: {why}", plan.node_rank)
                    }
                }
            }
            Remote::NodeLost(msg) => {
                output::say(Level::Error, &format!("another node failed: {msg}"));
                output::say(Level::Error, &ranks);
                msg
            }
            Remote::StoreLost(e) => {
                output::say(
                    Level::Error,
                    &format!(
                        "lost node 0's rendezvous store at {}:{} (its zrun ended?): {e}",
                        plan.master_addr, self.job.rdzv.layout.master_port
                    ),
                );
                output::say(Level::Error, &ranks);
                return Next::Exit(1);
            }
        };
        self.job.rdzv.publish_failure(&why, true);
        Next::Exit(1)
    }
}
