//! `zrun bench adam`: throughput of the CPU AdamW of optimizer offload.
//!
//!     zrun bench adam                                   # 10M and 50M params, 1 and 2 threads
//!     zrun bench adam --params 50M --threads 2 --state-dtype bf16 --json
//!     zrun bench adam --grads fp32,bf16                 # both gradient dtypes, interleaved
//!     zrun bench adam --predict                         # and the split delayed update's job
//!
//! Each row times whole steps (begin_step + one update over the shard, writing the bf16
//! parameter copy unless `--half none`) and reports the best of `--iters` in Gparam/s.
//! Bytes moved per element: 16 read + 12 written (+2 for the copy) with fp32 state,
//! 12 read + 8 written (+2) with bf16 state; 2 fewer read with bf16 gradients (the host
//! gradients of a bf16 rank alone, docs/memory.md). With several gradient dtypes each
//! timed step runs every one in turn, on the same values. With `--predict` each also runs
//! the job of a split delayed update (`zero.offload_delay_fresh`): the update writing the
//! next update's base (bf16 unless `--half fp16`) and v (bf16) instead of the copy, 2 bytes
//! more written an element.

use std::time::Instant;

use crate::bench::parse_counts;
use crate::launch::BadInput;
use zrun_optim::{AdamWConfig, BaseOut, Bf16, CpuAdamW, Grad, HalfKind, Prediction, StateDtype};

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
    /// Gradient dtypes, comma-separated: fp32, bf16 (the values are bf16 either way).
    #[arg(long, default_value = "fp32")]
    pub grads: String,
    /// Timed steps per row (the best is reported).
    #[arg(long, default_value_t = 10, value_parser = crate::bench::at_least_one::<usize>)]
    pub iters: usize,
    /// Also time the split delayed update's job (the update with the next update's base and
    /// v), interleaved with the plain update.
    #[arg(long)]
    pub predict: bool,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `zrun bench adam`.
pub fn run_adam(args: &AdamArgs) -> anyhow::Result<()> {
    let sizes = parse_counts(&args.params, "--params", 1000.0)?;
    // Each parameter takes at least 16 bytes of buffers here (the fp32 parameters, the fp32
    // and bf16 gradients, the base and the state): a size past the machine's memory is
    // refused, where its allocation would abort the process.
    let memory = zrun_train::memory::host_memory() as u128;
    if let Some(&n) = sizes
        .iter()
        .max()
        .filter(|&&n| memory > 0 && n as u128 * 16 > memory)
    {
        return Err(BadInput(format!(
            "--params {}: {n} parameters need at least {:.1} GiB of buffers, more than this machine's {:.1} GiB; give a smaller --params",
            args.params,
            (n as f64 * 16.0) / f64::from(1u32 << 30),
            memory as f64 / f64::from(1u32 << 30)
        ))
        .into());
    }
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
    let sides: Vec<bool> = args
        .grads
        .split(',')
        .map(|g| match g.trim() {
            "fp32" => Ok(false),
            "bf16" => Ok(true),
            other => Err(BadInput(format!("--grads: `{other}` is not fp32 or bf16")).into()),
        })
        .collect::<anyhow::Result<_>>()?;
    // (bf16 gradients, the split's job) of every row, interleaved.
    let sides: Vec<(bool, bool)> = sides
        .into_iter()
        .flat_map(|g| [(g, false), (g, true)])
        .filter(|&(_, p)| !p || args.predict)
        .collect();
    if !args.json {
        println!(
            "{:>12} {:>8} {:>12} {:>6} {:>6} {:>8} {:>10} {:>14}",
            "params", "threads", "state_dtype", "half", "grads", "job", "best_ms", "gparams_per_s"
        );
    }
    for &n in &sizes {
        // Values away from zero and denormals; contents do not change the work done. The
        // gradients are bf16 values, so both dtypes hold the same ones.
        let mut params: Vec<f32> = (0..n).map(|i| ((i % 1013) as f32 - 506.0) * 1e-3).collect();
        let g16: Vec<Bf16> = (0..n)
            .map(|i| {
                Bf16(
                    (((i % 997) as f32 - 498.0) * 1e-4)
                        .to_bits()
                        .wrapping_shr(16) as u16,
                )
            })
            .collect();
        let g32: Vec<f32> = g16.iter().map(|g| g.to_f32()).collect();
        let mut half = vec![0u16; if kind.is_some() { n } else { 0 }];
        let (mut base, mut v) = (vec![0u16; n], vec![0u16; n]);
        let base_kind = kind.unwrap_or(HalfKind::Bf16);
        for &t in &threads {
            let mut opts = Vec::new();
            for _ in &sides {
                opts.push(CpuAdamW::new(n, cfg, vec![(0, n / 2)], state, t)?);
            }
            let mut best = vec![f64::INFINITY; sides.len()];
            // One untimed step touches every page of the state first.
            for i in 0..args.iters + 1 {
                for ((&(bf16, split), opt), best) in sides.iter().zip(&mut opts).zip(&mut best) {
                    let h = kind.map(|k| (&mut half[..], k));
                    let out = Prediction {
                        base: BaseOut::Half(&mut base, base_kind),
                        v: &mut v,
                    };
                    let start = Instant::now();
                    opt.begin_step();
                    match (bf16, split) {
                        (true, false) => opt.update(0, &mut params, &g16, 1e-4, 1.0, h)?,
                        (false, false) => opt.update(0, &mut params, &g32, 1e-4, 1.0, h)?,
                        (true, true) => {
                            opt.update_predict(0, &mut params, &g16, 1e-4, 1.0, 1e-4, out)?
                        }
                        (false, true) => {
                            opt.update_predict(0, &mut params, &g32, 1e-4, 1.0, 1e-4, out)?
                        }
                    }
                    let dt = start.elapsed().as_secs_f64();
                    if i > 0 {
                        *best = best.min(dt);
                    }
                }
            }
            for (&(bf16, split), best) in sides.iter().zip(best) {
                let grads = if bf16 { "bf16" } else { "fp32" };
                let job = if split { "predict" } else { "update" };
                let gps = n as f64 / best / 1e9;
                if args.json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "params": n, "threads": t, "state_dtype": state.to_string(),
                            "half": args.half, "grads": grads, "job": job, "best_s": best,
                            "gparams_per_s": gps,
                        })
                    );
                } else {
                    println!(
                        "{:>12} {:>8} {:>12} {:>6} {:>6} {:>8} {:>10.2} {:>14.3}",
                        n,
                        t,
                        state,
                        args.half,
                        grads,
                        job,
                        best * 1e3,
                        gps
                    );
                }
            }
        }
    }
    Ok(())
}
