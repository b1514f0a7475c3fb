//! Hybrid sharding (`shard_group`): 4 real processes over tcp as 2 shard groups of 2 (or 4
//! groups of 1) train exactly as one rank on the whole batch: losses, gradient norms and
//! parameters. Every rank reads its own part of the batch, so the replica groups see
//! different data: without the all-reduce across them their parameters would part, and
//! both must hold the one-rank run's. Each rank computes the one-rank reference itself.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use common::{adamw, tokens};
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};
use zrun_comm::{Backend, Communicator, ReduceOp, StoreServer, Topology};
use zrun_models::{Gpt, GptConfig, Model};
use zrun_shard::{Engine, EngineConfig, Offload, Precision, Stage, StatePart};

const ROLE: &str = "ZRUN_TEST_ROLE";
const WORLD: usize = 4;
const COMM_TIMEOUT: Duration = Duration::from_secs(20);
/// Sequences of each rank's micro-batch.
const MICRO: i64 = 2;
const SEQ: i64 = 16;
const VOCAB: i64 = 97;
const STEPS: usize = 3;
/// Micro-steps of a step (gradients accumulate across them).
const ACCUM: usize = 2;
const LR: f64 = 1e-2;
const SEED: u64 = 21;
/// fp32 against the one-rank run: the sums run in another order, nothing else differs.
const TOL: f64 = 1e-6;

fn model(tied: bool) -> Arc<dyn Model> {
    let cfg = GptConfig {
        vocab_size: VOCAB,
        seq_len: SEQ,
        n_layer: 3,
        n_head: 2,
        d_model: 16,
        init_std: 0.02,
        tied,
    };
    Arc::new(Gpt::new(cfg).unwrap())
}

/// The global batch of micro-step `micro` of step `step` (`WORLD * MICRO` sequences; rank r
/// reads rows `r * MICRO..`), from a local generator.
fn global_batch(step: usize, micro: usize) -> (Tensor, Tensor) {
    let seed = (step * 31 + micro * 7 + 1) as u64;
    tokens(seed, WORLD as i64 * MICRO, SEQ, VOCAB)
}

fn rank_batch(step: usize, micro: usize, rank: usize) -> (Tensor, Tensor) {
    let (x, y) = global_batch(step, micro);
    let at = rank as i64 * MICRO;
    (x.narrow(0, at, MICRO), y.narrow(0, at, MICRO))
}

/// One configuration to train with hybrid sharding and on one rank.
#[derive(Clone, Copy, Debug)]
struct Case {
    stage: Stage,
    group: usize,
    precision: Precision,
    offload: bool,
    /// With offload: ZeRO-Offload's delayed update after one update on time.
    delay: bool,
    ckpt: bool,
    tied: bool,
    /// Clip to this norm (0: off; with offload the update then overlaps the last backward).
    max_norm: f64,
    /// Announce each step's last micro-step (`last_micro_step`), as the trainer does: its
    /// backward all-reduces across the replicas; otherwise the step does.
    announce: bool,
    /// Micro-steps a step; with offload, one keeps the gradients on the host only.
    accum: usize,
}

impl Case {
    fn config(&self, shard_group: Option<usize>, seed: u64) -> EngineConfig {
        // AdamW's update g / (|g| + eps) turns the rounding of an element whose gradient
        // cancels to ~0 into a step of up to the learning rate (5e-5 here at eps 1e-8, for
        // 4 ranks without hybrid sharding too); at eps 1e-3 the update is near linear in g,
        // so the comparison sees the reductions, not that amplification.
        let adamw = zrun_optim::AdamWConfig {
            eps: 1e-3,
            ..adamw()
        };
        let mut c = EngineConfig::fp32(self.stage, Device::Cpu, seed, adamw);
        c.precision = self.precision;
        c.activation_checkpointing = self.ckpt;
        c.shard_group = shard_group;
        if self.offload {
            c.offload = Offload::Cpu;
        }
        if self.delay {
            c.offload_delay = Some(1);
        }
        if self.accum == 1 {
            c.one_micro_step = true;
            c.oom_recovery = false;
        }
        c
    }
}

/// Losses (the mean over the global batch), gradient norms and final parameters.
struct Trained {
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<(String, Tensor)>,
}

/// Trains `e` for the steps in `steps`, on the global batch (`rank` None) or on `rank`'s
/// part of it; a rank's losses are averaged over the world.
fn train(e: &mut Engine, c: &Case, steps: &[usize], rank: Option<usize>) -> Trained {
    let mut t = Trained {
        losses: Vec::new(),
        norms: Vec::new(),
        params: Vec::new(),
    };
    for &s in steps {
        for m in 0..c.accum {
            let (x, y) = match rank {
                Some(r) => rank_batch(s, m, r),
                None => global_batch(s, m),
            };
            if c.offload && m + 1 == c.accum {
                e.prepare_step(LR, c.max_norm);
            } else if c.announce && m + 1 == c.accum {
                e.last_micro_step();
            }
            let loss = e.forward_backward(&x, &y, 1.0 / c.accum as f64).unwrap();
            t.losses.push(match rank {
                Some(_) => world_mean(e.comm(), loss),
                None => loss,
            });
        }
        let stats = e.step(LR, c.max_norm).unwrap();
        assert!(stats.applied, "{c:?}: {stats:?}");
        t.norms.push(stats.grad_norm);
    }
    t.params = e.full_parameters().unwrap();
    t
}

fn world_mean(comm: &Arc<dyn Communicator>, v: f64) -> f64 {
    let t = Tensor::from_slice(&[v as f32]);
    comm.all_reduce(&t, ReduceOp::Avg).unwrap().wait().unwrap();
    t.double_value(&[0])
}

/// Every parameter of `params` in one flat fp32 tensor.
fn flat(params: &[(String, Tensor)]) -> Tensor {
    let parts: Vec<Tensor> = params
        .iter()
        .map(|(_, t)| t.to_kind(Kind::Float).reshape([-1]))
        .collect();
    Tensor::cat(&parts, 0)
}

/// The largest absolute difference of two parameter lists.
fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    for ((n, _), (m, _)) in a.iter().zip(b) {
        assert_eq!(n, m);
    }
    (flat(a) - flat(b)).abs().max().double_value(&[])
}

/// Asserts that every rank holds the same parameters, bit for bit, as the rank at its
/// position in the first shard group (they are replicas).
fn assert_replicas_equal(e: &Engine, params: &[(String, Tensor)], what: &str) {
    let mine = flat(params);
    let n = mine.numel() as i64;
    let all = Tensor::zeros([n * WORLD as i64], (Kind::Float, Device::Cpu));
    e.comm().all_gather(&mine, &all).unwrap().wait().unwrap();
    let g = e.layout().world_size;
    for r in 0..WORLD as i64 {
        let first = all.narrow(0, (r % g) * n, n);
        assert!(
            all.narrow(0, r * n, n).equal(&first),
            "{what}: rank {r}'s parameters differ from its replica's in the first shard group"
        );
    }
}

/// Saves `e`'s optimizer state as a checkpoint would (the first shard group writes, the
/// others write nothing), hands each rank the part its replica in the first group wrote,
/// loads it into a fresh engine of another seed (every rank reads its owned range) and
/// checks that the two then train on identically.
fn round_trip(e: &mut Engine, c: &Case, fresh: Engine) {
    let mut f = fresh;
    let units = e.layout().units.len();
    let (replica, pos) = (e.layout().replica, e.layout().rank);
    let mut mine: Vec<f32> = Vec::new();
    for u in 0..units {
        let (saved, owned) = (e.saved_range(u), e.owned_range(u));
        assert_eq!(e.loaded_range(u), owned, "{c:?}: unit {u}");
        if replica == 0 {
            assert_eq!(saved, owned, "{c:?}: unit {u}");
        } else {
            assert_eq!(
                saved.1, 0,
                "{c:?}: unit {u}: a second replica writes nothing"
            );
        }
        e.visit_unit_state::<zrun_shard::Error>(u, |_, bytes| {
            mine.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap())),
            );
            Ok(())
        })
        .unwrap();
    }
    // Three parts of at most a shard each, whatever the rank.
    let cap = 3 * e.layout().shard_numel();
    assert!(mine.len() as i64 <= cap);
    mine.resize(cap as usize, 0.0);
    let all = Tensor::zeros([cap * WORLD as i64], (Kind::Float, Device::Cpu));
    e.comm()
        .all_gather(&Tensor::from_slice(&mine), &all)
        .unwrap()
        .wait()
        .unwrap();
    // The first shard group's rank at this rank's position wrote this rank's range.
    let from: Vec<f32> = Vec::try_from(&all.narrow(0, pos * cap, cap)).unwrap();
    let mut at = 0usize;
    for u in 0..units {
        f.load_unit_with::<zrun_shard::Error>(u, |_part: StatePart, buf| {
            buf.copy_from_slice(&from[at..at + buf.len()]);
            at += buf.len();
            Ok(())
        })
        .unwrap();
    }
    f.finish_load(e.counters().unwrap()).unwrap();
    let (a, b) = (e.full_parameters().unwrap(), f.full_parameters().unwrap());
    assert_eq!(max_diff(&a, &b), 0.0, "{c:?}: loaded parameters");
    let rank = e.comm().rank();
    let more = [STEPS];
    let (ta, tb) = (
        train(e, c, &more, Some(rank)),
        train(&mut f, c, &more, Some(rank)),
    );
    assert_eq!(ta.losses, tb.losses, "{c:?}: after loading");
    assert_eq!(
        max_diff(&ta.params, &tb.params),
        0.0,
        "{c:?}: after loading"
    );
}

fn case(stage: Stage, group: usize) -> Case {
    Case {
        stage,
        group,
        precision: Precision::Fp32,
        offload: false,
        delay: false,
        ckpt: false,
        tied: false,
        max_norm: 0.05,
        announce: true,
        accum: ACCUM,
    }
}

fn training_worker() {
    let topo = Topology::from_env().unwrap();
    let comm: Arc<dyn Communicator> =
        Arc::from(zrun_comm::init(&topo, Backend::Tcp, COMM_TIMEOUT).unwrap());
    let rank = comm.rank();
    let cases = [
        case(Stage::Zero1, 2),
        Case {
            offload: true,
            max_norm: 0.0,
            ..case(Stage::Zero2, 2)
        },
        Case {
            ckpt: true,
            tied: true,
            ..case(Stage::Zero3, 2)
        },
        Case {
            offload: true,
            delay: true,
            ..case(Stage::Zero3, 2)
        },
        case(Stage::Zero2, 1),
        // Groups of one gather nothing: every unit (and the tied one) read in place.
        Case {
            tied: true,
            ..case(Stage::Zero3, 1)
        },
        Case {
            announce: false,
            ..case(Stage::Zero2, 2)
        },
        Case {
            precision: Precision::Bf16,
            ..case(Stage::Zero3, 2)
        },
        // One micro-step a step with offload: gradients on the host only, the tied part
        // held until its owner's, reduced shards all-reduced across the replicas in place.
        Case {
            offload: true,
            tied: true,
            accum: 1,
            ..case(Stage::Zero3, 2)
        },
        Case {
            offload: true,
            max_norm: 0.0,
            accum: 1,
            ..case(Stage::Zero2, 1)
        },
    ];
    let steps: Vec<usize> = (0..STEPS).collect();
    for c in cases {
        let m = model(c.tied);
        let mut reference = Engine::new(m.clone(), common::single(), c.config(None, SEED)).unwrap();
        let want = train(&mut reference, &c, &steps, None);
        let mut e = Engine::new(m.clone(), comm.clone(), c.config(Some(c.group), SEED)).unwrap();
        let l = e.layout();
        assert_eq!(
            (l.rank, l.world_size, l.replica, l.replicas),
            (
                (rank % c.group) as i64,
                c.group as i64,
                (rank / c.group) as i64,
                (WORLD / c.group) as i64
            ),
            "{c:?}"
        );
        let on_host = c.offload && c.accum == 1;
        assert_eq!(e.memory().grads == 0, on_host, "{c:?}");
        let got = train(&mut e, &c, &steps, Some(rank));
        assert_replicas_equal(&e, &got.params, &format!("{c:?}"));
        let diff = max_diff(&got.params, &want.params);
        let loss_err = got
            .losses
            .iter()
            .zip(&want.losses)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        let norm_err = got
            .norms
            .iter()
            .zip(&want.norms)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        println!(
            "rank {rank}: {c:?}: parameters within {diff:e}, losses {loss_err:e}, norms {norm_err:e}"
        );
        // bf16 rounds the forward of 2 sequences otherwise than that of 8.
        let (tol_p, tol_l) = match c.precision {
            Precision::Fp32 => (TOL, TOL),
            _ => (2e-3, 1e-2),
        };
        assert!(diff <= tol_p, "{c:?}: parameters differ by {diff:e}");
        assert!(
            loss_err <= tol_l,
            "{c:?}: losses {:?} vs {:?}",
            got.losses,
            want.losses
        );
        assert!(
            norm_err <= tol_l,
            "{c:?}: norms {:?} vs {:?}",
            got.norms,
            want.norms
        );
        if c.stage == Stage::Zero2 && !c.offload {
            // Two reduce-scatters in flight (the all-reduce across the replicas is in place
            // on the gradient shards): two consecutive units' shards at most (fp32), besides
            // AdamW's scratch and the out-of-memory reserve. A shard group of one
            // reduce-scatters in place: no shard buffer at all.
            let s: Vec<i64> = e
                .layout()
                .units
                .iter()
                .rev()
                .map(|l| 4 * l.shard_len())
                .collect();
            let window = s.windows(2).map(|w| w.iter().sum::<i64>()).max().unwrap();
            let scratch = zrun_optim::AdamW::scratch_bytes_for(e.layout().shard_numel());
            assert_eq!(
                e.memory().buffers - scratch - e.oom_reserve_bytes(),
                if c.group == 1 { 0 } else { window },
                "{c:?}: bytes in flight"
            );
        }
        if c.stage == Stage::Zero3 {
            // Stage 3 holds gathered only the unit in use, those prefetched and a tied owner;
            // a shard group of one gathers nothing (its shard holds every unit whole).
            let prefetch = c.config(Some(c.group), SEED).prefetch as i64;
            let biggest = e.layout().units.iter().map(|l| l.padded).max().unwrap();
            let bound = (prefetch + 2) * biggest * c.precision.bytes();
            let peak = e.gathered_peak();
            if c.group == 1 {
                assert_eq!(peak, 0, "{c:?}: bytes gathered");
            } else {
                assert!(
                    peak > 0 && peak <= bound,
                    "{c:?}: {peak} bytes gathered, bound {bound}"
                );
            }
        }
        // (A delayed update's checkpoint also holds the stale parameters: not copied here.)
        if c.precision == Precision::Fp32 && !c.delay {
            let fresh = Engine::new(m, comm.clone(), c.config(Some(c.group), SEED + 1)).unwrap();
            round_trip(&mut e, &c, fresh);
        }
    }
}

/// Rank 1 (first shard group) fails in the forward of step 1 and rank 2 (second group) in
/// the loss of step 2; each finishes its micro-step's collectives with stand-ins, every rank
/// drops the step, and the run equals one rank's that never took those steps.
fn recovery_worker() {
    let topo = Topology::from_env().unwrap();
    let comm: Arc<dyn Communicator> =
        Arc::from(zrun_comm::init(&topo, Backend::Tcp, COMM_TIMEOUT).unwrap());
    let rank = comm.rank();
    let c = Case {
        tied: true,
        ..case(Stage::Zero3, 2)
    };
    let m = model(c.tied);
    let mut e = Engine::new(m.clone(), comm.clone(), c.config(Some(c.group), SEED)).unwrap();
    let fails = |s: usize| (s == 1 && rank == 1) || (s == 2 && rank == 2);
    for s in 0..4 {
        let before = flat(&e.full_parameters().unwrap());
        let (x, y) = rank_batch(s, 0, rank);
        // As the trainer does: the failed micro-step's stand-ins include the all-reduces
        // across the replicas that the last micro-step issues.
        e.last_micro_step();
        let failed = if fails(s) {
            let (x, y) = if s == 1 {
                // Token ids past the vocabulary: the embedding fails.
                (x + VOCAB, y)
            } else {
                // Targets of another shape: the loss fails.
                (x, y.narrow(1, 0, SEQ - 1))
            };
            let err = e.forward_backward(&x, &y, 1.0).unwrap_err();
            let err = err.to_string();
            let first = err.lines().next().unwrap_or_default();
            println!("rank {rank}: step {s} failed in {}: {first}", e.phase());
            e.finish_failed_micro_step().unwrap();
            true
        } else {
            e.forward_backward(&x, &y, 1.0).unwrap();
            false
        };
        let flag = Tensor::from_slice(&[f32::from(u8::from(failed))]);
        comm.all_reduce(&flag, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        if flag.double_value(&[0]) > 0.0 {
            e.abandon_step().unwrap();
            let after = flat(&e.full_parameters().unwrap());
            assert!(
                after.equal(&before),
                "step {s}: a dropped step changed the parameters"
            );
        } else {
            assert!(e.step(LR, c.max_norm).unwrap().applied);
        }
    }
    let got = e.full_parameters().unwrap();
    assert_replicas_equal(&e, &got, "after recovering");
    // One rank on the steps that were kept (one micro-step each).
    let mut reference = Engine::new(m, common::single(), c.config(None, SEED)).unwrap();
    for s in [0, 3] {
        let (x, y) = global_batch(s, 0);
        reference.forward_backward(&x, &y, 1.0).unwrap();
        reference.step(LR, c.max_norm).unwrap();
    }
    let diff = max_diff(&got, &reference.full_parameters().unwrap());
    assert!(
        diff <= TOL,
        "parameters differ from the kept steps' by {diff:e}"
    );
}

/// Runs this test's body in `WORLD` processes over tcp; returns their output.
fn spawn(name: &str) -> String {
    let token = format!("test-token-{}", std::process::id());
    let server = StoreServer::start("127.0.0.1:0", &token).unwrap();
    let exe = std::env::current_exe().unwrap();
    let t = Instant::now();
    let mut children: Vec<_> = (0..WORLD)
        .map(|r| {
            Command::new(&exe)
                .args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE, name)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", WORLD.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", WORLD.to_string())
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
    // Read the pipes as the ranks write, so none blocks on a full pipe.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let (mut out, mut err) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = out.read_to_string(&mut s);
                let _ = err.read_to_string(&mut s);
                s
            })
        })
        .collect();
    let mut codes = vec![None; WORLD];
    while codes.iter().any(Option::is_none) && t.elapsed() < 2 * COMM_TIMEOUT {
        for (c, code) in children.iter_mut().zip(&mut codes) {
            if code.is_none() {
                *code = c.try_wait().unwrap().map(|s| s.code());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = String::new();
    for (r, (mut c, h)) in children.into_iter().zip(readers).enumerate() {
        let _ = c.kill();
        let _ = c.wait();
        out.push_str(&format!("== rank {r}: exit {:?}\n", codes[r]));
        out.push_str(&h.join().unwrap_or_default());
    }
    drop(server);
    assert!(
        codes.iter().all(|c| *c == Some(Some(0))),
        "after {:?}:\n{out}",
        t.elapsed()
    );
    println!("{name}: {:?}\n{out}", t.elapsed());
    out
}

#[test]
fn two_shard_groups_of_two_train_as_one_rank_at_every_sharded_stage() {
    const NAME: &str = "two_shard_groups_of_two_train_as_one_rank_at_every_sharded_stage";
    if std::env::var(ROLE).is_ok_and(|r| r == NAME) {
        return training_worker();
    }
    spawn(NAME);
}

#[test]
fn hybrid_ranks_that_fail_a_micro_step_keep_both_groups_in_step() {
    const NAME: &str = "hybrid_ranks_that_fail_a_micro_step_keep_both_groups_in_step";
    if std::env::var(ROLE).is_ok_and(|r| r == NAME) {
        return recovery_worker();
    }
    let out = spawn(NAME);
    assert!(out.contains("step 1 failed in forward of unit"), "{out}");
    assert!(out.contains("step 2 failed in loss"), "{out}");
}
