//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::{Kind, Tensor};
use zrun_models::Model;
use zrun_optim::AdamWConfig;
use zrun_shard::Engine;

/// One rank's communicator (no peers, no store).
pub fn single() -> Arc<dyn zrun_comm::Communicator> {
    let topo = zrun_comm::Topology::single();
    let comm = zrun_comm::init(
        &topo,
        zrun_comm::Backend::Tcp,
        std::time::Duration::from_secs(5),
    );
    Arc::from(comm.unwrap())
}

/// A GPT of 2 layers, width 32, 4 heads, 97 tokens of vocabulary and 24 positions;
/// `tied`: its head reads the token embedding (GPT-2's tying).
pub fn small_gpt(tied: bool) -> Arc<dyn zrun_models::Model> {
    let cfg = zrun_models::GptConfig {
        vocab_size: 97,
        seq_len: 24,
        n_layer: 2,
        n_head: 4,
        d_model: 32,
        init_std: 0.02,
        tied,
    };
    Arc::new(zrun_models::Gpt::new(cfg).unwrap())
}

/// The AdamW hyper-parameters of these tests (GPT-2's betas, decay 0.1).
pub fn adamw() -> AdamWConfig {
    AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// `b` sequences of `t` token ids below `v` and their targets (the ids shifted by one), from a
/// local generator seeded with `seed`: libtorch's global one is shared by the tests running
/// in parallel threads, so it cannot reproduce a batch.
pub fn tokens(seed: u64, b: i64, t: i64, v: i64) -> (Tensor, Tensor) {
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let ids: Vec<i64> = (0..b * (t + 1))
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % v as u64) as i64
        })
        .collect();
    let all = Tensor::from_slice(&ids).view([b, t + 1]);
    (all.narrow(1, 0, t), all.narrow(1, 1, t))
}

/// The model's parameter names, unit by unit.
pub fn names(m: &dyn Model) -> Vec<String> {
    m.units()
        .iter()
        .flat_map(|u| u.params().iter().map(|p| p.name.clone()))
        .collect()
}

/// Named fp32 tensors from f64 ones in the model's order.
pub fn named(m: &dyn Model, ps: &[Tensor]) -> BTreeMap<String, Tensor> {
    names(m)
        .into_iter()
        .zip(ps.iter().map(|p| p.to_kind(Kind::Float)))
        .collect()
}

/// The engine's compute parameters by name, fp32, read as a checkpoint saves them (one
/// rank: every unit's elements `[0, numel)`).
pub fn compute_params(e: &mut Engine) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for u in 0..e.layout().units.len() {
        let mut vals = Vec::new();
        e.visit_delayed_params(u, |b: &[u8]| -> Result<(), zrun_shard::Error> {
            vals.extend(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap())),
            );
            Ok(())
        })
        .unwrap();
        let flat = Tensor::from_slice(&vals);
        for v in &e.layout().units[u].views {
            let t = flat.narrow(0, v.offset, v.numel).view(v.shape.as_slice());
            out.insert(v.name.clone(), t);
        }
    }
    out
}

/// The largest absolute difference between two sets of named tensors (the same names).
pub fn max_abs(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .map(|(k, x)| (x - &b[k]).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// The loss of `params` (f64, in the model's order) on `(x, y)`, its gradients in f64 and
/// their global norm: the reference loops' whole-model autograd.
pub fn loss_and_grads(
    m: &dyn Model,
    params: &[Tensor],
    x: &Tensor,
    y: &Tensor,
) -> (f64, Vec<Tensor>, f64) {
    let mut flat = params
        .iter()
        .map(|p| p.to_kind(Kind::Float).set_requires_grad(true));
    let leaves: Vec<Vec<Tensor>> = m
        .units()
        .iter()
        .map(|u| flat.by_ref().take(u.params().len()).collect())
        .collect();
    let loss =
        zrun_models::lm_loss(&zrun_models::forward_model(m, &leaves, x).unwrap(), y).unwrap();
    loss.backward();
    let grads: Vec<Tensor> = leaves
        .iter()
        .flatten()
        .map(|p| p.grad().to_kind(Kind::Double))
        .collect();
    let norm = grads
        .iter()
        .map(|g| g.square().sum(Kind::Double).double_value(&[]))
        .sum::<f64>()
        .sqrt();
    (loss.double_value(&[]), grads, norm)
}
