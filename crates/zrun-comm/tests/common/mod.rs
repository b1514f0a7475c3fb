//! Process harness and collective checks shared by the multi-process tests.
//!
//! A test re-executes its own binary once per rank (`current_exe() <test> --exact`) with
//! `ZRUN_TEST_ROLE=<test>`; in that child the same test function runs the rank's body.
#![allow(dead_code)]

pub mod split;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use tch::{Device, Kind, Tensor};
use zrun_comm::{chunk_offset, chunk_sizes, Communicator, ReduceOp, StoreServer};

pub const ROLE: &str = "ZRUN_TEST_ROLE";

/// True in a child started for test `name`.
pub fn is_worker(name: &str) -> bool {
    std::env::var(ROLE).is_ok_and(|r| r == name)
}

/// Runs a worker body, printing its error so the parent can show it. A body that succeeds
/// ends the process as zrun's own ranks end, without libtorch's static destructors, except
/// under mpirun, where MPI is finalised when this thread's state drops.
pub fn worker(body: impl FnOnce() -> anyhow::Result<()>) {
    if let Err(e) = body() {
        fail_now(e);
    }
    let source = zrun_comm::Topology::from_env().map(|t| t.source);
    if !matches!(source, Ok(zrun_comm::TopologySource::OpenMpi)) {
        zrun_torch_ext::quick_exit(0);
    }
}

/// Prints the error and ends the process at once, before any communicator is dropped (under
/// mpirun, finalising while a peer waits in a collective would block; mpirun instead ends
/// the job when a rank exits without finalising).
pub fn fail_now(e: anyhow::Error) -> ! {
    eprintln!("WORKER ERROR: {e:#}");
    // SAFETY: ends the process immediately; nothing after this runs.
    unsafe { libc::_exit(3) }
}

/// What one rank's process did.
pub struct Outcome {
    pub code: Option<i32>,
    pub output: String,
}

fn collect(mut c: Child) -> (Child, std::thread::JoinHandle<String>) {
    let mut out = c.stdout.take();
    let mut err = c.stderr.take();
    let h = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = out.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    (c, h)
}

fn wait_all(children: Vec<Child>, limit: Duration, what: &str) -> Vec<Outcome> {
    let start = Instant::now();
    let mut handles: Vec<_> = children.into_iter().map(collect).collect();
    let mut codes: Vec<Option<Option<i32>>> = vec![None; handles.len()];
    while codes.iter().any(|c| c.is_none()) {
        for (i, (c, _)) in handles.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Ok(Some(st)) = c.try_wait() {
                    codes[i] = Some(st.code());
                }
            }
        }
        if start.elapsed() > limit {
            for (c, _) in handles.iter_mut() {
                let _ = c.kill();
            }
            let outs: Vec<String> = handles
                .into_iter()
                .map(|(mut c, h)| {
                    let _ = c.wait();
                    h.join().unwrap_or_default()
                })
                .collect();
            panic!(
                "{what}: ranks still running after {limit:?}; output:\n{}",
                outs.join("\n----\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    handles
        .into_iter()
        .zip(codes)
        .map(|((_, h), code)| Outcome {
            code: code.flatten(),
            output: h.join().unwrap_or_default(),
        })
        .collect()
}

/// Starts `world` ranks of test `name` against a store hosted here on loopback.
pub fn spawn_ranks(
    name: &str,
    world: usize,
    env: &[(&str, &str)],
    limit: Duration,
) -> Vec<Outcome> {
    let token = test_token();
    let server = StoreServer::start("127.0.0.1:0", &token).expect("store");
    let all: Vec<usize> = (0..world).collect();
    spawn_on(&server, &token, name, &all, world, env, limit)
}

/// The job token of the stores these tests host.
pub fn test_token() -> String {
    format!("test-token-{}", std::process::id())
}

/// Starts `ranks` of a `world`-rank job of test `name` against `server` (token `token`).
pub fn spawn_on(
    server: &StoreServer,
    token: &str,
    name: &str,
    ranks: &[usize],
    world: usize,
    env: &[(&str, &str)],
    limit: Duration,
) -> Vec<Outcome> {
    let exe = std::env::current_exe().expect("test binary");
    let children: Vec<Child> = ranks
        .iter()
        .map(|&r| {
            let mut c = Command::new(&exe);
            c.args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, name)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", server.port().to_string())
                .env("ZRUN_JOB_TOKEN", token)
                .env("ZRUN_STORE_EXTERNAL", "1")
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().expect("spawn rank")
        })
        .collect();
    wait_all(children, limit, name)
}

/// Starts test `name` under `mpirun -np world`.
pub fn spawn_mpirun(name: &str, world: usize, limit: Duration) -> Vec<Outcome> {
    let exe = std::env::current_exe().expect("test binary");
    let child = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &world.to_string(),
        ])
        .arg(&exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, name)
        .env("OMP_NUM_THREADS", "1")
        .env("OMPI_MCA_btl", "self,vader,tcp")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun (install openmpi-bin)");
    wait_all(vec![child], limit, name)
}

/// Panics with every rank's output unless all exited 0.
pub fn assert_all_ok(name: &str, outs: &[Outcome]) {
    if outs.iter().any(|o| o.code != Some(0)) {
        let msg: Vec<String> = outs
            .iter()
            .enumerate()
            .map(|(r, o)| format!("== process {r}: exit {:?}\n{}", o.code, o.output))
            .collect();
        panic!("{name} failed:\n{}", msg.join("\n"));
    }
}

/// The value rank `r` contributes at global element `i`: a small integer, so sums of up to
/// four ranks are exact in bf16 and fp16 too.
pub fn value(r: usize, i: usize) -> f64 {
    ((i * 7 + r * 13) % 17) as f64 - 8.0
}

fn tensor(vals: &[f64], kind: Kind) -> Tensor {
    Tensor::from_slice(vals).to_kind(kind)
}

fn to_vec(t: &Tensor) -> anyhow::Result<Vec<f64>> {
    Ok(Vec::<f64>::try_from(&t.to_kind(Kind::Double))?)
}

/// Tolerance of an average (a sum divided by the world size, rounded once to `kind`).
fn tol(kind: Kind, x: f64) -> f64 {
    let eps = match kind {
        Kind::BFloat16 => 1.0 / 256.0,
        Kind::Half => 1.0 / 2048.0,
        _ => 1e-6,
    };
    x.abs() * eps + 1e-6
}

fn check(
    what: &str,
    got: &[f64],
    want: impl Fn(usize) -> f64,
    exact: bool,
    kind: Kind,
) -> anyhow::Result<()> {
    let mut wrong = 0;
    let mut first = None;
    for (i, &g) in got.iter().enumerate() {
        let w = want(i);
        let ok = if exact {
            g == w
        } else {
            (g - w).abs() <= tol(kind, w)
        };
        if !ok {
            wrong += 1;
            first.get_or_insert((i, g, w));
        }
    }
    if let Some((i, g, w)) = first {
        bail!(
            "{what}: {wrong} of {} elements wrong; first at {i}: got {g}, want {w}",
            got.len()
        );
    }
    Ok(())
}

/// Every collective, every dtype, sizes divisible and not by the world size, checked element
/// by element against sums computed here.
pub fn check_collectives(c: &dyn Communicator) -> anyhow::Result<()> {
    let (r, w) = (c.rank(), c.world_size());
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for n in [1usize, 7, 4 * w, 300_001] {
            let ctx = format!("rank {r}/{w} {kind:?} n={n}");
            let sizes = chunk_sizes(n, w);
            let off = chunk_offset(n, w, r);
            let mine: Vec<f64> = (0..n).map(|i| value(r, i)).collect();
            let owner = |i: usize| {
                (0..w)
                    .find(|&q| i < chunk_offset(n, w, q) + sizes[q])
                    .unwrap_or(0)
            };

            // all-gather from a separate shard, then with the shard a view of `full`
            let shard = tensor(&mine[off..off + sizes[r]], kind);
            let full = Tensor::full([n as i64], 99.0, (kind, Device::Cpu));
            c.all_gather(&shard, &full)?
                .wait()
                .with_context(|| ctx.clone())?;
            check(
                &format!("{ctx} all_gather"),
                &to_vec(&full)?,
                |i| value(owner(i), i),
                true,
                kind,
            )?;
            let full2 = Tensor::full([n as i64], 99.0, (kind, Device::Cpu));
            let view = full2.narrow(0, off as i64, sizes[r] as i64);
            view.shallow_clone().copy_(&shard);
            c.all_gather(&view, &full2)?.wait()?;
            check(
                &format!("{ctx} all_gather in place"),
                &to_vec(&full2)?,
                |i| value(owner(i), i),
                true,
                kind,
            )?;

            // reduce-scatter, sum and average; the input stays unchanged
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let full = tensor(&mine, kind);
                let out = Tensor::full([sizes[r] as i64], 99.0, (kind, Device::Cpu));
                c.reduce_scatter(&full, &out, op)?.wait()?;
                let want = |j: usize| {
                    let s: f64 = (0..w).map(|q| value(q, off + j)).sum();
                    if op == ReduceOp::Avg {
                        s / w as f64
                    } else {
                        s
                    }
                };
                check(
                    &format!("{ctx} reduce_scatter {op:?}"),
                    &to_vec(&out)?,
                    want,
                    op == ReduceOp::Sum,
                    kind,
                )?;
                check(
                    &format!("{ctx} reduce_scatter input"),
                    &to_vec(&full)?,
                    |i| value(r, i),
                    true,
                    kind,
                )?;
            }

            // all-reduce, two issued before either is waited on
            let a = tensor(&mine, kind);
            let b = tensor(&mine, kind);
            let wa = c.all_reduce(&a, ReduceOp::Sum)?;
            let wb = c.all_reduce(&b, ReduceOp::Avg)?;
            wa.wait()?;
            wb.wait()?;
            let sum = |i: usize| (0..w).map(|q| value(q, i)).sum::<f64>();
            check(
                &format!("{ctx} all_reduce Sum"),
                &to_vec(&a)?,
                sum,
                true,
                kind,
            )?;
            check(
                &format!("{ctx} all_reduce Avg"),
                &to_vec(&b)?,
                |i| sum(i) / w as f64,
                false,
                kind,
            )?;

            // broadcast from the last and the first rank
            for root in [w - 1, 0] {
                let t = tensor(&mine, kind);
                c.broadcast(&t, root)?.wait()?;
                check(
                    &format!("{ctx} broadcast from {root}"),
                    &to_vec(&t)?,
                    |i| value(root, i),
                    true,
                    kind,
                )?;
            }
            c.barrier()?.wait()?;
        }
    }
    // A wrong shard size is refused before anything is sent.
    let full = Tensor::zeros([10], (Kind::Float, Device::Cpu));
    let bad = Tensor::zeros([11], (Kind::Float, Device::Cpu));
    ensure!(
        c.all_gather(&bad, &full).is_err(),
        "wrong shard size accepted"
    );
    let ints = Tensor::zeros([10], (Kind::Int64, Device::Cpu));
    ensure!(
        c.all_reduce(&ints, ReduceOp::Sum).is_err(),
        "int64 accepted"
    );
    c.barrier()?.wait()?;
    Ok(())
}
