//! One rank: load the config, build the run, train (or describe it with --dry-run).

use anyhow::Result;
use std::path::Path;
use zrun_train::config::Config;
use zrun_train::trainer::{RankInfo, Run};

/// Loads `config` with `overrides` and trains this rank (or prints the plan for a dry run).
pub fn run(config: &Path, overrides: &[String], dry_run: bool) -> Result<()> {
    let cfg = Config::load(config, overrides)?;
    let run = Run::new(&cfg, RankInfo::single())?;
    if dry_run {
        describe(&run);
        return Ok(());
    }
    let floor = run.loss_floor();
    let s = run.train()?;
    let gap = floor
        .map(|f| format!(" (floor {f:.4}, {:+.1}%)", 100.0 * (s.eval_loss - f) / f))
        .unwrap_or_default();
    println!(
        "final: eval_loss {:.4}{gap}, train loss {:.4}, {:.0} tokens/s, {:.1} s, peak rss {} MiB, summary in {}",
        s.eval_loss,
        s.final_loss,
        s.tokens_per_s,
        s.wall_time_s,
        s.peak_rss_bytes.iter().max().copied().unwrap_or(0) >> 20,
        cfg.log.dir.join("summary.json").display()
    );
    Ok(())
}

/// Prints the parameter count, every unit's layout and the engine's bytes.
fn describe(run: &Run) {
    let e = run.engine();
    let l = e.layout();
    println!("parameters: {}", l.param_count());
    println!(
        "world size: {}  stage: {}  precision: {}",
        l.world_size,
        e.config().stage,
        e.config().precision
    );
    for (u, at) in l.units.iter().zip(&l.shard_offsets) {
        let (start, len) = u.shard_range(l.rank);
        println!(
            "  unit {:<8} params {:>12}  padded {:>12}  rank {} owns [{start}, {}) at {at}",
            u.unit,
            u.numel,
            u.padded,
            l.rank,
            start + len
        );
    }
    let m = e.memory();
    let mib = |b: i64| b as f64 / (1 << 20) as f64;
    println!(
        "rank {} model states {:.1} MiB (params {:.1}, grads {:.1}, master {:.1}, optimizer {:.1}), buffers {:.1} MiB",
        l.rank,
        mib(m.model_states()),
        mib(m.params),
        mib(m.grads),
        mib(m.master),
        mib(m.optimizer),
        mib(m.buffers)
    );
}

/// True for errors in what the user gave: exit code 2.
pub fn is_bad_input(e: &anyhow::Error) -> bool {
    e.downcast_ref::<zrun_train::Error>()
        .is_some_and(|e| e.is_bad_input())
        || e.downcast_ref::<zrun_train::config::ConfigError>()
            .is_some()
}
