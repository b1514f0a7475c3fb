//! Starting and supervising the ranks of a job on this node (torchrun's job for zrun).
//!
//! Node 0's launcher hosts the rendezvous store; each node starts `--nproc` workers with
//! torchrun's variables, copies their output with a `[rank R]` prefix, and stops them all
//! (SIGTERM, grace, SIGKILL) when one fails, when the launcher gets SIGINT/SIGTERM/SIGHUP, or
//! when another node reports a failure through the store. Workers die with the launcher
//! (parent-death signal), so none outlives it.

mod plan;
mod rendezvous;
mod signals;
mod spawn;
mod supervise;

use std::path::PathBuf;
use std::sync::mpsc::channel;

use anyhow::Context;

pub use plan::Plan;
pub use spawn::Program;

use rendezvous::{Remote, Rendezvous};
use supervise::{Outcome, Supervisor};

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
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub grace_s: f64,
    /// The job's id, given to workers as ZRUN_RUN_ID [default: generated on one node;
    /// MASTER_ADDR-MASTER_PORT with several].
    #[arg(long, value_name = "ID")]
    pub run_id: Option<String>,
    /// Seconds the nodes of a multi-node job wait for each other to start.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    pub rdzv_timeout_s: u64,
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

/// Runs `program` as this node's ranks and supervises them; returns the exit code.
pub fn run(flags: &LaunchFlags, program: &Program) -> anyhow::Result<u8> {
    let plan = Plan::new(flags)?;
    signals::install().context("installing the SIGINT/SIGTERM handler")?;
    let mut rdzv = if plan.nnodes == 1 {
        Rendezvous::single(&plan)?
    } else {
        Rendezvous::join(&plan)?
    };
    let layout = rdzv.layout;
    let omp = plan::omp_threads_for(plan.nproc);
    let prefix = layout.world_size > 1;
    let (tx, rx) = channel();
    let mut workers = Vec::with_capacity(plan.nproc);
    for local in 0..plan.nproc {
        let env = plan.worker_env(&layout, local, omp);
        let rank = layout.rank_offset + local;
        match spawn::spawn(
            program,
            rank,
            &env,
            prefix,
            plan.log_dir.as_deref(),
            tx.clone(),
        ) {
            Ok(w) => workers.push(w),
            Err(e) => {
                let mut sup = Supervisor::new(workers, rx, plan.grace);
                sup.stop_all(libc::SIGTERM);
                rdzv.publish_failure(&format!("node {}: {e:#}", plan.node_rank));
                return Err(e);
            }
        }
    }
    drop(tx);
    let mut sup = Supervisor::new(workers, rx, plan.grace);
    let outcome = sup.watch(rdzv.remote.as_ref());
    let first_signal = match outcome {
        Outcome::Signalled(sig) => sig,
        _ => libc::SIGTERM,
    };
    let stopped = sup.stop_all(first_signal);
    sup.drain();
    let here = if plan.nnodes > 1 {
        format!(" on node {}", plan.node_rank)
    } else {
        String::new()
    };
    let others = |n: usize| match n {
        0 => String::new(),
        1 => format!("; stopped the other rank{here}"),
        n => format!("; stopped the other {n} ranks{here}"),
    };
    let code = match outcome {
        Outcome::Success => match rdzv.finish() {
            Ok(()) => 0,
            Err(msg) => {
                eprintln!("zrun: this node's ranks finished, but the job failed: {msg}");
                1
            }
        },
        Outcome::Failed { rank, status } => {
            let how = spawn::describe(&status);
            let w = sup.workers.iter().find(|w| w.rank == rank);
            let tail = w.map(|w| w.last_lines()).unwrap_or_default();
            let first = if layout.world_size > 1 { " first" } else { "" };
            eprintln!(
                "zrun: rank {rank}{here} failed{first}: {how}{}",
                others(stopped)
            );
            if layout.world_size > 1 && !tail.is_empty() {
                eprintln!("zrun: last {} lines of rank {rank}:", tail.len());
                for l in &tail {
                    eprintln!("    | {l}");
                }
            }
            if plan.nnodes > 1 {
                let mut msg = format!("rank {rank} on node {} failed first: {how}", plan.node_rank);
                for l in &tail {
                    msg.push_str("\n    | ");
                    msg.push_str(l);
                }
                rdzv.publish_failure(&msg);
            }
            if status.code() == Some(2) {
                2
            } else {
                1
            }
        }
        Outcome::Signalled(sig) => {
            eprintln!(
                "zrun: received {}{}",
                signals::name(sig),
                match stopped {
                    0 => String::new(),
                    n => format!("; stopped {n} rank{}{here}", if n == 1 { "" } else { "s" }),
                }
            );
            rdzv.publish_failure(&format!(
                "node {}'s zrun received {}",
                plan.node_rank,
                signals::name(sig)
            ));
            u8::try_from(128 + sig).unwrap_or(1)
        }
        Outcome::Remote(news) => {
            match news {
                Remote::Failed(msg) => eprintln!("zrun: another node failed: {msg}"),
                Remote::StoreLost(e) => eprintln!(
                    "zrun: lost node 0's rendezvous store at {}:{} (its zrun ended?): {e}",
                    plan.master_addr, layout.master_port
                ),
            }
            eprintln!("zrun: stopped {stopped} rank(s){here}");
            1
        }
    };
    rdzv.close();
    Ok(code)
}
