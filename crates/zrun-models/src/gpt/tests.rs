//! Tests of the GPT units against closed forms and an independent reference written with
//! elementary tensor ops (explicit mean/variance LayerNorm, masked softmax attention, the
//! tanh GELU formula).

use tch::{Device, Kind, Tensor};

use super::Gpt;
use crate::config::GptConfig;
use crate::error::Error;
use crate::loss::lm_loss;
use crate::param::Init;
use crate::unit::{
    cached_logits, forward_model, forward_model_cached, init_model_params, init_unit_params,
    KvCache, Model, Tied,
};

const CPU: Device = Device::Cpu;

fn tiny() -> Gpt {
    Gpt::new(GptConfig::preset("tiny").unwrap()).unwrap()
}

fn tokens(b: i64, t: i64, v: i64, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randint(v, [b, t], (Kind::Int64, CPU))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

// ---------------------------------------------------------------- reference implementation

fn ref_ln(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    let mean = x.mean_dim(-1, true, None);
    let xc = x - &mean;
    let var = (&xc * &xc).mean_dim(-1, true, None);
    xc / (var + 1e-5).sqrt() * w + b
}

fn ref_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let y = x.matmul(&w.tr());
    match b {
        Some(b) => y + b,
        None => y,
    }
}

fn ref_gelu_tanh(x: &Tensor) -> Tensor {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let inner = (x + x * x * x * 0.044715) * k;
    x * 0.5 * (inner.tanh() + 1.0)
}

/// One block with explicit per-head masked softmax attention.
fn ref_block(p: &[Tensor], x: &Tensor, n_head: i64) -> Tensor {
    let (b, t, c) = x.size3().unwrap();
    let hs = c / n_head;
    let h = ref_ln(x, &p[0], &p[1]);
    let qkv = ref_linear(&h, &p[2], Some(&p[3]));
    let parts = qkv.split(c, 2);
    let split = |z: &Tensor| z.reshape([b, t, n_head, hs]).permute([0, 2, 1, 3]);
    let (q, k, v) = (split(&parts[0]), split(&parts[1]), split(&parts[2]));
    let att = q.matmul(&k.transpose(-2, -1)) / (hs as f64).sqrt(); // (B, nh, T, T)
    let future = Tensor::ones([t, t], (Kind::Bool, CPU)).triu(1);
    let att = att
        .masked_fill(&future, f64::NEG_INFINITY)
        .softmax(-1, None);
    let y = att.matmul(&v).permute([0, 2, 1, 3]).reshape([b, t, c]);
    let x = x + ref_linear(&y, &p[4], Some(&p[5]));
    let h = ref_ln(&x, &p[6], &p[7]);
    let h = ref_gelu_tanh(&ref_linear(&h, &p[8], Some(&p[9])));
    &x + ref_linear(&h, &p[10], Some(&p[11]))
}

/// Random fp64 parameters (biases and LayerNorms non-trivial, unlike the init).
fn random_params(model: &Gpt) -> Vec<Vec<Tensor>> {
    tch::manual_seed(42);
    model
        .units()
        .iter()
        .map(|u| {
            u.params()
                .iter()
                .map(|s| Tensor::randn(s.shape.as_slice(), (Kind::Double, CPU)) * 0.3)
                .collect()
        })
        .collect()
}

// ---------------------------------------------------------------------------------- tests

#[test]
fn units_and_param_names_follow_the_layout() {
    let gpt = tiny();
    let names: Vec<&str> = gpt.units().iter().map(|u| u.name()).collect();
    assert_eq!(names, ["embed", "h.0", "h.1", "head"]);
    let h1: Vec<&str> = gpt.units()[2]
        .params()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        h1,
        [
            "h.1.ln_1.weight",
            "h.1.ln_1.bias",
            "h.1.attn.qkv.weight",
            "h.1.attn.qkv.bias",
            "h.1.attn.proj.weight",
            "h.1.attn.proj.bias",
            "h.1.ln_2.weight",
            "h.1.ln_2.bias",
            "h.1.mlp.fc.weight",
            "h.1.mlp.fc.bias",
            "h.1.mlp.proj.weight",
            "h.1.mlp.proj.bias",
        ]
    );
    let all: Vec<_> = gpt.units().iter().flat_map(|u| u.params()).collect();
    for p in &all {
        let is_matrix = p.name.ends_with("weight") && !p.name.contains("ln");
        assert_eq!(p.decay, is_matrix, "{}", p.name);
        let want = if !p.name.ends_with("weight") {
            Init::Zeros
        } else if p.name.contains("ln") {
            Init::Ones
        } else if p.name.ends_with("proj.weight") {
            Init::Normal { std: 0.02 / 2.0 } // 0.02 / sqrt(2 * n_layer), n_layer = 2
        } else {
            Init::Normal { std: 0.02 }
        };
        assert_eq!(p.init, want, "{}", p.name);
    }
    let head: Vec<&str> = gpt.units()[3]
        .params()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(head, ["ln_f.weight", "ln_f.bias", "lm_head.weight"]);
}

#[test]
fn output_shapes_of_every_unit_and_the_chain() {
    let gpt = tiny();
    let params = init_model_params(&gpt, 3, Kind::Float, CPU).unwrap();
    for t in [1, 16, 64] {
        let idx = tokens(2, t, 256, t);
        let mut x = gpt.units()[0].forward(&params[0], &idx).unwrap();
        assert_eq!(x.size(), [2, t, 64]);
        for (u, p) in gpt.units()[1..3].iter().zip(&params[1..3]) {
            x = u.forward(p, &x).unwrap();
            assert_eq!(x.size(), [2, t, 64], "{}", u.name());
        }
        let logits = gpt.units()[3].forward(&params[3], &x).unwrap();
        assert_eq!(logits.size(), [2, t, 256]);
        let chained = forward_model(&gpt, &params, &idx).unwrap();
        assert_eq!(max_abs_diff(&chained, &logits), 0.0);
    }
}

#[test]
fn units_match_independent_reference() {
    let gpt = tiny();
    let p = random_params(&gpt);
    let idx = tokens(2, 24, 256, 5);
    let u = gpt.units();

    // Embedding: row lookup plus the first T position rows.
    let x = u[0].forward(&p[0], &idx).unwrap();
    let want = p[0][0]
        .index_select(0, &idx.reshape([-1]))
        .reshape([2, 24, 64])
        + p[0][1].narrow(0, 0, 24);
    assert!(max_abs_diff(&x, &want) < 1e-12);

    // Blocks.
    let mut h = x;
    for i in 1..3 {
        let got = u[i].forward(&p[i], &h).unwrap();
        let want = ref_block(&p[i], &h, 4);
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-10, "{}: max diff {d}", u[i].name());
        h = got;
    }

    // Head: LayerNorm then the untied projection.
    let got = u[3].forward(&p[3], &h).unwrap();
    let want = ref_linear(&ref_ln(&h, &p[3][0], &p[3][1]), &p[3][2], None);
    assert!(max_abs_diff(&got, &want) < 1e-10);
}

#[test]
fn causal_future_tokens_do_not_change_past_logits() {
    let gpt = tiny();
    let params = init_model_params(&gpt, 11, Kind::Float, CPU).unwrap();
    let idx = tokens(2, 32, 256, 9);
    let base = forward_model(&gpt, &params, &idx).unwrap();
    for t in [0i64, 10, 30] {
        // Replace every token after position t by a different one.
        let changed = idx.copy();
        let shifted = (idx.narrow(1, t + 1, 31 - t) + 1).remainder(256);
        changed.narrow(1, t + 1, 31 - t).copy_(&shifted);
        let out = forward_model(&gpt, &params, &changed).unwrap();
        let past = max_abs_diff(&out.narrow(1, 0, t + 1), &base.narrow(1, 0, t + 1));
        assert!(past < 1e-5, "t={t}: past logits moved by {past}");
        let future = max_abs_diff(
            &out.narrow(1, t + 1, 31 - t),
            &base.narrow(1, t + 1, 31 - t),
        );
        assert!(
            future > 1e-3,
            "t={t}: future logits did not react ({future})"
        );
    }
}

/// Closed-form parameter count from the shapes in the architecture description.
fn closed_form_params(v: i64, t: i64, l: i64, c: i64) -> i64 {
    let embed = v * c + t * c;
    let block = 2 * c // ln_1
        + 3 * c * c + 3 * c // attn.qkv
        + c * c + c // attn.proj
        + 2 * c // ln_2
        + 4 * c * c + 4 * c // mlp.fc
        + 4 * c * c + c; // mlp.proj
    let head = 2 * c + v * c;
    embed + l * block + head
}

#[test]
fn param_count_of_every_preset_matches_closed_form() {
    let shapes = [
        ("tiny", 256, 64, 2, 64),
        ("gpt2-small", 50304, 1024, 12, 768),
        ("gpt2-medium", 50304, 1024, 24, 1024),
        ("gpt2-large", 50304, 1024, 36, 1280),
        ("gpt2-xl", 50304, 1024, 48, 1600),
    ];
    assert_eq!(GptConfig::PRESETS.len(), shapes.len());
    for (name, v, t, l, c) in shapes {
        // Specs only: building the model allocates no tensors, even for gpt2-xl.
        let gpt = Gpt::new(GptConfig::preset(name).unwrap()).unwrap();
        assert_eq!(gpt.param_count(), closed_form_params(v, t, l, c), "{name}");
        assert_eq!(gpt.units().len() as i64, l + 2, "{name}");
        assert_eq!((gpt.vocab_size(), gpt.seq_len()), (v, t));
    }
    // nanoGPT reports 124,475,904 parameters for its tied gpt2 (vocab 50304); the head
    // here is untied, adding one more V x C matrix.
    let small = Gpt::new(GptConfig::preset("gpt2-small").unwrap()).unwrap();
    assert_eq!(small.param_count(), 124_475_904 + 50304 * 768);
}

#[test]
fn flops_per_token_of_gpt2_small_is_near_6n() {
    let gpt = Gpt::new(GptConfig::preset("gpt2-small").unwrap()).unwrap();
    let (v, t, l, c) = (50304.0, 1024.0, 12.0, 768.0);
    // nanoGPT's estimate_mfu: 6N + 12 L H Q T with N = its non-position parameter count
    // (tied wte/lm_head counted once, biases and LayerNorms included).
    let n_nano = 124_475_904.0 - t * c;
    let nano = 6.0 * n_nano + 12.0 * l * c * t;
    // This crate counts matmul weights only, so the difference is 6x the biases and norms.
    let biases_and_norms = l * 13.0 * c + 2.0 * c;
    let got = gpt.flops_per_token();
    assert!(
        (got - (nano - 6.0 * biases_and_norms)).abs() < 1.0,
        "{got} vs {nano}"
    );
    assert!((got / nano - 1.0).abs() < 1e-3);
    // Against 6 x all parameters (which counts both embeddings as matmuls): ~0.87.
    let ratio = got / (6.0 * gpt.param_count() as f64);
    assert!((0.8..1.0).contains(&ratio), "flops / 6N = {ratio}");
    // Training is 3x the sum of the units' forward FLOPs; the embedding costs none.
    let fwd: f64 = gpt.units().iter().map(|u| u.flops_per_token()).sum();
    assert_eq!(got, 3.0 * fwd);
    assert_eq!(gpt.units()[0].flops_per_token(), 0.0);
    assert_eq!(gpt.units()[13].flops_per_token(), 2.0 * v * c);
}

#[test]
fn bf16_params_compute_in_bf16_close_to_fp32() {
    let gpt = tiny();
    let p32 = init_model_params(&gpt, 4, Kind::Float, CPU).unwrap();
    let p16 = init_model_params(&gpt, 4, Kind::BFloat16, CPU).unwrap();
    let idx = tokens(2, 16, 256, 2);
    let l32 = forward_model(&gpt, &p32, &idx).unwrap();
    let l16 = forward_model(&gpt, &p16, &idx).unwrap();
    assert_eq!(l16.kind(), Kind::BFloat16);
    // A block fed fp32 activations with bf16 params computes (and returns) bf16.
    let x = gpt.units()[0].forward(&p32[0], &idx).unwrap();
    assert_eq!(
        gpt.units()[1].forward(&p16[1], &x).unwrap().kind(),
        Kind::BFloat16
    );
    let d = max_abs_diff(&l16.to_kind(Kind::Float), &l32);
    let scale = l32.abs().max().double_value(&[]);
    assert!(
        d < 0.05 * scale,
        "bf16 vs fp32 logits differ by {d} (max |logit| {scale})"
    );
}

#[test]
fn gradients_reach_every_parameter() {
    let gpt = tiny();
    let params: Vec<Vec<Tensor>> = random_params(&gpt)
        .into_iter()
        .map(|u| u.into_iter().map(|t| t.set_requires_grad(true)).collect())
        .collect();
    let idx = tokens(2, 8, 256, 3);
    let logits = forward_model(&gpt, &params, &idx).unwrap();
    lm_loss(&logits, &tokens(2, 8, 256, 4)).unwrap().backward();
    for (u, ps) in gpt.units().iter().zip(&params) {
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
fn init_unit_params_uses_init_into_and_residual_scaling() {
    let gpt = Gpt::new(GptConfig::preset("gpt2-small").unwrap()).unwrap();
    let block = gpt.units()[1].as_ref();
    let ps = init_unit_params(block, 77).unwrap();
    for (s, t) in block.params().iter().zip(&ps) {
        assert_eq!(t.size(), s.shape, "{}", s.name);
        assert_eq!(t.kind(), Kind::Float);
    }
    // attn.proj.weight: 768 x 768 normals with std 0.02 / sqrt(24).
    let w = &ps[4];
    let std = w.std(true).double_value(&[]);
    let want = 0.02 / 24f64.sqrt();
    assert!((std / want - 1.0).abs() < 0.01, "std {std} vs {want}");
    // Element 1000 equals a one-element init_into at that index.
    let mut one = [0f32];
    block.params()[4].init_into(77, 1000, &mut one);
    assert_eq!(w.reshape([-1]).double_value(&[1000]), f64::from(one[0]));
    // LayerNorm weights are ones, biases zeros.
    assert_eq!(ps[0].sum(None).double_value(&[]), 768.0);
    assert_eq!(ps[1].abs().sum(None).double_value(&[]), 0.0);
}

#[test]
fn bad_inputs_are_errors_that_say_what() {
    let gpt = tiny();
    let params = init_model_params(&gpt, 0, Kind::Float, CPU).unwrap();
    let u = gpt.units();
    let idx = tokens(1, 8, 256, 0);
    let x = u[0].forward(&params[0], &idx).unwrap();

    match u[1].forward(&params[1][..11], &x) {
        Err(Error::ParamCount {
            unit,
            expected: 12,
            got: 11,
            ..
        }) => assert_eq!(unit, "h.0"),
        other => panic!("expected ParamCount, got {other:?}"),
    }
    let mut swapped: Vec<Tensor> = params[1].iter().map(|t| t.shallow_clone()).collect();
    swapped.swap(8, 10); // fc.weight (256, 64) <-> proj.weight (64, 256)
    match u[1].forward(&swapped, &x) {
        Err(Error::ParamShape { param, .. }) => assert_eq!(param, "h.0.mlp.fc.weight"),
        other => panic!("expected ParamShape, got {other:?}"),
    }
    let long = tokens(1, 65, 256, 0);
    match u[0].forward(&params[0], &long) {
        Err(Error::SeqTooLong {
            got: 65, max: 64, ..
        }) => {}
        other => panic!("expected SeqTooLong, got {other:?}"),
    }
    let as_float = idx.to_kind(Kind::Float);
    assert!(matches!(
        u[0].forward(&params[0], &as_float),
        Err(Error::Input { .. })
    ));
    let narrow = x.narrow(2, 0, 32);
    let msg = u[3].forward(&params[3], &narrow).unwrap_err().to_string();
    assert!(msg.contains("head") && msg.contains("[1, 8, 32]"), "{msg}");
    assert!(forward_model(&gpt, &params[..3], &idx).is_err());
    assert!(Gpt::new(GptConfig {
        n_head: 5,
        ..gpt.config().clone()
    })
    .is_err());
}

// ------------------------------------------------------------- tied head and generation

fn tied_tiny() -> Gpt {
    Gpt::new(GptConfig {
        tied: true,
        ..GptConfig::preset("tiny").unwrap()
    })
    .unwrap()
}

#[test]
fn tied_head_reads_the_token_table() {
    let (tied, untied) = (tied_tiny(), tiny());
    let head = tied.units().last().unwrap();
    let names: Vec<&str> = head.params().iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["ln_f.weight", "ln_f.bias"]);
    assert_eq!(head.tied(), Some(Tied { unit: 0, param: 0 }));
    assert_eq!(untied.units().last().unwrap().tied(), None);
    assert_eq!(
        tied.param_count(),
        closed_form_params(256, 64, 2, 64) - 256 * 64
    );
    assert_eq!(tied.flops_per_token(), untied.flops_per_token());

    // The tied model equals the untied one whose lm_head is a copy of wte.
    let p = random_params(&tied);
    let mut q: Vec<Vec<Tensor>> = p
        .iter()
        .map(|u| u.iter().map(|t| t.copy()).collect())
        .collect();
    q[3].push(p[0][0].copy());
    let idx = tokens(2, 16, 256, 7);
    let a = forward_model(&tied, &p, &idx).unwrap();
    let b = forward_model(&untied, &q, &idx).unwrap();
    assert_eq!(max_abs_diff(&a, &b), 0.0);

    // The table's gradient collects both uses: the lookup's and the head's.
    let leaves = |ps: &[Vec<Tensor>]| -> Vec<Vec<Tensor>> {
        ps.iter()
            .map(|u| u.iter().map(|t| t.copy().set_requires_grad(true)).collect())
            .collect()
    };
    let (pl, ql) = (leaves(&p), leaves(&q));
    let target = tokens(2, 16, 256, 8);
    lm_loss(&forward_model(&tied, &pl, &idx).unwrap(), &target)
        .unwrap()
        .backward();
    lm_loss(&forward_model(&untied, &ql, &idx).unwrap(), &target)
        .unwrap()
        .backward();
    let both = ql[0][0].grad() + ql[3][2].grad();
    assert!(max_abs_diff(&pl[0][0].grad(), &both) < 1e-12);

    // Without the table the head says what it expected.
    let x = tied.units()[0].forward(&p[0], &idx).unwrap();
    match head.forward(&p[3], &x) {
        Err(Error::ParamCount {
            expected: 3,
            got: 2,
            names,
            ..
        }) => assert!(names.contains("wte.weight"), "{names}"),
        other => panic!("expected ParamCount, got {other:?}"),
    }
}

#[test]
fn cached_generation_equals_the_full_forward() {
    for gpt in [tiny(), tied_tiny()] {
        let p = random_params(&gpt);
        let idx = tokens(2, 24, 256, 12);
        let full = forward_model(&gpt, &p, &idx).unwrap();
        for prompt in [1, 9] {
            let cached = cached_logits(&gpt, &p, &idx, prompt).unwrap();
            let d = max_abs_diff(&cached, &full);
            assert!(d < 1e-10, "prompt {prompt}: max diff {d}");
        }
    }
}

#[test]
fn cached_steps_that_do_not_follow_the_cache_are_errors() {
    let gpt = tiny();
    let p = init_model_params(&gpt, 1, Kind::Float, CPU).unwrap();
    let mut caches: Vec<KvCache> = gpt.units().iter().map(|_| KvCache::default()).collect();
    let idx = tokens(1, 64, 256, 1);
    let _ = forward_model_cached(&gpt, &p, &idx.narrow(1, 0, 60), 0, &mut caches).unwrap();
    assert_eq!(caches[1].seen(), 60);
    let two = idx.narrow(1, 60, 2);
    match forward_model_cached(&gpt, &p, &two, 60, &mut caches) {
        Err(Error::KvCache { pos: 60, t: 2, .. }) => {}
        other => panic!("expected KvCache, got {other:?}"),
    }
    let one = idx.narrow(1, 61, 1);
    match forward_model_cached(&gpt, &p, &one, 61, &mut caches) {
        Err(Error::KvCache {
            unit,
            pos: 61,
            cached: 60,
            ..
        }) => assert_eq!(unit, "h.0"),
        other => panic!("expected KvCache, got {other:?}"),
    }
    for pos in 60..64 {
        let one = idx.narrow(1, pos, 1);
        let _ = forward_model_cached(&gpt, &p, &one, pos, &mut caches).unwrap();
    }
    // Position 64 is past the position table.
    match forward_model_cached(&gpt, &p, &one, 64, &mut caches) {
        Err(Error::SeqTooLong {
            got: 65, max: 64, ..
        }) => {}
        other => panic!("expected SeqTooLong, got {other:?}"),
    }
}
