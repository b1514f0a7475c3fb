//! A rank whose micro-step runs out of memory finishes the micro-step's collectives with
//! stand-ins that allocate nothing, so the other ranks' collectives complete, every rank
//! drops the step and training goes on.
//!
//! Two real processes over tcp, on the caching CPU allocator zrun's CPU ranks use. Rank 1
//! runs a micro-batch too large for the limit it gives the allocator's reserve (as
//! `dist.memory_limit` does on CPU) and fails in forward or in backward; it then tightens the
//! limit to what the allocator holds, so the reserve cannot grow by a byte, and recovers
//! under it, while libtorch's allocations are counted: none. (The limit alone would not prove
//! it: the allocator may serve a request from blocks freed earlier.) Rank 1 then runs the
//! same cases alone, with no reserve: it has no collective to stand in for.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use common::adamw;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};
use zrun_comm::{Backend, Communicator, ReduceOp, StoreServer, Topology};
use zrun_models::{Gpt, GptConfig, Model};
use zrun_shard::{Engine, EngineConfig, Precision, Stage};

const ROLE: &str = "ZRUN_TEST_ROLE";
/// A collective that hung would fail after this; the test wants far less.
const COMM_TIMEOUT: Duration = Duration::from_secs(20);
/// What the whole two-rank run may take.
const WITHIN: Duration = Duration::from_secs(15);

/// Units of 36K-200K parameters: every buffer a unit needs is over 64 KiB.
fn model(tied: bool) -> Arc<dyn Model> {
    let cfg = GptConfig {
        vocab_size: 256,
        seq_len: 32,
        n_layer: 2,
        n_head: 4,
        d_model: 128,
        init_std: 0.02,
        tied,
    };
    Arc::new(Gpt::new(cfg).unwrap())
}

/// A (B, T) batch of token ids and its targets, the same on every run.
fn batch(b: i64, t: i64) -> (Tensor, Tensor) {
    let all = Tensor::arange(b * (t + 1), (Kind::Int64, Device::Cpu))
        .f_remainder(251)
        .unwrap()
        .view([b, t + 1]);
    (all.narrow(1, 0, t), all.narrow(1, 1, t))
}

/// The bytes the caching CPU allocator reserves (live blocks and cached free ones).
fn reserved() -> i64 {
    zrun_torch_ext::cpu_memory_stats().unwrap().reserved as i64
}

/// Caps the caching CPU allocator's reserve (`None`: no cap).
fn limit_reserve(bytes: Option<i64>) {
    zrun_torch_ext::install_cpu_caching_allocator(bytes.map(|b| b as u64)).unwrap();
}

/// One case: a stage, precision, checkpointing, a tied head, and how much of its micro-step's
/// predicted activations rank 1's limit leaves room for (a small share fails in forward, a
/// large one with checkpointing in backward, where units are recomputed).
#[derive(Clone, Copy, Debug)]
struct Case {
    stage: Stage,
    precision: Precision,
    ckpt: bool,
    tied: bool,
    room: f64,
}

/// Where rank 1 failed in one case, and the allocator's reserve around its recovery.
struct Failed {
    phase: String,
    before: i64,
    after: i64,
    /// libtorch's allocations during the recovery.
    allocated: zrun_torch_ext::Allocations,
}

/// Runs case `c` on every rank of `comm`; the rank where `fails` runs out of memory.
fn run_case(comm: &Arc<dyn Communicator>, c: Case, fails: bool) -> Option<Failed> {
    let cfg = EngineConfig {
        precision: c.precision,
        activation_checkpointing: c.ckpt,
        ..EngineConfig::fp32(c.stage, Device::Cpu, 7, adamw())
    };
    let m = model(c.tied);
    let mut e = Engine::new(m.clone(), comm.clone(), cfg).unwrap();
    if comm.world_size() == 1 {
        // A rank alone has no one to stand in for: it keeps no reserve.
        assert_eq!(e.oom_reserve_bytes(), 0, "{c:?}");
    }
    let (x, y) = batch(2, 32);
    // A first step on both ranks: threads, the allocator and the communicator are warm.
    e.forward_backward(&x, &y, 1.0).unwrap();
    e.step(1e-3, 1.0).unwrap();
    let before_step = e.full_parameters().unwrap();

    let failed = if fails {
        let big = 32;
        let ec = e.estimate_config(big, 32);
        let est = zrun_shard::estimate(m.as_ref(), e.layout(), &ec);
        // The step's own allocations: the peak less what the rank holds and the runtime's heap.
        let activations = est.peak_bytes - e.memory().total() - zrun_shard::runtime_heap_bytes(&ec);
        // Cached blocks go back first, so the reserve is what the rank holds.
        zrun_torch_ext::cpu_empty_cache();
        limit_reserve(Some(reserved() + (c.room * activations as f64) as i64));
        let (bx, by) = batch(big, 32);
        let err = e
            .forward_backward(&bx, &by, 1.0)
            .expect_err("the micro-step must run out of memory");
        assert!(err.out_of_memory().is_some(), "{c:?}: {err}");
        let phase = e.phase();
        // Recovery under a limit at what the rank holds: not one byte more.
        let before = reserved();
        limit_reserve(Some(before));
        let counted = zrun_torch_ext::count_allocations(|| e.finish_failed_micro_step());
        let after = reserved();
        limit_reserve(None);
        let (r, allocated) = counted.unwrap();
        r.unwrap_or_else(|err| panic!("{c:?}: recovery after failing in {phase}: {err}"));
        Some(Failed {
            phase,
            before,
            after,
            allocated,
        })
    } else {
        e.forward_backward(&x, &y, 1.0).unwrap();
        None
    };
    // Every rank learns that one failed, and drops the step.
    let flag = Tensor::from_slice(&[f32::from(u8::from(failed.is_some()))]);
    comm.all_reduce(&flag, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(flag.double_value(&[0]), 1.0, "{c:?}");
    e.abandon_step().unwrap();
    let after_step = e.full_parameters().unwrap();
    for ((n, a), (_, b)) in before_step.iter().zip(&after_step) {
        assert!(a.equal(b), "{c:?}: {n} changed by a dropped step");
    }
    // And goes on.
    e.forward_backward(&x, &y, 1.0).unwrap();
    let s = e.step(1e-3, 1.0).unwrap();
    assert!(s.applied && s.grad_norm.is_finite(), "{c:?}: {s:?}");
    failed
}

/// Checks that recovering from `f` allocated nothing and left the allocator's reserve as it
/// was; returns the phase the micro-step failed in.
fn recovered(f: Failed, what: &str) -> String {
    assert_eq!(
        f.after, f.before,
        "{what}: the allocator's reserve grew in recovery"
    );
    assert_eq!(
        f.allocated,
        zrun_torch_ext::Allocations::default(),
        "{what}: recovery allocated"
    );
    println!("{what} failed in {}; recovered", f.phase);
    f.phase
}

fn worker() {
    // As zrun's CPU ranks: libtorch's CPU tensors come from the caching allocator, whose
    // reserve the limit caps.
    limit_reserve(None);
    let topo = Topology::from_env().unwrap();
    let comm: Arc<dyn Communicator> =
        Arc::from(zrun_comm::init(&topo, Backend::Tcp, COMM_TIMEOUT).unwrap());
    let cases = [
        (Stage::Zero2, Precision::Fp32, false, false, 0.12),
        (Stage::Zero2, Precision::Fp32, true, false, 0.91),
        (Stage::Zero3, Precision::Bf16, false, true, 0.13),
        (Stage::Zero3, Precision::Fp32, true, true, 0.91),
    ]
    .map(|(stage, precision, ckpt, tied, room)| Case {
        stage,
        precision,
        ckpt,
        tied,
        room,
    });
    let mut phases = Vec::new();
    for c in cases {
        if let Some(f) = run_case(&comm, c, comm.rank() == 1) {
            phases.push(recovered(f, &format!("rank 1: {c:?}")));
        }
    }
    if comm.rank() == 1 {
        // A rank alone recovers too, with no reserve: nothing to stand in for.
        let single: Arc<dyn Communicator> =
            Arc::from(zrun_comm::init(&Topology::single(), Backend::Tcp, COMM_TIMEOUT).unwrap());
        let mut alone = Vec::new();
        for c in cases {
            // Less room: a rank alone lays no unit's gradient out flat (with the
            // checkpointed cases' 0.91 it would not run out).
            let c = Case {
                room: c.room * 0.85,
                ..c
            };
            let f = run_case(&single, c, true).expect("the micro-step ran out of memory");
            alone.push(recovered(f, &format!("rank alone: {c:?}")));
        }
        assert!(
            alone.iter().any(|p| p.starts_with("backward of unit")),
            "no case alone failed in backward: {alone:?}"
        );
        for want in ["forward of unit", "backward of unit"] {
            assert!(
                phases.iter().any(|p| p.starts_with(want)),
                "no case failed in {want}: {phases:?}"
            );
        }
    }
}

#[test]
fn a_rank_out_of_memory_finishes_the_micro_step_without_allocating() {
    const NAME: &str = "a_rank_out_of_memory_finishes_the_micro_step_without_allocating";
    if std::env::var(ROLE).is_ok_and(|r| r == NAME) {
        worker();
        return;
    }
    let token = format!("test-token-{}", std::process::id());
    let server = StoreServer::start("127.0.0.1:0", &token).unwrap();
    let exe = std::env::current_exe().unwrap();
    let t = Instant::now();
    let mut children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(&exe)
                .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, NAME)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", server.port().to_string())
                .env("ZRUN_JOB_TOKEN", &token)
                .env("ZRUN_STORE_EXTERNAL", "1")
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut codes = vec![None; children.len()];
    while codes.iter().any(Option::is_none) && t.elapsed() < 2 * COMM_TIMEOUT {
        for (c, code) in children.iter_mut().zip(&mut codes) {
            if code.is_none() {
                *code = c.try_wait().unwrap().map(|s| s.code());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = t.elapsed();
    let mut out = String::new();
    for (r, c) in children.iter_mut().enumerate() {
        let _ = c.kill();
        let _ = c.wait();
        out.push_str(&format!("== rank {r}: exit {:?}\n", codes[r]));
        for pipe in [
            c.stdout.take().map(|p| Box::new(p) as Box<dyn Read>),
            c.stderr.take().map(|p| Box::new(p) as Box<dyn Read>),
        ]
        .into_iter()
        .flatten()
        {
            let mut p = pipe;
            let _ = p.read_to_string(&mut out);
        }
    }
    drop(server);
    assert!(
        codes.iter().all(|c| *c == Some(Some(0))),
        "after {took:?}:\n{out}"
    );
    assert!(took < WITHIN, "the ranks took {took:?}:\n{out}");
    assert!(out.contains("failed in backward of unit"), "{out}");
    println!("{out}");
}
