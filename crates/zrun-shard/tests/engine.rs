//! The unit engine against whole-model autograd on the same units.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use common::{adamw, single, tokens};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};
use zrun_models::{forward_model, init_model_params, lm_loss, Gpt, GptConfig, Model};
use zrun_optim::AdamWConfig;
use zrun_shard::{Engine, EngineConfig, Precision, Stage};

const SEED: u64 = 11;

fn model() -> Arc<dyn Model> {
    model_with(false)
}

/// The GPT of these tests; `tied`: its head reads the token embedding (GPT-2's tying).
fn model_with(tied: bool) -> Arc<dyn Model> {
    let cfg = GptConfig {
        vocab_size: 97,
        seq_len: 24,
        n_layer: 4,
        n_head: 4,
        d_model: 32,
        init_std: 0.02,
        tied,
    };
    Arc::new(Gpt::new(cfg).unwrap())
}

fn engine_at(m: Arc<dyn Model>, stage: Stage) -> Engine {
    let cfg = EngineConfig::fp32(stage, Device::Cpu, SEED, adamw());
    Engine::new(m, single(), cfg).unwrap()
}

fn engine(m: Arc<dyn Model>) -> Engine {
    engine_at(m, Stage::Zero0)
}

fn max_rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let diff = (a - b).abs().max().double_value(&[]);
    diff / b.abs().max().double_value(&[]).max(1e-30)
}

#[test]
fn parameters_are_the_models_deterministic_init() {
    let m = model();
    let mut e = engine(m.clone());
    let reference = init_model_params(m.as_ref(), SEED, Kind::Float, Device::Cpu).unwrap();
    let names: Vec<String> = m
        .units()
        .iter()
        .flat_map(|u| u.params().iter().map(|p| p.name.clone()))
        .collect();
    let got = e.full_parameters().unwrap();
    assert_eq!(got.len(), names.len());
    for ((name, t), (want_name, want)) in
        got.iter().zip(names.iter().zip(reference.iter().flatten()))
    {
        assert_eq!(name, want_name);
        assert!(t.equal(want), "{name} differs from the model's init");
    }
}

#[test]
fn unit_by_unit_gradients_equal_whole_model_autograd() {
    let m = model();
    let mut e = engine(m.clone());
    let (x, y) = tokens(3, 3, 24, 97);
    // Two micro-steps with weights that sum to 1: the engine accumulates.
    let (x2, y2) = tokens(4, 3, 24, 97);
    let l1 = e.forward_backward(&x, &y, 0.25).unwrap();
    let l2 = e.forward_backward(&x2, &y2, 0.75).unwrap();

    // Independent baseline: the same parameters as ordinary leaves, one forward over the
    // whole model, one backward of the weighted loss.
    let leaves: Vec<Vec<Tensor>> = init_model_params(m.as_ref(), SEED, Kind::Float, Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|u| u.into_iter().map(|p| p.set_requires_grad(true)).collect())
        .collect();
    let loss1 = lm_loss(&forward_model(m.as_ref(), &leaves, &x).unwrap(), &y).unwrap();
    let loss2 = lm_loss(&forward_model(m.as_ref(), &leaves, &x2).unwrap(), &y2).unwrap();
    assert!((loss1.double_value(&[]) - l1).abs() < 1e-6 * l1.abs());
    assert!((loss2.double_value(&[]) - l2).abs() < 1e-6 * l2.abs());
    (loss1 * 0.25 + loss2 * 0.75).backward();

    let grads = e.local_gradients().unwrap();
    let mut checked = 0;
    for ((name, g), want) in grads.iter().zip(leaves.iter().flatten()) {
        let want = want.grad();
        assert!(
            want.abs().max().double_value(&[]) > 0.0,
            "{name}: baseline gradient is zero"
        );
        let err = max_rel_err(g, &want);
        assert!(err <= 1e-6, "{name}: max relative error {err:e}");
        checked += 1;
    }
    assert_eq!(
        checked,
        m.units().iter().map(|u| u.params().len()).sum::<usize>()
    );
}

#[test]
fn every_parameter_gets_a_gradient_and_step_clears_them() {
    let m = model();
    let mut e = engine(m);
    let (x, y) = tokens(5, 2, 24, 97);
    e.forward_backward(&x, &y, 1.0).unwrap();
    for (name, g) in e.local_gradients().unwrap() {
        let used = g.abs().sum(Kind::Double).double_value(&[]);
        assert!(used > 0.0, "{name} has no gradient");
    }
    let before = e.full_parameters().unwrap()[0].1.copy();
    let stats = e.step(1e-3, 1.0).unwrap();
    assert!(stats.applied && stats.grad_norm > 0.0);
    assert!(
        !e.full_parameters().unwrap()[0].1.equal(&before),
        "the step changed nothing"
    );
    for (_, g) in e.local_gradients().unwrap() {
        assert_eq!(g.abs().sum(Kind::Double).double_value(&[]), 0.0);
    }
}

/// After a step the gradient buffer is not zeroed but marked stale: the next micro-steps'
/// gradients must be theirs alone (the first overwrites, the second adds), the tied matrix's
/// two parts included.
#[test]
fn the_gradients_after_a_step_are_the_next_micro_steps_alone() {
    for tied in [false, true] {
        for stage in [Stage::Zero0, Stage::Zero1] {
            let m = model_with(tied);
            let mut e = engine_at(m.clone(), stage);
            let (x, y) = tokens(7, 2, 24, 97);
            e.forward_backward(&x, &y, 1.0).unwrap();
            assert!(e.step(1e-2, 1.0).unwrap().applied);
            let (x2, y2) = tokens(8, 2, 24, 97);
            e.forward_backward(&x2, &y2, 0.5).unwrap();
            e.forward_backward(&x2, &y2, 0.5).unwrap();
            // Baseline: the stepped parameters as leaves, one backward of the batch's loss.
            let mut params = e.full_parameters().unwrap().into_iter();
            let leaves: Vec<Vec<Tensor>> = m
                .units()
                .iter()
                .map(|u| {
                    (0..u.params().len())
                        .map(|_| params.next().unwrap().1.set_requires_grad(true))
                        .collect()
                })
                .collect();
            let loss = lm_loss(&forward_model(m.as_ref(), &leaves, &x2).unwrap(), &y2).unwrap();
            loss.backward();
            for ((name, g), want) in e
                .local_gradients()
                .unwrap()
                .iter()
                .zip(leaves.iter().flatten())
            {
                let err = max_rel_err(g, &want.grad());
                assert!(err <= 1e-5, "tied {tied}, {stage:?}, {name}: {err:e}");
            }
        }
    }
}

#[test]
fn clipping_scales_gradients_to_the_max_norm() {
    let m = model();
    let mut a = engine(m.clone());
    let mut b = engine(m);
    let (x, y) = tokens(6, 2, 24, 97);
    a.forward_backward(&x, &y, 1.0).unwrap();
    b.forward_backward(&x, &y, 1.0).unwrap();
    // A huge clip threshold leaves gradients alone; a tiny one scales them.
    let sa = a.step(1e-3, 1e9).unwrap();
    let sb = b.step(1e-3, 1e-3).unwrap();
    assert_eq!(sa.clip_coef, 1.0);
    assert!((sb.clip_coef - 1e-3 / (sb.grad_norm + 1e-6)).abs() < 1e-12);
    assert!((sa.grad_norm - sb.grad_norm).abs() < 1e-9 * sa.grad_norm);
}

#[test]
fn every_stage_at_world_size_one_trains_identically() {
    // With one rank, sharding changes where things live, not the arithmetic.
    let m = model();
    let mut runs = Vec::new();
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let mut e = engine_at(m.clone(), stage);
        let mut losses = Vec::new();
        for k in 0..4 {
            let (x, y) = tokens(10 + k, 2, 24, 97);
            losses.push(e.forward_backward(&x, &y, 1.0).unwrap());
            e.step(1e-2, 0.5).unwrap();
        }
        runs.push((losses, e.full_parameters().unwrap()));
    }
    for (losses, params) in &runs[1..] {
        assert_eq!(losses, &runs[0].0);
        for ((n, a), (_, b)) in params.iter().zip(&runs[0].1) {
            assert!(a.equal(b), "{n} differs between stages");
        }
    }
}

fn train_losses(mut e: Engine, steps: i64) -> (Vec<f64>, Vec<(String, Tensor)>) {
    let mut losses = Vec::new();
    // One fixed batch: a working optimizer memorises it.
    let (x, y) = tokens(20, 2, 24, 97);
    for _ in 0..steps {
        losses.push(e.forward_backward(&x, &y, 1.0).unwrap());
        let s = e.step(1e-2, 1.0).unwrap();
        assert!(s.applied);
    }
    (losses, e.full_parameters().unwrap())
}

fn with(stage: Stage, f: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut cfg = EngineConfig::fp32(stage, Device::Cpu, SEED, adamw());
    f(&mut cfg);
    Engine::new(model(), single(), cfg).unwrap()
}

#[test]
fn activation_checkpointing_and_prefetch_depth_do_not_change_the_result() {
    for stage in [Stage::Zero0, Stage::Zero3] {
        let (want_l, want_p) = train_losses(with(stage, |_| {}), 3);
        for (ckpt, depth) in [(true, 1), (false, 0), (true, 3)] {
            let e = with(stage, |c| {
                c.activation_checkpointing = ckpt;
                c.prefetch = depth;
            });
            let (l, p) = train_losses(e, 3);
            assert_eq!(l, want_l, "stage {stage} ckpt {ckpt} prefetch {depth}");
            for ((n, a), (_, b)) in p.iter().zip(&want_p) {
                assert!(a.equal(b), "{n} differs with ckpt {ckpt} prefetch {depth}");
            }
        }
    }
}

/// Losses and final parameters of 4 steps at `stage` with a tied head, the chunked loss at
/// `chunk` logits (0: the full logits).
fn chunk_run(stage: Stage, ckpt: bool, precision: Precision, chunk: i64) -> Trained {
    // Adam turns a gradient's rounding into a whole step where the gradient is rounding
    // alone (the key bias's is 0 in exact arithmetic): a larger eps keeps those parameters
    // comparable.
    let adam = AdamWConfig {
        eps: 1e-3,
        ..adamw()
    };
    let mut cfg = EngineConfig::fp32(stage, Device::Cpu, SEED, adam);
    cfg.activation_checkpointing = ckpt;
    cfg.precision = precision;
    cfg.loss_chunk = chunk;
    train_losses(Engine::new(model_with(true), single(), cfg).unwrap(), 4)
}

type Trained = (Vec<f64>, Vec<(String, Tensor)>);

/// The largest relative difference of any parameter between two runs.
fn worst(a: &Trained, b: &Trained) -> f64 {
    a.1.iter()
        .zip(&b.1)
        .map(|((_, x), (_, y))| max_rel_err(x, y))
        .fold(0.0, f64::max)
}

#[test]
fn the_chunked_loss_trains_as_the_full_logits_do() {
    // 2 x 24 positions x V 97 in chunks of 776 logits: 8 rows at a time in the forward,
    // 16 columns in the backward.
    let chunk = 8 * 97;
    for (stage, ckpt) in [(Stage::Zero0, false), (Stage::Zero3, true)] {
        let full = chunk_run(stage, ckpt, Precision::Fp32, 0);
        let chunked = chunk_run(stage, ckpt, Precision::Fp32, chunk);
        for (a, b) in chunked.0.iter().zip(&full.0) {
            assert!(
                (a - b).abs() <= 1e-6 * b,
                "stage {stage} ckpt {ckpt}: {a} vs {b}"
            );
        }
        let w = worst(&chunked, &full);
        assert!(
            w <= 1e-5,
            "stage {stage} ckpt {ckpt}: parameters differ by {w}"
        );
    }
    // bf16: the input's gradient sums bf16-rounded chunks, so the runs differ by bf16
    // rounding; the chunked run stays as close to fp32 as the full logits' run.
    let fp32 = chunk_run(Stage::Zero2, false, Precision::Fp32, 0);
    let full = chunk_run(Stage::Zero2, false, Precision::Bf16, 0);
    let chunked = chunk_run(Stage::Zero2, false, Precision::Bf16, chunk);
    let (c, f) = (worst(&chunked, &fp32), worst(&full, &fp32));
    assert!(c <= 1.5 * f, "bf16 from fp32: chunked {c}, full logits {f}");
    for (a, b) in chunked.0.iter().zip(&full.0) {
        assert!((a - b).abs() <= 2e-3 * b, "bf16 loss: {a} vs {b}");
    }
}

#[test]
fn bf16_keeps_an_fp32_master_and_trains_like_fp32() {
    let (fp32_l, _) = train_losses(with(Stage::Zero0, |_| {}), 6);
    for stage in [Stage::Zero0, Stage::Zero2, Stage::Zero3] {
        let e = with(stage, |c| c.precision = Precision::Bf16);
        let m = e.memory();
        let psi = e.layout().full_numel();
        // One rank: every shard is the whole model. bf16 parameters, fp32 master and gradients.
        assert_eq!(m.params, 2 * psi);
        assert_eq!(m.master, 4 * psi);
        assert_eq!(m.grads, 4 * psi);
        assert_eq!(m.optimizer, 8 * psi);
        let (l, p) = train_losses(e, 6);
        assert!(
            p.iter().all(|(_, t)| t.kind() == Kind::Float),
            "master parameters are fp32"
        );
        for (a, b) in l.iter().zip(&fp32_l) {
            assert!(
                (a - b).abs() / b < 0.02,
                "stage {stage}: bf16 loss {a} vs fp32 {b}"
            );
        }
        assert!(l[5] < l[0]);
    }
}

#[test]
fn fp16_overflow_skips_the_step_halves_the_scale_and_recovers() {
    let mut e = with(Stage::Zero2, |c| {
        c.precision = Precision::Fp16;
        c.initial_loss_scale = 2f64.powi(30); // overflows fp16 in backward
        c.loss_scale_window = 20;
    });
    let before = e.full_parameters().unwrap();
    let mut skipped = 0;
    let mut losses = Vec::new();
    // One fixed batch: a working optimizer memorises it.
    let (x, y) = tokens(40, 2, 24, 97);
    for _ in 0..60 {
        losses.push(e.forward_backward(&x, &y, 1.0).unwrap());
        let s = e.step(1e-2, 1.0).unwrap();
        if !s.applied {
            skipped += 1;
            assert!(
                e.loss_scale() < s.loss_scale,
                "the scale halves after an overflow"
            );
            if skipped == 1 {
                // Nothing moved on a skipped step.
                for ((n, a), (_, b)) in e.full_parameters().unwrap().iter().zip(&before) {
                    assert!(a.equal(b), "{n} changed on a skipped step");
                }
            }
        }
    }
    assert!(skipped >= 1, "the huge initial scale must overflow");
    assert!(e.loss_scale() < 2f64.powi(30));
    assert!(
        losses[59] < losses[0] * 0.9,
        "training recovered: {} -> {}",
        losses[0],
        losses[59]
    );
}

#[test]
fn stage3_on_one_rank_reads_every_unit_in_place() {
    // One rank holds every unit whole in its shard: stage 3 then gathers nothing and
    // reduce-scatters in place, so no communication buffer is ever allocated (the gathered
    // window of more ranks is checked in tests/hybrid.rs).
    let mut e = engine_at(model_with(true), Stage::Zero3);
    let (x, y) = tokens(9, 2, 24, 97);
    e.forward_backward(&x, &y, 1.0).unwrap();
    e.step(1e-3, 1.0).unwrap();
    assert_eq!(
        e.gathered_peak(),
        0,
        "bytes gathered at stage 3 on one rank"
    );
    let scratch = zrun_optim::AdamW::scratch_bytes_for(e.layout().shard_numel());
    let in_flight = e.memory().buffers - scratch - e.oom_reserve_bytes();
    assert_eq!(
        in_flight, 0,
        "bytes of communication buffers at stage 3 on one rank"
    );
}

#[test]
fn stages_2_and_3_on_one_rank_allocate_in_a_micro_step_what_stage_0_does() {
    // A shard group of one lays each unit's gradients straight into its shard, as stages 0-1
    // do: no flat gradient of its own per unit, no copy of it. Counted from the second
    // micro-step, which accumulates (the first overwrites stale regions).
    let bytes = |stage: Stage| {
        let mut e = engine_at(model_with(true), stage);
        let (x, y) = tokens(9, 2, 24, 97);
        e.forward_backward(&x, &y, 0.5).unwrap();
        let (r, n) = zrun_torch_ext::count_allocations(|| e.forward_backward(&x, &y, 0.5)).unwrap();
        r.unwrap();
        n.bytes
    };
    let zero0 = bytes(Stage::Zero0);
    for stage in [Stage::Zero2, Stage::Zero3] {
        assert_eq!(bytes(stage), zero0, "stage {stage} against stage 0");
    }
}

/// Losses and final parameters of `steps` optimizer steps of two micro-steps each, clipped
/// to `max_norm` (0: off); `announce` calls `prepare_step` before the last micro-step, so the
/// offloaded update runs during backward (no clipping) or its gradients are staged then.
fn offload_run(
    mut e: Engine,
    steps: usize,
    announce: bool,
    max_norm: f64,
) -> (Vec<f64>, Vec<(String, Tensor)>) {
    let (x1, y1) = tokens(50, 4, 32, 256);
    let (x2, y2) = tokens(51, 4, 32, 256);
    let mut losses = Vec::new();
    for _ in 0..steps {
        losses.push(e.forward_backward(&x1, &y1, 0.5).unwrap());
        if announce {
            assert_eq!(e.prepare_step(2e-3, max_norm), max_norm <= 0.0);
        }
        losses.push(e.forward_backward(&x2, &y2, 0.5).unwrap());
        let s = e.step(2e-3, max_norm).unwrap();
        assert!(s.applied);
        assert!(max_norm <= 0.0 || s.clip_coef < 1.0, "clipped: {s:?}");
    }
    (losses, e.full_parameters().unwrap())
}

#[test]
fn one_rank_without_accumulation_trains_the_same_with_bf16_gradients() {
    // One rank, one micro-step a step, no tied parameter: each gradient is laid over its
    // region once, as autograd made it in bf16, so a bf16 gradient buffer holds exactly what
    // an fp32 one would (half the bytes: what an offloaded 8B model on one GPU may spend on
    // them), and training is the same.
    use zrun_shard::{Offload, ReduceDtype};
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for offload in [Offload::None, Offload::Cpu] {
            if offload == Offload::Cpu && stage == Stage::Zero0 {
                continue;
            }
            let run = |reduce_dtype| {
                let cfg = EngineConfig {
                    precision: Precision::Bf16,
                    reduce_dtype,
                    offload,
                    ..EngineConfig::fp32(stage, Device::Cpu, SEED, adamw())
                };
                let mut e = Engine::new(model_with(false), single(), cfg).unwrap();
                let mut out = Vec::new();
                for seed in 0..3 {
                    let (x, y) = tokens(60 + seed, 4, 24, 97);
                    let loss = e.forward_backward(&x, &y, 1.0).unwrap();
                    let s = e.step(2e-3, 0.05).unwrap();
                    assert!(s.clip_coef < 1.0, "clipped: {s:?}");
                    out.push((loss, s.grad_norm));
                }
                (out, e.full_parameters().unwrap())
            };
            let (fp32, p32) = run(ReduceDtype::Fp32);
            let (bf16, p16) = run(ReduceDtype::Bf16);
            let what = format!("stage {stage} offload {offload:?}");
            assert_eq!(fp32, bf16, "{what}: losses and norms");
            for ((n, a), (_, b)) in p32.iter().zip(&p16) {
                assert!(a.equal(b), "{what}: {n}");
            }
        }
    }
}

#[test]
fn offloaded_update_during_backward_equals_the_update_at_the_step() {
    use zrun_shard::Offload;
    for precision in [Precision::Fp32, Precision::Bf16] {
        for stage in [Stage::Zero2, Stage::Zero3] {
            // A model of 0.5M parameters, wide enough to learn in four steps.
            let wide = GptConfig {
                vocab_size: 256,
                seq_len: 32,
                n_layer: 2,
                n_head: 4,
                d_model: 128,
                init_std: 0.02,
                tied: false,
            };
            let make = || {
                let mut cfg = EngineConfig::fp32(stage, Device::Cpu, SEED, adamw());
                cfg.precision = precision;
                cfg.offload = Offload::Cpu;
                cfg.optimizer_threads = 2;
                Engine::new(Arc::new(Gpt::new(wide.clone()).unwrap()), single(), cfg).unwrap()
            };
            // Without clipping the update overlaps backward; with it (a norm of 0.5 clips
            // here) the gradients are staged during backward and the update waits.
            for max_norm in [0.0, 0.5] {
                let what = format!("{stage} {precision} max_norm {max_norm}");
                let (want_l, want_p) = offload_run(make(), 4, false, max_norm);
                let (got_l, got_p) = offload_run(make(), 4, true, max_norm);
                assert_eq!(got_l, want_l, "{what}: losses");
                assert!(want_l[7] < want_l[1], "{what}: trained {want_l:?}");
                for ((n, a), (_, b)) in got_p.iter().zip(&want_p) {
                    assert!(a.equal(b), "{what}: {n} differs");
                }
            }
        }
    }
    // Where the update needs the whole gradient first, it waits for the step.
    let mut e = with(Stage::Zero2, |c| c.offload = Offload::Cpu);
    assert!(!e.prepare_step(1e-2, 1.0), "clipping needs the global norm");
    let mut e1 = with(Stage::Zero1, |c| c.offload = Offload::Cpu);
    assert!(
        !e1.prepare_step(1e-2, 0.0),
        "stage 1 reduces after backward"
    );
    let mut e16 = with(Stage::Zero3, |c| {
        c.offload = Offload::Cpu;
        c.precision = Precision::Fp16;
    });
    assert!(
        !e16.prepare_step(1e-2, 0.0),
        "fp16 checks for overflow first"
    );
    let mut dev = with(Stage::Zero2, |_| {});
    assert!(
        !dev.prepare_step(1e-2, 0.0),
        "no offload, nothing to overlap"
    );
    // A step that disagrees with what was announced is refused.
    let (x, y) = tokens(52, 2, 24, 97);
    e = with(Stage::Zero2, |c| c.offload = Offload::Cpu);
    assert!(e.prepare_step(1e-2, 0.0));
    e.forward_backward(&x, &y, 1.0).unwrap();
    let err = e.step(2e-2, 0.0).unwrap_err().to_string();
    assert!(err.contains("must agree"), "{err}");
    // So is a micro-step after the one announced as the last.
    assert!(e.prepare_step(1e-2, 0.0));
    e.forward_backward(&x, &y, 1.0).unwrap();
    let err = e.forward_backward(&x, &y, 1.0).unwrap_err().to_string();
    assert!(err.contains("call step first"), "{err}");
    assert!(e.step(1e-2, 0.0).unwrap().applied);
}

#[test]
fn a_tied_embedding_gets_both_gradients_at_every_stage_and_setting() {
    let m = model_with(true);
    // Against whole-model autograd, where the one matrix is used twice.
    let mut e = engine(m.clone());
    let (x, y) = tokens(3, 3, 24, 97);
    e.forward_backward(&x, &y, 1.0).unwrap();
    let leaves: Vec<Vec<Tensor>> = init_model_params(m.as_ref(), SEED, Kind::Float, Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|u| u.into_iter().map(|p| p.set_requires_grad(true)).collect())
        .collect();
    lm_loss(&forward_model(m.as_ref(), &leaves, &x).unwrap(), &y)
        .unwrap()
        .backward();
    let grads = e.local_gradients().unwrap();
    assert_eq!(grads[0].0, "wte.weight");
    for ((name, g), want) in grads.iter().zip(leaves.iter().flatten()) {
        let err = max_rel_err(g, &want.grad());
        assert!(err <= 1e-6, "{name}: max relative error {err:e}");
    }
    // Sharding, prefetch and checkpointing move the second use, not the arithmetic.
    let make = |stage, f: &dyn Fn(&mut EngineConfig)| {
        let mut cfg = EngineConfig::fp32(stage, Device::Cpu, SEED, adamw());
        f(&mut cfg);
        Engine::new(model_with(true), single(), cfg).unwrap()
    };
    let (want_l, want_p) = train_losses(make(Stage::Zero0, &|_| {}), 3);
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for (ckpt, depth) in [(false, 1), (true, 1), (false, 0), (true, 3)] {
            let e = make(stage, &|c| {
                c.activation_checkpointing = ckpt;
                c.prefetch = depth;
            });
            let (l, p) = train_losses(e, 3);
            let what = format!("stage {stage} ckpt {ckpt} prefetch {depth}");
            assert_eq!(l, want_l, "{what}");
            for ((n, a), (_, b)) in p.iter().zip(&want_p) {
                assert!(a.equal(b), "{n} differs with {what}");
            }
        }
    }
}

#[test]
fn a_tied_embedding_is_updated_once_by_an_overlapped_offloaded_step() {
    // The head's share of the embedding's gradient arrives first: the update during backward
    // must wait for the embedding's own.
    let wide = GptConfig {
        vocab_size: 256,
        seq_len: 32,
        n_layer: 2,
        n_head: 4,
        d_model: 64,
        init_std: 0.02,
        tied: true,
    };
    let make = || {
        let mut cfg = EngineConfig::fp32(Stage::Zero3, Device::Cpu, SEED, adamw());
        cfg.offload = zrun_shard::Offload::Cpu;
        cfg.optimizer_threads = 2;
        Engine::new(Arc::new(Gpt::new(wide.clone()).unwrap()), single(), cfg).unwrap()
    };
    let (want_l, want_p) = offload_run(make(), 2, false, 0.0);
    let (got_l, got_p) = offload_run(make(), 2, true, 0.0);
    assert_eq!(got_l, want_l);
    for ((n, a), (_, b)) in got_p.iter().zip(&want_p) {
        assert!(a.equal(b), "{n} differs");
    }
}

/// A communicator whose collectives succeed but which, once `failed` is set, reports a
/// failure at `check`: an NCCL communicator aborted by its watch while the host ran ahead
/// (its cut-short collectives complete without an error of their own).
struct CutShort {
    inner: Arc<dyn zrun_comm::Communicator>,
    failed: std::sync::atomic::AtomicBool,
}

impl zrun_comm::Communicator for CutShort {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> zrun_comm::Backend {
        self.inner.backend()
    }
    fn all_gather(&self, s: &Tensor, f: &Tensor) -> Result<zrun_comm::Work, zrun_comm::Error> {
        self.inner.all_gather(s, f)
    }
    fn reduce_scatter(
        &self,
        f: &Tensor,
        s: &Tensor,
        op: zrun_comm::ReduceOp,
    ) -> Result<zrun_comm::Work, zrun_comm::Error> {
        self.inner.reduce_scatter(f, s, op)
    }
    fn all_reduce(
        &self,
        t: &Tensor,
        op: zrun_comm::ReduceOp,
    ) -> Result<zrun_comm::Work, zrun_comm::Error> {
        self.inner.all_reduce(t, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<zrun_comm::Work, zrun_comm::Error> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> Result<zrun_comm::Work, zrun_comm::Error> {
        self.inner.barrier()
    }
    fn check(&self) -> Result<(), zrun_comm::Error> {
        if self.failed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(zrun_comm::Error::Poisoned {
                rank: 0,
                op: "read of a collective's result",
                first: "rank 0, all_gather: timed out (aborted)".into(),
            });
        }
        Ok(())
    }
}

#[test]
fn reads_after_a_cut_short_collective_fail_instead_of_training_on_them() {
    let comm = Arc::new(CutShort {
        inner: single(),
        failed: std::sync::atomic::AtomicBool::new(false),
    });
    let cfg = EngineConfig::fp32(Stage::Zero3, Device::Cpu, SEED, adamw());
    let mut e = Engine::new(model(), comm.clone(), cfg).unwrap();
    let (x, y) = tokens(1, 2, 24, 97);
    e.forward_backward(&x, &y, 1.0).unwrap();
    e.step(1e-3, 1.0).unwrap();
    comm.failed.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = e.forward_backward(&x, &y, 1.0).unwrap_err().to_string();
    assert!(err.contains("aborted"), "{err}");
    let err = e.step(1e-3, 1.0).unwrap_err().to_string();
    assert!(err.contains("aborted"), "{err}");
}
