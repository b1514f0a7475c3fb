//! `zrun`: trains a model described by a `train.toml`.
//!
//!     zrun configs/tiny-cpu.toml --set train.steps=50
//!     zrun --dry-run configs/tiny-cpu.toml
//!
//! Exit codes: 0 success, 1 failure during training, 2 bad input (flags, config, data).

mod worker;

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

/// Command line of `zrun`.
#[derive(Parser, Debug)]
#[command(
    name = "zrun",
    version,
    about = "Sharded data-parallel training (ZeRO stages 0-3) on CPUs and GPUs"
)]
struct Cli {
    /// The training config (TOML); see docs/config.md.
    config: PathBuf,
    /// Override a config key, e.g. --set train.steps=50 --set model.n_layer=6.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Validate the config and print the model and memory layout without training.
    #[arg(long)]
    dry_run: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match worker::run(&cli.config, &cli.set, cli.dry_run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zrun: error: {e:#}");
            ExitCode::from(if worker::is_bad_input(&e) { 2 } else { 1 })
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
