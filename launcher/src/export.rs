//! `zrun export CKPT_DIR --hf OUT_DIR [--dtype bf16|fp32|fp16] [--max-shard-size 5GB]`: a
//! directory `transformers.AutoModelForCausalLM.from_pretrained` loads, streamed parameter by
//! parameter from a sharded checkpoint of any world size.
//!
//! The checkpoint is validated and every rank file verified against its hash before the
//! export is renamed into place (written first into `OUT_DIR.tmp-<pid>` beside it); an
//! `OUT_DIR` that exists and is not empty, or lies inside the checkpoint directory, is refused.
//! A damaged or inconsistent checkpoint is one line and exit code 2, and leaves no `OUT_DIR`.
//! SIGINT, SIGTERM or SIGHUP removes the temporary directory and exits 128+N with one line;
//! one that a killed export left (its process gone) is removed by the next export into
//! `OUT_DIR`, with a note. A write that fails (a full disk) names `--hf` and what to do.
//!
//! The pieces `zrun consolidate` and `zrun prepare` share with it live here too: the signals
//! that stop a command writing its output ([`catch_signals`], [`interrupted`], [`stopped`])
//! and the line for a failed write of that output ([`output_error`]).

use std::path::{Path, PathBuf};

use zrun_ckpt::OutDtype;

use crate::launch::{output, signals, BadInput, Level};

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
    catch_signals()?;
    for (left, pid) in zrun_train::hf::remove_killed_exports(&args.hf) {
        output::say(
            Level::Warn,
            &format!(
                "note: removed {}, left by an export (process {pid}) that no longer runs",
                left.display()
            ),
        );
    }
    let tmp = zrun_train::hf::export_tmp(&args.hf)?;
    let stop = || interrupted().is_some();
    let done = zrun_train::hf::export_until(&dir, &args.hf, dtype, max, &stop)
        .map_err(|e| own_output_error(e, &args.hf, &tmp))?;
    let Some(e) = done else {
        return Ok(stopped(
            "export",
            &format!("the partial output {}", tmp.display()),
        ));
    };
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

/// `e`, or for a failed write of the export's own files (the temporary directory `tmp`, or
/// `out` itself) the line of [`output_error`]: the library's generic I/O errors advise on
/// checkpoint.dir or log.dir, which have nothing to do with `--hf`.
fn own_output_error(e: zrun_train::Error, out: &Path, tmp: &Path) -> anyhow::Error {
    let (op, path, source) = match &e {
        zrun_train::Error::Io { path, source } => ("write", path, source),
        zrun_train::Error::Ckpt(zrun_ckpt::Error::Io { op, path, source }) => (*op, path, source),
        _ => return e.into(),
    };
    if path.starts_with(tmp) || path == out {
        return output_error("--hf", out, op, path, source);
    }
    e.into()
}

/// The one line for a failed `op` (`write`, `create`, ...) on `path`, a file of the output a
/// command was given as `flag value` (`--hf out/model`, `-o model.safetensors`): the OS error
/// and what to do, by its kind: free space or choose another directory.
pub(crate) fn output_error(
    flag: &str,
    value: &Path,
    op: &str,
    path: &Path,
    source: &std::io::Error,
) -> anyhow::Error {
    let dir = match value.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let fix = match source.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT) => format!(
            "the disk (or a quota) is full: free space there, or give {flag} a path on another \
             disk"
        ),
        Some(libc::EFBIG) => format!(
            "the file is larger than a file-size limit allows (ulimit -f, or the file system's \
             own): raise it, or give {flag} a path on another disk"
        ),
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => format!(
            "{} is not writable (permissions, or a read-only file system): give {flag} a path \
             in a directory you can write",
            dir.display()
        ),
        _ => format!(
            "check {} and its disk, or give {flag} another path",
            dir.display()
        ),
    };
    anyhow::anyhow!(
        "{flag} {}: cannot {op} {}: {source}; {fix}",
        value.display(),
        path.display()
    )
}

/// Records SIGINT, SIGTERM, SIGHUP and SIGUSR1 (the launcher's handler) instead of dying of
/// them, so a command writing its output (export, consolidate, prepare) stops at its next
/// tensor, rank file or batch, removes what it wrote and says so ([`stopped`]); and ignores
/// SIGXFSZ, so a file-size limit is a failed write that is reported and cleaned up like a
/// full disk.
pub(crate) fn catch_signals() -> anyhow::Result<()> {
    signals::install()?;
    // SAFETY: setting a signal's disposition to SIG_IGN has no memory-safety preconditions;
    // no handler for SIGXFSZ is installed anywhere.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    Ok(())
}

/// The signal that asked the command to stop, once one has arrived.
pub(crate) fn interrupted() -> Option<i32> {
    signals::received().map(|(sig, _)| sig)
}

/// Says on one line that `command` stopped at the signal it received and what it `removed`;
/// returns the exit code, 128 + the signal's number.
pub(crate) fn stopped(command: &str, removed: &str) -> u8 {
    let sig = interrupted().unwrap_or(libc::SIGINT);
    output::say(
        Level::Warn,
        &format!(
            "{command} interrupted by {}; removed {removed}",
            signals::name(sig)
        ),
    );
    signals::exit_code(sig)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_of_the_output_names_the_flag_and_what_to_do() {
        let line = |code: i32| {
            output_error(
                "--hf",
                Path::new("/data/out/model"),
                "write",
                Path::new("/data/out/model.tmp-7/model.safetensors.tmp"),
                &std::io::Error::from_raw_os_error(code),
            )
            .to_string()
        };
        for code in [
            libc::ENOSPC,
            libc::EDQUOT,
            libc::EFBIG,
            libc::EACCES,
            libc::EROFS,
        ] {
            let l = line(code);
            assert!(
                l.starts_with("--hf /data/out/model: cannot write /data/out/model.tmp-7/"),
                "{l}"
            );
            assert!(l.contains("give --hf a path"), "{l}");
            assert!(
                !l.contains("checkpoint.dir") && !l.contains("log.dir"),
                "{l}"
            );
            assert_eq!(l.lines().count(), 1, "{l}");
        }
        assert!(line(libc::ENOSPC).contains("is full: free space there"));
        assert!(line(libc::EFBIG).contains("ulimit -f"));
        assert!(line(libc::EROFS).contains("/data/out is not writable"));
        assert!(line(libc::EIO).contains("check /data/out and its disk"));
    }
}
