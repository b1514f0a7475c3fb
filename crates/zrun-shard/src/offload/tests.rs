//! The host optimizer's staging of unit 0 beside a running delayed update.

use super::*;
use zrun_models::{Gpt, GptConfig, Model};

fn optimizer(delayed: bool, grad_kind: Kind) -> Result<(ShardLayout, HostOptimizer)> {
    let m = Gpt::new(GptConfig {
        vocab_size: 64,
        seq_len: 8,
        n_layer: 4,
        n_head: 4,
        d_model: 256,
        init_std: 0.02,
        tied: false,
    })
    .map_err(|e| Error::Unsupported(e.to_string()))?;
    let layout = ShardLayout::new(m.units(), 0, 1);
    let setup = HostSetup {
        adamw: AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        state: StateDtype::Fp32,
        threads: 1,
        precision: Precision::Fp32,
        device: Device::Cpu,
        delayed,
        fresh: false,
        grad_kind,
    };
    // The master stays zero.
    let h = HostOptimizer::new(&layout, |_| Ok(()), setup, None)?;
    Ok((layout, h))
}

/// The next backward stages a unit's gradient while the delayed update of the last step
/// may still read the unit's host slice: staging waits for that unit's update, except
/// unit 0's, which goes to the other buffer of its pair at once. The update runs its
/// units last first, so unit 0 (the embedding) is its last; its gradient staged at once
/// must not reach the update, and must reach the next one. With fp32 and with bf16 host
/// gradients (whose spare is bf16 too).
#[test]
fn staging_a_unit_leaves_its_running_delayed_update_alone() -> Result<()> {
    for kind in [Kind::Float, Kind::BFloat16] {
        staging_beside_a_delayed_update(kind)?;
    }
    Ok(())
}

fn staging_beside_a_delayed_update(kind: Kind) -> Result<()> {
    let (layout, mut h) = optimizer(true, kind)?;
    let n = layout.shard_numel();
    let lr = 1e-3;
    let len = layout.units[0].shard_len();
    let unit0 = |h: &HostOptimizer| h.master().narrow(0, layout.shard_offsets[0], len);
    // The delayed update: gradient +1 everywhere.
    let ones = Tensor::ones([n], (Kind::Float, Device::Cpu));
    h.submit_deferred(&layout, Some(&[ones]), lr, 1.0, lr)?;
    // The next backward's final gradients of units 1 and 0: -1.
    for u in [1, 0] {
        let l = layout.units[u].shard_len();
        let next = Tensor::full([l], -1.0, (Kind::Float, Device::Cpu));
        h.stage_unit(&layout, u, &next)?;
    }
    assert!(h.in_spare, "unit 0's gradient went to the spare");
    h.finish()?;
    // AdamW's first step moves each parameter by lr against the gradient's sign.
    let want = Tensor::full([len], -lr, (Kind::Float, Device::Cpu));
    let off = (unit0(&h) - &want).abs().max().double_value(&[]);
    assert!(
        off < 1e-6,
        "unit 0's update read the next step's gradient: off by {off}"
    );
    // ... and the staged gradients are what the next update reads: the same update as
    // without the delay's spare.
    h.submit_deferred(&layout, None, lr, 1.0, lr)?;
    h.finish()?;
    let (_, mut plain) = optimizer(false, kind)?;
    let ones = Tensor::ones([n], (Kind::Float, Device::Cpu));
    plain.submit_deferred(&layout, Some(&[ones]), lr, 1.0, lr)?;
    plain.finish()?;
    let minus = Tensor::full([n], -1.0, (Kind::Float, Device::Cpu));
    let ones = Tensor::ones([n], (Kind::Float, Device::Cpu));
    let rest = layout.shard_offsets[2];
    let second = Tensor::cat(
        &[minus.narrow(0, 0, rest), ones.narrow(0, rest, n - rest)],
        0,
    );
    plain.submit_deferred(&layout, Some(&[second]), lr, 1.0, lr)?;
    plain.finish()?;
    assert!(
        h.master().equal(plain.master()),
        "the spare's update differs"
    );
    assert!(!unit0(&h).equal(&want), "the second update moved unit 0");
    Ok(())
}

#[test]
fn staged_pieces_cover_a_gradient_exactly() {
    assert_eq!(pieces(0, 4).count(), 0);
    assert_eq!(pieces(8, 4).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
    assert_eq!(pieces(9, 4).collect::<Vec<_>>(), [(0, 4), (4, 4), (8, 1)]);
    assert_eq!(pieces(3, 4).collect::<Vec<_>>(), [(0, 3)]);
}
