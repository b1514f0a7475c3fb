//! `Unit::loss` of each head, chunked, against the full logits' `lm_loss`: the loss and the
//! gradients of every parameter the head reads (a tied embedding included) and of its input.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_models::{init_model_params, unit_inputs, ArchConfig, Model, IGNORE_INDEX};

/// Loss and gradients (parameters, then input) of the head of `model` at `kind`, through
/// `Unit::loss` with `chunk` (0: the full logits).
fn head_loss(model: &dyn Model, kind: Kind, chunk: i64) -> (f64, Vec<Tensor>) {
    let units = model.units();
    let head = units.len() - 1;
    let params = init_model_params(model, 5, kind, Device::Cpu).unwrap();
    let leaves: Vec<Tensor> = unit_inputs(model, &params, head)
        .into_iter()
        .map(|p| p.detach().set_requires_grad(true))
        .collect();
    tch::manual_seed(11);
    let (b, t) = (3, 10);
    let c = leaves.last().unwrap().size()[1];
    let x = Tensor::randn([b, t, c], (kind, Device::Cpu)).set_requires_grad(true);
    let y = Tensor::randint(model.vocab_size(), [b, t], (Kind::Int64, Device::Cpu));
    let y = y.index_fill(1, &Tensor::from_slice(&[2i64]), IGNORE_INDEX);
    let loss = units[head].loss(&leaves, &x, &y, chunk).unwrap();
    let mut wrt: Vec<&Tensor> = leaves.iter().collect();
    wrt.push(&x);
    let grads = zrun_torch_ext::grad(&[&loss], &[&loss.ones_like()], &wrt).unwrap();
    (loss.double_value(&[]), grads)
}

#[test]
fn chunked_heads_equal_the_full_logits_in_loss_and_every_gradient() {
    let presets = [("gpt", "tiny"), ("llama", "llama-tiny")];
    for ((arch, preset), tied) in presets.iter().flat_map(|p| [(*p, true), (*p, false)]) {
        let mut cfg = ArchConfig::preset(arch, preset).unwrap();
        match &mut cfg {
            ArchConfig::Gpt(c) => c.tied = tied,
            ArchConfig::Llama(c) => c.tied = tied,
        }
        let model = cfg.build().unwrap();
        for (kind, tol) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2e-2)] {
            let (want, wg) = head_loss(model.as_ref(), kind, 0);
            // 30 positions x V 256: chunks of 2 rows forward, 8 columns backward.
            let (got, gg) = head_loss(model.as_ref(), kind, 600);
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "{arch} {kind:?}: {got} vs {want}"
            );
            assert_eq!(wg.len(), gg.len());
            for (i, (w, g)) in wg.iter().zip(&gg).enumerate() {
                let scale = w.abs().max().double_value(&[]);
                let off = (w.to_kind(Kind::Double) - g.to_kind(Kind::Double))
                    .abs()
                    .max()
                    .double_value(&[]);
                assert!(
                    scale > 0.0,
                    "{arch} tied={tied} {kind:?} gradient {i} is zero"
                );
                assert!(
                    off <= tol * scale,
                    "{arch} tied={tied} {kind:?} gradient {i}: {off} of {scale}"
                );
            }
        }
    }
}

#[test]
fn units_that_are_not_heads_offer_no_hidden_state() {
    let model = ArchConfig::preset("gpt", "tiny").unwrap().build().unwrap();
    let block = &model.units()[1];
    assert!(block.hidden(&[], &Tensor::new()).unwrap().is_none());
}

#[test]
fn mismatched_inputs_are_one_line_errors_naming_the_shapes() {
    let h = Tensor::zeros([2, 4, 8], (Kind::Float, Device::Cpu));
    let w = Tensor::zeros([16, 8], (Kind::Float, Device::Cpu));
    let y = Tensor::zeros([2, 5], (Kind::Int64, Device::Cpu));
    let msg = zrun_models::linear_lm_loss(&h, &w, &y, 64)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("[2, 4, 16]") && msg.contains("[2, 5]"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");
    let narrow = Tensor::zeros([16, 7], (Kind::Float, Device::Cpu));
    let msg = zrun_models::linear_lm_loss(&h, &narrow, &y.narrow(1, 0, 4), 64)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("[16, 7]"), "{msg}");
}
