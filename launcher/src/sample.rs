//! `zrun sample MODEL [--prompt TEXT | --prompt-ids 1,2,3] --max-new-tokens N [--greedy |
//! --temperature T --top-k K --seed S] [--json]`: generation from a Hugging Face directory, a
//! zrun checkpoint or an export, on one process (CPU or one GPU), with a KV cache.

use std::path::PathBuf;
use std::time::Instant;

use tch::{Device, Kind};
use zrun_train::sample::{generate, SampleOptions};

use crate::launch::BadInput;

/// Flags of `zrun sample`.
#[derive(clap::Args, Debug, Clone)]
pub struct SampleArgs {
    /// A Hugging Face model directory (an export included), a checkpoint directory, or a
    /// checkpoint.dir (its newest complete checkpoint).
    pub model: PathBuf,
    /// The prompt as text, encoded with the model's tokenizer.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Vec<i64>,
    /// Tokens to generate at most (fewer when an end-of-sequence token comes first).
    #[arg(long, default_value_t = 50)]
    pub max_new_tokens: usize,
    /// Always the most likely token (as transformers' generate(do_sample=False)).
    #[arg(long)]
    pub greedy: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Sample among the K most likely tokens only.
    #[arg(long)]
    pub top_k: Option<i64>,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A tokenizer.json to use instead of the model's.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// cpu, or cuda / cuda:N for one GPU.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype: fp32, bf16 or fp16.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16", "fp16"])]
    pub dtype: String,
    /// Print one JSON object: tokens (the new ids), text (when there is a tokenizer),
    /// prompt_tokens, seconds and tokens_per_s.
    #[arg(long)]
    pub json: bool,
}

fn device(s: &str) -> Result<Device, BadInput> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|i| i.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| BadInput(format!("--device {s}: give cpu, cuda or cuda:N"))),
    }
}

/// Runs `zrun sample`; a bad model, prompt or flag is bad input (exit code 2).
pub fn run(args: &SampleArgs) -> anyhow::Result<u8> {
    let dev = device(&args.device)?;
    if dev.is_cuda() && !tch::Cuda::is_available() {
        return Err(BadInput(format!(
            "--device {}: no CUDA device is visible",
            args.device
        ))
        .into());
    }
    let kind = match args.dtype.as_str() {
        "bf16" => Kind::BFloat16,
        "fp16" => Kind::Half,
        _ => Kind::Float,
    };
    let loaded = zrun_train::hf::load_full(&args.model)?;
    let tokenizer =
        match args.tokenizer.as_ref().or(loaded.tokenizer.as_ref()) {
            Some(p) => Some(tokenizers::Tokenizer::from_file(p).map_err(|e| {
                BadInput(format!("{}: not a usable tokenizer.json: {e}", p.display()))
            })?),
            None => None,
        };
    let prompt: Vec<i64> = match (&args.prompt, &tokenizer) {
        (Some(text), Some(t)) => t
            .encode(text.as_str(), true)
            .map_err(|e| BadInput(format!("--prompt: the tokenizer cannot encode it: {e}")))?
            .get_ids()
            .iter()
            .map(|&i| i64::from(i))
            .collect(),
        (Some(_), None) => {
            return Err(BadInput(format!(
                "--prompt: {} has no tokenizer; pass --tokenizer tokenizer.json or --prompt-ids",
                args.model.display()
            ))
            .into())
        }
        (None, _) => args.prompt_ids.clone(),
    };
    let params: Vec<Vec<tch::Tensor>> = loaded
        .params
        .iter()
        .map(|u| {
            u.iter()
                .map(|p| p.f_to_device(dev).and_then(|p| p.f_to_kind(kind)))
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<_, _>>()?;
    let o = SampleOptions {
        max_new_tokens: args.max_new_tokens,
        greedy: args.greedy,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
        eos: if args.ignore_eos {
            Vec::new()
        } else {
            loaded.eos.clone()
        },
    };
    let t0 = Instant::now();
    let tokens = generate(loaded.model.as_ref(), &params, &prompt, dev, &o)
        .map_err(|e| BadInput(e.to_string()))?;
    let secs = t0.elapsed().as_secs_f64();
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    let text = tokenizer.as_ref().and_then(|t| t.decode(&ids, true).ok());
    if args.json {
        let obj = serde_json::json!({
            "tokens": tokens,
            "text": text,
            "prompt_tokens": prompt.len(),
            "seconds": secs,
            "tokens_per_s": tokens.len() as f64 / secs.max(1e-9),
        });
        println!("{obj}");
    } else {
        match text {
            Some(t) => println!("{}{t}", args.prompt.as_deref().unwrap_or("")),
            None => println!("{tokens:?}"),
        }
    }
    Ok(0)
}
