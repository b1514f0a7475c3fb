//! GPT's three kinds of unit: token + position embedding, pre-LN block, final LN + head.
//!
//! Each unit owns its `ParamSpec`s; `forward` checks the tensors it is handed against them and
//! computes in the parameters' dtype (activations of another dtype are cast on entry).

use tch::{Kind, Tensor};

use crate::activation::Activations;
use crate::error::{Error, Result, TorchCtx};
use crate::param::{Init, ParamSpec};
use crate::unit::{check_params, Unit};

/// LayerNorm epsilon (PyTorch's default, as GPT-2 / nanoGPT).
const LN_EPS: f64 = 1e-5;

/// GELU variant used by the MLP: the tanh approximation, as the original GPT-2 ("gelu_new"),
/// so GPT-2 weights reproduce GPT-2's activations.
const GELU_APPROX: &str = "tanh";

/// Build a `ParamSpec` with decay for 2-D weights only.
fn spec(name: String, shape: Vec<i64>, init: Init) -> ParamSpec {
    let decay = shape.len() >= 2;
    ParamSpec {
        name,
        shape,
        init,
        decay,
    }
}

/// Cast `x` to the parameters' dtype when it differs (mixed precision enters here).
fn to_param_kind(unit: &str, x: &Tensor, kind: Kind) -> Result<Tensor> {
    if x.kind() == kind {
        Ok(x.shallow_clone())
    } else {
        x.f_to_kind(kind).ctx(unit, "to_kind")
    }
}

/// Check that `x` is (B, T, C) floating point with T <= seq_len; returns (B, T).
fn check_activation(unit: &str, x: &Tensor, c: i64, seq_len: i64) -> Result<(i64, i64)> {
    let size = x.size();
    if size.len() != 3 || size[2] != c || !x.is_floating_point() {
        return Err(Error::Input {
            unit: unit.to_string(),
            expected: format!("a floating-point (B, T, {c}) activation"),
            got: size,
            kind: format!("{:?}", x.kind()),
        });
    }
    if size[1] > seq_len {
        return Err(Error::SeqTooLong {
            unit: unit.to_string(),
            got: size[1],
            max: seq_len,
        });
    }
    Ok((size[0], size[1]))
}

/// Unit `"embed"`: `wte.weight` (V, C), `wpe.weight` (T_max, C); x = wte[idx] + wpe[0..T].
pub(crate) struct Embed {
    specs: Vec<ParamSpec>,
    seq_len: i64,
    c: i64,
}

impl Embed {
    /// Specs for vocabulary `v`, `seq_len` positions, width `c`.
    pub(crate) fn new(v: i64, seq_len: i64, c: i64, std: f64) -> Embed {
        let n = Init::Normal { std };
        Embed {
            specs: vec![
                spec("wte.weight".into(), vec![v, c], n),
                spec("wpe.weight".into(), vec![seq_len, c], n),
            ],
            seq_len,
            c,
        }
    }
}

impl Unit for Embed {
    fn name(&self) -> &str {
        "embed"
    }

    fn params(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn forward(&self, params: &[Tensor], idx: &Tensor) -> Result<Tensor> {
        let u = self.name();
        check_params(u, &self.specs, params)?;
        let size = idx.size();
        if size.len() != 2 || !matches!(idx.kind(), Kind::Int64 | Kind::Int) {
            return Err(Error::Input {
                unit: u.to_string(),
                expected: "token ids (B, T) of dtype int64".to_string(),
                got: size,
                kind: format!("{:?}", idx.kind()),
            });
        }
        let t = size[1];
        if t > self.seq_len {
            return Err(Error::SeqTooLong {
                unit: u.to_string(),
                got: t,
                max: self.seq_len,
            });
        }
        let (wte, wpe) = (&params[0], &params[1]);
        let tok = Tensor::f_embedding(wte, idx, -1, false, false).ctx(u, "embedding")?; // (B, T, C)
        let pos = wpe.f_narrow(0, 0, t).ctx(u, "narrow")?; // (T, C)
        tok.f_add(&pos).ctx(u, "add") // (B, T, C)
    }

    /// A table lookup: no matmul FLOPs.
    fn flops_per_token(&self) -> f64 {
        0.0
    }

    /// The output (B, T, C); the looked-up rows (B, T, C) live until the position add.
    fn activations(&self, b: i64, t: i64, elt: i64) -> Activations {
        let x = b * t * self.c * elt;
        Activations {
            output: x,
            saved: 0,
            forward_temp: x,
            backward_temp: 0,
            no_grad_temp: x,
        }
    }
}

/// Unit `"h.{i}"`: a pre-LN transformer block with causal self-attention and a GELU MLP.
pub(crate) struct Block {
    name: String,
    specs: Vec<ParamSpec>,
    n_head: i64,
    c: i64,
    seq_len: i64,
}

impl Block {
    /// Block `i` of `n_layer`, width `c`, `n_head` heads; the two output projections use
    /// GPT-2's residual scaling `std / sqrt(2 * n_layer)`.
    pub(crate) fn new(i: i64, n_layer: i64, n_head: i64, c: i64, seq_len: i64, std: f64) -> Block {
        let name = format!("h.{i}");
        let n = Init::Normal { std };
        let nres = Init::Normal {
            std: std / ((2 * n_layer) as f64).sqrt(),
        };
        let p = |s: &str| format!("{name}.{s}");
        let specs = vec![
            spec(p("ln_1.weight"), vec![c], Init::Ones),
            spec(p("ln_1.bias"), vec![c], Init::Zeros),
            spec(p("attn.qkv.weight"), vec![3 * c, c], n),
            spec(p("attn.qkv.bias"), vec![3 * c], Init::Zeros),
            spec(p("attn.proj.weight"), vec![c, c], nres),
            spec(p("attn.proj.bias"), vec![c], Init::Zeros),
            spec(p("ln_2.weight"), vec![c], Init::Ones),
            spec(p("ln_2.bias"), vec![c], Init::Zeros),
            spec(p("mlp.fc.weight"), vec![4 * c, c], n),
            spec(p("mlp.fc.bias"), vec![4 * c], Init::Zeros),
            spec(p("mlp.proj.weight"), vec![c, 4 * c], nres),
            spec(p("mlp.proj.bias"), vec![c], Init::Zeros),
        ];
        Block {
            name,
            specs,
            n_head,
            c,
            seq_len,
        }
    }
}

impl Unit for Block {
    fn name(&self) -> &str {
        &self.name
    }

    fn params(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn forward(&self, params: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let u = self.name.as_str();
        check_params(u, &self.specs, params)?;
        let (b, t) = check_activation(u, x, self.c, self.seq_len)?;
        let (c, nh) = (self.c, self.n_head);
        let hs = c / nh;
        let [ln1_w, ln1_b, qkv_w, qkv_b, ap_w, ap_b, ln2_w, ln2_b, fc_w, fc_b, mp_w, mp_b] = params
        else {
            return Err(Error::ParamCount {
                unit: u.to_string(),
                expected: 12,
                got: params.len(),
                names: "the 12 block parameters".to_string(),
            });
        };
        let x = to_param_kind(u, x, ln1_w.kind())?; // (B, T, C)

        // Attention.
        let h = x
            .f_layer_norm([c], Some(ln1_w), Some(ln1_b), LN_EPS, true)
            .ctx(u, "layer_norm(ln_1)")?;
        let qkv = h.f_linear(qkv_w, Some(qkv_b)).ctx(u, "linear(qkv)")?; // (B, T, 3C)
        let heads = |part: i64| -> Result<Tensor> {
            qkv.f_narrow(2, part * c, c) // (B, T, C)
                .and_then(|p| p.f_reshape([b, t, nh, hs])) // (B, T, nh, hs)
                .and_then(|p| p.f_transpose(1, 2)) // (B, nh, T, hs)
                .ctx(u, "split heads")
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let y = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            0.0,
            true,
            None,
            false,
        )
        .ctx(u, "scaled_dot_product_attention")?; // (B, nh, T, hs)
        let y = y
            .f_transpose(1, 2) // (B, T, nh, hs)
            .and_then(|y| y.f_reshape([b, t, c])) // (B, T, C)
            .ctx(u, "merge heads")?;
        let y = y.f_linear(ap_w, Some(ap_b)).ctx(u, "linear(attn.proj)")?;
        let x = x.f_add(&y).ctx(u, "residual add")?;

        // MLP.
        let h = x
            .f_layer_norm([c], Some(ln2_w), Some(ln2_b), LN_EPS, true)
            .ctx(u, "layer_norm(ln_2)")?;
        let h = h.f_linear(fc_w, Some(fc_b)).ctx(u, "linear(mlp.fc)")?; // (B, T, 4C)
        let h = h.f_gelu(GELU_APPROX).ctx(u, "gelu")?;
        let h = h.f_linear(mp_w, Some(mp_b)).ctx(u, "linear(mlp.proj)")?; // (B, T, C)
        x.f_add(&h).ctx(u, "residual add")
    }

    /// `2 * 12 C^2` for the four matmuls (qkv 3C^2, proj C^2, fc 4C^2, proj 4C^2) plus
    /// `2 * 2 * T * C` for attention (QK^T and AV at full length T = seq_len, as nanoGPT
    /// and PaLM count it, although the causal mask skips about half of that work).
    fn flops_per_token(&self) -> f64 {
        let (c, t) = (self.c as f64, self.seq_len as f64);
        2.0 * 12.0 * c * c + 4.0 * t * c
    }

    /// Per token, in the compute dtype: ln_1's output C, qkv 3C (q, k, v are views of it),
    /// the attention output C (the CPU and flash kernels lay it out as (B, T, nh, hs), so
    /// merging the heads is a view), the residual sum C, ln_2's output C, the MLP's 4C
    /// before and 4C after GELU: 15C besides the input (Korthikanti et al. 2022's 34sbh
    /// without dropout masks and with no T x T matrix); in fp32: the two LayerNorms' mean
    /// and rstd (4) and attention's logsumexp (one per head). The backward holds the
    /// gradients of GELU's input and output (4C each) while GELU's input is still saved;
    /// without autograd the MLP's two 4C tensors and the residual sum are alive at once.
    fn activations(&self, b: i64, t: i64, elt: i64) -> Activations {
        let (n, c) = (b * t, self.c);
        Activations {
            output: n * c * elt,
            saved: n * (15 * c * elt + (4 + self.n_head) * 4),
            forward_temp: n * c * elt,
            backward_temp: 4 * n * c * elt + 2 * n * c * elt,
            no_grad_temp: 9 * n * c * elt,
        }
    }
}

/// Unit `"head"`: `ln_f.weight/bias` (C) and an untied `lm_head.weight` (V, C);
/// logits = ln_f(x) @ W^T.
pub(crate) struct Head {
    specs: Vec<ParamSpec>,
    v: i64,
    c: i64,
    seq_len: i64,
}

impl Head {
    /// Specs for vocabulary `v` and width `c`.
    pub(crate) fn new(v: i64, c: i64, seq_len: i64, std: f64) -> Head {
        Head {
            specs: vec![
                spec("ln_f.weight".into(), vec![c], Init::Ones),
                spec("ln_f.bias".into(), vec![c], Init::Zeros),
                spec("lm_head.weight".into(), vec![v, c], Init::Normal { std }),
            ],
            v,
            c,
            seq_len,
        }
    }
}

impl Unit for Head {
    fn name(&self) -> &str {
        "head"
    }

    fn params(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn forward(&self, params: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let u = self.name();
        check_params(u, &self.specs, params)?;
        check_activation(u, x, self.c, self.seq_len)?;
        let (w, b, lm) = (&params[0], &params[1], &params[2]);
        let x = to_param_kind(u, x, w.kind())?;
        let h = x
            .f_layer_norm([self.c], Some(w), Some(b), LN_EPS, true)
            .ctx(u, "layer_norm(ln_f)")?;
        h.f_linear(lm, None::<Tensor>).ctx(u, "linear(lm_head)") // (B, T, V)
    }

    /// `2 * V * C` for the logits matmul.
    fn flops_per_token(&self) -> f64 {
        2.0 * self.v as f64 * self.c as f64
    }

    /// The logits (B, T, V); ln_f's output C and its fp32 mean and rstd are saved; the
    /// backward makes the gradient of ln_f's output. The loss is [`crate::LossBytes`].
    fn activations(&self, b: i64, t: i64, elt: i64) -> Activations {
        let n = b * t;
        Activations {
            output: n * self.v * elt,
            saved: n * (self.c * elt + 2 * 4),
            forward_temp: 0,
            backward_temp: n * self.c * elt,
            no_grad_temp: n * self.c * elt,
        }
    }
}
