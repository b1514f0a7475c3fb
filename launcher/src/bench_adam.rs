//! `zrun bench adam`: throughput of the CPU AdamW of optimizer offload.
//!
//!     zrun bench adam                                   # 10M and 50M params, 1 and 2 threads
//!     zrun bench adam --params 50M --threads 2 --state-dtype bf16 --json
//!
//! Each row times whole steps (begin_step + one update over the shard, writing the bf16
//! parameter copy unless `--half none`) and reports the best of `--iters` in Gparam/s.
//! Bytes moved per element: 16 read + 12 written (+2 for the copy) with fp32 state,
//! 12 read + 8 written (+2) with bf16 state.

use std::time::Instant;

use crate::bench::parse_counts;
use zrun_optim::{AdamWConfig, CpuAdamW, HalfKind, StateDtype};

/// Flags of `zrun bench adam`.
#[derive(clap::Args, Debug, Clone)]
pub struct AdamArgs {
    /// Shard sizes in elements, comma-separated; K, M, G are powers of 10 (50M = 5e7).
    #[arg(long, default_value = "10M,50M")]
    pub params: String,
    /// Thread counts, comma-separated.
    #[arg(long, default_value = "1,2")]
    pub threads: String,
    /// Storage type of m and v: fp32 or bf16.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub state_dtype: String,
    /// Compute-dtype copy written with the update: bf16, fp16 or none.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "fp16", "none"])]
    pub half: String,
    /// Timed steps per row (the best is reported).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `zrun bench adam`.
pub fn run_adam(args: &AdamArgs) -> anyhow::Result<()> {
    let sizes = parse_counts(&args.params, "--params", 1000.0)?;
    let threads = parse_counts(&args.threads, "--threads", 1000.0)?;
    let state: StateDtype = args
        .state_dtype
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))?;
    let kind = match args.half.as_str() {
        "bf16" => Some(HalfKind::Bf16),
        "fp16" => Some(HalfKind::Fp16),
        _ => None,
    };
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    if !args.json {
        println!(
            "{:>12} {:>8} {:>12} {:>6} {:>10} {:>14}",
            "params", "threads", "state_dtype", "half", "best_ms", "gparams_per_s"
        );
    }
    for &n in &sizes {
        // Values away from zero and denormals; contents do not change the work done.
        let mut params: Vec<f32> = (0..n).map(|i| ((i % 1013) as f32 - 506.0) * 1e-3).collect();
        let grads: Vec<f32> = (0..n).map(|i| ((i % 997) as f32 - 498.0) * 1e-4).collect();
        let mut half = vec![0u16; if kind.is_some() { n } else { 0 }];
        for &t in &threads {
            let mut opt = CpuAdamW::new(n, cfg, vec![(0, n / 2)], state, t)?;
            let mut best = f64::INFINITY;
            // One untimed step touches every page of the state first.
            for i in 0..args.iters + 1 {
                let h = kind.map(|k| (&mut half[..], k));
                let start = Instant::now();
                opt.begin_step();
                opt.update(0, &mut params, &grads, 1e-4, 1.0, h)?;
                let dt = start.elapsed().as_secs_f64();
                if i > 0 {
                    best = best.min(dt);
                }
            }
            let gps = n as f64 / best / 1e9;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "params": n, "threads": t, "state_dtype": state.to_string(),
                        "half": args.half, "best_s": best, "gparams_per_s": gps,
                    })
                );
            } else {
                println!(
                    "{:>12} {:>8} {:>12} {:>6} {:>10.2} {:>14.3}",
                    n,
                    t,
                    state,
                    args.half,
                    best * 1e3,
                    gps
                );
            }
        }
    }
    Ok(())
}
