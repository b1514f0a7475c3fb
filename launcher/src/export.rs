//! `zrun export CKPT_DIR --hf OUT_DIR [--dtype bf16|fp32|fp16] [--max-shard-size 5GB]`: a
//! directory `transformers.AutoModelForCausalLM.from_pretrained` loads, streamed parameter by
//! parameter from a sharded checkpoint of any world size.
//!
//! The checkpoint is validated and every rank file verified against its hash before the
//! export is renamed into place (written first into `OUT_DIR.tmp-<pid>` beside it); an
//! `OUT_DIR` that exists and is not empty, or lies inside the checkpoint directory, is refused.
//! A damaged or inconsistent checkpoint is one line and exit code 2, and leaves no `OUT_DIR`.

use std::path::PathBuf;

use zrun_ckpt::OutDtype;

use crate::launch::{output, BadInput, Level};

/// Flags of `zrun export`.
#[derive(clap::Args, Debug, Clone)]
pub struct ExportArgs {
    /// A checkpoint directory (`runs/x/ckpt/step-00000500`), or a checkpoint.dir, whose
    /// newest complete checkpoint is then used.
    pub checkpoint: PathBuf,
    /// The Hugging Face model directory to write (config.json, model.safetensors or shards
    /// with their index, and the run's tokenizer files).
    #[arg(long = "hf", value_name = "OUT_DIR")]
    pub hf: PathBuf,
    /// Element type of the weights: fp32 (the master weights as they are), bf16 or fp16.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16", "fp16"])]
    pub dtype: String,
    /// Largest weights file, as transformers' max_shard_size: 5GB, 500MB, 2GiB or bytes.
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
}

/// Runs `zrun export`; bad or damaged checkpoints are bad input (exit code 2).
pub fn run(args: &ExportArgs) -> anyhow::Result<u8> {
    let dtype: OutDtype = args.dtype.parse().map_err(BadInput)?;
    let max = zrun_ckpt::parse_size(&args.max_shard_size)
        .map_err(|e| BadInput(format!("--max-shard-size {}: {e}", args.max_shard_size)))?;
    let mut dir = args.checkpoint.clone();
    if !dir.join(zrun_ckpt::MANIFEST).exists() {
        if let Some((_, newest)) = zrun_ckpt::complete(&dir)?.pop() {
            dir = newest;
        }
    }
    // An export inside the checkpoint would be written among its files (and removed with it).
    zrun_ckpt::refuse_inside(&dir, &args.hf)?;
    let e = zrun_train::hf::export(&dir, &args.hf, dtype, max)?;
    if let Some(why) = &e.tokenizer_skipped {
        output::say(
            Level::Warn,
            &format!(
                "warning: {why}; exported without a tokenizer: copy a tokenizer.json into {} yourself",
                args.hf.display()
            ),
        );
    }
    let tokenizer = if e.tokenizer.is_empty() {
        "no tokenizer".to_string()
    } else {
        e.tokenizer.join(", ")
    };
    println!(
        "wrote {}: {} tensors, {} parameters in {} file(s) ({}), {tokenizer}, from {} (step {})",
        args.hf.display(),
        e.tensors,
        e.params,
        e.files.len(),
        args.dtype,
        dir.display(),
        e.step
    );
    Ok(0)
}
