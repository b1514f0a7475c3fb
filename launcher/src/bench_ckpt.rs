//! `zrun bench ckpt`: checkpoint save and load bandwidth beside a plain sequential write and
//! read of the same bytes on the same disk, and the time training is blocked per save,
//! synchronous and asynchronous.
//!
//!     zrun bench ckpt                                  # gpt2-medium, stage 3, 2 ranks, ./runs/bench-ckpt
//!     zrun bench ckpt --model gpt2-small --dir /scratch/x --rounds 3
//!
//! Every rank holds the real engine state of the model (fp32 master, AdamW m and v) and
//! writes, in interleaved rounds: a plain file of its checkpoint file's size (64 MiB writes,
//! fsync), a checkpoint (hashing, fsync, the manifest commit), then reads the plain file and
//! loads the checkpoint (mapping, hash verification, copying into the engine). Each file is
//! evicted from the page cache (`posix_fadvise(DONTNEED)`) after it is written, so reads come
//! from the disk on both sides. A row's time is the slowest rank's; GB/s counts all ranks'
//! bytes.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use zrun_comm::{Backend, Communicator, ReduceOp, Topology};
use zrun_train::checkpoint::Position;
use zrun_train::config::{Config, DeviceChoice};
use zrun_train::trainer::Run;

use crate::bench::{launch_local, WORKER_ENV};

/// Flags of `zrun bench ckpt`.
#[derive(clap::Args, Debug, Clone)]
pub struct CkptArgs {
    /// Ranks to start on this host.
    #[arg(long, default_value_t = 2, value_parser = crate::bench::ranks())]
    pub nproc: usize,
    /// Model preset whose state is saved.
    #[arg(long, default_value = "gpt2-medium")]
    pub model: String,
    /// ZeRO stage of the engine (its state per rank is the same at stages 1-3).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i64).range(0..=3))]
    pub stage: i64,
    /// Directory for the files (on the disk to measure); removed afterwards.
    #[arg(long, default_value = "runs/bench-ckpt")]
    pub dir: PathBuf,
    /// Interleaved rounds; the best of each row is reported.
    #[arg(long, default_value_t = 3, value_parser = crate::bench::at_least_one::<usize>)]
    pub rounds: usize,
}

/// Runs `zrun bench ckpt`.
pub fn run_ckpt(args: &CkptArgs) -> anyhow::Result<()> {
    let topo = Topology::from_env().context("reading the rank variables")?;
    let is_rank = std::env::var(WORKER_ENV).is_ok() || topo.world_size > 1;
    if is_rank {
        return bench_rank(args, &topo);
    }
    // The directory is the benchmark's own: a fresh one, removed afterwards.
    let _ = std::fs::remove_dir_all(&args.dir);
    let result = if args.nproc > 1 {
        launch_local(args.nproc)
    } else {
        bench_rank(args, &topo)
    };
    let _ = std::fs::remove_dir_all(&args.dir);
    result
}

/// Drops `path`'s pages from the page cache (after an fsync), so the next read is from disk.
fn evict(path: &Path) -> anyhow::Result<()> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.sync_all()?;
    // SAFETY: the fd is valid for the call; posix_fadvise only changes caching.
    unsafe {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    Ok(())
}

/// Writes `bytes` to `path` in 64 MiB writes from one buffer, then fsyncs.
fn plain_write(path: &Path, bytes: u64, buf: &[u8]) -> anyhow::Result<()> {
    let mut f = std::fs::File::create(path)?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(())
}

/// Reads `path` to its end in 64 MiB reads.
fn plain_read(path: &Path, buf: &mut [u8]) -> anyhow::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let mut total = 0;
    loop {
        let n = f.read(buf)?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

/// The median of `v` (the mean of the middle two for an even count).
fn median_of(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The slowest rank's seconds for `op`, timed between barriers.
fn timed(
    comm: &Arc<dyn Communicator>,
    op: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    comm.barrier()?.wait()?;
    let t = Instant::now();
    op()?;
    let mine = t.elapsed().as_secs_f64();
    let w = comm.world_size();
    let mut all = vec![0f32; w];
    all[comm.rank()] = mine as f32;
    let t = tch::Tensor::from_slice(&all);
    comm.all_reduce(&t, ReduceOp::Sum)?.wait()?;
    let all = Vec::<f32>::try_from(&t)?;
    Ok(all.iter().fold(0f32, |a, &b| a.max(b)) as f64)
}

fn bench_rank(args: &CkptArgs, topo: &Topology) -> anyhow::Result<()> {
    let comm: Arc<dyn Communicator> = Arc::from(zrun_comm::init(
        topo,
        Backend::Tcp,
        Duration::from_secs(600),
    )?);
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut cfg = Config::default();
    cfg.model.preset = Some(args.model.clone());
    cfg.zero.stage = zrun_shard::Stage::from_number(args.stage)
        .ok_or_else(|| anyhow::anyhow!("--stage {}: give 0, 1, 2 or 3", args.stage))?;
    cfg.dist.device = DeviceChoice::Cpu;
    cfg.train.micro_batch = 1;
    cfg.log.dir = args.dir.join("log");
    cfg.checkpoint.dir = Some(args.dir.join("ckpt"));
    cfg.checkpoint.keep = 1;
    // Asynchronous saves take their host buffer when the run starts.
    cfg.checkpoint.async_save = true;
    cfg.checkpoint.every = 1;
    cfg.arch()?;
    let mut run = Run::new(&cfg, comm.clone(), topo)?;
    let params = run.engine().layout().param_count();
    let plain_dir = args.dir.join("plain");
    std::fs::create_dir_all(&plain_dir)?;
    let plain = plain_dir.join(format!("rank-{rank}.bin"));
    let mut buf = vec![1u8; 64 << 20];
    let ckpt_dir = args.dir.join("ckpt");
    let mut rows: Vec<(&str, Vec<f64>)> = ["plain write", "ckpt save", "plain read", "ckpt load"]
        .iter()
        .map(|n| (*n, Vec::new()))
        .collect();
    let (mut blocked_sync, mut blocked_async, mut async_total) =
        (Vec::new(), Vec::new(), Vec::new());
    let mut file_bytes = 0u64;
    let mut step = 0;
    for round in 0..args.rounds {
        step += 1;
        let pos = Position {
            step,
            next_sample: step,
            lr: 0.0,
        };
        let mine = zrun_ckpt::step_dir(&ckpt_dir, step).join(zrun_ckpt::rank_file_name(rank));
        // The checkpoint first in round 0, to learn its size for the plain file.
        let save = timed(&comm, || run.save(&pos).map(drop).map_err(Into::into))?;
        // Old checkpoints are deleted in the background: not while the next row runs.
        run.flush_saves()?;
        rows[1].1.push(save);
        blocked_sync.push(save);
        file_bytes = std::fs::metadata(&mine)?.len();
        evict(&mine)?;
        let write = timed(&comm, || plain_write(&plain, file_bytes, &buf))?;
        rows[0].1.push(write);
        evict(&plain)?;
        let read = timed(&comm, || plain_read(&plain, &mut buf).map(drop))?;
        rows[2].1.push(read);
        // Written afresh each round, as checkpoints are (not over an old file).
        std::fs::remove_file(&plain)?;
        let load = timed(&comm, || {
            let r = run.restore()?;
            anyhow::ensure!(
                r.is_some_and(|r| r.step == step),
                "the load found no checkpoint"
            );
            Ok(())
        })?;
        rows[3].1.push(load);
        // Asynchronous: blocked while the snapshot is taken, then written in the background.
        step += 1;
        let pos = Position { step, ..pos };
        let t = Instant::now();
        let blocked = timed(&comm, || run.save_async(&pos).map_err(Into::into))?;
        run.flush_saves()?;
        blocked_async.push(blocked);
        async_total.push(t.elapsed().as_secs_f64());
        if rank == 0 {
            eprintln!("round {} of {} done", round + 1, args.rounds);
        }
    }
    if rank != 0 {
        return Ok(());
    }
    let total = file_bytes as f64 * world as f64;
    let best = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "zrun bench ckpt: {} ({:.1}M params), stage {}, {world} rank(s), {:.2} GB per checkpoint ({:.2} GB per rank), in {}",
        args.model,
        params as f64 / 1e6,
        args.stage,
        total / 1e9,
        file_bytes as f64 / 1e9,
        args.dir.display()
    );
    // The disk's speed drifts between rounds: each checkpoint row is compared with the plain
    // row of its own round, and the median of those ratios is the figure.
    println!(
        "{:<12} {:>9} {:>8} {:>13}   every round: s (vs plain)",
        "op", "best s", "GB/s", "median ratio"
    );
    for (i, (name, times)) in rows.iter().enumerate() {
        let t = best(times);
        let (median, rounds) = if i % 2 == 1 {
            let ratios: Vec<f64> = rows[i - 1]
                .1
                .iter()
                .zip(times)
                .map(|(p, c)| p / c)
                .collect();
            let shown = times
                .iter()
                .zip(&ratios)
                .map(|(t, r)| format!("{t:.2} ({r:.2}x)"))
                .collect::<Vec<_>>();
            (format!("{:.2}x", median_of(&ratios)), shown)
        } else {
            (
                "-".into(),
                times.iter().map(|t| format!("{t:.2}")).collect(),
            )
        };
        println!(
            "{name:<12} {t:>9.3} {:>8.2} {median:>13}   {}",
            total / t / 1e9,
            rounds.join(" ")
        );
    }
    let (bs, ba) = (best(&blocked_sync), best(&blocked_async));
    let all: Vec<String> = blocked_async.iter().map(|t| format!("{t:.2}")).collect();
    println!(
        "training blocked per save: synchronous {bs:.3} s, asynchronous {ba:.3} s ({:.0}% of synchronous; every round: {}); the background write took {:.3} s; extra host memory {:.2} GB per rank, taken when the run starts",
        100.0 * ba / bs,
        all.join(" "),
        best(&async_total),
        file_bytes as f64 / 1e9
    );
    Ok(())
}
