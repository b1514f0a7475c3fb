//! The split delayed update (`zero.offload_delay_fresh`) against a plain loop in f64 whose
//! forward runs on the base of each update minus its fresh gradient's share, and whose master
//! is torch's AdamW on the gradients taken there.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use common::{adamw, compute_params, loss_and_grads, max_abs, named, single, small_gpt, tokens};
use std::collections::BTreeMap;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};
use zrun_models::{init_model_params, Model};
use zrun_optim::clip_coefficient;
use zrun_shard::{Engine, EngineConfig, Offload, Stage};

const SEED: u64 = 5;
const LR: f64 = 2e-3;
const STEPS: u64 = 8;
/// The fp32 engine (bf16 v on the device) against the f64 reference, absolute.
const TOL: f64 = 2e-5;

fn model() -> Arc<dyn Model> {
    small_gpt(false)
}

fn batch(t: u64) -> (Tensor, Tensor) {
    tokens(t + 100, 4, 24, 97)
}

struct Run {
    losses: Vec<f64>,
    newest: BTreeMap<String, Tensor>,
    compute: BTreeMap<String, Tensor>,
}

/// Updates after the first `warmup` split: the forward runs on the base minus the fresh share.
fn reference(m: &dyn Model, warmup: u64, max_norm: f64) -> Run {
    let c = adamw();
    let mut w: Vec<Tensor> = init_model_params(m, SEED, Kind::Float, Device::Cpu)
        .unwrap()
        .into_iter()
        .flatten()
        .map(|p| p.to_kind(Kind::Double))
        .collect();
    let decay: Vec<bool> = m
        .units()
        .iter()
        .flat_map(|u| u.params().iter().map(|p| p.decay))
        .collect();
    let mut mom: Vec<Tensor> = w.iter().map(Tensor::zeros_like).collect();
    let mut var: Vec<Tensor> = w.iter().map(Tensor::zeros_like).collect();
    let mut compute: Vec<Tensor> = w.iter().map(Tensor::copy).collect();
    let mut losses = Vec::new();
    for t in 1..=STEPS {
        let (x, y) = batch(t);
        let (loss, grads, norm) = loss_and_grads(m, &compute, &x, &y);
        losses.push(loss);
        let coef = clip_coefficient(norm, max_norm);
        let split = t > warmup;
        let (s, k) = ((t - 1) as i32, t as i32);
        let (bc1, bc2) = (1.0 - c.beta1.powi(k), 1.0 - c.beta2.powi(k));
        for i in 0..w.len() {
            let g = &grads[i] * coef;
            let keep = if decay[i] {
                1.0 - LR * c.weight_decay
            } else {
                1.0
            };
            let v_new = &var[i] * c.beta2 + g.square() * (1.0 - c.beta2);
            let d_new = v_new.sqrt() / bc2.sqrt() + c.eps;
            if split {
                // The base from the state before update t, then the fresh share.
                let base = if s == 0 {
                    &w[i] * keep
                } else {
                    let d_old = var[i].sqrt() / (1.0 - c.beta2.powi(s)).sqrt() + c.eps;
                    &w[i] * keep - &mom[i] / d_old * (LR * c.beta1 / bc1)
                };
                compute[i] = base - &g / &d_new * (LR * (1.0 - c.beta1) / bc1);
            }
            mom[i] = &mom[i] * c.beta1 + &g * (1.0 - c.beta1);
            var[i] = v_new;
            w[i] = &w[i] * keep - &mom[i] / &d_new * (LR / bc1);
            if !split {
                compute[i] = w[i].copy();
            }
        }
    }
    Run {
        losses,
        newest: named(m, &w),
        compute: named(m, &compute),
    }
}

fn engine(m: Arc<dyn Model>, stage: Stage, delay: Option<u64>, fresh: bool) -> Engine {
    let cfg = EngineConfig {
        offload: Offload::Cpu,
        offload_delay: delay,
        offload_delay_fresh: fresh,
        ..EngineConfig::fp32(stage, Device::Cpu, SEED, adamw())
    };
    Engine::new(m, single(), cfg).unwrap()
}

fn trained(mut e: Engine, max_norm: f64) -> Run {
    let mut losses = Vec::new();
    for t in 1..=STEPS {
        let (x, y) = batch(t);
        losses.push(e.forward_backward(&x, &y, 1.0).unwrap());
        e.set_next_lr(LR);
        assert!(e.step(LR, max_norm).unwrap().applied);
    }
    let compute = compute_params(&mut e);
    let newest = e.full_parameters().unwrap().into_iter().collect();
    Run {
        losses,
        newest,
        compute,
    }
}

#[test]
fn a_split_delayed_run_equals_the_loop_that_applies_the_fresh_share_at_once() {
    let m = model();
    for (stage, warmup, max_norm) in [
        (Stage::Zero1, 0, 0.0),
        (Stage::Zero2, 2, 1.0),
        (Stage::Zero3, 3, 0.05),
    ] {
        let what = format!("stage {stage}, warm-up {warmup}, max_norm {max_norm}");
        let want = reference(m.as_ref(), warmup, max_norm);
        let got = trained(engine(m.clone(), stage, Some(warmup), true), max_norm);
        for (t, (g, w)) in got.losses.iter().zip(&want.losses).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "{what}: loss of step {} is {g}, the reference {w}",
                t + 1
            );
        }
        let newest = max_abs(&got.newest, &want.newest);
        assert!(newest <= TOL, "{what}: newest parameters off by {newest:e}");
        let compute = max_abs(&got.compute, &want.compute);
        assert!(
            compute <= TOL,
            "{what}: compute parameters off by {compute:e}"
        );
    }
}

/// The mean loss of steps 21-30 at `lr = 2e-2` (the plain delay's staleness shows there).
fn late_loss(stage: Stage, delay: Option<u64>, fresh: bool) -> f64 {
    let (lr, steps) = (2e-2, 30);
    let mut e = engine(model(), stage, delay, fresh);
    let mut late = 0.0;
    for t in 1..=steps {
        let (x, y) = batch(t);
        let loss = e.forward_backward(&x, &y, 1.0).unwrap();
        if t > steps - 10 {
            late += loss / 10.0;
        }
        e.set_next_lr(lr);
        e.step(lr, 1.0).unwrap();
    }
    late
}

#[test]
fn the_split_trains_like_the_undelayed_run_where_the_plain_delay_does_not() {
    for stage in [Stage::Zero2, Stage::Zero3] {
        let undelayed = late_loss(stage, None, false);
        let plain = late_loss(stage, Some(3), false);
        let fresh = late_loss(stage, Some(3), true);
        assert!(
            (fresh - undelayed).abs() * 5.0 < (plain - undelayed).abs(),
            "stage {stage}: late loss split {fresh}, plain delay {plain}, undelayed {undelayed}"
        );
    }
}

#[test]
fn the_split_keeps_the_gradients_on_the_device_and_counts_v() {
    for stage in [Stage::Zero2, Stage::Zero3] {
        let cfg = |fresh| EngineConfig {
            one_micro_step: true,
            oom_recovery: false,
            offload: Offload::Cpu,
            offload_delay: Some(0),
            offload_delay_fresh: fresh,
            ..EngineConfig::fp32(stage, Device::Cpu, SEED, adamw())
        };
        let (mut e, plain) = (
            Engine::new(model(), single(), cfg(true)).unwrap(),
            Engine::new(model(), single(), cfg(false)).unwrap(),
        );
        let ec = e.estimate_config(2, 24);
        assert!(ec.offload_delay_fresh && !ec.host_grads, "stage {stage}");
        let planned = zrun_shard::MemoryLedger::planned(e.layout(), &ec);
        let s = e.layout().shard_numel();
        // Gradients on the device (fp32) where the plain delay keeps them on the host only.
        assert_eq!(
            e.memory().grads - plain.memory().grads,
            4 * s,
            "stage {stage}"
        );
        // Host: v (bf16) and the fp32 base.
        let (x, y) = batch(1);
        e.forward_backward(&x, &y, 1.0).unwrap();
        e.step(LR, 1.0).unwrap();
        assert_eq!(planned, e.memory(), "stage {stage}");
    }
}

#[test]
fn a_split_run_with_skipped_fp16_steps_submits_nothing_on_a_skip_and_trains() {
    use zrun_shard::Precision;
    // A scale that doubles after every clean step overflows again soon after each halving.
    let cfg = EngineConfig {
        precision: Precision::Fp16,
        initial_loss_scale: 2f64.powi(30),
        loss_scale_window: 1,
        offload: Offload::Cpu,
        offload_delay: Some(0),
        offload_delay_fresh: true,
        ..EngineConfig::fp32(Stage::Zero2, Device::Cpu, SEED, adamw())
    };
    let mut e = Engine::new(model(), single(), cfg).unwrap();
    let (mut skipped, mut losses) = (0, Vec::new());
    for t in 1..=40 {
        let (x, y) = batch(t);
        losses.push(e.forward_backward(&x, &y, 1.0).unwrap());
        let s = e.step(1e-3, 1.0).unwrap();
        // Nothing is pending after a skipped step: the compute parameters are the base.
        assert_eq!(e.params_behind(), s.applied, "step {t}");
        skipped += usize::from(!s.applied);
    }
    assert!(skipped >= 2, "{skipped} skipped");
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(losses[39] < losses[0], "{losses:?}");
}

#[test]
fn a_split_rank_alone_in_bf16_keeps_its_gradients_in_bf16_and_trains_the_same() {
    use zrun_shard::Precision;
    // A rank alone, bf16 compute, one micro-step a step, no tied parameter: the gradients
    // are autograd's bf16 values, so the device buffer and the host's copy hold them as bf16.
    // `one_micro_step: false` (nothing announced) keeps them fp32: the same run otherwise.
    let cfg = |one_micro_step| EngineConfig {
        precision: Precision::Bf16,
        one_micro_step,
        oom_recovery: false,
        offload: Offload::Cpu,
        offload_delay: Some(2),
        offload_delay_fresh: true,
        ..EngineConfig::fp32(Stage::Zero2, Device::Cpu, SEED, adamw())
    };
    let run = |one_micro_step| {
        let mut e = Engine::new(model(), single(), cfg(one_micro_step)).unwrap();
        let losses: Vec<f64> = (1..=10)
            .map(|t| {
                let (x, y) = batch(t);
                let l = e.forward_backward(&x, &y, 1.0).unwrap();
                e.step(LR, 1.0).unwrap();
                l
            })
            .collect();
        (e, losses)
    };
    let ((bf16, l16), (fp32, l32)) = (run(true), run(false));
    assert_eq!(l16, l32, "bf16 gradients trained otherwise");
    let s = bf16.layout().shard_numel();
    assert_eq!(fp32.memory().grads - bf16.memory().grads, 2 * s);
    // The host's copy and unit 0's spare: half the bytes too.
    let spare = bf16.layout().units[0].shard_len();
    assert_eq!(
        fp32.memory().buffers - bf16.memory().buffers,
        2 * (s + spare)
    );
    // The estimate plans what the engine holds.
    for e in [&bf16, &fp32] {
        let ec = e.estimate_config(4, 24);
        assert_eq!(
            zrun_shard::MemoryLedger::planned(e.layout(), &ec),
            e.memory()
        );
    }
}
