//! GPT's three kinds of unit: token + position embedding, pre-LN block, final LN + head.
//!
//! Each unit owns its `ParamSpec`s; `forward` checks the tensors it is handed against them and
//! computes in the parameters' dtype (activations of another dtype are cast on entry).
//! `forward_cached` runs the same math on positions `[pos, pos + T)` with a KV cache.

use tch::Tensor;

use crate::activation::Activations;
use crate::error::{Error, Result, TorchCtx};
use crate::param::{Init, ParamSpec};
use crate::unit::{
    cache_append, check_activation, check_params, check_step, check_tokens, spec, to_param_kind,
    KvCache, Tied, Unit,
};

/// LayerNorm epsilon (PyTorch's default, as GPT-2 / nanoGPT).
const LN_EPS: f64 = 1e-5;

/// LayerNorm over the last dimension, as `f_layer_norm`, through one autograd node whose weight
/// and bias gradients are one kernel pass on CUDA (`zrun_torch_ext::layer_norm`; bitwise
/// ATen's on CPU).
fn layer_norm(unit: &str, what: &str, x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    zrun_torch_ext::layer_norm(x, w, b, LN_EPS).map_err(|source| Error::Shim {
        place: format!("{unit}: layer_norm({what})"),
        source,
    })
}

/// `x w^T + b`, as `f_linear`, through one autograd node whose bias gradient is one kernel
/// pass on CUDA (`zrun_torch_ext::linear`; bitwise ATen's on CPU).
fn linear(unit: &str, what: &str, x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    zrun_torch_ext::linear(x, w, b).map_err(|source| Error::Shim {
        place: format!("{unit}: linear({what})"),
        source,
    })
}

/// `gelu(x w^T + b)` with the tanh GELU, the MLP's activation as the original GPT-2's
/// ("gelu_new", so GPT-2 weights reproduce GPT-2's activations), through one autograd node
/// whose GELU and bias gradients are one kernel pass on CUDA (`zrun_torch_ext::linear_gelu`;
/// bitwise ATen's linear and gelu on CPU).
fn linear_gelu(unit: &str, what: &str, x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    zrun_torch_ext::linear_gelu(x, w, b).map_err(|source| Error::Shim {
        place: format!("{unit}: linear_gelu({what})"),
        source,
    })
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

    /// Token rows plus position rows `[pos, pos + T)`: (B, T) -> (B, T, C).
    fn lookup(&self, params: &[Tensor], idx: &Tensor, pos: i64) -> Result<Tensor> {
        let u = "embed";
        check_params(u, &self.specs, params)?;
        let (_, t) = check_tokens(u, idx, i64::MAX)?;
        if pos + t > self.seq_len {
            return Err(Error::SeqTooLong {
                unit: u.to_string(),
                got: pos + t,
                max: self.seq_len,
            });
        }
        let (wte, wpe) = (&params[0], &params[1]);
        let tok = Tensor::f_embedding(wte, idx, -1, false, false).ctx(u, "embedding")?; // (B, T, C)
        let positions = wpe.f_narrow(0, pos, t).ctx(u, "narrow")?; // (T, C)
        tok.f_add(&positions).ctx(u, "add") // (B, T, C)
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
        self.lookup(params, idx, 0)
    }

    /// Positions `[pos, pos + T)` of the table; their end must not pass `seq_len`.
    fn forward_cached(
        &self,
        params: &[Tensor],
        idx: &Tensor,
        pos: i64,
        _cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (_, t) = check_tokens(self.name(), idx, i64::MAX)?;
        check_step(self.name(), pos, t, pos)?;
        self.lookup(params, idx, pos)
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

    /// The block's math; with a cache, queries at `[pos, pos + T)` attend to every cached key
    /// (causally for a prompt).
    fn run(
        &self,
        params: &[Tensor],
        x: &Tensor,
        cache: Option<(i64, &mut KvCache)>,
    ) -> Result<Tensor> {
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
        let h = layer_norm(u, "ln_1", &x, ln1_w, ln1_b)?;
        let qkv = linear(u, "qkv", &h, qkv_w, qkv_b)?; // (B, T, 3C)
                                                       // One split, not three narrows: split's backward writes the three gradients into one
                                                       // (B, T, 3C) tensor with one cat, where each narrow's would fill a (B, T, 3C) tensor of
                                                       // zeros around its third and autograd would add the three together.
        let parts = qkv.f_split(c, 2).ctx(u, "split(qkv)")?; // 3 x (B, T, C)
        let heads = |p: &Tensor| -> Result<Tensor> {
            p.f_view([b, t, nh, hs]) // (B, T, nh, hs)
                .and_then(|p| p.f_transpose(1, 2)) // (B, nh, T, hs)
                .ctx(u, "split heads")
        };
        let (q, k, v) = (heads(&parts[0])?, heads(&parts[1])?, heads(&parts[2])?);
        drop(parts);
        let (k, v, causal) = match cache {
            None => (k, v, true),
            Some((pos, cache)) => cache_append(u, cache, k, v, pos)?, // (B, nh, pos+T, hs)
        };
        let y = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            0.0,
            causal,
            None,
            false,
        )
        .ctx(u, "scaled_dot_product_attention")?; // (B, nh, T, hs)
        let y = y
            .f_transpose(1, 2) // (B, T, nh, hs)
            .and_then(|y| y.f_reshape([b, t, c])) // (B, T, C)
            .ctx(u, "merge heads")?;
        let y = linear(u, "attn.proj", &y, ap_w, ap_b)?;
        let x = x.f_add(&y).ctx(u, "residual add")?;

        // MLP.
        let h = layer_norm(u, "ln_2", &x, ln2_w, ln2_b)?;
        let h = linear_gelu(u, "mlp.fc", &h, fc_w, fc_b)?; // (B, T, 4C)
        let h = linear(u, "mlp.proj", &h, mp_w, mp_b)?; // (B, T, C)
        x.f_add(&h).ctx(u, "residual add")
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
        self.run(params, x, None)
    }

    /// Appends this block's keys and values (B, nh, T, hs) to `cache`.
    fn forward_cached(
        &self,
        params: &[Tensor],
        x: &Tensor,
        pos: i64,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.run(params, x, Some((pos, cache)))
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

/// Unit `"head"`: `ln_f.weight/bias` (C) and `lm_head.weight` (V, C), or with a tied head
/// the embedding's `wte.weight` read through [`Unit::tied`]; logits = ln_f(x) @ W^T.
pub(crate) struct Head {
    specs: Vec<ParamSpec>,
    /// What `forward` takes: `specs`, then the tied table when there is one.
    inputs: Vec<ParamSpec>,
    tied: bool,
    v: i64,
    c: i64,
    seq_len: i64,
}

impl Head {
    /// Specs for vocabulary `v` and width `c`; `tied` reads `wte.weight` instead of owning
    /// `lm_head.weight`.
    pub(crate) fn new(v: i64, c: i64, seq_len: i64, std: f64, tied: bool) -> Head {
        let mut specs = vec![
            spec("ln_f.weight".into(), vec![c], Init::Ones),
            spec("ln_f.bias".into(), vec![c], Init::Zeros),
        ];
        let lm = spec("lm_head.weight".into(), vec![v, c], Init::Normal { std });
        let mut inputs = specs.clone();
        if tied {
            inputs.push(spec("wte.weight".into(), vec![v, c], Init::Normal { std }));
        } else {
            specs.push(lm.clone());
            inputs.push(lm);
        }
        Head {
            specs,
            inputs,
            tied,
            v,
            c,
            seq_len,
        }
    }

    /// ln_f's output (B, T, C) and the logits matrix, for up to `max_t` positions.
    fn normed(&self, params: &[Tensor], x: &Tensor, max_t: i64) -> Result<(Tensor, Tensor)> {
        let u = "head";
        check_params(u, &self.inputs, params)?;
        check_activation(u, x, self.c, max_t)?;
        let (w, b, lm) = (&params[0], &params[1], &params[2]);
        let x = to_param_kind(u, x, w.kind())?;
        let h = layer_norm(u, "ln_f", &x, w, b)?;
        Ok((h, lm.shallow_clone()))
    }

    /// ln_f then the logits matmul, for up to `max_t` positions.
    fn run(&self, params: &[Tensor], x: &Tensor, max_t: i64) -> Result<Tensor> {
        let (h, lm) = self.normed(params, x, max_t)?;
        h.f_linear(&lm, None::<Tensor>)
            .ctx("head", "linear(lm_head)") // (B, T, V)
    }
}

impl Unit for Head {
    fn name(&self) -> &str {
        "head"
    }

    fn params(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// `wte.weight`: parameter 0 of unit 0, when tied.
    fn tied(&self) -> Option<Tied> {
        self.tied.then_some(Tied { unit: 0, param: 0 })
    }

    fn forward(&self, params: &[Tensor], x: &Tensor) -> Result<Tensor> {
        self.run(params, x, self.seq_len)
    }

    fn hidden(&self, params: &[Tensor], x: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        self.normed(params, x, self.seq_len).map(Some)
    }

    /// As `forward`: the head has no state across positions.
    fn forward_cached(
        &self,
        params: &[Tensor],
        x: &Tensor,
        _pos: i64,
        _cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.run(params, x, self.seq_len)
    }

    /// `2 * V * C` for the logits matmul (counted whether or not the matrix is tied).
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
