//! Tests of the Llama units against closed forms and an independent reference written with
//! elementary tensor ops (RMSNorm by its formula, rotary embeddings as explicit rotations of
//! the pairs (i, i + hd/2), grouped-query attention by picking each query head's kv head,
//! masked softmax attention).

use tch::{Device, Kind, Tensor};

use super::{Llama, LlamaConfig, RopeScaling};
use crate::error::Error;
use crate::loss::lm_loss;
use crate::param::Init;
use crate::unit::{cached_logits, forward_model, init_model_params, KvCache, Model, Tied};

const CPU: Device = Device::Cpu;

fn tiny_cfg() -> LlamaConfig {
    LlamaConfig::preset("llama-tiny").unwrap()
}

fn tiny() -> Llama {
    Llama::new(tiny_cfg()).unwrap()
}

fn tokens(b: i64, t: i64, v: i64, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randint(v, [b, t], (Kind::Int64, CPU))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Random fp64 parameters (norm weights around 1, not all ones as at init).
fn random_params(model: &Llama) -> Vec<Vec<Tensor>> {
    tch::manual_seed(42);
    model
        .units()
        .iter()
        .map(|u| {
            u.params()
                .iter()
                .map(|s| {
                    let r = Tensor::randn(s.shape.as_slice(), (Kind::Double, CPU));
                    if s.shape.len() == 1 {
                        r * 0.2 + 1.0
                    } else {
                        r * 0.3
                    }
                })
                .collect()
        })
        .collect()
}

// ---------------------------------------------------------------- reference implementation

fn ref_rms(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let ms = (x * x).mean_dim(-1, true, None);
    x / (ms + eps).sqrt() * w
}

/// Rotate the pairs (i, i + hd/2) of `x` (B, h, T, hd) at positions 0.. by angle
/// `pos * inv[i]` (angles in fp32, as transformers computes them).
fn ref_rope(x: &Tensor, inv: &Tensor) -> Tensor {
    let (t, hd) = (x.size()[2], x.size()[3]);
    let half = hd / 2;
    let pos = Tensor::arange(t, (Kind::Float, CPU));
    let ang = pos.unsqueeze(1) * inv.unsqueeze(0); // (T, hd/2), fp32
    let (c, s) = (
        ang.cos().to_kind(Kind::Double),
        ang.sin().to_kind(Kind::Double),
    );
    let (x1, x2) = (x.narrow(-1, 0, half), x.narrow(-1, half, half));
    Tensor::cat(&[&x1 * &c - &x2 * &s, &x2 * &c + &x1 * &s], -1)
}

/// One decoder layer with explicit per-head masked softmax attention.
fn ref_layer(p: &[Tensor], x: &Tensor, cfg: &LlamaConfig, inv: &Tensor) -> Tensor {
    let (b, t, _) = x.size3().unwrap();
    let (nh, nkv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
    let lin = |h: &Tensor, w: &Tensor| h.matmul(&w.tr());
    let heads = |z: Tensor, n: i64| z.reshape([b, t, n, hd]).permute([0, 2, 1, 3]);
    let h = ref_rms(x, &p[0], cfg.rms_norm_eps);
    let q = ref_rope(&heads(lin(&h, &p[1]), nh), inv);
    let k = ref_rope(&heads(lin(&h, &p[2]), nkv), inv);
    let v = heads(lin(&h, &p[3]), nkv);
    // Query head j reads kv head j / (nh / nkv).
    let pick: Vec<i64> = (0..nh).map(|j| j / (nh / nkv)).collect();
    let pick = Tensor::from_slice(&pick);
    let (k, v) = (k.index_select(1, &pick), v.index_select(1, &pick));
    let att = q.matmul(&k.transpose(-2, -1)) / (hd as f64).sqrt(); // (B, nh, T, T)
    let future = Tensor::ones([t, t], (Kind::Bool, CPU)).triu(1);
    let att = att
        .masked_fill(&future, f64::NEG_INFINITY)
        .softmax(-1, None);
    let y = att
        .matmul(&v)
        .permute([0, 2, 1, 3])
        .reshape([b, t, nh * hd]);
    let x = x + lin(&y, &p[4]);
    let h = ref_rms(&x, &p[5], cfg.rms_norm_eps);
    let gate = lin(&h, &p[6]);
    let silu = &gate * gate.sigmoid();
    &x + lin(&(silu * lin(&h, &p[7])), &p[8])
}

// ---------------------------------------------------------------------------------- tests

#[test]
fn units_and_param_names_follow_the_layout() {
    let m = tiny();
    let names: Vec<&str> = m.units().iter().map(|u| u.name()).collect();
    assert_eq!(names, ["embed", "layers.0", "layers.1", "head"]);
    let l1: Vec<(&str, Vec<i64>)> = m.units()[2]
        .params()
        .iter()
        .map(|p| (p.name.as_str(), p.shape.clone()))
        .collect();
    assert_eq!(
        l1,
        [
            ("layers.1.input_layernorm.weight", vec![64]),
            ("layers.1.self_attn.q_proj.weight", vec![64, 64]),
            ("layers.1.self_attn.k_proj.weight", vec![32, 64]),
            ("layers.1.self_attn.v_proj.weight", vec![32, 64]),
            ("layers.1.self_attn.o_proj.weight", vec![64, 64]),
            ("layers.1.post_attention_layernorm.weight", vec![64]),
            ("layers.1.mlp.gate_proj.weight", vec![128, 64]),
            ("layers.1.mlp.up_proj.weight", vec![128, 64]),
            ("layers.1.mlp.down_proj.weight", vec![64, 128]),
        ]
    );
    for p in m.units().iter().flat_map(|u| u.params()) {
        let matrix = p.shape.len() == 2;
        assert_eq!(p.decay, matrix, "{}", p.name);
        let want = if matrix {
            Init::Normal { std: 0.02 }
        } else {
            Init::Ones
        };
        assert_eq!(p.init, want, "{}", p.name);
    }
    let head: Vec<&str> = m.units()[3]
        .params()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(head, ["norm.weight", "lm_head.weight"]);
    assert_eq!(m.units()[0].params()[0].name, "embed_tokens.weight");
}

/// Closed-form parameter count from the shapes in the architecture description.
fn closed_form_params(c: &LlamaConfig) -> i64 {
    let (v, d, f) = (c.vocab_size, c.d_model, c.ffn_hidden);
    let (q, kv) = (c.n_head * c.head_dim, c.n_kv_head * c.head_dim);
    let layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f;
    let head = d + if c.tied { 0 } else { v * d };
    v * d + c.n_layer * layer + head
}

#[test]
fn param_count_of_every_preset_matches_the_released_models() {
    let want = [
        ("llama-tiny", None),
        ("llama3.2-1b", Some(1_235_814_400)),
        ("llama3.2-3b", Some(3_212_749_824)),
        ("llama3.1-8b", Some(8_030_261_248)),
        ("llama2-7b", Some(6_738_415_616)),
    ];
    assert_eq!(LlamaConfig::PRESETS.len(), want.len());
    for (name, count) in want {
        let cfg = LlamaConfig::preset(name).unwrap();
        // Specs only: building the model allocates no parameter tensors, even for 8B.
        let m = Llama::new(cfg.clone()).unwrap();
        assert_eq!(m.param_count(), closed_form_params(&cfg), "{name}");
        if let Some(n) = count {
            assert_eq!(m.param_count(), n, "{name}");
        }
        assert_eq!(m.units().len() as i64, cfg.n_layer + 2);
        assert_eq!((m.vocab_size(), m.seq_len()), (cfg.vocab_size, cfg.seq_len));
        assert_eq!(
            m.units().last().unwrap().tied().is_some(),
            cfg.tied,
            "{name}"
        );
    }
}

#[test]
fn flops_per_token_counts_matmuls_and_attention() {
    let m = Llama::new(LlamaConfig::preset("llama3.1-8b").unwrap()).unwrap();
    let (v, l, c, q, kv, f, t) = (128256.0, 32.0, 4096.0, 4096.0, 1024.0, 14336.0, 2048.0);
    let matmul = l * (2.0 * c * q + 2.0 * c * kv + 3.0 * c * f) + v * c;
    let want = 3.0 * (2.0 * matmul + 4.0 * l * t * q);
    assert!((m.flops_per_token() - want).abs() < 1.0);
    // Against 6 x all parameters: the embedding lookup and the norms cost no FLOPs, the
    // attention term adds about 4%.
    let ratio = m.flops_per_token() / (6.0 * m.param_count() as f64);
    assert!((0.9..1.1).contains(&ratio), "flops / 6N = {ratio}");
    assert_eq!(m.units()[0].flops_per_token(), 0.0);
}

#[test]
fn units_match_independent_reference() {
    for scaling in [
        None,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        }),
    ] {
        let cfg = LlamaConfig {
            rope_scaling: scaling,
            ..tiny_cfg()
        };
        let inv = cfg.rope_inv_freq(CPU).unwrap();
        let m = Llama::new(cfg.clone()).unwrap();
        let p = random_params(&m);
        let idx = tokens(2, 24, 256, 5);
        let u = m.units();
        let x = u[0].forward(&p[0], &idx).unwrap();
        let want = p[0][0]
            .index_select(0, &idx.reshape([-1]))
            .reshape([2, 24, 64]);
        assert_eq!(max_abs_diff(&x, &want), 0.0);
        let mut h = x;
        for i in 1..3 {
            let got = u[i].forward(&p[i], &h).unwrap();
            let want = ref_layer(&p[i], &h, &cfg, &inv);
            let d = max_abs_diff(&got, &want);
            assert!(d < 1e-9, "{}: max diff {d}", u[i].name());
            h = got;
        }
        let got = u[3].forward(&p[3], &h).unwrap();
        let want = ref_rms(&h, &p[3][0], 1e-5).matmul(&p[3][1].tr());
        assert!(max_abs_diff(&got, &want) < 1e-9);
    }
}

#[test]
fn causal_future_tokens_do_not_change_past_logits() {
    let m = tiny();
    let params = init_model_params(&m, 11, Kind::Float, CPU).unwrap();
    let idx = tokens(2, 32, 256, 9);
    let base = forward_model(&m, &params, &idx).unwrap();
    for t in [0i64, 10, 30] {
        let changed = idx.copy();
        let shifted = (idx.narrow(1, t + 1, 31 - t) + 1).remainder(256);
        changed.narrow(1, t + 1, 31 - t).copy_(&shifted);
        let out = forward_model(&m, &params, &changed).unwrap();
        let past = max_abs_diff(&out.narrow(1, 0, t + 1), &base.narrow(1, 0, t + 1));
        assert!(past < 1e-5, "t={t}: past logits moved by {past}");
        let future = max_abs_diff(
            &out.narrow(1, t + 1, 31 - t),
            &base.narrow(1, t + 1, 31 - t),
        );
        assert!(
            future > 1e-4,
            "t={t}: future logits did not react ({future})"
        );
    }
}

#[test]
fn tied_head_equals_an_untied_copy_of_the_embedding() {
    let tied = Llama::new(LlamaConfig {
        tied: true,
        ..tiny_cfg()
    })
    .unwrap();
    let untied = tiny();
    let head = tied.units().last().unwrap();
    assert_eq!(head.params().len(), 1);
    assert_eq!(head.tied(), Some(Tied { unit: 0, param: 0 }));
    assert_eq!(tied.param_count(), untied.param_count() - 256 * 64);
    let p = random_params(&tied);
    let mut q: Vec<Vec<Tensor>> = p
        .iter()
        .map(|u| u.iter().map(|t| t.copy()).collect())
        .collect();
    q[3].push(p[0][0].copy());
    let idx = tokens(2, 16, 256, 3);
    let a = forward_model(&tied, &p, &idx).unwrap();
    let b = forward_model(&untied, &q, &idx).unwrap();
    assert_eq!(max_abs_diff(&a, &b), 0.0);
}

#[test]
fn cached_generation_equals_the_full_forward() {
    let variants = [
        tiny_cfg(),
        LlamaConfig {
            tied: true,
            n_kv_head: 1,
            ..tiny_cfg()
        },
        LlamaConfig {
            n_kv_head: 4,
            rope_scaling: Some(RopeScaling::Linear { factor: 2.0 }),
            ..tiny_cfg()
        },
    ];
    for cfg in variants {
        let m = Llama::new(cfg.clone()).unwrap();
        let p = random_params(&m);
        let idx = tokens(2, 24, 256, 12);
        let full = forward_model(&m, &p, &idx).unwrap();
        for prompt in [1, 10] {
            let cached = cached_logits(&m, &p, &idx, prompt).unwrap();
            let d = max_abs_diff(&cached, &full);
            assert!(d < 1e-9, "{cfg:?} prompt {prompt}: max diff {d}");
        }
        // Generation may run past seq_len (64): rotary positions have no table.
        let long = tokens(1, 70, 256, 4);
        let logits = cached_logits(&m, &p, &long, 60).unwrap();
        assert_eq!(logits.size(), [1, 70, 256]);
    }
}

#[test]
fn gradients_reach_every_parameter() {
    let m = tiny();
    let params: Vec<Vec<Tensor>> = random_params(&m)
        .into_iter()
        .map(|u| u.into_iter().map(|t| t.set_requires_grad(true)).collect())
        .collect();
    let idx = tokens(2, 8, 256, 3);
    let logits = forward_model(&m, &params, &idx).unwrap();
    lm_loss(&logits, &tokens(2, 8, 256, 4)).unwrap().backward();
    for (u, ps) in m.units().iter().zip(&params) {
        for (s, p) in u.params().iter().zip(ps) {
            let g = p.grad();
            assert!(g.defined(), "{} has no gradient", s.name);
            assert!(
                g.abs().sum(None).double_value(&[]) > 0.0,
                "{} gradient is 0",
                s.name
            );
        }
    }
}

#[test]
fn bf16_params_compute_in_bf16_close_to_fp32() {
    let m = tiny();
    let p32 = init_model_params(&m, 4, Kind::Float, CPU).unwrap();
    let p16 = init_model_params(&m, 4, Kind::BFloat16, CPU).unwrap();
    let idx = tokens(2, 16, 256, 2);
    let l32 = forward_model(&m, &p32, &idx).unwrap();
    let l16 = forward_model(&m, &p16, &idx).unwrap();
    assert_eq!(l16.kind(), Kind::BFloat16);
    let d = max_abs_diff(&l16.to_kind(Kind::Float), &l32);
    let scale = l32.abs().max().double_value(&[]);
    assert!(
        d < 0.05 * scale,
        "bf16 vs fp32 logits differ by {d} (max {scale})"
    );
}

#[test]
fn bad_inputs_are_errors_that_say_what() {
    let m = tiny();
    let params = init_model_params(&m, 0, Kind::Float, CPU).unwrap();
    let u = m.units();
    let idx = tokens(1, 8, 256, 0);
    let x = u[0].forward(&params[0], &idx).unwrap();
    match u[1].forward(&params[1][..8], &x) {
        Err(Error::ParamCount {
            unit,
            expected: 9,
            got: 8,
            ..
        }) => assert_eq!(unit, "layers.0"),
        other => panic!("expected ParamCount, got {other:?}"),
    }
    let mut swapped: Vec<Tensor> = params[1].iter().map(|t| t.shallow_clone()).collect();
    swapped.swap(2, 1); // k_proj (32, 64) <-> q_proj (64, 64)
    match u[1].forward(&swapped, &x) {
        Err(Error::ParamShape { param, .. }) => {
            assert_eq!(param, "layers.0.self_attn.q_proj.weight")
        }
        other => panic!("expected ParamShape, got {other:?}"),
    }
    match u[0].forward(&params[0], &tokens(1, 65, 256, 0)) {
        Err(Error::SeqTooLong {
            got: 65, max: 64, ..
        }) => {}
        other => panic!("expected SeqTooLong, got {other:?}"),
    }
    let mut cache = KvCache::default();
    match u[1].forward_cached(&params[1], &x, 3, &mut cache) {
        Err(Error::KvCache { pos: 3, t: 8, .. }) => {}
        other => panic!("expected KvCache, got {other:?}"),
    }
    assert!(Llama::new(LlamaConfig {
        n_kv_head: 3,
        ..tiny_cfg()
    })
    .is_err());
}

#[test]
fn activations_scale_with_tokens_and_follow_the_dtype() {
    let m = Llama::new(LlamaConfig::preset("llama3.2-1b").unwrap()).unwrap();
    let block = m.units()[1].as_ref();
    let (a1, a2) = (block.activations(1, 512, 2), block.activations(2, 512, 2));
    // Everything but cos/sin (T x hd, shared by the batch) doubles with the batch.
    let rope = 2 * 512 * 64 * 2;
    assert_eq!(a2.saved - rope, 2 * (a1.saved - rope));
    assert_eq!(a2.output, 2 * a1.output);
    // Per token in bf16, C 2048, q 2048, kv 512, F 8192: the second norm's input 2C, 8 rstd,
    // normalised activations 2 * 2C, q and out 2 * 2q, k and v 2 * 2kv, logsumexp 32 * 4,
    // MLP 3 * 2F (gate, up and their SwiGLU product).
    let per_token =
        2 * 2048 + 8 + 2 * 2 * 2048 + 2 * 2 * 2048 + 2 * 2 * 512 + 32 * 4 + 3 * 2 * 8192;
    assert_eq!(a1.saved, 512 * per_token + rope);
    // fp32: twice the bytes, but for rstd, logsumexp and cos/sin.
    let f = block.activations(1, 512, 4);
    assert!(f.saved > a1.saved && f.saved < 2 * a1.saved);
    let e = m.units()[0].activations(3, 100, 2);
    assert_eq!((e.output, e.saved), (3 * 100 * 2048 * 2, 0));
    let h = m.units()[17].activations(1, 100, 2);
    assert_eq!(h.output, 100 * 128_256 * 2);
}
