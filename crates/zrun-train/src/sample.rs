//! `zrun sample`: generation on one process with a KV cache, greedy or sampled with a
//! temperature and top-k, as nanoGPT's sample.py and transformers' `generate` do.

use tch::{Device, Kind, Tensor};
use zrun_models::{unit_inputs, KvCache, Model};

use crate::Error;

/// How to pick each new token.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// The most likely token every time (ignores temperature, top-k and seed).
    pub greedy: bool,
    /// Divides the logits before sampling (> 0).
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<i64>,
    /// Seed of the sampling.
    pub seed: u64,
    /// Generation stops after one of these tokens.
    pub eos: Vec<i64>,
}

fn torch(op: &str) -> impl Fn(tch::TchError) -> Error + '_ {
    move |e| Error::Unsupported(format!("sample: libtorch op `{op}` failed: {e}"))
}

fn shim(op: &str) -> impl Fn(zrun_torch_ext::Error) -> Error + '_ {
    move |e| Error::Unsupported(format!("sample: libtorch op `{op}` failed: {e}"))
}

/// The next token from the logits (V) of the last position.
fn pick(logits: &Tensor, o: &SampleOptions) -> Result<i64, Error> {
    // A copy, even of fp32 logits: changed in place below.
    let logits = logits
        .f_to_dtype(Kind::Float, false, true)
        .map_err(torch("to_kind"))?;
    if o.greedy {
        return logits
            .f_argmax(-1, false)
            .and_then(|t| t.f_int64_value(&[]))
            .map_err(torch("argmax"));
    }
    // In place on that fp32 copy (zrun_torch_ext::scalar: an error, not tch's panic).
    let l = logits;
    zrun_torch_ext::scalar::div_(&l, o.temperature).map_err(shim("div"))?;
    if let Some(k) = o.top_k {
        let k = k.min(l.size()[0]);
        let (top, _) = l.f_topk(k, -1, true, true).map_err(torch("topk"))?;
        let kth = top.f_select(0, k - 1).map_err(torch("select"))?;
        let below = l.f_lt_tensor(&kth).map_err(torch("lt"))?;
        zrun_torch_ext::scalar::masked_fill_(&l, &below, f64::NEG_INFINITY)
            .map_err(shim("masked_fill"))?;
    }
    l.f_softmax(-1, Kind::Float)
        .and_then(|p| p.f_multinomial(1, false))
        .and_then(|t| t.f_int64_value(&[0]))
        .map_err(torch("multinomial"))
}

/// Generates up to `o.max_new_tokens` tokens after `prompt` with `model`'s parameters
/// `params` (one `Vec` per unit, on `device`, in the compute dtype): the prompt in one
/// forward, then one token at a time against the cached keys and values. Returns the new
/// token ids (ending with an EOS token when one was generated).
pub fn generate(
    model: &dyn Model,
    params: &[Vec<Tensor>],
    prompt: &[i64],
    device: Device,
    o: &SampleOptions,
) -> Result<Vec<i64>, Error> {
    if prompt.is_empty() {
        return Err(Error::Unsupported(
            "sample: the prompt is empty; give --prompt text or --prompt-ids".into(),
        ));
    }
    // Saturating: a --max-new-tokens near usize::MAX must fail this check, not wrap past it.
    let total = prompt.len().saturating_add(o.max_new_tokens);
    if total > usize::try_from(model.seq_len()).unwrap_or(0) {
        return Err(Error::Unsupported(format!(
            "sample: {} prompt tokens + {} new ones exceed the model's sequence length {}; shorten the prompt or --max-new-tokens",
            prompt.len(),
            o.max_new_tokens,
            model.seq_len()
        )));
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t < 0 || t >= model.vocab_size()) {
        return Err(Error::Unsupported(format!(
            "sample: prompt token {bad} is outside the vocabulary [0, {})",
            model.vocab_size()
        )));
    }
    if let Some(k) = o.top_k.filter(|&k| k < 1) {
        return Err(Error::Unsupported(format!(
            "sample: --top-k {k} must be at least 1 (1 picks the most likely token)"
        )));
    }
    let usable = o.temperature.is_finite() && o.temperature > 0.0;
    if !o.greedy && !usable {
        return Err(Error::Unsupported(format!(
            "sample: --temperature {} must be a finite number > 0",
            o.temperature
        )));
    }
    let _guard = tch::no_grad_guard();
    tch::manual_seed(o.seed as i64);
    let units = model.units();
    let inputs: Vec<Vec<Tensor>> = (0..units.len())
        .map(|u| unit_inputs(model, params, u))
        .collect();
    let mut caches: Vec<KvCache> = units.iter().map(|_| KvCache::default()).collect();
    let mut out = Vec::with_capacity(o.max_new_tokens);
    let mut x = Tensor::f_from_slice(prompt)
        .and_then(|t| t.f_view([1, -1]))
        .and_then(|t| t.f_to_device(device))
        .map_err(torch("from_slice"))?;
    let mut pos = 0;
    while out.len() < o.max_new_tokens {
        let t = x.size()[1];
        for (u, unit) in units.iter().enumerate() {
            x = unit.forward_cached(&inputs[u], &x, pos, &mut caches[u])?;
        }
        pos += t;
        let last = x
            .f_select(0, 0)
            .and_then(|l| l.f_select(0, t - 1))
            .map_err(torch("select"))?; // (V)
        let next = pick(&last, o)?;
        out.push(next);
        if o.eos.contains(&next) {
            break;
        }
        x = Tensor::f_from_slice(&[next])
            .and_then(|t| t.f_view([1, 1]))
            .and_then(|t| t.f_to_device(device))
            .map_err(torch("from_slice"))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zrun_models::ArchConfig;

    fn options() -> SampleOptions {
        SampleOptions {
            max_new_tokens: 4,
            greedy: false,
            temperature: 1.0,
            top_k: None,
            seed: 0,
            eos: vec![],
        }
    }

    /// Refused before anything is allocated or run (no parameters are needed to get there).
    fn refusal(o: &SampleOptions) -> String {
        let model = ArchConfig::preset("gpt", "tiny").unwrap().build().unwrap();
        match generate(model.as_ref(), &[], &[1, 2], Device::Cpu, o) {
            Err(e) => e.to_string(),
            Ok(t) => panic!("generated {t:?}"),
        }
    }

    #[test]
    fn a_length_past_the_model_is_refused_however_large() {
        for n in [63, 1 << 40, usize::MAX - 1, usize::MAX] {
            let o = SampleOptions {
                max_new_tokens: n,
                ..options()
            };
            assert!(
                refusal(&o).contains("exceed the model's sequence length 64"),
                "{n}"
            );
        }
    }

    #[test]
    fn top_k_below_one_is_refused() {
        for k in [0, -1, i64::MIN] {
            let o = SampleOptions {
                top_k: Some(k),
                ..options()
            };
            assert!(refusal(&o).contains(&format!("--top-k {k} must be at least 1")));
        }
    }
}
