//! Gradients on the host only (offload at stages 2-3, one micro-step a step): the engine
//! trains as the one that keeps its gradient shard, and holds no gradient of its own; bf16
//! ones where they are exact.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use common::{adamw, single, small_gpt, tokens};
use std::sync::Arc;
use tch::{Device, Tensor};
use zrun_models::Model;
use zrun_shard::{Engine, EngineConfig, Offload, Precision, Stage};

const SEED: u64 = 13;

fn model(tied: bool) -> Arc<dyn Model> {
    small_gpt(tied)
}

/// One setting of the offloaded engine.
#[derive(Clone, Copy, Debug)]
struct Case {
    stage: Stage,
    precision: Precision,
    tied: bool,
    delay: Option<u64>,
    ckpt: bool,
    /// 0: the update overlaps the backward; else the gradients are staged for it.
    max_norm: f64,
}

fn engine(c: Case, one_micro_step: bool) -> Engine {
    let cfg = EngineConfig {
        precision: c.precision,
        offload: Offload::Cpu,
        offload_delay: c.delay,
        activation_checkpointing: c.ckpt,
        oom_recovery: false,
        one_micro_step,
        ..EngineConfig::fp32(c.stage, Device::Cpu, SEED, adamw())
    };
    Engine::new(model(c.tied), single(), cfg).unwrap()
}

/// Each step's loss and gradient norm, and the final parameters by name.
type Trained = (Vec<(f64, f64)>, Vec<(String, Tensor)>);

/// 4 steps of one announced micro-step each.
fn run(mut e: Engine, max_norm: f64) -> Trained {
    let mut out = Vec::new();
    for t in 0..4 {
        e.prepare_step(2e-3, max_norm);
        let (x, y) = tokens(70 + t, 4, 24, 97);
        let loss = e.forward_backward(&x, &y, 1.0).unwrap();
        let s = e.step(2e-3, max_norm).unwrap();
        assert!(s.applied);
        out.push((loss, s.grad_norm));
    }
    (out, e.full_parameters().unwrap())
}

#[test]
fn gradients_on_the_host_train_as_gradients_on_the_device() {
    let mut cases = Vec::new();
    for stage in [Stage::Zero2, Stage::Zero3] {
        for (precision, tied, delay, ckpt) in [
            (Precision::Fp32, false, None, false),
            (Precision::Bf16, true, None, true),
            (Precision::Bf16, false, Some(1), false),
            (Precision::Fp32, true, Some(0), true),
            (Precision::Fp16, false, None, false),
        ] {
            for max_norm in [0.0, 0.05] {
                cases.push(Case {
                    stage,
                    precision,
                    tied,
                    delay,
                    ckpt,
                    max_norm,
                });
            }
        }
    }
    for c in cases {
        let (want, want_p) = run(engine(c, false), c.max_norm);
        let host = engine(c, true);
        let m = host.memory();
        assert_eq!(m.grads, 0, "{c:?}: no gradient buffer");
        // The host's copy is bf16 where it holds autograd's bf16 values exactly (nothing
        // summed: no tied parameter), else fp32; a delayed update has a spare of unit 0's.
        let bytes = if c.precision == Precision::Bf16 && !c.tied {
            2
        } else {
            4
        };
        let l = host.layout();
        let spare = c.delay.map_or(0, |_| l.units[0].shard_len());
        assert_eq!(m.buffers, bytes * (l.shard_numel() + spare), "{c:?}");
        let (got, got_p) = run(host, c.max_norm);
        // The norm is summed unit by unit instead of over the whole buffer: rounding.
        for (t, ((l, n), (wl, wn))) in got.iter().zip(&want).enumerate() {
            assert_eq!(l, wl, "{c:?}: loss of step {t}");
            assert!((n - wn).abs() <= 1e-12 * wn, "{c:?}: norm {n} against {wn}");
        }
        assert!(got[3].0 < got[0].0, "{c:?}: trained {got:?}");
        for ((n, a), (_, b)) in got_p.iter().zip(&want_p) {
            if c.max_norm == 0.0 {
                assert!(a.equal(b), "{c:?}: {n} differs");
            } else {
                // Clipped by a coefficient from that norm.
                let d = (a - b).abs().max().double_value(&[]);
                assert!(d <= 1e-6, "{c:?}: {n} off by {d:e}");
            }
        }
    }
}

#[test]
fn gradients_stay_on_the_device_where_a_step_may_need_them_later() {
    let c = Case {
        stage: Stage::Zero3,
        precision: Precision::Fp32,
        tied: false,
        delay: None,
        ckpt: false,
        max_norm: 0.0,
    };
    let shard = engine(c, false).memory().grads;
    assert!(shard > 0);
    // Micro-steps accumulate, a step out of memory is dropped with its gradients, stage 1
    // reduces after backward: each keeps the gradient shard.
    for (stage, one, recovery) in [
        (Stage::Zero3, false, false),
        (Stage::Zero3, true, true),
        (Stage::Zero1, true, false),
    ] {
        let cfg = EngineConfig {
            offload: Offload::Cpu,
            oom_recovery: recovery,
            one_micro_step: one,
            ..EngineConfig::fp32(stage, Device::Cpu, SEED, adamw())
        };
        let e = Engine::new(model(false), single(), cfg).unwrap();
        assert!(e.memory().grads > 0, "{stage} {one} {recovery}");
    }
    // With them on the host, a micro-step that is not announced has nowhere to go.
    let mut e = engine(c, true);
    let (x, y) = tokens(80, 2, 24, 97);
    let err = e.forward_backward(&x, &y, 1.0).unwrap_err().to_string();
    assert!(err.contains("prepare_step"), "{err}");
    let err = e.step(2e-3, 0.0).unwrap_err().to_string();
    assert!(err.contains("prepare_step"), "{err}");
    // The engine goes on once it is.
    e.prepare_step(2e-3, 0.0);
    e.forward_backward(&x, &y, 1.0).unwrap();
    assert!(e.step(2e-3, 0.0).unwrap().applied);
}

#[test]
fn an_fp16_overflow_is_skipped_on_the_host_as_on_the_device() {
    // The gradients that overflowed went to the host before the step saw the norm: the
    // step is skipped all the same, and the next ones apply.
    let make = |one_micro_step| {
        let cfg = EngineConfig {
            precision: Precision::Fp16,
            offload: Offload::Cpu,
            oom_recovery: false,
            one_micro_step,
            initial_loss_scale: 2f64.powi(24), // overflows fp16 in backward
            loss_scale_window: 20,
            ..EngineConfig::fp32(Stage::Zero3, Device::Cpu, SEED, adamw())
        };
        Engine::new(model(false), single(), cfg).unwrap()
    };
    let run = |mut e: Engine| {
        let mut out = Vec::new();
        for t in 0..12 {
            e.prepare_step(1e-2, 1.0);
            let (x, y) = tokens(90 + t, 2, 24, 97);
            let loss = e.forward_backward(&x, &y, 1.0).unwrap();
            let s = e.step(1e-2, 1.0).unwrap();
            out.push((loss, s.applied, s.loss_scale));
        }
        (out, e.full_parameters().unwrap())
    };
    let (want, want_p) = run(make(false));
    let (got, got_p) = run(make(true));
    assert!(
        got.iter().any(|r| !r.1),
        "the huge scale overflows: {got:?}"
    );
    assert!(got.iter().any(|r| r.1), "and then steps apply: {got:?}");
    assert_eq!(got, want);
    for ((n, a), (_, b)) in got_p.iter().zip(&want_p) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-6, "{n} off by {d:e}");
    }
}
