//! Llama's three kinds of unit: token embedding, decoder layer (RMSNorm, rotary grouped-query
//! attention, RMSNorm, SwiGLU MLP), final RMSNorm + head. No biases.
//!
//! The math is transformers' `LlamaForCausalLM` (RMSNorm in fp32, rotary angles in fp32,
//! grouped-query attention as `repeat_kv`), so Hugging Face weights give its logits: op for op in fp32;
//! with 16-bit parameters the RMSNorm's weight multiplies before the one rounding to 16 bits
//! (as ATen's `rms_norm` and its fused CUDA kernel do), where transformers rounds first. Each
//! unit computes in its parameters' dtype (activations of another dtype are cast on entry).

use tch::Tensor;

use super::rope;
use crate::activation::Activations;
use crate::error::{Error, Result, TorchCtx};
use crate::param::{Init, ParamSpec};
use crate::unit::{
    cache_append, check_activation, check_params, check_step, check_tokens, spec, to_param_kind,
    KvCache, Tied, Unit,
};

/// RMSNorm `x * rsqrt(mean(x^2) + eps) * w` in fp32 (fp64 activations, in tests, in fp64),
/// rounded once to the input's dtype: one autograd node that keeps its input and an fp32
/// rstd per row, ATen's fused kernels on CUDA (`zrun_torch_ext::rms_norm`).
fn rms_norm(unit: &str, x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    zrun_torch_ext::rms_norm(x, w, eps).map_err(|source| Error::Shim {
        place: format!("{unit}: rms_norm"),
        source,
    })
}

/// Unit `"embed"`: `embed_tokens.weight` (V, C); x = table[idx].
pub(crate) struct Embed {
    specs: Vec<ParamSpec>,
    seq_len: i64,
    c: i64,
}

impl Embed {
    /// Specs for vocabulary `v` and width `c`.
    pub(crate) fn new(v: i64, c: i64, seq_len: i64, std: f64) -> Embed {
        Embed {
            specs: vec![spec(
                "embed_tokens.weight".into(),
                vec![v, c],
                Init::Normal { std },
            )],
            seq_len,
            c,
        }
    }

    /// The lookup (B, T) -> (B, T, C), for up to `max_t` tokens.
    fn lookup(&self, params: &[Tensor], idx: &Tensor, max_t: i64) -> Result<Tensor> {
        let u = "embed";
        check_params(u, &self.specs, params)?;
        check_tokens(u, idx, max_t)?;
        Tensor::f_embedding(&params[0], idx, -1, false, false).ctx(u, "embedding")
        // (B, T, C)
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
        self.lookup(params, idx, self.seq_len)
    }

    /// The same lookup; positions enter in the blocks' rotary embeddings.
    fn forward_cached(
        &self,
        params: &[Tensor],
        idx: &Tensor,
        pos: i64,
        _cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (_, t) = check_tokens(self.name(), idx, i64::MAX)?;
        check_step(self.name(), pos, t, pos)?;
        self.lookup(params, idx, i64::MAX)
    }

    /// A table lookup: no matmul FLOPs.
    fn flops_per_token(&self) -> f64 {
        0.0
    }

    /// The output (B, T, C) only: the lookup keeps nothing but the ids for its backward.
    fn activations(&self, b: i64, t: i64, elt: i64) -> Activations {
        Activations {
            output: b * t * self.c * elt,
            ..Activations::default()
        }
    }
}

/// Shapes of a decoder layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    /// Width C.
    pub(crate) c: i64,
    /// Query heads.
    pub(crate) n_head: i64,
    /// Key/value heads.
    pub(crate) n_kv_head: i64,
    /// Head size.
    pub(crate) head_dim: i64,
    /// MLP width F.
    pub(crate) ffn: i64,
    /// Longest training sequence.
    pub(crate) seq_len: i64,
    /// RMSNorm epsilon.
    pub(crate) eps: f64,
}

/// Unit `"layers.{i}"`: a pre-norm decoder layer with rotary grouped-query attention and a
/// SwiGLU MLP `down(silu(gate(x)) * up(x))`.
pub(crate) struct Block {
    name: String,
    specs: Vec<ParamSpec>,
    d: Dims,
    /// Rotary inverse frequencies (hd/2), computed once in fp32 as transformers does.
    inv_freq: Vec<f32>,
}

impl Block {
    /// Layer `i` with shapes `d`, rotary inverse frequencies `inv_freq` and Normal(0, std)
    /// matrices (transformers' Llama init: no residual scaling).
    pub(crate) fn new(i: i64, d: Dims, inv_freq: Vec<f32>, std: f64) -> Block {
        let name = format!("layers.{i}");
        let n = Init::Normal { std };
        let p = |s: &str| format!("{name}.{s}");
        let (c, q, kv, f) = (d.c, d.n_head * d.head_dim, d.n_kv_head * d.head_dim, d.ffn);
        let specs = vec![
            spec(p("input_layernorm.weight"), vec![c], Init::Ones),
            spec(p("self_attn.q_proj.weight"), vec![q, c], n),
            spec(p("self_attn.k_proj.weight"), vec![kv, c], n),
            spec(p("self_attn.v_proj.weight"), vec![kv, c], n),
            spec(p("self_attn.o_proj.weight"), vec![c, q], n),
            spec(p("post_attention_layernorm.weight"), vec![c], Init::Ones),
            spec(p("mlp.gate_proj.weight"), vec![f, c], n),
            spec(p("mlp.up_proj.weight"), vec![f, c], n),
            spec(p("mlp.down_proj.weight"), vec![c, f], n),
        ];
        Block {
            name,
            specs,
            d,
            inv_freq,
        }
    }

    /// The layer; with a cache, queries at `[pos, pos + T)` attend to every cached key
    /// (causally for a prompt), and positions are not bounded by `seq_len`.
    fn run(
        &self,
        params: &[Tensor],
        x: &Tensor,
        cache: Option<(i64, &mut KvCache)>,
    ) -> Result<Tensor> {
        let u = self.name.as_str();
        check_params(u, &self.specs, params)?;
        let max_t = if cache.is_some() {
            i64::MAX
        } else {
            self.d.seq_len
        };
        let (_, t) = check_activation(u, x, self.d.c, max_t)?;
        if let Some((pos, cache)) = &cache {
            check_step(u, *pos, t, cache.seen())?;
        }
        let [ln1, wq, wk, wv, wo, ln2, wg, wu, wd] = params else {
            return Err(Error::ParamCount {
                unit: u.to_string(),
                expected: 9,
                got: params.len(),
                names: "the 9 layer parameters".to_string(),
            });
        };
        let x = to_param_kind(u, x, ln1.kind())?; // (B, T, C)
        let a = self.attention(&x, [ln1, wq, wk, wv, wo], cache)?;
        let x = x.f_add(&a).ctx(u, "residual add")?;
        drop(a);
        let m = self.mlp(&x, [ln2, wg, wu, wd])?;
        x.f_add(&m).ctx(u, "residual add")
    }

    /// `o_proj(attention(rope(q_proj(h)), rope(k_proj(h)), v_proj(h)))` with h = RMSNorm(x).
    fn attention(
        &self,
        x: &Tensor,
        [ln, wq, wk, wv, wo]: [&Tensor; 5],
        cache: Option<(i64, &mut KvCache)>,
    ) -> Result<Tensor> {
        let u = self.name.as_str();
        let Dims {
            n_head: nh,
            n_kv_head: nkv,
            head_dim: hd,
            ..
        } = self.d;
        let (b, t) = (x.size()[0], x.size()[1]);
        let pos = cache.as_ref().map_or(0, |(pos, _)| *pos);
        let h = rms_norm(u, x, ln, self.d.eps)?; // (B, T, C)
        let (cos, sin) = rope::cos_sin(u, &self.inv_freq, pos, t, x.device(), x.kind())?;
        let heads = |w: &Tensor, n: i64| -> Result<Tensor> {
            h.f_linear(w, None::<Tensor>) // (B, T, n*hd)
                .and_then(|p| p.f_view([b, t, n, hd])) // (B, T, n, hd)
                .ctx(u, "linear and split heads")
        };
        let by_head = |x: Tensor| x.f_transpose(1, 2).ctx(u, "transpose heads"); // (B, n, T, hd)
        let q = by_head(rope::apply(u, &heads(wq, nh)?, &cos, &sin)?)?; // (B, nh, T, hd)
        let k = by_head(rope::apply(u, &heads(wk, nkv)?, &cos, &sin)?)?; // (B, nkv, T, hd)
        let v = by_head(heads(wv, nkv)?)?; // (B, nkv, T, hd)
        let (k, v, causal) = match cache {
            None => (k, v, true),
            Some((pos, cache)) => cache_append(u, cache, k, v, pos)?, // (B, nkv, S, hd)
        };
        // Grouped-query attention inside SDPA (`enable_gqa`): kv head j serves query heads
        // j*g .. (j+1)*g - 1, as transformers' repeat_kv, without copying k and v g times (and
        // summing their gradients back in backward); the flash kernels read them as they are.
        let y = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            0.0,
            causal,
            None,
            nh != nkv,
        )
        .ctx(u, "scaled_dot_product_attention")?; // (B, nh, T, hd)
        drop((q, k, v));
        y.f_transpose(1, 2) // (B, T, nh, hd)
            .and_then(|y| y.f_reshape([b, t, nh * hd])) // (B, T, nh*hd)
            .and_then(|y| y.f_linear(wo, None::<Tensor>)) // (B, T, C)
            .ctx(u, "linear(o_proj)")
    }

    /// `down_proj(silu(gate_proj(h)) * up_proj(h))` with h = RMSNorm(x).
    fn mlp(&self, x: &Tensor, [ln, wg, wu, wd]: [&Tensor; 4]) -> Result<Tensor> {
        let u = self.name.as_str();
        let h = rms_norm(u, x, ln, self.d.eps)?; // (B, T, C)
        let gate = h.f_linear(wg, None::<Tensor>).ctx(u, "linear(gate_proj)")?; // (B, T, F)
        let up = h.f_linear(wu, None::<Tensor>).ctx(u, "linear(up_proj)")?; // (B, T, F)
        drop(h);
        // silu(gate) * up as one node keeping gate and up only (silu is recomputed in the
        // backward; one kernel each way on CUDA).
        let m = zrun_torch_ext::swiglu(&gate, &up).map_err(|source| Error::Shim {
            place: format!("{u}: swiglu"),
            source,
        })?;
        drop((gate, up));
        m.f_linear(wd, None::<Tensor>).ctx(u, "linear(down_proj)") // (B, T, C)
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

    /// Appends this layer's rotated keys and its values (B, n_kv_head, T, hd) to `cache`.
    fn forward_cached(
        &self,
        params: &[Tensor],
        x: &Tensor,
        pos: i64,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.run(params, x, Some((pos, cache)))
    }

    /// `2 * (C q + 2 C kv + q C + 3 C F)` for the seven matmuls (q = nh hd, kv = nkv hd)
    /// plus `2 * 2 * T * nh * hd` for attention at full length T = seq_len, as GPT counts it.
    fn flops_per_token(&self) -> f64 {
        let Dims {
            c,
            n_head,
            n_kv_head,
            head_dim,
            ffn,
            seq_len,
            ..
        } = self.d;
        let (c, q, kv, f) = (
            c as f64,
            (n_head * head_dim) as f64,
            (n_kv_head * head_dim) as f64,
            ffn as f64,
        );
        2.0 * (2.0 * c * q + 2.0 * c * kv + 3.0 * c * f) + 4.0 * seq_len as f64 * q
    }

    /// Per token, with q = nh hd: each RMSNorm its input and an fp32 rstd (the first norm's
    /// input is the layer's, counted where it is made; the second's is the residual sum, C);
    /// the normalised activations feeding q/k/v and gate/up (C each); attention's rotated q,
    /// rotated k and v (kv = n_kv_head hd each: SDPA groups the heads itself, and the rotary
    /// products keep only cos and sin), its output q and fp32 logsumexp (one per head); the
    /// MLP's gate, up and silu(gate) x up (F each; SwiGLU's node recomputes silu(gate)). Besides, cos and sin (T, hd) for the whole
    /// micro-batch. The forward's peak temporary is the rotary work on q (the projection and
    /// three products, 4q) or, off CUDA, a norm's fp32 work (its square and, with 16-bit
    /// activations, the fp32 copy of its input); the backward's the MLP's three F-wide
    /// gradients (or attention's, 2q + 2kv) beside the residual's and the norm
    /// input's (2C), or, off CUDA, a norm's fp32 gradients; without autograd, the MLP's
    /// three F-wide tensors beside the residual and normalised activations, the rotary work
    /// on q beside the norm's output, or a norm's fp32 work.
    /// (`saved` is measured against the ops themselves by tests/llama_memory.rs.)
    fn activations(&self, b: i64, t: i64, elt: i64) -> Activations {
        let Dims {
            c,
            n_head,
            n_kv_head,
            ffn: f,
            head_dim,
            ..
        } = self.d;
        let n = b * t;
        let (q, kv) = (n_head * head_dim, n_kv_head * head_dim);
        let attention = (2 * q + 2 * kv) * elt;
        let saved = n * (c * elt + 2 * 4 + 2 * c * elt + attention + n_head * 4 + 3 * f * elt)
            + 2 * t * head_dim * elt;
        // A norm's fp32 work off CUDA: its square, and the fp32 copy of a 16-bit input; in
        // the backward the normalised input, the weighted gradient and a product (and the
        // fp32 copy of a 16-bit gradient).
        let (norm_fwd, norm_bwd) = if elt == 4 {
            (4 * c, 12 * c)
        } else {
            (8 * c, 16 * c)
        };
        let residual_16 = if elt == 4 { 0 } else { c * elt };
        Activations {
            output: n * c * elt,
            saved,
            forward_temp: n * (4 * q * elt).max(norm_fwd),
            backward_temp: n
                * ((3 * f * elt).max(attention) + 2 * c * elt).max(norm_bwd + 2 * c * elt),
            no_grad_temp: n
                * ((3 * f + 2 * c) * elt)
                    .max((c + 5 * q) * elt)
                    .max(8 * c + c * elt + residual_16),
        }
    }
}

/// Unit `"head"`: `norm.weight` (C) and `lm_head.weight` (V, C), or with a tied head the
/// embedding's `embed_tokens.weight` read through [`Unit::tied`]; logits = RMSNorm(x) @ W^T.
pub(crate) struct Head {
    specs: Vec<ParamSpec>,
    /// What `forward` takes: `specs`, then the tied table when there is one.
    inputs: Vec<ParamSpec>,
    tied: bool,
    v: i64,
    c: i64,
    seq_len: i64,
    eps: f64,
}

impl Head {
    /// Specs for vocabulary `v` and width `c`; `tied` reads `embed_tokens.weight` instead of
    /// owning `lm_head.weight`.
    pub(crate) fn new(v: i64, c: i64, seq_len: i64, eps: f64, std: f64, tied: bool) -> Head {
        let mut specs = vec![spec("norm.weight".into(), vec![c], Init::Ones)];
        let mut inputs = specs.clone();
        let table = |name: &str| spec(name.into(), vec![v, c], Init::Normal { std });
        if tied {
            inputs.push(table("embed_tokens.weight"));
        } else {
            specs.push(table("lm_head.weight"));
            inputs.push(table("lm_head.weight"));
        }
        Head {
            specs,
            inputs,
            tied,
            v,
            c,
            seq_len,
            eps,
        }
    }

    /// The norm's output (B, T, C) and the logits matrix, for up to `max_t` positions.
    fn normed(&self, params: &[Tensor], x: &Tensor, max_t: i64) -> Result<(Tensor, Tensor)> {
        let u = "head";
        check_params(u, &self.inputs, params)?;
        check_activation(u, x, self.c, max_t)?;
        let (w, lm) = (&params[0], &params[1]);
        let x = to_param_kind(u, x, w.kind())?;
        Ok((rms_norm(u, &x, w, self.eps)?, lm.shallow_clone()))
    }

    /// The norm then the logits matmul, for up to `max_t` positions.
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

    /// `embed_tokens.weight`: parameter 0 of unit 0, when tied.
    fn tied(&self) -> Option<Tied> {
        self.tied.then_some(Tied { unit: 0, param: 0 })
    }

    fn forward(&self, params: &[Tensor], x: &Tensor) -> Result<Tensor> {
        self.run(params, x, self.seq_len)
    }

    fn hidden(&self, params: &[Tensor], x: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        self.normed(params, x, self.seq_len).map(Some)
    }

    /// As `forward`, for any number of positions: the head has no state across positions.
    fn forward_cached(
        &self,
        params: &[Tensor],
        x: &Tensor,
        _pos: i64,
        _cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.run(params, x, i64::MAX)
    }

    /// `2 * V * C` for the logits matmul (counted whether or not the matrix is tied).
    fn flops_per_token(&self) -> f64 {
        2.0 * self.v as f64 * self.c as f64
    }

    /// The logits (B, T, V); the norm keeps an fp32 rstd (its input is the unit's) and its
    /// output (C) is kept for the matmul; the forward's peak temporary is, off CUDA, the
    /// norm's fp32 work, the backward's the norm's gradients, and without autograd the norm's
    /// intermediates (as a layer's norm, see [`Block`]). The loss is [`crate::LossBytes`].
    fn activations(&self, b: i64, t: i64, elt: i64) -> Activations {
        let (n, c) = (b * t, self.c);
        let copy_16 = if elt == 4 { 0 } else { 4 * c };
        let (norm_fwd, norm_bwd) = if elt == 4 {
            (4 * c, 12 * c)
        } else {
            (8 * c, 16 * c)
        };
        Activations {
            output: n * self.v * elt,
            saved: n * (4 + c * elt),
            forward_temp: n * norm_fwd,
            backward_temp: n * (norm_bwd + c * elt),
            no_grad_temp: n * (4 * c + c * elt + copy_16),
        }
    }
}
