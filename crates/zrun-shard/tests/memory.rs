//! The engine's model-state bytes per rank equal the ZeRO formula plus padding, for every
//! stage and precision: (2+2+12)Ψ, 4Ψ+12Ψ/W, 2Ψ+14Ψ/W, 16Ψ/W for bf16 + AdamW with bf16
//! gradients, and the fp32 equivalents. Ψ is computed here from the parameter shapes.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use common::adamw;
use std::sync::Arc;
use tch::{Device, Tensor};
use zrun_comm::{Backend, Communicator, Error, ReduceOp, Work};
use zrun_models::{Gpt, GptConfig, Model};
use zrun_shard::{Engine, EngineConfig, Offload, Precision, ReduceDtype, Stage, StateDtype};

/// Rank and world size only: building an engine allocates but never communicates. With
/// hybrid sharding over groups of `group` its splits answer as the engine makes them, the
/// shard group's first (position `rank % group` of `group`), then the replica group's
/// (`rank / group` of `world / group`).
struct Placement {
    rank: usize,
    world: usize,
    group: usize,
    splits: std::sync::atomic::AtomicUsize,
}

impl Placement {
    /// `rank` of `world`, sharding over all ranks.
    fn at(rank: usize, world: usize) -> Placement {
        Placement::grouped(rank, world, world)
    }

    /// `rank` of `world`, sharding over groups of `group`.
    fn grouped(rank: usize, world: usize, group: usize) -> Placement {
        Placement {
            rank,
            world,
            group,
            splits: Default::default(),
        }
    }
}

impl Communicator for Placement {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn backend(&self) -> Backend {
        Backend::Tcp
    }
    fn all_gather(&self, _: &Tensor, _: &Tensor) -> Result<Work, Error> {
        unreachable!("construction does not communicate")
    }
    fn reduce_scatter(&self, _: &Tensor, _: &Tensor, _: ReduceOp) -> Result<Work, Error> {
        unreachable!("construction does not communicate")
    }
    fn all_reduce(&self, _: &Tensor, _: ReduceOp) -> Result<Work, Error> {
        unreachable!("construction does not communicate")
    }
    fn broadcast(&self, _: &Tensor, _: usize) -> Result<Work, Error> {
        unreachable!("construction does not communicate")
    }
    fn barrier(&self) -> Result<Work, Error> {
        unreachable!("construction does not communicate")
    }
    fn split(&self, _: usize, _: usize) -> Result<Box<dyn Communicator>, Error> {
        let n = self
            .splits
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let (rank, world) = match n {
            0 => (self.rank % self.group, self.group),
            _ => (self.rank / self.group, self.world / self.group),
        };
        Ok(Box::new(Placement::at(rank, world)))
    }
}

fn tiny() -> Arc<dyn Model> {
    Arc::new(Gpt::new(GptConfig::preset("tiny").unwrap()).unwrap())
}

#[test]
fn model_state_bytes_per_rank_equal_the_zero_formula() {
    // Odd sizes so that units need padding at every world size.
    let gpt = Gpt::new(GptConfig {
        vocab_size: 101,
        seq_len: 13,
        n_layer: 3,
        n_head: 3,
        d_model: 21,
        init_std: 0.02,
        tied: false,
    })
    .unwrap();
    let model: Arc<dyn Model> = Arc::new(gpt);
    let adamw = adamw();
    let mut padded_somewhere = false;
    for world in 1..=4i64 {
        // Ψ with padding: every unit rounded up to a multiple of W x SHARD_ALIGN; Ψ/W is
        // exact.
        let step = world * zrun_shard::SHARD_ALIGN;
        let psi: i64 = model
            .units()
            .iter()
            .map(|u| {
                let n: i64 = u
                    .params()
                    .iter()
                    .map(|p| p.shape.iter().product::<i64>())
                    .sum();
                (n + step - 1) / step * step
            })
            .sum();
        let s = psi / world;
        padded_somewhere |= psi > model.param_count();
        let cases = [
            // (precision, reduce dtype, stage, params, grads, master, optimizer)
            (
                Precision::Fp32,
                ReduceDtype::Fp32,
                Stage::Zero0,
                4 * psi,
                4 * psi,
                0,
                8 * psi,
            ),
            (
                Precision::Fp32,
                ReduceDtype::Fp32,
                Stage::Zero1,
                4 * psi,
                4 * psi,
                0,
                8 * s,
            ),
            (
                Precision::Fp32,
                ReduceDtype::Fp32,
                Stage::Zero2,
                4 * psi,
                4 * s,
                0,
                8 * s,
            ),
            (
                Precision::Fp32,
                ReduceDtype::Fp32,
                Stage::Zero3,
                4 * s,
                4 * s,
                0,
                8 * s,
            ),
            (
                Precision::Bf16,
                ReduceDtype::Bf16,
                Stage::Zero0,
                2 * psi,
                2 * psi,
                4 * psi,
                8 * psi,
            ),
            (
                Precision::Bf16,
                ReduceDtype::Bf16,
                Stage::Zero1,
                2 * psi,
                2 * psi,
                4 * s,
                8 * s,
            ),
            (
                Precision::Bf16,
                ReduceDtype::Bf16,
                Stage::Zero2,
                2 * psi,
                2 * s,
                4 * s,
                8 * s,
            ),
            (
                Precision::Bf16,
                ReduceDtype::Bf16,
                Stage::Zero3,
                2 * s,
                2 * s,
                4 * s,
                8 * s,
            ),
            (
                Precision::Bf16,
                ReduceDtype::Fp32,
                Stage::Zero2,
                2 * psi,
                4 * s,
                4 * s,
                8 * s,
            ),
            (
                Precision::Fp16,
                ReduceDtype::Fp32,
                Stage::Zero3,
                2 * s,
                4 * s,
                4 * s,
                8 * s,
            ),
        ];
        for (precision, reduce_dtype, stage, params, grads, master, optimizer) in cases {
            for rank in 0..world {
                let comm = Arc::new(Placement::at(rank as usize, world as usize));
                let cfg = EngineConfig {
                    precision,
                    reduce_dtype,
                    ..EngineConfig::fp32(stage, Device::Cpu, 1, adamw)
                };
                let m = Engine::new(model.clone(), comm, cfg).unwrap().memory();
                let what = format!(
                    "{precision} reduce {reduce_dtype} stage {stage} W={world} rank {rank}"
                );
                assert_eq!(
                    (m.params, m.grads, m.master, m.optimizer),
                    (params, grads, master, optimizer),
                    "{what}"
                );
                // The paper's totals, for bf16 with bf16 gradients and for fp32.
                let total = match (precision, reduce_dtype, stage) {
                    (Precision::Bf16, ReduceDtype::Bf16, Stage::Zero0) => Some(16 * psi),
                    (Precision::Bf16, ReduceDtype::Bf16, Stage::Zero1) => Some(4 * psi + 12 * s),
                    (Precision::Bf16, ReduceDtype::Bf16, Stage::Zero2) => Some(2 * psi + 14 * s),
                    (Precision::Bf16, ReduceDtype::Bf16, Stage::Zero3) => Some(16 * s),
                    (Precision::Fp32, _, Stage::Zero0) => Some(16 * psi),
                    (Precision::Fp32, _, Stage::Zero1) => Some(8 * psi + 8 * s),
                    (Precision::Fp32, _, Stage::Zero2) => Some(4 * psi + 12 * s),
                    (Precision::Fp32, _, Stage::Zero3) => Some(16 * s),
                    _ => None,
                };
                if let Some(t) = total {
                    assert_eq!(m.model_states(), t, "{what}: total");
                }
            }
        }
    }
    assert!(padded_somewhere, "the sizes must exercise padding");
}

#[test]
fn the_static_plan_matches_what_the_engine_allocates() {
    let model = tiny();
    let adamw = adamw();
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for (precision, reduce_dtype) in [
            (Precision::Fp32, ReduceDtype::Fp32),
            (Precision::Bf16, ReduceDtype::Fp32),
            (Precision::Bf16, ReduceDtype::Bf16),
            (Precision::Fp16, ReduceDtype::Fp32),
        ] {
            let comm = Arc::new(Placement::at(1, 3));
            let cfg = EngineConfig {
                precision,
                reduce_dtype,
                ..EngineConfig::fp32(stage, Device::Cpu, 1, adamw)
            };
            let e = Engine::new(model.clone(), comm, cfg).unwrap();
            let plan = zrun_shard::MemoryLedger::plan(e.layout(), stage, precision, reduce_dtype);
            assert_eq!(
                plan,
                zrun_shard::MemoryLedger {
                    buffers: 0,
                    ..e.memory()
                },
                "{stage} {precision} {reduce_dtype}"
            );
        }
    }
}

#[test]
fn the_init_buffers_go_back_to_the_system_once_the_engine_is_built() {
    // The parameters are initialised in an fp32 host buffer, cast and dropped: the caching
    // CPU allocator must not keep it. The offloaded master is initialised where it lives: no
    // second init buffer ever lives beside the host state (on a GPU machine an 8B model's
    // 30 GiB beside the 105 GiB of pinned state would not fit its 128 GiB).
    zrun_torch_ext::install_cpu_caching_allocator(None).unwrap();
    let cfg = EngineConfig {
        precision: Precision::Bf16,
        offload: Offload::Cpu,
        ..EngineConfig::fp32(Stage::Zero3, Device::Cpu, 1, adamw())
    };
    zrun_torch_ext::reset_cpu_peak();
    let before = zrun_torch_ext::cpu_memory_stats().unwrap();
    let e = Engine::new(tiny(), Arc::new(Placement::at(0, 1)), cfg).unwrap();
    let after = zrun_torch_ext::cpu_memory_stats().unwrap();
    let init = 4 * e.layout().shard_numel() as u64;
    assert!(
        after.peak_reserved - before.reserved >= init,
        "an fp32 init buffer ({init} bytes) came from the caching allocator"
    );
    let over = after.peak_allocated - after.allocated;
    assert!(
        over < init / 4,
        "Engine::new's peak was {over} bytes over what it holds; an init buffer is {init}"
    );
    let cached = after.reserved - after.allocated;
    assert!(
        cached < init / 4,
        "{cached} bytes cached after Engine::new, an init buffer is {init}"
    );
}

#[test]
fn offloaded_optimizer_bytes_are_on_the_host_and_none_on_the_device() {
    let model = tiny();
    let adamw = adamw();
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for (precision, state, moment_bytes) in [
            (Precision::Fp32, StateDtype::Fp32, 8),
            (Precision::Bf16, StateDtype::Bf16, 4),
        ] {
            let comm = Arc::new(Placement::at(1, 2));
            let cfg = EngineConfig {
                precision,
                offload: Offload::Cpu,
                optimizer_state_dtype: state,
                ..EngineConfig::fp32(stage, Device::Cpu, 1, adamw)
            };
            let e = Engine::new(model.clone(), comm, cfg).unwrap();
            let m = e.memory();
            let s = e.layout().shard_numel();
            let what = format!("stage {stage} {precision} state {state}");
            assert_eq!(
                (m.optimizer, m.master),
                (0, 0),
                "{what}: nothing of the optimizer on the device"
            );
            assert_eq!(
                m.host,
                4 * s + moment_bytes * s,
                "{what}: fp32 master + moments on the host"
            );
            assert_eq!(m.device_model_states(), m.params + m.grads, "{what}");
            // Stage 1 stages the owned slices of its full gradient buffer on the host; at
            // stages 2-3 on the host the gradient shard itself is read in place, no copy.
            let staged = if stage == Stage::Zero1 { 4 * s } else { 0 };
            assert_eq!(
                m.buffers,
                staged + e.oom_reserve_bytes(),
                "{what}: host gradient staging and the out-of-memory reserve"
            );
        }
    }
    // Stage 0 has nothing sharded to offload: a clear error.
    let comm = Arc::new(Placement::at(0, 2));
    let cfg = EngineConfig {
        offload: Offload::Cpu,
        ..EngineConfig::fp32(Stage::Zero0, Device::Cpu, 1, adamw)
    };
    let err = Engine::new(model, comm, cfg).err().unwrap().to_string();
    assert!(err.contains("zero.stage to 1, 2 or 3"), "{err}");
}

#[test]
fn stages_2_and_3_reserve_the_largest_unit_for_out_of_memory_recovery() {
    let model = tiny();
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for (precision, reduce_dtype) in [
            (Precision::Fp32, ReduceDtype::Fp32),
            (Precision::Bf16, ReduceDtype::Fp32),
            (Precision::Bf16, ReduceDtype::Bf16),
        ] {
            let comm = Arc::new(Placement::at(1, 3));
            let cfg = EngineConfig {
                precision,
                reduce_dtype,
                ..EngineConfig::fp32(stage, Device::Cpu, 1, adamw())
            };
            let e = Engine::new(model.clone(), comm, cfg).unwrap();
            let largest = e.layout().units.iter().map(|l| l.padded).max().unwrap();
            // Stand-in reduce-scatters read the reduce dtype; stage 3's gathers write the
            // compute dtype; one at a time, so one buffer of the wider serves both.
            let rb = if reduce_dtype == ReduceDtype::Fp32 {
                4
            } else {
                2
            };
            let want = match stage {
                Stage::Zero0 | Stage::Zero1 => 0,
                Stage::Zero2 => largest * rb,
                Stage::Zero3 => largest * rb.max(precision.bytes()),
            };
            let what = format!("stage {stage} {precision} reduce {reduce_dtype}");
            assert_eq!(e.oom_reserve_bytes(), want, "{what}");
            // A run that stops at an out-of-memory issues no stand-ins: nothing reserved.
            let stop = EngineConfig {
                oom_recovery: false,
                ..cfg
            };
            let comm = Arc::new(Placement::at(1, 3));
            let e0 = Engine::new(model.clone(), comm, stop).unwrap();
            assert_eq!(e0.oom_reserve_bytes(), 0, "{what}");
            let owned = if stage == Stage::Zero0 {
                e.layout().full_numel()
            } else {
                e.layout().shard_numel()
            };
            assert_eq!(
                e.memory().buffers,
                zrun_optim::AdamW::scratch_bytes_for(owned) + want,
                "{what}: AdamW scratch and the reserve"
            );
        }
    }
}

#[test]
fn the_estimators_model_states_equal_the_engines_ledger_everywhere() {
    let model = tiny();
    let mut cases = 0;
    for world in 1..=4usize {
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for (precision, reduce_dtype) in [
                (Precision::Fp32, ReduceDtype::Fp32),
                (Precision::Bf16, ReduceDtype::Fp32),
                (Precision::Bf16, ReduceDtype::Bf16),
                (Precision::Fp16, ReduceDtype::Fp32),
            ] {
                for (offload, state) in [
                    (Offload::None, StateDtype::Fp32),
                    (Offload::Cpu, StateDtype::Fp32),
                    (Offload::Cpu, StateDtype::Bf16),
                ] {
                    if offload == Offload::Cpu && stage == Stage::Zero0 {
                        continue;
                    }
                    // With one micro-step a step and no recovery, offloaded gradients live
                    // on the host at stages 2-3.
                    for one in [false, true] {
                        let rank = world - 1;
                        let comm = Arc::new(Placement::at(rank, world));
                        let cfg = EngineConfig {
                            precision,
                            reduce_dtype,
                            offload,
                            optimizer_state_dtype: state,
                            one_micro_step: one,
                            oom_recovery: !one,
                            ..EngineConfig::fp32(stage, Device::Cpu, 1, adamw())
                        };
                        let e = Engine::new(model.clone(), comm, cfg).unwrap();
                        let ec = e.estimate_config(2, 16);
                        let planned = zrun_shard::MemoryLedger::planned(e.layout(), &ec);
                        let what = format!(
                        "W={world} rank {rank} stage {stage} {precision} reduce {reduce_dtype} offload {offload:?} state {state} one micro-step {one}"
                    );
                        let on_host = offload == Offload::Cpu
                            && one
                            && matches!(stage, Stage::Zero2 | Stage::Zero3);
                        assert_eq!(ec.host_grads, on_host, "{what}");
                        assert_eq!(e.memory().grads == 0, on_host, "{what}");
                        assert_eq!(planned, e.memory(), "{what}");
                        // The estimate starts from the same ledger and adds the run's terms.
                        let est = zrun_shard::estimate(model.as_ref(), e.layout(), &ec);
                        assert_eq!(est.ledger, planned, "{what}");
                        let states = est.terms.iter().find(|t| t.name == "model states").unwrap();
                        assert_eq!(
                            states.bytes,
                            planned.total(),
                            "{what}: on CPU every byte is one memory"
                        );
                        assert!(est.peak_bytes > planned.total(), "{what}");
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 4 * (4 * 4 + 3 * 4 * 2));
}

#[test]
fn hybrid_sharding_holds_the_model_states_of_its_shard_group() {
    let model = tiny();
    let mut cases = 0;
    for (world, group) in [(4, 2), (4, 1), (6, 3), (6, 2)] {
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for (precision, reduce_dtype, offload) in [
                (Precision::Fp32, ReduceDtype::Fp32, Offload::None),
                (Precision::Bf16, ReduceDtype::Bf16, Offload::None),
                (Precision::Bf16, ReduceDtype::Fp32, Offload::Cpu),
            ] {
                if offload == Offload::Cpu && stage == Stage::Zero0 {
                    continue;
                }
                for rank in [0, world - 1] {
                    let cfg = EngineConfig {
                        precision,
                        reduce_dtype,
                        offload,
                        shard_group: Some(group),
                        ..EngineConfig::fp32(stage, Device::Cpu, 1, adamw())
                    };
                    let comm = Arc::new(Placement::grouped(rank, world, group));
                    let e = Engine::new(model.clone(), comm, cfg).unwrap();
                    // Stage 0 shards nothing: the shard group does not apply.
                    let (g, r) = match stage {
                        Stage::Zero0 => (world, rank),
                        _ => (group, rank % group),
                    };
                    let same = Arc::new(Placement::at(r, g));
                    let plain = EngineConfig {
                        shard_group: None,
                        ..cfg
                    };
                    let e_g = Engine::new(model.clone(), same, plain).unwrap();
                    let what = format!(
                        "W={world} G={group} rank {rank} stage {stage} {precision} reduce {reduce_dtype} offload {offload:?}"
                    );
                    // A rank alone keeps no out-of-memory reserve (no other rank waits in
                    // its collectives); a shard group of one with replicas does.
                    let alone = g == 1 && matches!(stage, Stage::Zero2 | Stage::Zero3);
                    if g == 1 {
                        assert_eq!(e_g.oom_reserve_bytes(), 0, "{what}: as a world of 1");
                    }
                    let reserve = if alone { e.oom_reserve_bytes() } else { 0 };
                    assert_eq!(alone, reserve > 0, "{what}");
                    let as_group = zrun_shard::MemoryLedger {
                        buffers: e_g.memory().buffers + reserve,
                        ..e_g.memory()
                    };
                    assert_eq!(e.memory(), as_group, "{what}: as a world of {g}");
                    let l = e.layout();
                    let hybrid = zrun_shard::ShardLayout::hybrid(
                        model.units(),
                        rank as i64,
                        world as i64,
                        g as i64,
                    )
                    .unwrap();
                    assert_eq!(
                        (l.rank, l.world_size, l.replica, l.replicas),
                        (
                            hybrid.rank,
                            hybrid.world_size,
                            hybrid.replica,
                            hybrid.replicas
                        ),
                        "{what}"
                    );
                    let ec = e.estimate_config(2, 16);
                    let planned = zrun_shard::MemoryLedger::planned(&hybrid, &ec);
                    assert_eq!(planned, e.memory(), "{what}");
                    let est = zrun_shard::estimate(model.as_ref(), &hybrid, &ec);
                    assert_eq!(est.ledger, planned, "{what}");
                    // The all-reduce across the replicas runs in place on the gradient
                    // shards: the peak is sharding's alone, except that a rank alone lays its
                    // gradients straight into its shards and keeps no reserve; a shard group
                    // of one with replicas lays each unit's gradient out flat (the reduce
                    // dtype), with one more perhaps in flight, beside its reserve.
                    let plain = zrun_shard::estimate(model.as_ref(), e_g.layout(), &ec);
                    let extra = est.peak_bytes - plain.peak_bytes;
                    if alone {
                        let rb = reduce_dtype.kind().elt_size_in_bytes() as i64;
                        let widest = l.units.iter().map(|u| u.padded).max().unwrap();
                        assert!(
                            extra > reserve && extra <= 2 * widest * rb + reserve,
                            "{what}: {extra}"
                        );
                    } else {
                        assert_eq!(extra, 0, "{what}");
                    }
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 4 * 2 * (2 + 3 * 3));
}
