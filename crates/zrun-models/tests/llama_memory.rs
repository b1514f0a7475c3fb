//! What a Llama layer and head hold for their backward, measured with the caching CPU
//! allocator zrun's ranks run on, against `Unit::activations` (what the estimator counts).
//! Alone in its own test binary: installing a CPU allocator is process-wide.

zrun_torch_ext::end_tests_without_destructors!();

use tch::{Device, Kind, Tensor};
use zrun_models::{init_unit_params, Llama, LlamaConfig, Model};
use zrun_torch_ext::{cpu_memory_stats, install_cpu_caching_allocator};

fn allocated() -> i64 {
    cpu_memory_stats().expect("installed").allocated as i64
}

#[test]
fn a_layer_and_the_head_hold_what_the_estimator_counts() {
    install_cpu_caching_allocator(None).unwrap();
    let cfg = LlamaConfig {
        d_model: 256,
        n_head: 4,
        n_kv_head: 2,
        head_dim: 64,
        ffn_hidden: 768,
        seq_len: 128,
        max_position_embeddings: 128,
        vocab_size: 512,
        ..LlamaConfig::preset("llama-tiny").unwrap()
    };
    let model = Llama::new(cfg).unwrap();
    let (b, t) = (4i64, 128i64);
    for kind in [Kind::Float, Kind::BFloat16] {
        let elt = kind.elt_size_in_bytes() as i64;
        for u in [1, model.units().len() - 1] {
            let unit = model.units()[u].as_ref();
            let params: Vec<Tensor> = init_unit_params(unit, 5)
                .unwrap()
                .into_iter()
                .map(|p| p.to_kind(kind).set_requires_grad(true))
                .collect();
            let x = Tensor::randn([b, t, 256], (kind, Device::Cpu)).set_requires_grad(true);
            let before = allocated();
            let y = unit.forward(&params, &x).unwrap();
            let out = y.numel() as i64 * elt;
            let held = allocated() - before - out;
            let want = unit.activations(b, t, elt);
            assert_eq!(want.output, out, "{} {kind:?} output", unit.name());
            eprintln!(
                "{} {kind:?}: holds {held}, counted {}",
                unit.name(),
                want.saved
            );
            // Small tensors round up to their allocator block: a few KiB.
            assert!(
                held >= want.saved * 97 / 100 && held <= want.saved * 103 / 100 + (64 << 10),
                "{} {kind:?}: holds {held} bytes for its backward, the estimator counts {}",
                unit.name(),
                want.saved
            );
        }
    }
}
