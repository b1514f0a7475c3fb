//! Starting and supervising the ranks of a job on this node (torchrun's job for zrun).
//!
//! Node 0's launcher hosts the rendezvous store; each node starts `--nproc` workers with
//! torchrun's variables, copies their output with a `[rank R]` prefix, and stops them all
//! (SIGTERM, grace, SIGKILL) when one fails, when the launcher gets SIGINT/SIGHUP, or when
//! another node reports a failure through the store; with `--max-restarts N` every node then
//! starts its workers again, together. SIGTERM and SIGUSR1 are forwarded as they are and the
//! workers get the stop deadline to save a checkpoint and exit 3. Workers die with the
//! launcher (parent-death signal), so none outlives it.
//!
//! Every line goes through [`output`]: human or JSON (`--log-format`), `--quiet`, and above
//! rank 0's live progress line ([`progress`]) when node 0's launcher draws one on a terminal.

pub mod output;
mod plan;
mod progress;
mod rendezvous;
mod round;
pub mod signals;
pub(crate) mod spawn;
mod supervise;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

pub use output::{Level, LogFormat, Style};
pub use plan::{check_world, Plan, MAX_NPROC, MAX_WORLD};
pub use progress::Source;
pub use spawn::Program;

use rendezvous::Rendezvous;
use round::{Job, Next};

/// A mistake in what the user gave (flags, layout, addresses): exit code 2, one line.
#[derive(Debug)]
pub struct BadInput(pub String);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

/// The launcher's flags (shared by training and `zrun exec`).
#[derive(clap::Args, Debug, Clone)]
pub struct LaunchFlags {
    /// Workers to start on this node [default: the number of visible GPUs, or 1].
    #[arg(long, alias = "nproc-per-node", value_name = "N")]
    pub nproc: Option<usize>,
    /// Nodes in the job; start one zrun on each [default: 1].
    #[arg(long, value_name = "M")]
    pub nnodes: Option<usize>,
    /// This node's index, 0..M [default: 0].
    #[arg(long, value_name = "K")]
    pub node_rank: Option<usize>,
    /// Node 0's host name or IP, where the rendezvous store listens
    /// [default: 127.0.0.1 on one node; required with --nnodes > 1].
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// The store's port [default: a free port on one node; 29500 with --nnodes > 1].
    #[arg(long, value_name = "P")]
    pub master_port: Option<u16>,
    /// Also write each rank's output to DIR/rank-R.log.
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping workers (and, for `zrun exec`,
    /// between a forwarded SIGTERM/SIGUSR1 and SIGKILL); at most 31536000 (a year).
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub grace_s: f64,
    /// The job's id, given to workers as ZRUN_RUN_ID [default: generated on one node;
    /// MASTER_ADDR-MASTER_PORT with several].
    #[arg(long, value_name = "ID")]
    pub run_id: Option<String>,
    /// Seconds the nodes of a multi-node job wait for each other to start (and to restart);
    /// at most 31536000 (a year).
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    pub rdzv_timeout_s: u64,
    /// Start every worker again (on every node) when one fails, up to N times; never after
    /// a worker exits 2 (bad input) or zrun gets a signal. Give every node the same N.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_restarts: u32,
    /// Print only warnings, errors and the final line (the ranks get ZRUN_QUIET=1).
    #[arg(long, short)]
    pub quiet: bool,
    /// How every line is printed; the ranks get ZRUN_LOG_FORMAT [default: human, or
    /// ZRUN_LOG_FORMAT].
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
}

impl LaunchFlags {
    /// True when the user asked for a launcher layout explicitly.
    pub fn any_layout_flag(&self) -> bool {
        self.nproc.is_some()
            || self.nnodes.is_some()
            || self.node_rank.is_some()
            || self.master_addr.is_some()
            || self.master_port.is_some()
    }

    /// Ranks in the whole job when every node runs `--nproc` (for a dry run).
    pub fn world_size(&self) -> Result<usize, BadInput> {
        let p = Plan::new(self)?;
        Ok(p.nproc * p.nnodes)
    }
}

/// How this launch treats its workers beyond the flags.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Time between forwarding SIGTERM or SIGUSR1 to the workers and SIGKILL, for them to
    /// save a checkpoint (training: `checkpoint.signal_deadline_s`); `None`: `--grace-s`.
    pub stop_deadline: Option<Duration>,
    /// The workers follow the trainer's stop convention: on SIGTERM/SIGUSR1 (to zrun or to
    /// any rank) they save a checkpoint and exit 3, a stop rather than a failure. `false`
    /// (`zrun exec`): 3 is an exit code like any other.
    pub checkpoint_stops: bool,
    /// Variables every rank gets unless the launcher's environment already sets them.
    pub env: Vec<(String, String)>,
    /// Training: the directory where a rank that ran out of memory (exit code 4) wrote its
    /// diagnosis (`oom-rank-N.txt`), printed once by the launcher.
    pub reports: Option<std::path::PathBuf>,
    /// Training: rank 0's metrics, for the live progress line that node 0's launcher draws
    /// when stderr is a terminal (human format, not `--quiet`).
    pub progress: Option<Source>,
}

/// Runs `program` as this node's ranks and supervises them, restarting the group up to
/// `--max-restarts` times; returns the exit code.
pub fn run(flags: &LaunchFlags, program: &Program, opts: &Options) -> anyhow::Result<u8> {
    let mut plan = Plan::new(flags)?;
    // A second back: file times may be coarser than the clock.
    let started = std::time::SystemTime::now() - Duration::from_secs(1);
    signals::install().context("installing the SIGINT/SIGTERM/SIGHUP/SIGUSR1 handler")?;
    let joined = if plan.nnodes == 1 {
        Rendezvous::single(&plan)
    } else {
        Rendezvous::join(&plan)
    };
    let mut rdzv = match (joined, signals::received()) {
        (Ok(r), _) => r,
        // Stopped while meeting the other nodes: no rank started, the exit code is the
        // signal's, as for a signal once the ranks run.
        (Err(e), Some((sig, _))) => {
            output::say(Level::Warn, &format!("{e:#}"));
            return Ok(signals::exit_code(sig));
        }
        (Err(e), None) => return Err(e),
    };
    // A made-up multi-node run id (`addr-port`) is the same for every job on that address:
    // node 0's word makes it this job's own, on every node and across its restarts (the
    // token was derived from it before, which every node did alike).
    if let (false, Some(word)) = (plan.run_id_given, &rdzv.instance) {
        plan.run_id = format!("{}-{word}", plan.run_id);
    }
    let style = output::style();
    let mut env = style.worker_env();
    for (k, v) in &opts.env {
        if std::env::var_os(k).is_none() {
            env.push((k.clone(), v.clone()));
        }
    }
    // Only node 0 hosts rank 0, whose metrics the line shows; it clears itself when dropped.
    let draw = opts.progress.clone().filter(|_| {
        plan.node_rank == 0
            && style == Style::default()
            && std::io::IsTerminal::is_terminal(&std::io::stderr())
    });
    let progress = match draw {
        Some(src) => Some(progress::Progress::start(src).context("starting the progress line")?),
        None => None,
    };
    if progress.is_some() {
        env.push((output::PROGRESS_ENV.to_string(), "launcher".to_string()));
    }
    let job = Job {
        plan: &plan,
        program,
        rdzv: &rdzv,
        stop_deadline: opts.stop_deadline.unwrap_or(plan.grace),
        stop_code: opts.checkpoint_stops.then_some(supervise::STOPPED),
        env,
        reports: opts.reports.clone(),
        started,
    };
    let mut round = 0;
    let code = loop {
        match job.round(round)? {
            Next::Exit(code) => break code,
            Next::Restart => {}
        }
        // Every node meets before any starts again (nothing to wait for on one node).
        if let Err(msg) = rdzv.ready(round + 1, zrun_comm::deadline_in(plan.rdzv_timeout)) {
            output::say(Level::Error, &format!("not restarting: {msg}"));
            rdzv.publish_failure(
                &format!("node {} did not restart: {msg}", plan.node_rank),
                true,
            );
            break signals::received().map_or(1, |(sig, _)| signals::exit_code(sig));
        }
        round += 1;
        if let Some((sig, _)) = signals::received() {
            // Published as round `round`'s failure: the others watch that key now.
            rdzv.set_round(round);
            output::say(
                Level::Warn,
                &format!("received {}; not restarting", signals::name(sig)),
            );
            rdzv.publish_failure(
                &format!(
                    "node {}'s zrun received {}",
                    plan.node_rank,
                    signals::name(sig)
                ),
                true,
            );
            break signals::exit_code(sig);
        }
    };
    if let Some(p) = progress {
        p.finish();
    }
    rdzv.close();
    Ok(code)
}
