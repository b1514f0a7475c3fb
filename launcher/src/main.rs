//! `zrun`: trains a model described by a `train.toml` on one or several ranks.
//!
//!     zrun configs/tiny-cpu.toml --set train.steps=50          # --nproc: GPUs, or 1
//!     zrun --nproc 4 configs/tiny-cpu.toml                     # 4 ranks on this node
//!     zrun --nnodes 2 --node-rank 0 --master-addr h0 --nproc 8 train.toml   # node 0 of 2
//!     mpirun -np 2 zrun train.toml                             # under mpirun/srun: one rank
//!     zrun --dry-run --nproc 8 train.toml                      # layout and bytes per rank
//!     zrun estimate train.toml --nproc 8 --device-mem 80GiB    # memory per rank, every alternative
//!     zrun plan train.toml --nproc 8 --device-mem 80GiB        # the cheapest config that fits
//!     zrun exec --nproc 2 -- sh -c 'echo $RANK'                # any program as the ranks
//!     zrun bench comm --nproc 2                                # collective bandwidth
//!     zrun bench adam --params 50M --threads 2                 # CPU AdamW Gparam/s
//!     zrun bench ckpt                                          # checkpoint GB/s vs plain I/O
//!     zrun --max-restarts 3 --nproc 8 train.toml               # restart from the newest checkpoint
//!     zrun consolidate runs/x/ckpt/step-00001000 -o model.safetensors
//!     zrun export runs/x/ckpt/step-00001000 --hf out/       # a directory transformers loads
//!     zrun sample out/ --prompt "Once upon" --max-new-tokens 50  # generate on one process
//!     zrun prepare --tokenizer tokenizer.json corpus/ -o data/  # token shards from JSONL, Parquet, text
//!
//! Output: on a terminal node 0's launcher draws rank 0's progress as one live line (step,
//! loss, tokens/s, MFU, memory, ETA) with every other line above it; elsewhere (a pipe, a
//! file, CI, under mpirun/srun) the ranks print plain lines every `log.every` steps.
//! `--quiet` leaves the final line and errors; `--log-format json` makes every line a JSON
//! object. Lines carry the time of day (`12:34:56`), and `RUST_LOG` sets what is logged.
//!
//! Launcher or rank: a process whose environment holds rank variables (zrun's and torchrun's
//! `RANK`/`WORLD_SIZE`, OpenMPI's, PMI's or Slurm's) trains as that one rank; without them it
//! is the launcher and starts the ranks. Layout flags (`--nproc`, `--nnodes`, ...) together
//! with rank variables other than Slurm's are refused as ambiguous; with Slurm's only (an
//! `sbatch` script) the layout flags win and zrun launches.
//!
//! Exit codes: 0 success, 1 failure during training, 2 bad input (flags, config, data,
//! checkpoints), 3 stopped by SIGTERM/SIGUSR1 after every rank saved a checkpoint (run the same
//! command to resume), 4 out of memory (with a diagnosis and the `--set` lines predicted to
//! fit); 128+N when the launcher was stopped by signal N without a complete save.

mod bench;
mod bench_adam;
mod bench_ckpt;
mod bench_kernels;
mod bench_optim;
mod cluster;
mod consolidate;
mod export;
mod fit;
mod launch;
mod plot;
mod prepare;
mod sample;
mod worker;

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::path::PathBuf;

use launch::{output, BadInput, LaunchFlags, Level, Program, Style};
use zrun_comm::{Topology, TopologySource};

/// `zrun --version`: the version and the backends built in (a bug report's first line; set by
/// build.rs from the features).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (backends: ",
    env!("ZRUN_BACKENDS"),
    ")"
);

/// Command line of `zrun`.
#[derive(Parser, Debug)]
#[command(
    name = "zrun",
    version = VERSION,
    about = "Sharded data-parallel training (ZeRO stages 0-3) on CPUs and GPUs",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    launch: LaunchFlags,
    /// The training config (TOML); see docs/config.md.
    #[arg(required = true)]
    config: Option<PathBuf>,
    /// Override a config key, e.g. --set train.steps=50 --set model.n_layer=6.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Validate the config and the world layout, print the parameter count and every rank's
    /// shards and model-state bytes, and exit without training.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run any program as the ranks, with zrun's environment and supervision (like
    /// torchrun --no-python). MASTER_ADDR:MASTER_PORT is zrun's rendezvous store. A
    /// non-zero exit is a failure, 3 included (only the trainer's 3 is a checkpointed stop);
    /// 2, bad input, is not restarted.
    Exec(ExecArgs),
    /// Write one safetensors file of full, named parameters from a sharded checkpoint.
    Consolidate(consolidate::ConsolidateArgs),
    /// Write a Hugging Face model directory (config.json, safetensors weights, the run's
    /// tokenizer) from a checkpoint, for transformers' from_pretrained.
    Export(export::ExportArgs),
    /// Generate text from a Hugging Face directory, a checkpoint or an export, on one process.
    Sample(sample::SampleArgs),
    /// Encode JSON Lines, Parquet and text files with a Hugging Face tokenizer.json into a
    /// directory of token shards and index.json for data.source = "tokens", on every core.
    Prepare(prepare::PrepareArgs),
    /// Draw PNG and SVG charts (loss, throughput, memory, step-time breakdown) of one run or
    /// several, compared, from their metrics.jsonl and summary.json.
    Plot(plot::PlotArgs),
    /// Every rank's predicted memory before anything is allocated (model states, activations,
    /// buffers, the runtime, the peak and its phase) and every alternative at the same global
    /// batch, with whether it fits --device-mem.
    Estimate(fit::FitArgs),
    /// The cheapest configuration that fits --device-mem at the config's global batch, as
    /// --set lines; --verify trains two steps of it and prints measured against predicted.
    Plan(fit::PlanArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(clap::Args, Debug)]
struct ExecArgs {
    #[command(flatten)]
    launch: LaunchFlags,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    program: Vec<OsString>,
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// Collective bandwidth and correctness, nccl-tests style.
    Comm(bench::CommArgs),
    /// Throughput of the CPU AdamW of optimizer offload (Gparam/s).
    Adam(bench_adam::AdamArgs),
    /// Checkpoint save and load bandwidth against plain file I/O, and training blocked per save.
    Ckpt(bench_ckpt::CkptArgs),
    /// zrun's fused ops (the loss on the full logits, SwiGLU, the rotary embedding) against
    /// PyTorch's, forward and backward: time, peak memory, and how far apart the results are.
    Kernels(bench_kernels::KernelsArgs),
}

/// What `zrun` alone prints (then it exits 2).
const USAGE: &str = "\
zrun: sharded data-parallel training (ZeRO stages 0-3) on CPUs and GPUs

Usage: zrun [OPTIONS] CONFIG.toml [--set KEY=VALUE]...
       zrun COMMAND [ARGS]...

Common commands:
  zrun configs/tiny-cpu.toml                      train (ranks: --nproc, default the GPUs or 1)
  zrun --nproc 4 train.toml                       4 ranks on this node
  zrun train.toml --set train.steps=50            override a config key
  zrun --dry-run --nproc 8 train.toml             layout and bytes per rank, no training
  zrun estimate train.toml --nproc 8 --device-mem 80GiB   memory per rank, every alternative
  zrun plan train.toml --nproc 8 --device-mem 80GiB       the cheapest config that fits
  zrun exec --nproc 2 -- sh -c 'echo $RANK'       any program as the ranks
  zrun consolidate runs/x/ckpt/step-00001000 -o model.safetensors
  zrun export runs/x/ckpt/step-00001000 --hf out/  a directory transformers loads
  zrun sample out/ --prompt \"Once upon\" --max-new-tokens 50   generate
  zrun prepare --tokenizer tokenizer.json corpus/ -o data/   token shards from JSONL, Parquet, text
  zrun bench comm --nproc 2                       collective bandwidth
  zrun plot runs/a runs/b -o plots/               charts from metrics.jsonl

Output: --quiet (the final line and errors), --log-format json (one object per line)
More: zrun --help, zrun COMMAND --help
";

fn main() {
    let code = run();
    // Every file is written and closed by now: end without libtorch's static destructors,
    // a third of each zrun process's start-up and exit cost (launchers and ranks alike).
    zrun_torch_ext::quick_exit(code.into())
}

/// zrun's exit status for this command line (0 on success, 2 for bad input, 3 for a
/// requested stop with the state saved, else the failure's own code).
fn run() -> u8 {
    // NCCL's settings, while this process has no other thread (the ranks a zrun launcher
    // starts inherit them; one under mpirun or srun sets its own).
    zrun_comm::set_process_env();
    // Output piped into `head` ends zrun quietly, as it ends other tools (Rust ignores
    // SIGPIPE, so a print would panic instead).
    // SAFETY: setting a signal's disposition to the default has no memory-safety
    // preconditions; no handler for SIGPIPE is installed anywhere.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    if std::env::args_os().len() <= 1 {
        eprint!("{USAGE}");
        return 2;
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
            } else {
                // Lossy: an argument that is not UTF-8 must not panic here.
                let args: Vec<String> = std::env::args_os()
                    .skip(1)
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect();
                eprintln!("zrun: {}", usage_error(&e.render().to_string(), &args));
            }
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    let flags = match &cli.command {
        None => Some(&cli.launch),
        Some(Cmd::Exec(e)) => Some(&e.launch),
        Some(_) => None,
    };
    let style = Style::resolve(
        flags.and_then(|f| f.log_format),
        flags.is_some_and(|f| f.quiet),
    );
    output::set_style(style);
    init_logging(style);
    let result = match cli.command {
        Some(Cmd::Bench(BenchCmd::Comm(ref args))) => bench::run_comm(args).map(|()| 0),
        Some(Cmd::Bench(BenchCmd::Adam(ref args))) => bench_adam::run_adam(args).map(|()| 0),
        Some(Cmd::Bench(BenchCmd::Ckpt(ref args))) => bench_ckpt::run_ckpt(args).map(|()| 0),
        Some(Cmd::Bench(BenchCmd::Kernels(ref args))) => {
            bench_kernels::run_kernels(args).map(|()| 0)
        }
        Some(Cmd::Consolidate(ref args)) => consolidate::run(args),
        Some(Cmd::Export(ref args)) => export::run(args),
        Some(Cmd::Sample(ref args)) => sample::run(args),
        Some(Cmd::Prepare(ref args)) => prepare::run(args),
        Some(Cmd::Plot(ref args)) => plot::run(args),
        Some(Cmd::Estimate(ref args)) => fit::estimate(args),
        Some(Cmd::Plan(ref args)) => fit::plan(args),
        Some(Cmd::Exec(ref e)) => exec(e),
        None => train(&cli),
    };
    match result {
        Ok(code) => code,
        Err(e) if worker::exit_code(&e) == 3 => {
            // Not a failure: a requested stop, with the state saved.
            output::say(Level::Warn, &stated(&e));
            3
        }
        Err(e) => {
            if worker::follows(&e) {
                // Another rank failed and this one only learnt of it: let that rank's own
                // error be printed and reaped first, so the launcher names the cause.
                std::thread::sleep(worker::FOLLOW_DELAY);
            }
            output::say(
                Level::Error,
                &format!("error: {}", without_cpp_backtrace(&stated(&e))),
            );
            if is_bad_input(&e) {
                2
            } else {
                worker::exit_code(&e)
            }
        }
    }
}

/// `e` and its causes, as `{e:#}` joins them, without a cause whose words the error before
/// it already states (most errors quote their OS error in their own message).
/// clap's several-line usage error (`error: ...`, a list, a tip, the usage) as one line: the
/// error, its list, the tip, and the help to read (`zrun prepare --help` for a subcommand's).
fn usage_error(rendered: &str, args: &[String]) -> String {
    let mut lines = rendered.lines().map(str::trim).filter(|l| !l.is_empty());
    let mut out = lines.next().unwrap_or("error: bad arguments").to_string();
    let mut listed = Vec::new();
    let mut tips = Vec::new();
    for l in lines {
        if l.starts_with("Usage: ") || l.starts_with("For more information") {
            break;
        }
        match l.strip_prefix("tip: ") {
            Some(tip) => tips.push(tip),
            None => listed.push(l),
        }
    }
    if !listed.is_empty() {
        out = format!("{out} {}", listed.join(", "));
    }
    for tip in tips {
        out.push_str("; ");
        out.push_str(tip);
    }
    // The subcommands named in the arguments, as far as they go.
    let mut help = vec!["zrun".to_string()];
    let mut cmd = <Cli as clap::CommandFactory>::command();
    for a in args {
        let Some(sub) = cmd.find_subcommand(a).cloned() else {
            break;
        };
        help.push(a.clone());
        cmd = sub;
    }
    format!("{out}; see {} --help", help.join(" "))
}

fn stated(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.contains(&text) {
            out = format!("{out}: {text}");
        }
    }
    out
}

/// `message` without the C++ backtraces libtorch appends to its errors ("Exception raised
/// from ..." and the "frame #N: ..." lines after it): the words say what failed, the frames
/// only where in libtorch.
fn without_cpp_backtrace(message: &str) -> String {
    let frame = |l: &str| {
        l.trim_start()
            .strip_prefix("frame #")
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
    };
    let kept: Vec<&str> = message
        .lines()
        .filter(|l| !l.trim_start().starts_with("Exception raised from") && !frame(l))
        .collect();
    kept.join("\n").trim_end().to_string()
}

fn is_bad_input(e: &anyhow::Error) -> bool {
    worker::is_bad_input(e) || e.downcast_ref::<BadInput>().is_some()
}

/// Reads the rank variables; malformed ones are bad input.
/// The rank variables, for a command with `flags`: inside an `sbatch` script Slurm's are
/// incomplete when no task count was asked for (no `SLURM_NTASKS`), and with layout flags
/// zrun launches there anyway, as it does with complete ones.
fn topology_for(flags: &LaunchFlags) -> anyhow::Result<Topology> {
    match Topology::from_env() {
        Ok(t) => Ok(t),
        Err(zrun_comm::Error::Topology { source_name, .. })
            if source_name == "Slurm" && flags.any_layout_flag() =>
        {
            Ok(Topology::single())
        }
        Err(e) => Err(BadInput(e.to_string()).into()),
    }
}

/// True when this process is one rank of a job started by someone else (zrun, torchrun,
/// mpirun, srun); refuses layout flags that would start a second layer of ranks.
fn is_rank(topo: &Topology, flags: &LaunchFlags) -> anyhow::Result<bool> {
    match (topo.source, flags.any_layout_flag()) {
        (TopologySource::Single, _) => Ok(false),
        (_, false) => Ok(true),
        (TopologySource::Slurm, true) => Ok(false),
        (source, true) => Err(BadInput(format!(
            "this process already is rank {} of {} ({source:?} variables such as RANK or OMPI_COMM_WORLD_RANK are set), so --nproc/--nnodes/--node-rank/--master-addr/--master-port do not apply; drop those flags, or unset the variables to launch a new job",
            topo.rank, topo.world_size
        ))
        .into()),
    }
}

/// The launcher's checks of the config `config`, once here before any rank starts, so a
/// mistake is one line rather than one per rank: its keys, its data path (one node), its
/// global batch, its backend and device against this build and this machine's GPUs, its
/// shard group against the job. Returns the config, its resolved backend and device, and
/// the ranks to start on this node.
fn preflight(
    config: &std::path::Path,
    cli: &Cli,
) -> anyhow::Result<(
    zrun_train::config::Config,
    zrun_train::config::ResolvedDist,
    usize,
)> {
    let cfg = zrun_train::config::Config::load(config, &cli.set)?;
    let world = cli.launch.world_size()?;
    if cli.launch.nnodes.unwrap_or(1) <= 1 {
        // One node: a missing data.path is one line here. Across nodes each node may lack
        // it alone, so its ranks say so and the store tells the other nodes.
        zrun_train::data::check_path(&cfg).map_err(|e| BadInput(e.to_string()))?;
    }
    cfg.check_global_batch(world)?;
    // The ranks inherit this process's CUDA_VISIBLE_DEVICES: they see what it sees.
    let caps = zrun_train::config::Capabilities::detect();
    let nproc = cli.launch.nproc.unwrap_or(caps.gpus.max(1));
    let dist = cfg.dist.resolve_for(caps, nproc)?;
    // A shard group that does not divide the job, or splits a node, is refused here, before
    // any rank starts.
    cfg.zero.shard_group.resolve(world, nproc)?;
    if dist.device == zrun_train::config::DeviceKind::Cuda {
        dist.check_node(nproc, world, caps)?;
    }
    Ok((cfg, dist, nproc))
}

fn train(cli: &Cli) -> anyhow::Result<u8> {
    let Some(config) = cli.config.as_ref() else {
        return Err(BadInput("give a training config: zrun train.toml".into()).into());
    };
    let topo = topology_for(&cli.launch)?;
    if is_rank(&topo, &cli.launch)? {
        if cli.dry_run {
            worker::dry_run(config, &cli.set, topo.world_size, topo.local_world_size)?;
        } else {
            worker::run(config, &cli.set)?;
        }
        return Ok(0);
    }
    // A dry run refuses what the launch would refuse, then shows the layout.
    let (cfg, dist, nproc) = preflight(config, cli)?;
    if cli.dry_run {
        let world = cli.launch.world_size()?;
        let local = world / cli.launch.nnodes.unwrap_or(1).max(1);
        worker::dry_run(config, &cli.set, world, local)?;
        return Ok(0);
    }
    let mut set = cli.set.clone();
    if dist.device == zrun_train::config::DeviceKind::Cuda
        && dist.backend == zrun_comm::Backend::Tcp
        && cfg.dist.backend == zrun_train::config::BackendChoice::Auto
    {
        // Each rank sees the one GPU and cannot tell that the others share it: say so.
        eprintln!(
            "zrun: dist.backend = \"auto\" chose tcp: the {nproc} ranks share the one visible GPU, which NCCL refuses; their CUDA tensors are staged through host memory"
        );
        set.push("dist.backend=\"tcp\"".into());
        set.push("dist.device=\"cuda\"".into());
    }
    let mut args: Vec<OsString> = vec![config.clone().into_os_string()];
    for s in &set {
        args.push("--set".into());
        args.push(s.into());
    }
    let program = Program {
        exe: std::env::current_exe()
            .map_err(|e| {
                anyhow::anyhow!("cannot find zrun's own executable to start the ranks: {e}")
            })?
            .into_os_string(),
        args,
    };
    // The ranks save a checkpoint on SIGTERM/SIGUSR1; the launcher kills them after this.
    // Rank 0 writes metrics.jsonl, which feeds the progress line on a terminal.
    let opts = launch::Options {
        stop_deadline: Some(std::time::Duration::from_secs(
            cfg.checkpoint.signal_deadline_s,
        )),
        progress: Some(launch::Source {
            metrics: cfg.log.dir.join("metrics.jsonl"),
            steps: cfg.train.steps,
        }),
        reports: Some(cfg.log.dir.clone()),
        env: Vec::new(),
        checkpoint_stops: true,
    };
    launch::run(&cli.launch, &program, &opts)
}

fn exec(e: &ExecArgs) -> anyhow::Result<u8> {
    let topo = topology_for(&e.launch)?;
    if is_rank(&topo, &e.launch)? {
        return Err(BadInput(format!(
            "zrun exec starts ranks, but this process already is rank {} of {} ({:?} variables are set); run the program directly",
            topo.rank, topo.world_size, topo.source
        ))
        .into());
    }
    let (exe, args) = e
        .program
        .split_first()
        .ok_or_else(|| BadInput("zrun exec needs a program: zrun exec -- PROGRAM ARGS".into()))?;
    let program = Program {
        exe: exe.clone(),
        args: args.to_vec(),
    };
    // A program of the user's: SIGTERM/SIGUSR1 give it --grace-s, like any stop, and its exit
    // code 3 is a failure like any other (no checkpoint convention).
    launch::run(&e.launch, &program, &launch::Options::default())
}

/// Logs to stderr (through [`output`], so above a progress line) at `RUST_LOG`'s levels, else
/// INFO, or WARN with `--quiet`/`ZRUN_QUIET=1`. Human lines carry the local time of day to the
/// second (`12:34:56  INFO ...`): enough to line a log up with the system's and to see a stall,
/// short enough to read; JSON lines (`--log-format json`/`ZRUN_LOG_FORMAT=json`) carry the
/// full UTC timestamp and the event's fields at the top level.
fn init_logging(style: Style) {
    let level = if style.quiet { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(output::LogWriter);
    match style.format {
        launch::LogFormat::Human => fmt
            .with_timer(output::Clock)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        launch::LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_backtraces_are_left_out_of_errors() {
        let m = "engine: copy failed in unit `h.0`: Internal torch error: size mismatch\n\
                 Exception raised from copy_impl at /pytorch/aten/src/ATen/native/Copy.cpp:337 (most recent call first):\n\
                 frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\n\
                 frame #1: <unknown function> + 0x4110a6 (0x5621f1afa0a6 in zrun)\n";
        assert_eq!(
            without_cpp_backtrace(m),
            "engine: copy failed in unit `h.0`: Internal torch error: size mismatch"
        );
        let plain = "rank 1: out of memory in forward of unit h.0\nsee the frame #3 note";
        assert_eq!(without_cpp_backtrace(plain), plain);
    }

    #[test]
    fn a_cause_the_error_already_quotes_is_stated_once() {
        let io = || std::io::Error::from_raw_os_error(libc::ENOTDIR);
        let e = anyhow::Error::new(zrun_ckpt::Error::Io {
            op: "list",
            path: "base.toml".into(),
            source: io(),
        });
        let text = stated(&e);
        assert_eq!(text.matches(&io().to_string()).count(), 1, "{text}");
        // A cause the message does not quote is still given.
        let e = anyhow::Error::new(io()).context("reading the index");
        assert_eq!(stated(&e), format!("reading the index: {}", io()));
    }
}
