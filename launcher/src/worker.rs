//! One rank: load the config, connect to the other ranks, train; or describe the plan.

use crate::launch::{output, LogFormat};
use anyhow::Result;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use zrun_comm::{Communicator, Topology};
use zrun_shard::{MemoryLedger, ShardLayout};
use zrun_train::config::{Capabilities, Config};
use zrun_train::trainer::{rank_device, Outcome, Run};

/// Trains this process as one rank. The topology comes from the environment (zrun's and
/// torchrun's variables, OpenMPI, PMI or Slurm); with none at all it is a world of one.
pub fn run(config: &Path, overrides: &[String]) -> Result<()> {
    let cfg = Config::load(config, overrides)?;
    let allocator = zrun_train::memory::set_allocator()?;
    let topo = Topology::from_env().map_err(BadInput::from)?;
    if let (0, Some(a)) = (topo.rank, allocator) {
        tracing::debug!("{a}");
    }
    // The device first, then the backend (the launcher checked this once already; under
    // mpirun or srun this is the first check).
    let dist = cfg.dist.resolve(Capabilities::detect())?;
    if topo.rank == 0 {
        if let Some(chosen) = dist.auto_choices(&cfg.dist) {
            tracing::info!("{chosen}");
        }
    }
    // This rank's GPU current on this thread before anything touches CUDA; a node with more
    // ranks than GPUs stops here, as bad input.
    rank_device(dist.device, &topo)?;
    let timeout = Duration::from_secs(cfg.dist.timeout_s);
    // One rank trains alone: its collectives are copies or nothing (an NCCL communicator of
    // one rank would still run a kernel per reduction: 1.4 ms of gpt2-medium's 54 ms step on
    // an H100, check p of 2026-11-27). `zrun bench comm` keeps NCCL at one rank.
    let comm: Arc<dyn Communicator> = if topo.world_size == 1 {
        Arc::from(zrun_comm::solo(dist.backend))
    } else {
        Arc::from(zrun_comm::init(&topo, dist.backend, timeout)?)
    };
    // From here a stop signal is a request to save and stop, not death. Before, while the
    // ranks meet (up to dist.timeout_s), there is nothing to save: SIGTERM ends the rank.
    zrun_train::stop::install()
        .map_err(|e| anyhow::anyhow!("installing the stop-signal handler: {e}"))?;
    let mut run = Run::new(&cfg, comm, &topo)?;
    let floor = run.loss_floor();
    let trained = run.train();
    if let Err(zrun_train::Error::OutOfMemory(o)) = &trained {
        // Without zrun's launcher to print the diagnosis once, each rank prints its own.
        if std::env::var_os("ZRUN_RUN_ID").is_none() {
            eprintln!("{}", o.report);
        }
    }
    let s = match trained? {
        Outcome::Finished(s) => s,
        Outcome::AlreadyDone { step, checkpoint } => {
            if topo.rank == 0 {
                let steps = cfg.train.steps;
                let at = if step == steps {
                    format!("step {step} = train.steps")
                } else {
                    format!("step {step}, past train.steps = {steps}")
                };
                show(&format!(
                    "final: nothing to train: {} is at {at}",
                    checkpoint.display()
                ));
            }
            return Ok(());
        }
    };
    // --quiet (or ZRUN_QUIET) leaves out the tables, not the final line.
    let quiet = output::style().quiet;
    if topo.rank == 0 && !quiet {
        show(&zrun_train::report::memory_table(&s.ranks));
        show(&zrun_train::report::time_table(&s.ranks));
    }
    if topo.rank == 0 {
        if !s.stragglers.is_empty() && !quiet {
            show(&format!(
                "stragglers: rank(s) {:?} are busy over 20% longer per step than the median rank (the others wait for them)",
                s.stragglers
            ));
        }
        // A chain of one successor per token has a floor of 0: no percentage of it.
        let gap = floor
            .map(|f| match f.abs() > 1e-12 {
                true => format!(" (floor {f:.4}, {:+.1}%)", 100.0 * (s.eval_loss - f) / f),
                false => " (floor 0)".to_string(),
            })
            .unwrap_or_default();
        show(&format!(
            "final: eval_loss {:.4}{gap}, train loss {:.4}, {:.0} tokens/s, {:.1} s, {} rank(s), peak rss {} MiB/rank, summary in {}",
            s.eval_loss,
            s.final_loss,
            s.tokens_per_s,
            s.wall_time_s,
            s.world_size,
            s.peak_rss_bytes.iter().max().copied().unwrap_or(0) >> 20,
            cfg.log.dir.join("summary.json").display()
        ));
    }
    Ok(())
}

/// Prints rank 0's report `text` on stdout: as it is, or each line as one JSON object with
/// `--log-format json` (under zrun's launcher the rank prints text and the launcher wraps it;
/// under mpirun, srun or torchrun this rank is the one that must).
fn show(text: &str) {
    match output::style().format {
        LogFormat::Human => println!("{text}"),
        LogFormat::Json => {
            for line in text.lines() {
                println!("{}", output::json_worker_line(0, false, line));
            }
        }
    }
}

/// Validates the config for `world_size` ranks and prints the parameter count, every rank's
/// unit shards and its model-state bytes (offloaded ones included), without allocating the
/// model; `zrun estimate` adds activations and buffers.
pub fn dry_run(config: &Path, overrides: &[String], world_size: usize, local: usize) -> Result<()> {
    let mut cfg = Config::load(config, overrides)?;
    cfg.check_global_batch(world_size)?;
    let g = cfg.resolve_shard_group(world_size.max(1), local.max(1))? as i64;
    let model = cfg.build_model()?;
    let units = model.units();
    let w = world_size.max(1) as i64;
    let mib = |b: i64| b as f64 / (1 << 20) as f64;
    let first = ShardLayout::new(units, 0, w);
    println!("parameters: {}", first.param_count());
    println!(
        "world size: {w}  stage: {}  precision: {}",
        cfg.zero.stage, cfg.zero.precision
    );
    if g < w {
        println!(
            "shard groups: {} of {g} ranks (ranks {}..{} and so on), each holding one copy of the model states",
            w / g,
            0,
            g - 1
        );
    }
    for r in 0..w {
        let l = ShardLayout::hybrid(units, r, w, g)?;
        let m = MemoryLedger::planned(&l, &zrun_train::memory::estimate_config(&cfg)?);
        println!(
            "rank {r}: model states {:.1} MiB (params {:.1}, grads {:.1}, master {:.1}, optimizer {:.1}, on the host {:.1})",
            mib(m.model_states()),
            mib(m.params),
            mib(m.grads),
            mib(m.master),
            mib(m.optimizer),
            mib(m.host)
        );
        for (u, at) in l.units.iter().zip(&l.shard_offsets) {
            let (start, len) = u.shard_range(l.rank);
            println!(
                "  unit {:<8} params {:>12}  padded {:>12}  owns [{start}, {}) at {at}",
                u.unit,
                u.numel,
                u.padded,
                start + len
            );
        }
    }
    Ok(())
}

/// A fault in what the user gave (environment, flags).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct BadInput(#[from] zrun_comm::Error);

/// How long a rank that stops because another failed waits before it exits.
pub const FOLLOW_DELAY: std::time::Duration = std::time::Duration::from_millis(1500);

/// Whether `e` says another rank failed and this one stops with it: a failure shared at a
/// point every rank passes together, or a collective that lost its peer, waited for it in
/// vain or was refused after such a loss.
pub fn follows(e: &anyhow::Error) -> bool {
    match e.downcast_ref::<zrun_train::Error>() {
        Some(zrun_train::Error::Follows { .. }) => true,
        Some(zrun_train::Error::Engine(zrun_shard::Error::Comm(c))) => c.blames_a_peer(),
        Some(_) => false,
        None => e
            .downcast_ref::<zrun_comm::Error>()
            .is_some_and(zrun_comm::Error::blames_a_peer),
    }
}

/// The exit code of a rank that ended with `e`: 3 when a stop signal ended it after a
/// checkpoint, 2 for bad input, else 1.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<zrun_train::Error>() {
        Some(t) => t.exit_code(),
        None if is_bad_input(e) => 2,
        None => 1,
    }
}

/// True for errors in what the user gave: exit code 2.
pub fn is_bad_input(e: &anyhow::Error) -> bool {
    e.downcast_ref::<zrun_train::Error>()
        .is_some_and(|e| e.is_bad_input())
        || e.downcast_ref::<zrun_train::config::ConfigError>()
            .is_some()
        || e.downcast_ref::<zrun_ckpt::Error>()
            .is_some_and(|e| e.is_bad_input())
        || e.downcast_ref::<zrun_models::Error>().is_some()
        || e.downcast_ref::<BadInput>().is_some()
        || e.downcast_ref::<zrun_comm::Error>()
            .is_some_and(zrun_comm::Error::is_bad_input)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost() -> zrun_comm::Error {
        zrun_comm::Error::PeerLost {
            rank: 0,
            op: "all_reduce",
            bytes: 8,
            peer: 1,
            detail: "receive: Connection reset by peer".into(),
        }
    }

    #[test]
    fn a_rank_that_lost_its_peer_lets_the_peer_be_named_first() {
        // As the trainer returns it: the engine's collective failed.
        let e = anyhow::Error::from(zrun_train::Error::Engine(zrun_shard::Error::Comm(lost())));
        assert!(follows(&e));
        assert!(follows(&anyhow::Error::from(lost()).context("step 7")));
        let timeout = zrun_comm::Error::Timeout {
            rank: 0,
            op: "reduce_scatter",
            bytes: 8,
            peer: "1".into(),
            timeout: Duration::from_secs(1),
        };
        assert!(follows(&anyhow::Error::from(timeout)));
        // A fault of this rank's own is named as its own.
        let own = zrun_comm::Error::InvalidArgument {
            rank: 0,
            op: "all_reduce",
            detail: "wrong dtype".into(),
        };
        let own = zrun_train::Error::Engine(zrun_shard::Error::Comm(own));
        assert!(!follows(&anyhow::Error::from(own)));
        assert!(!follows(&anyhow::anyhow!("data file gone")));
    }
}
