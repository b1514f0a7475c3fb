//! The examples in examples/ run as their headers say, shortened with `--set` overrides (a
//! tiny fp32 model, tens of steps): the single-machine ones for real, the two-node example as
//! two zruns on 127.0.0.1, mpirun on one host, and the Slurm scripts under stand-ins for
//! `srun` and `scontrol` that start their tasks on this machine with Slurm's variables. Each
//! test checks what the example leaves behind: exit codes, summary.json, checkpoints, charts.

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

/// Longest any example may take here before the test fails (they take a few seconds).
const TIMEOUT: Duration = Duration::from_secs(180);

/// One libtorch thread per rank: the examples run two at a time on a 2-core machine, and
/// threads that outnumber the cores spin against each other (10x slower steps).
const THREADS: (&str, &str) = ("OMP_NUM_THREADS", "1");

/// `--set` arguments, one per override.
fn sets(overrides: &[String]) -> Vec<String> {
    overrides
        .iter()
        .flat_map(|o| ["--set".to_string(), o.clone()])
        .collect()
}

fn log_dir(dir: &Path) -> String {
    format!("log.dir=\"{}\"", dir.display())
}

/// examples/train.toml (GPT-2 small, bf16, 5000 steps) cut down to the tiny model in fp32,
/// `steps` steps, a checkpoint every 10, logging into `dir`.
fn short_gpt(dir: &Path, steps: usize) -> Vec<String> {
    let mut o: Vec<String> = [
        "model.preset=\"tiny\"",
        "model.seq_len=64",
        "zero.precision=\"fp32\"",
        "train.micro_batch=4",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "train.eval_batches=1",
        "log.every=5",
        "checkpoint.every=10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.push(format!("train.steps={steps}"));
    o.push(log_dir(dir));
    sets(&o)
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Runs `script` to its end; returns the exit code and the output.
fn run_script(script: &str, args: &[String], env: &[(&str, &str)]) -> (i32, String) {
    let mut env = env.to_vec();
    env.push(THREADS);
    let mut s = Script::start(script, &strs(args), &env);
    let code = s.code_within(TIMEOUT);
    (code, s.text())
}

/// The checkpoint directories `step-NNNNNNNN` under `dir`, sorted.
fn checkpoints(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("step-") && !n.contains('.'))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Asserts a finished run in `dir`: summary.json with `world` ranks and `steps` steps, and
/// complete checkpoints at `ckpts` (each with its manifest).
fn assert_run(dir: &Path, world: u64, steps: u64, ckpts: &[&str], out: &str) {
    assert!(
        dir.join("summary.json").exists(),
        "no summary.json in {}:\n{out}",
        dir.display()
    );
    let s = read_json(&dir.join("summary.json"));
    assert_eq!(s["world_size"].as_u64(), Some(world), "{s}\n{out}");
    assert_eq!(s["steps"].as_u64(), Some(steps), "{s}");
    assert!(s["final_loss"].as_f64().is_some_and(f64::is_finite), "{s}");
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["step"].as_u64(), Some(steps), "{last}");
    let ck = dir.join("ckpt");
    assert_eq!(checkpoints(&ck), ckpts, "{out}");
    for c in ckpts {
        assert!(
            ck.join(c).join("manifest.json").exists(),
            "{c} has no manifest"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The scripts themselves.

/// Every example directory with its script files (and the config files beside them).
fn example_files() -> Vec<(String, Vec<String>)> {
    let ex = root().join("examples");
    let mut dirs: Vec<(String, Vec<String>)> = std::fs::read_dir(&ex)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let mut files: Vec<String> = std::fs::read_dir(e.path())
                .unwrap()
                .flatten()
                .map(|f| f.file_name().to_string_lossy().into_owned())
                .filter(|f| f.ends_with(".sh") || f.ends_with(".sbatch"))
                .collect();
            files.sort();
            (name, files)
        })
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn every_example_is_listed_parses_and_states_its_commands() {
    let ex = root().join("examples");
    let readme = std::fs::read_to_string(ex.join("README.md")).unwrap();
    let dirs = example_files();
    let names: Vec<&str> = dirs.iter().map(|(d, _)| d.as_str()).collect();
    assert_eq!(
        names,
        [
            "compare-stages",
            "finetune-hf",
            "jsonl-to-model",
            "mpirun",
            "offload-larger-than-memory",
            "slurm",
            "two-nodes"
        ]
    );
    for (dir, files) in &dirs {
        assert!(!files.is_empty(), "examples/{dir} has no script");
        for f in files {
            let rel = format!("examples/{dir}/{f}");
            assert!(
                readme.contains(&rel),
                "examples/README.md does not list {rel}"
            );
            let path = ex.join(dir).join(f);
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(text.starts_with("#!/bin/bash\n"), "{rel}: no bash shebang");
            // The header: the comment block after the shebang states the exact commands.
            let header: String = text
                .lines()
                .skip(1)
                .take_while(|l| l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n");
            assert!(
                header.contains(&rel) && header.contains("zrun"),
                "{rel}: its header does not show how to run it:\n{header}"
            );
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert!(mode & 0o111 != 0, "{rel} is not executable");
            let out = std::process::Command::new("bash")
                .arg("-n")
                .arg(&path)
                .output()
                .unwrap();
            assert!(out.status.success(), "bash -n {rel}: {}", stderr(&out));
        }
    }
    // The shared config parses and validates as a 16-rank job.
    let out = zrun(&["--dry-run", "--nproc", "16", "examples/train.toml"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("world size: 16  stage: 2  precision: bf16"),
        "{}",
        stdout(&out)
    );
}

// ---------------------------------------------------------------------------------------------
// Slurm: the sbatch scripts run as Slurm would run them, with stand-ins for srun and scontrol.

/// A stand-in for `srun`: starts the command once per task on this machine, SLURM_NNODES
/// "nodes" of --ntasks-per-node tasks, each with the variables srun gives a task; exits with
/// the highest task exit code, as srun does. Every call is logged to $STUB_LOG.
const FAKE_SRUN: &str = r#"#!/bin/bash
echo "srun $*" >> "$STUB_LOG"
per_node=${SLURM_NTASKS_PER_NODE:-1}
while [ $# -gt 0 ]; do
    case "$1" in
        --ntasks-per-node=*) per_node=${1#*=} ;;
        --*) ;;
        *) break ;;
    esac
    shift
done
nodes=${SLURM_NNODES:-1}
n=$((nodes * per_node))
pids=()
for ((node = 0; node < nodes; node++)); do
    for ((l = 0; l < per_node; l++)); do
        SLURM_NODEID=$node SLURM_PROCID=$((node * per_node + l)) SLURM_LOCALID=$l \
        SLURM_NTASKS=$n SLURM_NPROCS=$n SLURM_NTASKS_PER_NODE=$per_node \
        SLURM_TASKS_PER_NODE="$per_node(x$nodes)" SLURM_STEP_NUM_TASKS=$n "$@" &
        pids+=($!)
    done
done
rc=0
for p in "${pids[@]}"; do
    wait "$p"
    s=$?
    [ "$s" -gt "$rc" ] && rc=$s
done
exit "$rc"
"#;

/// A stand-in for `scontrol`: `show hostnames` names 127.0.0.1 once per node; every call is
/// logged to $STUB_LOG (`requeue JOBID` is what the scripts call on exit code 3).
const FAKE_SCONTROL: &str = r#"#!/bin/bash
echo "scontrol $*" >> "$STUB_LOG"
if [ "$1 $2" = "show hostnames" ]; then
    for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do echo 127.0.0.1; done
fi
"#;

/// A directory with the stand-ins, the PATH that finds them first, and their log.
struct FakeSlurm {
    path: String,
    log: std::path::PathBuf,
}

impl FakeSlurm {
    fn new(dir: &Path) -> FakeSlurm {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        for (name, text) in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)] {
            let p = bin.join(name);
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        FakeSlurm {
            path: format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            log: dir.join("stub.log"),
        }
    }

    /// The batch script's environment on a job of `nodes` nodes with `per_node` tasks each.
    fn batch_env<'a>(
        &'a self,
        nodes: &'a str,
        per_node: &'a str,
        tasks: &'a str,
    ) -> Vec<(&'a str, &'a str)> {
        vec![
            ("PATH", self.path.as_str()),
            ("STUB_LOG", self.log.to_str().unwrap()),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_JOB_NODELIST", "node[0-1]"),
            ("SLURM_NNODES", nodes),
            ("SLURM_NTASKS", tasks),
            ("SLURM_NTASKS_PER_NODE", per_node),
            ("SLURM_TASKS_PER_NODE", per_node),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
        ]
    }

    fn calls(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// one-node.sbatch: SIGUSR1 to the batch shell (Slurm's `--signal=B:USR1@90`) reaches zrun,
/// every rank saves and exits 3, the script requeues the job; run again (as the requeued job),
/// it resumes from that checkpoint and finishes without requeueing.
#[test]
fn slurm_one_node_saves_on_sigusr1_requeues_and_resumes() {
    let d = scratch("ex-slurm1");
    let slurm = FakeSlurm::new(&d);
    let runs = d.join("run");
    let mut env = slurm.batch_env("1", "1", "1");
    env.extend([("NPROC", "2"), THREADS]);
    // Far more steps than it gets to: the signal comes after the first logged step.
    let mut long = short_gpt(&runs, 100_000);
    long.extend(sets(&["log.every=1".into(), "checkpoint.every=0".into()]));
    let mut s = Script::start("examples/slurm/one-node.sbatch", &strs(&long), &env);
    let t = Instant::now();
    while !std::fs::read_to_string(runs.join("metrics.jsonl")).is_ok_and(|m| !m.is_empty()) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no step logged: {}",
            s.text()
        );
        if let Ok(Some(_)) = s.job.child.try_wait() {
            panic!("the script ended early: {}", s.text());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    signal(s.job.pid(), libc::SIGUSR1);
    let code = s.code_within(TIMEOUT);
    let out = s.text();
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("passing it to zrun"), "{out}");
    assert_eq!(slurm.calls(), "scontrol requeue 4242\n", "{out}");
    let ck = checkpoints(&runs.join("ckpt"));
    assert_eq!(ck.len(), 1, "{ck:?}\n{out}");
    let at: u64 = ck[0]["step-".len()..].parse().unwrap();
    assert!(!runs.join("summary.json").exists(), "{out}");

    // The requeued job: the same script, resuming; 10 steps past the checkpoint.
    let steps = at + 10;
    let (code, out) = run_script(
        "examples/slurm/one-node.sbatch",
        &short_gpt(&runs, steps as usize),
        &env,
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!(
            "resuming from {}",
            runs.join("ckpt").join(&ck[0]).display()
        )),
        "{out}"
    );
    assert_eq!(
        slurm.calls(),
        "scontrol requeue 4242\n",
        "requeued again: {out}"
    );
    // checkpoint.every = 10 from here on, and one after the last step
    let mut want = ck.clone();
    want.extend(
        (at + 1..=steps)
            .filter(|s| s % 10 == 0 || *s == steps)
            .map(|s| format!("step-{s:08}")),
    );
    assert_run(&runs, 2, steps, &strs(&want), &out);
}

/// two-nodes.sbatch: srun starts one zrun per node, which launch the ranks; rank 0's store is
/// on the first host `scontrol show hostnames` names.
#[test]
fn slurm_two_nodes_start_one_zrun_per_node() {
    let d = scratch("ex-slurm2");
    let slurm = FakeSlurm::new(&d);
    let runs = d.join("run");
    let port = free_port().to_string();
    let mut env = slurm.batch_env("2", "1", "2");
    env.extend([("NPROC", "1"), ("MASTER_PORT", port.as_str())]);
    let (code, out) = run_script(
        "examples/slurm/two-nodes.sbatch",
        &short_gpt(&runs, 20),
        &env,
    );
    assert_eq!(code, 0, "{out}");
    let calls = slurm.calls();
    assert!(
        calls.starts_with("scontrol show hostnames node[0-1]\nsrun --ntasks-per-node=1 "),
        "{calls}"
    );
    assert!(!calls.contains("requeue"), "{calls}");
    // each node's zrun prefixes its rank's lines
    assert!(
        out.contains("[rank 0] ") && out.contains("[rank 1] "),
        "{out}"
    );
    assert_run(&runs, 2, 20, &["step-00000010", "step-00000020"], &out);
}

/// two-nodes-tasks.sbatch: every srun task trains as one rank from Slurm's variables, meeting
/// at MASTER_ADDR:MASTER_PORT; no launcher, so no rank prefixes.
#[test]
fn slurm_tasks_train_as_one_rank_each() {
    let d = scratch("ex-slurm3");
    let slurm = FakeSlurm::new(&d);
    let runs = d.join("run");
    let port = free_port().to_string();
    let mut env = slurm.batch_env("2", "1", "2");
    env.extend([("NPROC", "1"), ("MASTER_PORT", port.as_str())]);
    let (code, out) = run_script(
        "examples/slurm/two-nodes-tasks.sbatch",
        &short_gpt(&runs, 20),
        &env,
    );
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("[rank "), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("final: eval_loss")),
        "{out}"
    );
    assert_run(&runs, 2, 20, &["step-00000010", "step-00000020"], &out);
}

// ---------------------------------------------------------------------------------------------
// mpirun and two nodes, on this machine.

#[test]
fn mpirun_one_host_runs_each_process_as_one_rank() {
    if std::process::Command::new("mpirun")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: mpirun is not installed (apt-get install openmpi-bin)");
        return;
    }
    let mut backends = vec!["tcp"];
    if cfg!(feature = "mpi") {
        backends.push("mpi");
    } else {
        eprintln!("mpi backend part skipped: run with `--features mpi` to test it");
    }
    for backend in backends {
        let d = scratch(&format!("ex-mpirun-{backend}"));
        let port = free_port().to_string();
        let mut args = short_gpt(&d, 20);
        args.extend(sets(&[format!("dist.backend=\"{backend}\"")]));
        let (code, out) = run_script(
            "examples/mpirun/run.sh",
            &args,
            &[
                ("MASTER_PORT", port.as_str()),
                ("MPIRUN_ARGS", "--oversubscribe"),
                // mpirun refuses root without these (CI containers run as root)
                ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
                ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
            ],
        );
        assert_eq!(code, 0, "{backend}: {out}");
        assert!(!out.contains("[rank "), "{out}");
        assert_run(&d, 2, 20, &["step-00000010", "step-00000020"], &out);
    }
}

#[test]
fn two_nodes_on_loopback_form_one_job() {
    let d = scratch("ex-two-nodes");
    let port = free_port().to_string();
    // the default config is configs/tiny-cpu.toml: 800 steps, eval every 200
    let args = sets(&[
        "train.steps=20".into(),
        "train.warmup_steps=2".into(),
        "train.micro_batch=8".into(),
        "train.eval_batches=1".into(),
        "log.every=5".into(),
        "checkpoint.every=10".into(),
        log_dir(&d),
    ]);
    let (code, out) = run_script(
        "examples/two-nodes/run.sh",
        &args,
        &[("MASTER_PORT", port.as_str())],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("two-nodes: node 0 exited 0, node 1 exited 0"),
        "{out}"
    );
    assert!(out.contains("[rank 0] final:"), "{out}");
    assert!(out.contains("[rank 1] "), "{out}");
    assert_run(&d, 2, 20, &["step-00000010", "step-00000020"], &out);
}

// ---------------------------------------------------------------------------------------------
// Offload and the stage comparison.

/// The elements rank `r` owns, summed over the dry run's unit lines
/// (`  unit h.0  params N  padded P  owns [a, b) at o`).
fn owned_by(dry_run: &str, r: usize) -> i64 {
    let head = format!("rank {r}: model states");
    dry_run
        .lines()
        .skip_while(|l| !l.starts_with(&head))
        .skip(1)
        .take_while(|l| l.starts_with("  unit "))
        .map(|l| {
            let range = l.split("owns [").nth(1).unwrap().split(')').next().unwrap();
            let (a, b) = range.split_once(", ").unwrap();
            b.parse::<i64>().unwrap() - a.parse::<i64>().unwrap()
        })
        .sum()
}

/// offload-larger-than-memory/run.sh on a shrunken model: the dry run's bytes per rank are
/// the README's stage-3 formula, and the run keeps exactly the bf16 parameter shard on the
/// device and the fp32 master and AdamW moments (12 bytes per owned element) in host memory,
/// where the gradients go as they are made.
#[test]
fn offload_dry_run_then_train_keeps_the_optimizer_on_the_host() {
    let d = scratch("ex-offload");
    let args = sets(&[
        "model.n_layer=2".into(),
        "model.d_model=64".into(),
        "model.n_head=4".into(),
        "model.vocab_size=256".into(),
        "model.seq_len=32".into(),
        "train.steps=6".into(),
        "train.warmup_steps=1".into(),
        "train.eval_every=0".into(),
        "train.eval_batches=1".into(),
        "log.every=2".into(),
        "checkpoint.every=3".into(),
        log_dir(&d),
    ]);
    let (code, out) = run_script("examples/offload-larger-than-memory/run.sh", &args, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("world size: 2  stage: 3  precision: bf16"),
        "{out}"
    );
    // the script leaves the per-unit lines out; the same dry run here keeps them
    let mut dry_args = vec![
        "--dry-run",
        "--nproc",
        "2",
        "examples/offload-larger-than-memory/train.toml",
    ];
    dry_args.extend(strs(&args));
    let dry = zrun(&dry_args);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let text = stdout(&dry);
    let s = read_json(&d.join("summary.json"));
    assert_eq!(s["world_size"].as_u64(), Some(2), "{s}");
    for r in 0..2 {
        let owned = owned_by(&text, r);
        assert!(owned > 0, "{text}");
        // stage 3, bf16: 2 bytes per owned element on the device, 12 on the host; the
        // gradients go to the host as they are made (one micro-step a step)
        let mib = 14.0 * owned as f64 / (1 << 20) as f64;
        assert!(
            text.contains(&format!("rank {r}: model states {mib:.1} MiB")),
            "rank {r}: expected {mib:.1} MiB:\n{text}"
        );
        let m = &s["ranks"][r]["memory"];
        assert_eq!(m["params"].as_i64(), Some(2 * owned), "rank {r}: {m}");
        assert_eq!(m["grads"].as_i64(), Some(0), "rank {r}: {m}");
        assert_eq!(m["master"].as_i64(), Some(0), "rank {r}: {m}");
        assert_eq!(m["optimizer"].as_i64(), Some(0), "rank {r}: {m}");
        assert_eq!(m["host"].as_i64(), Some(12 * owned), "rank {r}: {m}");
        assert_eq!(
            s["model_state_bytes"][r].as_i64(),
            Some(14 * owned),
            "rank {r}: {s}"
        );
    }
    assert!(out.contains("host (offloaded)"), "{out}");
    assert_run(&d, 2, 6, &["step-00000003", "step-00000006"], &out);
}

/// compare-stages/run.sh: stage 2 and stage 3 train the same model (the same losses), hold
/// the README's bytes per rank, and `zrun plot` draws both runs into one set of charts.
#[test]
fn compare_stages_trains_both_and_plots_them_together() {
    let d = scratch("ex-compare");
    let args = sets(&[
        "model.n_layer=2".into(),
        "model.d_model=64".into(),
        "train.micro_batch=8".into(),
        "train.steps=20".into(),
        "train.warmup_steps=2".into(),
        "train.eval_every=10".into(),
        "train.eval_batches=1".into(),
        "log.every=5".into(),
    ]);
    let runs = d.display().to_string();
    let (code, out) = run_script(
        "examples/compare-stages/run.sh",
        &args,
        &[("RUNS", runs.as_str())],
    );
    assert_eq!(code, 0, "{out}");
    let (s2, s3) = (
        read_json(&d.join("stage2/summary.json")),
        read_json(&d.join("stage3/summary.json")),
    );
    for s in [&s2, &s3] {
        assert_eq!(s["world_size"].as_u64(), Some(2), "{s}");
        assert_eq!(s["steps"].as_u64(), Some(20), "{s}");
    }
    for key in ["final_loss", "eval_loss"] {
        let (a, b) = (s2[key].as_f64().unwrap(), s3[key].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-4 * a.abs(),
            "{key}: stage 2 {a} vs stage 3 {b}"
        );
    }
    // bytes per rank, fp32 AdamW, W = 2 (no padding: every unit has an even size):
    // stage 2 4Ψ + 12Ψ/W, stage 3 16Ψ/W
    let psi = s2["params"].as_i64().unwrap();
    assert_eq!(s3["params"].as_i64(), Some(psi));
    let w = 2;
    for r in 0..2 {
        assert_eq!(
            s2["model_state_bytes"][r].as_i64(),
            Some(4 * psi + 12 * psi / w),
            "{s2}"
        );
        assert_eq!(
            s3["model_state_bytes"][r].as_i64(),
            Some(16 * psi / w),
            "{s3}"
        );
    }
    let plots = d.join("plots");
    for chart in ["loss", "loss_tokens", "throughput", "memory", "breakdown"] {
        let png = std::fs::read(plots.join(format!("{chart}.png")))
            .unwrap_or_else(|e| panic!("{chart}.png: {e}\n{out}"));
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n"),
            "{chart}.png is no PNG"
        );
        let svg = std::fs::read_to_string(plots.join(format!("{chart}.svg"))).unwrap();
        assert!(svg.contains("<svg"), "{chart}.svg is no SVG");
    }
    // both runs are on the loss chart, named by their directories
    let loss = std::fs::read_to_string(plots.join("loss.svg")).unwrap();
    assert!(
        loss.contains("stage2") && loss.contains("stage3"),
        "loss.svg names neither run"
    );
}

// ---------------------------------------------------------------------------------------------
// A Hugging Face model fine-tuned and exported.

/// The lines of `out` after the line `heading`, up to the next `== ` heading.
fn section<'a>(out: &'a str, heading: &str) -> Vec<&'a str> {
    out.lines()
        .skip_while(|l| *l != heading)
        .skip(1)
        .take_while(|l| !l.starts_with("== "))
        .collect()
}

/// finetune-hf/run.sh as it stands: a Llama made by transformers is fine-tuned on 2 ranks at
/// stage 3 from its directory (tokenizer found beside it), its loss falls, the export loads
/// in transformers, whose greedy tokens `zrun sample --greedy` picks too, and both recite the
/// text learned.
#[test]
fn finetune_hf_trains_exports_and_generates_in_transformers_and_zrun() {
    let d = scratch("ex-finetune-hf");
    let out_dir = d.display().to_string();
    let (code, out) = run_script(
        "examples/finetune-hf/run.sh",
        &[],
        &[("OUT", out_dir.as_str())],
    );
    assert_eq!(code, 0, "{out}");
    let run = d.join("run");
    assert_run(&run, 2, 150, &["step-00000150"], &out);
    // Started from the model directory, at stage 3, encoding with the tokenizer beside it.
    let model = d.join("model");
    assert!(
        out.contains(&format!("initialised from {}", model.display())),
        "{out}"
    );
    let m = read_json(&run.join("ckpt/step-00000150/manifest.json"));
    assert_eq!(m["stage"].as_u64(), Some(3), "{m}");
    assert_eq!(
        m["model"]["tokenizer"].as_str(),
        Some(model.join("tokenizer.json").to_str().unwrap()),
        "{m}"
    );
    // The loss fell: from near ln(512) at the first logged step to a fraction of it.
    let losses: Vec<f64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(first > 4.5, "first logged loss {first}: {losses:?}");
    assert!(last < first / 3.0, "loss {first} -> {last}: {losses:?}");
    // The export carries the tokenizer.
    let export = d.join("export");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(export.join(f).is_file(), "export has no {f}: {out}");
    }
    assert_eq!(
        read_json(&export.join("config.json"))["model_type"].as_str(),
        Some("llama")
    );
    // transformers generated 20 tokens from the export; zrun's greedy text is the same.
    let hf = section(&out, "== transformers, greedy");
    let ids = hf
        .last()
        .and_then(|l| l.strip_prefix("ids: "))
        .unwrap_or_else(|| panic!("no ids line from generate.py: {out}"));
    assert_eq!(ids.split(',').count(), 20, "{ids}");
    let hf_text = hf[..hf.len() - 1].join("\n");
    let zrun_text = section(&out, "== zrun sample --greedy").join("\n");
    assert!(
        hf_text.starts_with("The Fox") && hf_text.len() > "The Fox".len() + 20,
        "{hf_text:?}"
    );
    assert_eq!(zrun_text.trim_end(), hf_text.trim_end(), "{out}");
    // What was learned: the story that follows the title (the untrained model knows no words).
    assert!(hf_text.contains("hungry"), "{hf_text:?}");
    let sampled = section(&out, "== zrun sample --temperature 0.7 --top-k 5").join("\n");
    assert!(
        sampled.starts_with("The Fox") && sampled.len() > "The Fox".len(),
        "{out}"
    );
}

// ---------------------------------------------------------------------------------------------
// From a JSON Lines file to a trained model.

/// jsonl-to-model/run.sh as it stands: the gzipped JSON Lines corpus is prepared into 4 train
/// shards and 1 val shard, a Llama trains from the shard directory on 2 ranks, its loss falls,
/// and greedy generation from the checkpoint and from the export recites the start of the
/// text the corpus was made from.
#[test]
fn jsonl_to_model_prepares_trains_and_generates() {
    let d = scratch("ex-jsonl-to-model");
    let out_dir = d.display().to_string();
    let (code, out) = run_script(
        "examples/jsonl-to-model/run.sh",
        &[],
        &[("OUT", out_dir.as_str())],
    );
    assert_eq!(code, 0, "{out}");
    // Eight documents: seven in 4 train shards of at most 500 tokens, the eighth in val.
    let index = read_json(&d.join("data/index.json"));
    let shards = |split: &str| index[split].as_array().unwrap().clone();
    let (train, val) = (shards("train"), shards("val"));
    assert_eq!((train.len(), val.len()), (4, 1), "{index}");
    let docs = |s: &[serde_json::Value]| -> u64 {
        s.iter().map(|r| r["documents"].as_u64().unwrap()).sum()
    };
    assert_eq!((docs(&train), docs(&val)), (7, 1), "{index}");
    assert!(train[..3].iter().all(|r| r["tokens"] == 500), "{index}");
    assert_eq!(index["vocab_size"].as_u64(), Some(512), "{index}");
    let run = d.join("run");
    assert_run(&run, 2, 200, &["step-00000100", "step-00000200"], &out);
    let losses: Vec<f64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect();
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        first > 4.5 && last < 0.1,
        "loss {first} -> {last}: {losses:?}"
    );
    // Greedy text from the checkpoint and sampled text from the export: the fables' start.
    let fables = std::fs::read_to_string(root().join("examples/finetune-hf/fables.txt")).unwrap();
    let greedy = section(&out, "== zrun sample --greedy").join("\n");
    let greedy = greedy.trim_end();
    assert!(
        greedy.len() > 40 && fables.starts_with(greedy),
        "{greedy:?}\n{out}"
    );
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(
            d.join("export").join(f).is_file(),
            "export has no {f}: {out}"
        );
    }
    let sampled = section(
        &out,
        "== zrun sample of the export --temperature 0.7 --top-k 5",
    )
    .join("\n");
    assert!(
        sampled.starts_with("The Fox") && sampled.trim_end().len() > "The Fox".len(),
        "{out}"
    );
}
