//! The delayed parameter update (`zero.offload_delay`) against a plain loop that applies
//! each update one step late: whole-model autograd and torch's AdamW written out in f64.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use common::{adamw, compute_params, loss_and_grads, max_abs, named, single, small_gpt, tokens};
use std::collections::BTreeMap;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};
use zrun_models::{forward_model, init_model_params, lm_loss, Model};
use zrun_optim::clip_coefficient;
use zrun_shard::{Engine, EngineConfig, Offload, Stage};

const SEED: u64 = 5;
const LR: f64 = 2e-3;
const STEPS: u64 = 6;
/// The fp32 engine against the f64 reference, absolute: rounding only (seen: 3e-6 unclipped,
/// 2.4e-7 clipped), where applying an update on time instead moves parameters by 4e-3 or more.
const TOL: f64 = 1e-5;

fn model() -> Arc<dyn Model> {
    small_gpt(false)
}

/// Step `t`'s batch, from a local generator (libtorch's global one is shared by the tests).
fn batch(t: u64) -> (Tensor, Tensor) {
    tokens(t + 100, 4, 24, 97)
}

/// What a run ends with: its losses, the newest parameters (every update applied) and the
/// parameters the next forward would run on, by name.
struct Run {
    losses: Vec<f64>,
    newest: BTreeMap<String, Tensor>,
    compute: BTreeMap<String, Tensor>,
}

/// The reference: update k (1-based) is delayed when `delay` is `Some(w)` and k > w; the
/// forward of step t runs on P_{t-2} when update t-1 was delayed, else on P_{t-1}, where P_k
/// is the model after k updates.
fn reference(m: &dyn Model, delay: Option<u64>, max_norm: f64) -> Run {
    let c = adamw();
    let p0: Vec<Tensor> = init_model_params(m, SEED, Kind::Float, Device::Cpu)
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
    let mut hist = vec![p0.iter().map(Tensor::copy).collect::<Vec<_>>()];
    let mut mom: Vec<Tensor> = p0.iter().map(Tensor::zeros_like).collect();
    let mut var: Vec<Tensor> = p0.iter().map(Tensor::zeros_like).collect();
    let delayed = |k: u64| k >= 1 && delay.is_some_and(|w| k > w);
    let mut losses = Vec::new();
    for t in 1..=STEPS {
        let at = if delayed(t - 1) { t - 2 } else { t - 1 };
        // The parameters of the forward as fp32 leaves, split into units.
        let (x, y) = batch(t);
        let (loss, grads, norm) = loss_and_grads(m, &hist[at as usize], &x, &y);
        losses.push(loss);
        let coef = clip_coefficient(norm, max_norm);
        // torch.optim.AdamW on P_{t-1}.
        let step = t as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(step), 1.0 - c.beta2.powi(step));
        let next: Vec<Tensor> = hist[(t - 1) as usize]
            .iter()
            .zip(&grads)
            .enumerate()
            .map(|(i, (p, g))| {
                let g = g * coef;
                let mut p = p.copy();
                if decay[i] {
                    p *= 1.0 - LR * c.weight_decay;
                }
                mom[i] = &mom[i] * c.beta1 + &g * (1.0 - c.beta1);
                var[i] = &var[i] * c.beta2 + g.square() * (1.0 - c.beta2);
                let denom = var[i].sqrt() / bc2.sqrt() + c.eps;
                p - &mom[i] / denom * (LR / bc1)
            })
            .collect();
        hist.push(next);
    }
    let last = STEPS as usize;
    let compute = if delayed(STEPS) { last - 1 } else { last };
    Run {
        losses,
        newest: named(m, &hist[last]),
        compute: named(m, &hist[compute]),
    }
}

fn engine(m: Arc<dyn Model>, stage: Stage, delay: Option<u64>) -> Engine {
    let cfg = EngineConfig {
        offload: Offload::Cpu,
        offload_delay: delay,
        ..EngineConfig::fp32(stage, Device::Cpu, SEED, adamw())
    };
    Engine::new(m, single(), cfg).unwrap()
}

fn trained(m: Arc<dyn Model>, stage: Stage, delay: Option<u64>, max_norm: f64) -> (Run, bool) {
    let mut e = engine(m, stage, delay);
    let mut losses = Vec::new();
    for t in 1..=STEPS {
        let delays = e.delays_next_update();
        assert_eq!(delays, delay.is_some_and(|w| t > w), "step {t}");
        // A delayed update never overlaps the backward (its host buffers are busy).
        let overlaps = e.prepare_step(LR, max_norm);
        assert!(!(delays && overlaps), "step {t}");
        let (x, y) = batch(t);
        losses.push(e.forward_backward(&x, &y, 1.0).unwrap());
        assert!(e.step(LR, max_norm).unwrap().applied);
        assert_eq!(e.params_behind(), delays, "step {t}");
    }
    let behind = e.params_behind();
    let compute = compute_params(&mut e);
    let newest = e.full_parameters().unwrap().into_iter().collect();
    let run = Run {
        losses,
        newest,
        compute,
    };
    (run, behind)
}

/// Losses within 1e-6 relative, parameters within `tol` absolute of the reference.
fn assert_matches(got: &Run, want: &Run, tol: f64, what: &str) {
    for (t, (g, w)) in got.losses.iter().zip(&want.losses).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs(),
            "{what}: loss of step {} is {g}, the reference {w}",
            t + 1
        );
    }
    let newest = max_abs(&got.newest, &want.newest);
    assert!(newest <= tol, "{what}: newest parameters off by {newest:e}");
    let compute = max_abs(&got.compute, &want.compute);
    assert!(
        compute <= tol,
        "{what}: compute parameters off by {compute:e}"
    );
}

#[test]
fn a_delayed_run_equals_a_loop_that_applies_each_update_one_step_late() {
    let m = model();
    for (stage, warmup, max_norm) in [
        (Stage::Zero1, 0, 0.0),
        (Stage::Zero2, 2, 0.0),
        (Stage::Zero3, 0, 0.05),
        (Stage::Zero2, 3, 0.05),
    ] {
        let what = format!("stage {stage}, warm-up {warmup}, max_norm {max_norm}");
        let want = reference(m.as_ref(), Some(warmup), max_norm);
        let (got, behind) = trained(m.clone(), stage, Some(warmup), max_norm);
        assert!(behind, "{what}: the last update is pending");
        assert_matches(&got, &want, TOL, &what);
        // The delay is visible: the undelayed reference is far from this run.
        let undelayed = reference(m.as_ref(), None, max_norm);
        let apart = max_abs(&got.newest, &undelayed.newest);
        assert!(
            apart > 100.0 * TOL,
            "{what}: only {apart:e} from the undelayed run"
        );
        let last = got.losses.len() - 1;
        assert!((got.losses[last] - undelayed.losses[last]).abs() > 1e-6);
    }
}

#[test]
fn without_the_delay_the_offloaded_run_is_the_undelayed_loop() {
    let m = model();
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let want = reference(m.as_ref(), None, 0.05);
        let (got, behind) = trained(m.clone(), stage, None, 0.05);
        assert!(!behind);
        assert_matches(&got, &want, TOL, &format!("stage {stage}, no delay"));
    }
}

#[test]
fn evaluation_runs_on_the_compute_parameters_one_update_behind() {
    let m = model();
    let mut e = engine(m.clone(), Stage::Zero3, Some(0));
    for t in 1..=3 {
        let (x, y) = batch(t);
        e.forward_backward(&x, &y, 1.0).unwrap();
        e.step(LR, 0.0).unwrap();
    }
    let (x, y) = batch(9);
    let got = e.eval_loss(&x, &y).unwrap();
    let compute = compute_params(&mut e);
    let leaves: Vec<Vec<Tensor>> = m
        .units()
        .iter()
        .map(|u| u.params().iter().map(|p| compute[&p.name].copy()).collect())
        .collect();
    let want = lm_loss(&forward_model(m.as_ref(), &leaves, &x).unwrap(), &y)
        .unwrap()
        .double_value(&[]);
    assert!((got - want).abs() <= 1e-6 * want.abs(), "{got} vs {want}");
    // ... and they are not the newest parameters.
    let newest = e.full_parameters().unwrap().into_iter().collect();
    assert!(max_abs(&newest, &compute) > 1e-5);
}

#[test]
fn the_delay_needs_offload() {
    let cfg = EngineConfig {
        offload_delay: Some(0),
        ..EngineConfig::fp32(Stage::Zero2, Device::Cpu, SEED, adamw())
    };
    let err = Engine::new(model(), single(), cfg)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("zero.offload_optimizer"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn a_skipped_fp16_step_applies_the_pending_update_and_submits_nothing() {
    use zrun_shard::Precision;
    // A scale that doubles after every clean step overflows again soon after each halving:
    // some skipped steps find an update pending.
    let cfg = EngineConfig {
        precision: Precision::Fp16,
        initial_loss_scale: 2f64.powi(30),
        loss_scale_window: 1,
        offload: Offload::Cpu,
        offload_delay: Some(0),
        ..EngineConfig::fp32(Stage::Zero2, Device::Cpu, SEED, adamw())
    };
    let mut e = Engine::new(model(), single(), cfg).unwrap();
    let (mut skipped_behind, mut applied_after) = (0, 0);
    for t in 1..=40 {
        let was_behind = e.params_behind();
        let (x, y) = batch(t);
        e.forward_backward(&x, &y, 1.0).unwrap();
        let s = e.step(1e-3, 1.0).unwrap();
        assert_eq!(e.params_behind(), s.applied, "step {t}");
        if !s.applied && was_behind {
            skipped_behind += 1;
            // The compute parameters are the master's, in fp16.
            let compute = compute_params(&mut e);
            for (n, m) in e.full_parameters().unwrap() {
                let want = m.to_kind(Kind::Half).to_kind(Kind::Float);
                assert!(compute[&n].equal(&want), "step {t}: {n}");
            }
        } else if s.applied && skipped_behind > 0 {
            applied_after += 1;
        }
    }
    assert!(skipped_behind >= 1 && applied_after >= 1);
}

#[test]
fn the_planned_ledger_counts_the_host_gradient_copies_of_the_delay() {
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let (e, plain) = (
            engine(model(), stage, Some(0)),
            engine(model(), stage, None),
        );
        let ec = e.estimate_config(2, 24);
        assert!(ec.offload_delay);
        let planned = zrun_shard::MemoryLedger::planned(e.layout(), &ec);
        assert_eq!(planned, e.memory(), "stage {stage}");
        // Stage 1 stages a copy anyway; at stages 2-3 the undelayed host reads in place.
        // The delay adds the second buffer of unit 0's gradient.
        let s = e.layout().shard_numel();
        let spare = 4 * e.layout().units[0].shard_len();
        let extra = spare + if stage == Stage::Zero1 { 0 } else { 4 * s };
        assert_eq!(
            e.memory().buffers - plain.memory().buffers,
            extra,
            "stage {stage}"
        );
    }
}
