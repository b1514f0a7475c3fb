//! The `Unit` and `Model` traits, and helpers that materialise and run a whole model.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result, TorchCtx};
use crate::hf::HfParam;
use crate::param::{Init, ParamSpec};

/// A parameter a unit reads but an earlier unit owns: tied input and output embeddings
/// (GPT-2, small Llamas), where the head multiplies by the embedding table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tied {
    /// Index of the owning unit in the model's unit list.
    pub unit: usize,
    /// Index of the parameter in the owning unit's `params()`.
    pub param: usize,
}

/// The keys and values a block has seen so far, for generation one token at a time.
#[derive(Default)]
pub struct KvCache {
    /// Keys (B, n_kv_head, T_seen, head_dim), or None before the first call.
    pub k: Option<Tensor>,
    /// Values, as `k`.
    pub v: Option<Tensor>,
}

impl KvCache {
    /// Number of positions cached so far (0 before the first call).
    pub fn seen(&self) -> i64 {
        self.k
            .as_ref()
            .map_or(0, |k| k.size().get(2).copied().unwrap_or(0))
    }
}

/// A unit: the granularity of gathering, freeing, reducing and checkpointing.
pub trait Unit: Send + Sync {
    /// Unit name: `"embed"`, `"h.0"` (GPT) or `"layers.0"` (Llama), ..., `"head"`.
    fn name(&self) -> &str;
    /// The unit's parameters, in a fixed order.
    fn params(&self) -> &[ParamSpec];
    /// Pure forward. `params[i]` has shape `self.params()[i].shape` (any float dtype; compute
    /// happens in the dtype of the params). The embedding unit takes token ids (B, T) int64
    /// and returns (B, T, C); blocks map (B, T, C) -> (B, T, C); the head maps (B, T, C) to
    /// logits (B, T, V).
    fn forward(&self, params: &[Tensor], x: &Tensor) -> Result<Tensor>;
    /// Forward FLOPs per token of this unit (matmul 2*m*n*k counting, plus attention).
    fn flops_per_token(&self) -> f64;
    /// Activation bytes of a forward and backward over `b` sequences of `t` tokens whose
    /// activations have `elt` bytes per element (4 for fp32, 2 for bf16 and fp16).
    fn activations(&self, b: i64, t: i64, elt: i64) -> crate::Activations;
    /// For the head: its last hidden states (B, T, C) and its output matrix (V, C), whose
    /// product is what [`Unit::forward`] returns; `None` for other units. Same `params` as
    /// [`Unit::forward`].
    fn hidden(&self, params: &[Tensor], x: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        let _ = (params, x);
        Ok(None)
    }
    /// The mean loss of this unit's logits against `targets` (B, T): for a head, with a
    /// positive `chunk`, through [`crate::linear_lm_loss`] (the logits never held whole);
    /// with `chunk` 0 where [`crate::fused_loss_applies`] (CUDA, bf16 or fp32) through
    /// [`crate::fused_lm_loss`]; otherwise [`crate::lm_loss`] of [`Unit::forward`]'s logits.
    fn loss(&self, params: &[Tensor], x: &Tensor, targets: &Tensor, chunk: i64) -> Result<Tensor> {
        if chunk > 0 || crate::fused_loss_applies(x) {
            if let Some((h, w)) = self.hidden(params, x)? {
                return if chunk > 0 {
                    crate::linear_lm_loss(&h, &w, targets, chunk)
                } else {
                    crate::fused_lm_loss(&h, &w, targets)
                };
            }
        }
        crate::lm_loss(&self.forward(params, x)?, targets)
    }
    /// The parameter of another unit this unit's forward takes after its own (tied
    /// embeddings), if any. Its gradient belongs to the owning unit.
    fn tied(&self) -> Option<Tied> {
        None
    }
    /// Forward of positions `[pos, pos + T)` for generation: blocks append their keys and
    /// values to `cache` and attend to all cached positions. `pos` is 0 (a whole prompt) or
    /// `T` is 1 (one new token). Same `params` as [`Unit::forward`].
    fn forward_cached(
        &self,
        params: &[Tensor],
        x: &Tensor,
        pos: i64,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let _ = (params, x, pos, cache);
        Err(Error::Unsupported(format!(
            "unit `{}` cannot generate with a KV cache",
            self.name()
        )))
    }
}

/// A model is an ordered list of units.
pub trait Model: Send + Sync {
    /// The units, in forward order.
    fn units(&self) -> &[Box<dyn Unit>];
    /// Sum of all `ParamSpec` numels.
    fn param_count(&self) -> i64;
    /// Training FLOPs per token (forward + backward = 3x forward), for MFU.
    fn flops_per_token(&self) -> f64;
    /// Vocabulary size V (logits' last dimension).
    fn vocab_size(&self) -> i64;
    /// Width C of the hidden states (the head's input).
    fn d_model(&self) -> i64;
    /// Longest sequence the model accepts.
    fn seq_len(&self) -> i64;
    /// Every parameter's Hugging Face name and layout, in `units()` order (a tied parameter
    /// once, under its owner).
    fn hf_params(&self) -> Vec<HfParam>;
}

/// Materialise one unit's parameters as fp32 CPU tensors via `ParamSpec::init_into`.
///
/// The values equal what any sharded build with the same `seed` produces, so this is the
/// single-process reference for tests and small tools.
pub fn init_unit_params(unit: &dyn Unit, seed: u64) -> Result<Vec<Tensor>> {
    unit.params()
        .iter()
        .map(|p| {
            let mut data = vec![0f32; usize::try_from(p.numel()).unwrap_or(0)];
            p.init_into(seed, 0, &mut data);
            Tensor::f_from_slice(&data)
                .and_then(|t| t.f_reshape(&p.shape))
                .ctx(&p.name, "from_slice/reshape")
        })
        .collect()
}

/// Materialise every unit's parameters (see [`init_unit_params`]), cast to `kind` and moved
/// to `device`. Returns one `Vec<Tensor>` per unit, in unit order.
pub fn init_model_params(
    model: &dyn Model,
    seed: u64,
    kind: Kind,
    device: Device,
) -> Result<Vec<Vec<Tensor>>> {
    model
        .units()
        .iter()
        .map(|u| {
            init_unit_params(u.as_ref(), seed)?
                .into_iter()
                .map(|t| t.f_to_device(device).and_then(|t| t.f_to_kind(kind)))
                .collect::<std::result::Result<Vec<_>, _>>()
                .ctx(u.name(), "to_device/to_kind")
        })
        .collect()
}

/// Run the whole model unit by unit: token ids (B, T) int64 -> logits (B, T, V).
///
/// `params[u]` holds unit `u`'s tensors in `Unit::params()` order. This is the unsharded
/// reference forward that sharded engines are checked against.
pub fn forward_model(model: &dyn Model, params: &[Vec<Tensor>], idx: &Tensor) -> Result<Tensor> {
    let units = model.units();
    if params.len() != units.len() {
        let names: Vec<&str> = units.iter().map(|u| u.name()).collect();
        return Err(Error::ParamCount {
            unit: "<model>".to_string(),
            expected: units.len(),
            got: params.len(),
            names: format!("one Vec<Tensor> per unit: {}", names.join(", ")),
        });
    }
    let mut x = idx.shallow_clone();
    for (u, unit) in units.iter().enumerate() {
        x = unit.forward(&unit_inputs(model, params, u), &x)?;
    }
    Ok(x)
}

/// Run the whole model on positions `[pos, pos + T)` for generation: token ids (B, T) int64
/// -> logits (B, T, V), each unit through [`Unit::forward_cached`] with its own entry of
/// `caches` (one per unit; the embedding and head leave theirs empty). Start with fresh
/// caches and the prompt at `pos` 0, then feed one token at a time at `pos` = tokens so far.
pub fn forward_model_cached(
    model: &dyn Model,
    params: &[Vec<Tensor>],
    idx: &Tensor,
    pos: i64,
    caches: &mut [KvCache],
) -> Result<Tensor> {
    let units = model.units();
    if params.len() != units.len() || caches.len() != units.len() {
        let names: Vec<&str> = units.iter().map(|u| u.name()).collect();
        return Err(Error::ParamCount {
            unit: "<model>".to_string(),
            expected: units.len(),
            got: if params.len() != units.len() {
                params.len()
            } else {
                caches.len()
            },
            names: format!(
                "one Vec<Tensor> and one KvCache per unit: {}",
                names.join(", ")
            ),
        });
    }
    let mut x = idx.shallow_clone();
    for (u, (unit, cache)) in units.iter().zip(caches.iter_mut()).enumerate() {
        x = unit.forward_cached(&unit_inputs(model, params, u), &x, pos, cache)?;
    }
    Ok(x)
}

/// The tensors unit `u`'s forward takes: its own parameters, then the tied one it reads from
/// another unit. `params[v]` holds unit `v`'s parameters.
pub fn unit_inputs(model: &dyn Model, params: &[Vec<Tensor>], u: usize) -> Vec<Tensor> {
    let mut p: Vec<Tensor> = params[u].iter().map(Tensor::shallow_clone).collect();
    if let Some(t) = model.units()[u].tied() {
        p.push(params[t.unit][t.param].shallow_clone());
    }
    p
}

/// Check that `params` matches `specs` in count and shapes; used by every unit's forward.
pub(crate) fn check_params(unit: &str, specs: &[ParamSpec], params: &[Tensor]) -> Result<()> {
    if params.len() != specs.len() {
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        return Err(Error::ParamCount {
            unit: unit.to_string(),
            expected: specs.len(),
            got: params.len(),
            names: names.join(", "),
        });
    }
    for (s, t) in specs.iter().zip(params) {
        let got = t.size();
        if got != s.shape {
            return Err(Error::ParamShape {
                unit: unit.to_string(),
                param: s.name.clone(),
                expected: s.shape.clone(),
                got,
            });
        }
    }
    Ok(())
}

/// Build a `ParamSpec` with decay for 2-D weights only.
pub(crate) fn spec(name: String, shape: Vec<i64>, init: Init) -> ParamSpec {
    let decay = shape.len() >= 2;
    ParamSpec {
        name,
        shape,
        init,
        decay,
    }
}

/// Cast `x` to the parameters' dtype when it differs (mixed precision enters here).
pub(crate) fn to_param_kind(unit: &str, x: &Tensor, kind: Kind) -> Result<Tensor> {
    if x.kind() == kind {
        Ok(x.shallow_clone())
    } else {
        x.f_to_kind(kind).ctx(unit, "to_kind")
    }
}

/// Check that `x` is (B, T, C) floating point with T <= `max_t`; returns (B, T).
pub(crate) fn check_activation(unit: &str, x: &Tensor, c: i64, max_t: i64) -> Result<(i64, i64)> {
    let size = x.size();
    if size.len() != 3 || size[2] != c || !x.is_floating_point() {
        return Err(Error::Input {
            unit: unit.to_string(),
            expected: format!("a floating-point (B, T, {c}) activation"),
            got: size,
            kind: format!("{:?}", x.kind()),
        });
    }
    if size[1] > max_t {
        return Err(Error::SeqTooLong {
            unit: unit.to_string(),
            got: size[1],
            max: max_t,
        });
    }
    Ok((size[0], size[1]))
}

/// Check that `idx` holds token ids (B, T) of an integer dtype with T <= `max_t`; returns
/// (B, T).
pub(crate) fn check_tokens(unit: &str, idx: &Tensor, max_t: i64) -> Result<(i64, i64)> {
    let size = idx.size();
    if size.len() != 2 || !matches!(idx.kind(), Kind::Int64 | Kind::Int) {
        return Err(Error::Input {
            unit: unit.to_string(),
            expected: "token ids (B, T) of dtype int64".to_string(),
            got: size,
            kind: format!("{:?}", idx.kind()),
        });
    }
    if size[1] > max_t {
        return Err(Error::SeqTooLong {
            unit: unit.to_string(),
            got: size[1],
            max: max_t,
        });
    }
    Ok((size[0], size[1]))
}

/// Check that a cached forward of `t` tokens at position `pos` is a whole prompt (`pos` 0)
/// or one token right after the `cached` positions.
pub(crate) fn check_step(unit: &str, pos: i64, t: i64, cached: i64) -> Result<()> {
    let reason = if pos < 0 {
        "the position must be >= 0"
    } else if pos > 0 && t != 1 {
        "after the prompt (pos 0) tokens come one at a time (T = 1)"
    } else if pos > 0 && pos != cached {
        "the position must equal the number of cached positions; start again at pos 0 \
         with a fresh cache"
    } else {
        return Ok(());
    };
    Err(Error::KvCache {
        unit: unit.to_string(),
        pos,
        t,
        cached,
        reason: reason.to_string(),
    })
}

/// Store keys and values `k`, `v` (B, n_kv_head, T, hs) of positions `[pos, pos + T)` in
/// `cache` (a prompt at `pos` 0 replaces what it held) and return the keys and values of all
/// cached positions, plus whether attention is causal (a prompt) rather than to every cached
/// position (one new token).
pub(crate) fn cache_append(
    unit: &str,
    cache: &mut KvCache,
    k: Tensor,
    v: Tensor,
    pos: i64,
) -> Result<(Tensor, Tensor, bool)> {
    let t = k.size().get(2).copied().unwrap_or(0);
    check_step(unit, pos, t, cache.seen())?;
    let (k, v) = match (pos, cache.k.take(), cache.v.take()) {
        (0, _, _) | (_, None, _) | (_, _, None) => (k, v),
        (_, Some(k0), Some(v0)) => (
            Tensor::f_cat(&[k0, k], 2).ctx(unit, "cat(k cache)")?, // (B, nkv, pos+1, hs)
            Tensor::f_cat(&[v0, v], 2).ctx(unit, "cat(v cache)")?,
        ),
    };
    cache.k = Some(k.shallow_clone());
    cache.v = Some(v.shallow_clone());
    Ok((k, v, pos == 0))
}

/// Logits (B, T, V) of every position of `idx` computed with KV caches: the first `prompt`
/// tokens at once, then one token at a time.
#[cfg(test)]
pub(crate) fn cached_logits(
    model: &dyn Model,
    params: &[Vec<Tensor>],
    idx: &Tensor,
    prompt: i64,
) -> Result<Tensor> {
    let t = idx.size()[1];
    let mut caches: Vec<KvCache> = model.units().iter().map(|_| KvCache::default()).collect();
    let mut out = vec![forward_model_cached(
        model,
        params,
        &idx.narrow(1, 0, prompt),
        0,
        &mut caches,
    )?];
    for pos in prompt..t {
        let one = idx.narrow(1, pos, 1);
        out.push(forward_model_cached(model, params, &one, pos, &mut caches)?);
    }
    Ok(Tensor::cat(&out, 1))
}
