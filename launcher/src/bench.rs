//! `zrun bench comm`: collective bandwidth in the style of nccl-tests, checked in the same run.
//!
//!     zrun bench comm --nproc 2                          # tcp, 1M,16M,64M fp32 elements
//!     zrun bench comm --nproc 2 --backend mpi --json     # starts mpirun itself
//!     zrun bench comm --nproc 2 --sizes 64K,1M,16M,64M --save cluster.toml   # fit and save
//!
//! Without rank variables it starts `--nproc` ranks of itself on this host (hosting the
//! rendezvous store on loopback), or `mpirun` for `--backend mpi`; under mpirun/srun/zrun it
//! runs as one rank. Rank 0 prints one row per collective and size: the full tensor's bytes,
//! the mean time, algbw = bytes / time, busbw = algbw x (n-1)/n (all-gather, reduce-scatter)
//! or 2(n-1)/n (all-reduce), and #wrong, the elements that differ from the expected result.
//!
//! `--save FILE` fits `t = alpha + bytes x f / busbw` to each collective's rows by least
//! squares and writes the fits into the cluster file FILE (docs/cluster.md) as `[inter]`
//! when the job spans nodes (LOCAL_WORLD_SIZE < WORLD_SIZE), else `[intra]`, keeping what
//! the file already holds: a one-node and a two-node run fill one file.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tch::{Device, Kind, Tensor};
use zrun_comm::{
    chunk_offset, chunk_sizes, Backend, Communicator, ReduceOp, StoreServer, Topology,
};
use zrun_train::config::DeviceKind;
use zrun_train::steptime::{merge_link_class, Link, LinkClass};

use crate::launch::BadInput;

/// Set in the ranks that `zrun bench comm` and `zrun bench ckpt` start themselves.
pub(crate) const WORKER_ENV: &str = "ZRUN_BENCH_WORKER";

/// Flags of `zrun bench comm`.
#[derive(clap::Args, Debug, Clone)]
pub struct CommArgs {
    /// Ranks to start on this host (ignored under mpirun/srun/zrun, which set the ranks).
    #[arg(long, default_value_t = 2, value_parser = ranks())]
    pub nproc: usize,
    /// Communication backend: tcp, mpi or nccl.
    #[arg(long, default_value = "tcp", value_parser = parse_backend)]
    pub backend: Backend,
    /// Full-tensor sizes in elements, comma-separated; K, M, G are powers of 2.
    #[arg(long, default_value = "1M,16M,64M")]
    pub sizes: String,
    /// Element type: fp32, bf16 or fp16.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16", "fp16"])]
    pub dtype: String,
    /// Timed iterations per row.
    #[arg(long, default_value_t = 5, value_parser = at_least_one::<usize>)]
    pub iters: usize,
    /// Untimed iterations before the timed ones.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Deadline of every collective, in seconds (dist.timeout_s): 1 to 31536000 (a year).
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=zrun_comm::MAX_TIMEOUT_S))]
    pub timeout_s: u64,
    /// Fit alpha and busbw per collective (least squares of time against bytes x f) and
    /// save them into this cluster file: as [inter] when the job spans nodes, else [intra];
    /// the file's other tables and keys stay (docs/cluster.md). Give several --sizes.
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    s.parse()
}

/// A count flag of the benches (iterations, rounds, seconds): 1 or more; clap refuses 0 as
/// a usage error (exit 2).
pub(crate) fn at_least_one<T: std::str::FromStr + PartialOrd + From<u8>>(
    s: &str,
) -> Result<T, String> {
    match s.parse::<T>() {
        Ok(n) if n >= T::from(1) => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(_) => Err("not a whole number".into()),
    }
}

/// A bench's `--nproc`: 1 to [`crate::launch::MAX_NPROC`] ranks on this host.
pub(crate) fn ranks() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..=crate::launch::MAX_NPROC as u64)
}

/// Parses a comma-separated list of counts like `1M,16M,3` for `flag`. K, M and G are powers
/// of `unit` (1024 for tensor sizes, 1000 for parameter counts); fractions are allowed
/// (`0.5M`), zero and negative counts are not.
pub(crate) fn parse_counts(s: &str, flag: &str, unit: f64) -> anyhow::Result<Vec<usize>> {
    s.split(',')
        .map(|p| {
            let p = p.trim().to_ascii_uppercase();
            let (num, power) = match p.chars().last() {
                Some('K') => (&p[..p.len() - 1], 1),
                Some('M') => (&p[..p.len() - 1], 2),
                Some('G') => (&p[..p.len() - 1], 3),
                _ => (&p[..], 0),
            };
            let n: f64 = num
                .parse()
                .map_err(|_| BadInput(format!("{flag}: `{p}` is not a count like 64M")))?;
            let count = (n * unit.powi(power)).round();
            if count.is_nan() || count < 1.0 {
                return Err(BadInput(format!("{flag}: `{p}` must be a positive count")).into());
            }
            Ok(count as usize)
        })
        .collect()
}

/// Runs `zrun bench comm`.
pub fn run_comm(args: &CommArgs) -> anyhow::Result<()> {
    let sizes = parse_counts(&args.sizes, "--sizes", 1024.0)?;
    // A backend this build lacks: one line before any rank starts, not one per rank.
    let caps = zrun_train::config::Capabilities::detect();
    let missing = match args.backend {
        Backend::Nccl if !caps.cuda_built => Some("CUDA (--features cuda)"),
        Backend::Mpi if !caps.mpi_built => Some("MPI (--features mpi)"),
        _ => None,
    };
    if let Some(what) = missing {
        return Err(BadInput(format!(
            "--backend {}: this zrun was built without {what}; rebuild with it, or use --backend tcp",
            args.backend
        ))
        .into());
    }
    let topo = Topology::from_env().context("reading the rank variables")?;
    let is_rank = std::env::var(WORKER_ENV).is_ok() || topo.world_size > 1;
    if let (Some(path), 0) = (&args.save, topo.rank) {
        // Before any rank starts: a fit that cannot be saved is not worth the run.
        let (world, class) = if is_rank {
            (topo.world_size, class_of(&topo))
        } else {
            (args.nproc, "intra")
        };
        check_save(path, world, class)?;
    }
    if is_rank || args.nproc <= 1 {
        return bench_rank(args, &topo, &sizes);
    }
    if args.backend == Backend::Mpi {
        return launch_mpirun(args);
    }
    launch_local(args.nproc)
}

/// The arguments this process was started with, minus the program name.
fn own_args() -> Vec<String> {
    std::env::args().skip(1).collect()
}

fn launch_mpirun(args: &CommArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let status = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &args.nproc.to_string(),
        ])
        .arg(exe)
        .args(own_args())
        .env(WORKER_ENV, "1")
        .status()
        .context("starting mpirun (install openmpi-bin)")?;
    if !status.success() {
        bail!("mpirun exited with {status}");
    }
    Ok(())
}

/// Starts `nproc` ranks of this same command on this host (the store on loopback) and waits
/// for them; rank 0 prints, the others are silent.
pub(crate) fn launch_local(nproc: usize) -> anyhow::Result<()> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let token = format!("bench-{}-{nanos}", std::process::id());
    let server = StoreServer::start("127.0.0.1:0", &token)?;
    let exe = std::env::current_exe()?;
    let threads = (std::thread::available_parallelism().map_or(1, |n| n.get()) / nproc).max(1);
    let mut children = Vec::new();
    for r in 0..nproc {
        let child = Command::new(&exe)
            .args(own_args())
            .env(WORKER_ENV, "1")
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", server.port().to_string())
            .env(zrun_comm::TOKEN_ENV, &token)
            .env(zrun_comm::STORE_EXTERNAL_ENV, "1")
            .env("OMP_NUM_THREADS", threads.to_string())
            .envs(zrun_comm::share::launch_env(r))
            .stdout(if r == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .with_context(|| format!("starting rank {r}"))?;
        children.push(child);
    }
    let mut failed = None;
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (r, c) in children.iter_mut().enumerate() {
            if done[r] {
                continue;
            }
            if let Some(st) = c.try_wait()? {
                done[r] = true;
                if !st.success() && failed.is_none() {
                    failed = Some((r, st));
                }
            }
        }
        if failed.is_some() {
            for (r, c) in children.iter_mut().enumerate() {
                if !done[r] {
                    let _ = c.kill();
                    let _ = c.wait();
                    done[r] = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some((r, st)) = failed {
        if let Some(hint) = crate::launch::spawn::sigkill_hint(&st) {
            bail!("bench rank {r} was killed ({hint}): use smaller --sizes");
        }
        bail!("bench rank {r} failed ({st}); its error is above");
    }
    Ok(())
}

/// One measured row.
struct Row {
    op: &'static str,
    bytes: usize,
    time_s: f64,
    factor: f64,
    wrong: u64,
}

fn kind_of(dtype: &str) -> Kind {
    match dtype {
        "bf16" => Kind::BFloat16,
        "fp16" => Kind::Half,
        _ => Kind::Float,
    }
}

/// Rank r's input: small integers (exact in every dtype when summed over a few ranks). A
/// size past the memory is an error naming it, not libtorch's panic.
fn input(r: usize, n: usize, kind: Kind, dev: Device) -> anyhow::Result<Tensor> {
    // Element i is i % 7 + r + 1: seven values repeated, built without tch's scalar
    // arguments (a failed allocation inside an op that takes one panics in tch).
    let first: Vec<i64> = (0..7).map(|i| i + r as i64 + 1).collect();
    let reps = n.div_ceil(7) as i64;
    Tensor::f_from_slice(&first)
        .and_then(|t| t.f_to_device(dev))
        .and_then(|t| t.f_repeat([reps]))
        .and_then(|t| t.f_narrow(0, 0, n as i64))
        .and_then(|t| t.f_to_kind(kind))
        .and_then(|t| t.f_contiguous())
        .map_err(|e| {
            anyhow::anyhow!(
                "bench comm: cannot make a {n}-element {kind:?} tensor on {dev:?} (--sizes): {}",
                e.to_string().lines().next().unwrap_or_default()
            )
        })
}

fn sync(dev: Device) {
    if let Device::Cuda(i) = dev {
        tch::Cuda::synchronize(i as i64);
    }
}

fn timed(
    c: &dyn Communicator,
    dev: Device,
    args: &CommArgs,
    mut op: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for _ in 0..args.warmup {
        op()?;
    }
    sync(dev);
    c.barrier()?.wait()?;
    let t = Instant::now();
    for _ in 0..args.iters {
        op()?;
    }
    sync(dev);
    c.barrier()?.wait()?;
    Ok(t.elapsed().as_secs_f64() / args.iters.max(1) as f64)
}

fn count_wrong(got: &Tensor, want: &Tensor) -> anyhow::Result<u64> {
    let n = got
        .f_ne_tensor(want)?
        .f_sum(Kind::Int64)?
        .f_int64_value(&[])?;
    Ok(n as u64)
}

fn bench_rank(args: &CommArgs, topo: &Topology, sizes: &[usize]) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(args.timeout_s);
    if !zrun_comm::compiled(args.backend) {
        let feature = if args.backend == Backend::Mpi {
            "mpi"
        } else {
            "cuda"
        };
        return Err(zrun_comm::Error::NotCompiled {
            backend: args.backend.name(),
            feature,
        }
        .into());
    }
    // nccl: this rank's own GPU (the rule the backend follows), current before anything
    // touches CUDA.
    let kind = if args.backend == Backend::Nccl {
        DeviceKind::Cuda
    } else {
        DeviceKind::Cpu
    };
    let dev = zrun_train::trainer::rank_device(kind, topo)?;
    let c = zrun_comm::init(topo, args.backend, timeout)?;
    let (r, w) = (c.rank(), c.world_size());
    let kind = kind_of(&args.dtype);
    let esz = kind.elt_size_in_bytes();
    let mut rows = Vec::new();
    let per_rank = |n: usize| {
        (0..w)
            .map(|q| input(q, n, kind, dev))
            .collect::<anyhow::Result<Vec<_>>>()
    };
    for &n in sizes {
        let (off, len) = (chunk_offset(n, w, r) as i64, chunk_sizes(n, w)[r] as i64);
        let mine = input(r, n, kind, dev)?;
        // all-gather: rank q's shard is chunk q of its own input
        let shard = mine.f_narrow(0, off, len)?.f_contiguous()?;
        let mut full = Tensor::f_zeros([n as i64], (kind, dev))?;
        let t = timed(c.as_ref(), dev, args, || {
            Ok(c.all_gather(&shard, &full)?.wait()?)
        })?;
        let all = per_rank(n)?;
        let want = Tensor::f_cat(
            &(0..w)
                .map(|q| {
                    all[q].f_narrow(0, chunk_offset(n, w, q) as i64, chunk_sizes(n, w)[q] as i64)
                })
                .collect::<Result<Vec<_>, _>>()?,
            0,
        )?;
        let _ = full.f_zero_()?;
        c.all_gather(&shard, &full)?.wait()?;
        rows.push(Row {
            op: "all_gather",
            bytes: n * esz,
            time_s: t,
            factor: (w as f64 - 1.0) / w as f64,
            wrong: count_wrong(&full, &want)?,
        });
        drop((full, want));
        // reduce-scatter (sum)
        let mut out = Tensor::f_zeros([len], (kind, dev))?;
        let t = timed(c.as_ref(), dev, args, || {
            Ok(c.reduce_scatter(&mine, &out, ReduceOp::Sum)?.wait()?)
        })?;
        let mut sum = all[0].f_to_kind(Kind::Float)?;
        for b in &all[1..] {
            sum = sum.f_add(&b.f_to_kind(Kind::Float)?)?;
        }
        let sum = sum.f_to_kind(kind)?;
        let _ = out.f_zero_()?;
        c.reduce_scatter(&mine, &out, ReduceOp::Sum)?.wait()?;
        rows.push(Row {
            op: "reduce_scatter",
            bytes: n * esz,
            time_s: t,
            factor: (w as f64 - 1.0) / w as f64,
            wrong: count_wrong(&out, &sum.f_narrow(0, off, len)?)?,
        });
        drop((out, all));
        // all-reduce (sum), in place; checked on a fresh copy of the input
        let mut buf = mine.f_zeros_like()?;
        buf.f_copy_(&mine)?;
        let t = timed(c.as_ref(), dev, args, || {
            Ok(c.all_reduce(&buf, ReduceOp::Sum)?.wait()?)
        })?;
        buf.f_copy_(&mine)?;
        c.all_reduce(&buf, ReduceOp::Sum)?.wait()?;
        rows.push(Row {
            op: "all_reduce",
            bytes: n * esz,
            time_s: t,
            factor: 2.0 * (w as f64 - 1.0) / w as f64,
            wrong: count_wrong(&buf, &sum)?,
        });
    }
    // Total the wrong counts over ranks (fp32 holds counts up to 2^24 exactly).
    let wrong =
        Tensor::from_slice(&rows.iter().map(|r| r.wrong as f32).collect::<Vec<_>>()).to_device(dev);
    c.all_reduce(&wrong, ReduceOp::Sum)?.wait()?;
    let wrong: Vec<f32> = Vec::<f32>::try_from(&wrong.to_device(Device::Cpu))?;
    if r == 0 {
        print_rows(args, w, &rows, &wrong);
    }
    let saved = match (&args.save, r) {
        (Some(path), 0) if wrong.iter().any(|&x| x > 0.0) => Err(anyhow::anyhow!(
            "--save: not saved to {}: some collectives returned wrong elements (#wrong above)",
            path.display()
        )),
        (Some(path), 0) => save_fit(path, args, topo, &rows),
        _ => Ok(()),
    };
    c.barrier()?.wait()?;
    saved
}

/// Refuses a `--save` that could not be written after the run: one rank (nothing to fit), a
/// file that is not a readable TOML cluster file, or a directory this process cannot create
/// the file in.
fn check_save(path: &Path, world: usize, class: &str) -> Result<(), BadInput> {
    let bad = |why: String| BadInput(format!("--save {}: {why}", path.display()));
    if world < 2 {
        return Err(bad(
            "one rank moves nothing: run with --nproc 2 or more".into()
        ));
    }
    match zrun_train::config::read_config(path) {
        Ok(text) => {
            merge_link_class(&text, class, &LinkClass::uniform(1e-6, 1e9)).map_err(|e| {
                bad(format!(
                    "not a cluster file zrun can add [{class}] to ({e}); give a new file or one `--save` wrote"
                ))
            })?;
            std::fs::OpenOptions::new()
                .append(true)
                .open(path)
                .map_err(|e| bad(format!("cannot write it ({e})")))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(|e| {
                    bad(format!(
                        "cannot create it ({e}); give a path in a writable directory"
                    ))
                })?;
            let _ = std::fs::remove_file(path);
        }
        Err(e) => return Err(bad(format!("cannot read it ({e})"))),
    }
    Ok(())
}

/// The link class a job measures: `inter` when it spans nodes, else `intra`.
fn class_of(topo: &Topology) -> &'static str {
    if topo.local_world_size < topo.world_size {
        "inter"
    } else {
        "intra"
    }
}

/// Fits each collective's rows and merges them into the cluster file `path` under the class
/// this job measured; prints the fits.
fn save_fit(path: &PathBuf, args: &CommArgs, topo: &Topology, rows: &[Row]) -> anyhow::Result<()> {
    let fit = |op: &str| -> anyhow::Result<Link> {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.op == op)
            .map(|r| (r.bytes as f64 * r.factor, r.time_s))
            .collect();
        let link = Link::fit(&points).with_context(|| {
            format!("--save: {op}'s times do not grow with its size, so no bandwidth fits: give larger and more --sizes (e.g. 1M,16M,64M,256M) or more --iters")
        })?;
        println!(
            "# fit {op:>15}: alpha {:.1} us, busbw {:.3} GB/s",
            link.alpha_s * 1e6,
            link.busbw / 1e9
        );
        Ok(link)
    };
    let class = class_of(topo);
    let links = LinkClass {
        all_gather: fit("all_gather")?,
        reduce_scatter: fit("reduce_scatter")?,
        all_reduce: fit("all_reduce")?,
        ranks_per_node: topo.local_world_size,
        rails: 1,
        ranks: Some(topo.world_size),
        backend: Some(args.backend.name().to_string()),
        dtype: Some(args.dtype.clone()),
    };
    let old = match zrun_train::config::read_config(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("--save: reading {}", path.display())),
    };
    let body = merge_link_class(&old, class, &links)
        .with_context(|| format!("--save: {}", path.display()))?;
    let text = format!(
        "# zrun cluster file (docs/cluster.md): [intra] and [inter] come from `zrun bench comm --save`;\n# a collective over n ranks of `bytes` costs alpha_s + bytes x f / busbw (f = (n-1)/n, 2(n-1)/n).\n{body}"
    );
    std::fs::write(path, text).with_context(|| format!("--save: writing {}", path.display()))?;
    println!(
        "# saved [{class}] ({} ranks, {} per node) to {}",
        topo.world_size,
        topo.local_world_size,
        path.display()
    );
    Ok(())
}

fn print_rows(args: &CommArgs, world: usize, rows: &[Row], wrong: &[f32]) {
    let backend = args.backend.name();
    if !args.json {
        println!(
            "# zrun bench comm  backend {backend}  nproc {world}  dtype {}  iters {}",
            args.dtype, args.iters
        );
        println!(
            "{:>15} {:>12} {:>10} {:>12} {:>12} {:>7}",
            "op", "size(B)", "time(ms)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
        );
    }
    for (row, &wr) in rows.iter().zip(wrong) {
        let algbw = row.bytes as f64 / row.time_s / 1e9;
        let busbw = algbw * row.factor;
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "op": row.op, "backend": backend, "dtype": args.dtype, "bytes": row.bytes,
                    "time_s": row.time_s, "algbw_gbps": algbw, "busbw_gbps": busbw, "wrong": wr as u64,
                })
            );
        } else {
            println!(
                "{:>15} {:>12} {:>10.2} {:>12.3} {:>12.3} {:>7}",
                row.op,
                row.bytes,
                row.time_s * 1e3,
                algbw,
                busbw,
                wr as u64
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_binary_or_decimal_suffixes_and_reject_junk() {
        let sizes = |s| parse_counts(s, "--sizes", 1024.0);
        assert_eq!(sizes("1M,16M,3").unwrap(), vec![1 << 20, 16 << 20, 3]);
        assert_eq!(sizes("2k").unwrap(), vec![2048]);
        let params = |s| parse_counts(s, "--params", 1000.0);
        assert_eq!(
            params("10M, 0.5M,2G").unwrap(),
            vec![10_000_000, 500_000, 2_000_000_000]
        );
        for bad in ["lots", "0", "-3M", "", "NaN"] {
            let err = params(bad).unwrap_err().to_string();
            assert!(err.starts_with("--params: "), "{bad}: {err}");
        }
    }
}
