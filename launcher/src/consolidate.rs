//! `zrun consolidate CKPT_DIR -o model.safetensors [--dtype fp32|bf16|fp16]`: one
//! safetensors file of full parameters named as the model names them, streamed parameter by
//! parameter from a sharded checkpoint of any world size. The manifest is validated before any
//! rank file is read and every rank file is verified before `FILE.tmp` is renamed to `FILE`;
//! a damaged or inconsistent checkpoint is one line, exit code 2, and leaves `FILE` as it was.
//! So is a `FILE` that cannot be one: inside the checkpoint directory (it would overwrite the
//! checkpoint), an existing directory, an existing file that is not a safetensors file (an
//! earlier consolidation's is replaced, as documented), or in a directory that does not exist.
//! SIGINT, SIGTERM or SIGHUP removes `FILE.tmp` and exits 128+N with one line (export.rs has
//! the signal handling); a write that fails (a full disk) names `-o` and what to do.

use std::path::PathBuf;

use zrun_ckpt::OutDtype;

use crate::export::{catch_signals, interrupted, output_error, stopped};
use crate::launch::BadInput;

/// Flags of `zrun consolidate`.
#[derive(clap::Args, Debug, Clone)]
pub struct ConsolidateArgs {
    /// A checkpoint directory (`runs/x/ckpt/step-00000500`), or a checkpoint.dir, whose
    /// newest complete checkpoint is then used.
    pub checkpoint: PathBuf,
    /// The safetensors file to write.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// Element type of the file: fp32 (the master weights as they are), bf16 or fp16.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16", "fp16"])]
    pub dtype: String,
}

/// Runs `zrun consolidate`; bad or damaged checkpoints are bad input (exit code 2).
pub fn run(args: &ConsolidateArgs) -> anyhow::Result<u8> {
    let dtype: OutDtype = args.dtype.parse().map_err(BadInput)?;
    let mut dir = args.checkpoint.clone();
    if !dir.join(zrun_ckpt::MANIFEST).exists() {
        // A checkpoint.dir: its newest complete checkpoint.
        if let Some((_, newest)) = zrun_ckpt::complete(&dir)?.pop() {
            dir = newest;
        }
    }
    let tmp = zrun_ckpt::consolidate_tmp(&args.output);
    let failed = |e: zrun_ckpt::Error| match e {
        // A write of the output itself: the flag and what to do, not checkpoint.dir's advice.
        zrun_ckpt::Error::Io { op, path, source } if path == tmp || path == args.output => {
            output_error("-o", &args.output, op, &path, &source)
        }
        zrun_ckpt::Error::Io { .. } | zrun_ckpt::Error::Invalid(_) => anyhow::Error::new(e),
        other => anyhow::Error::new(BadInput(other.to_string())),
    };
    // The manifest's tables must be its model's before they name and shape the tensors.
    let ckpt = zrun_ckpt::Checkpoint::open(&dir).map_err(failed)?;
    zrun_train::hf::check_checkpoint_views(&ckpt).map_err(|e| BadInput(e.to_string()))?;
    drop(ckpt);
    catch_signals()?;
    let stop = || interrupted().is_some();
    let done = zrun_ckpt::consolidate_until(&dir, &args.output, dtype, &stop).map_err(failed)?;
    let Some(c) = done else {
        return Ok(stopped(
            "consolidate",
            &format!("the partial output {}", tmp.display()),
        ));
    };
    println!(
        "wrote {}: {} tensors, {} parameters, {:.1} MiB ({}), from {} (step {})",
        c.path.display(),
        c.tensors,
        c.params,
        c.bytes as f64 / (1 << 20) as f64,
        args.dtype,
        dir.display(),
        c.step
    );
    Ok(0)
}
