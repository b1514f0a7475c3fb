//! Checkpoints over real processes (tcp backend): a run stopped at step 10 and resumed
//! trains bitwise like one that never stopped, at every stage, precision and with offload; a
//! stage-3 checkpoint of 2 ranks loads at 1, 3 and 4 ranks and other stages with its state
//! intact and the same next losses; a consolidated file loads in Python's safetensors with
//! the engine's gathered parameters; a hybrid-sharded run (`zero.shard_group`) trains like full
//! sharding, resumes bitwise and its checkpoint moves between layouts.

zrun_torch_ext::end_tests_without_destructors!();

mod common;

use std::path::Path;

use zrun_ckpt::Checkpoint;
use zrun_train::checkpoint::Position;
use zrun_train::config::Config;
use zrun_train::trainer::Run;

const CONFIG: &str = r#"
[model]
preset = "tiny"
vocab_size = 64
seq_len = 16
n_layer = 2
n_head = 4
d_model = 32
[data]
branching = 4
seed = 3
[train]
steps = 20
micro_batch = 6
lr = 3e-3
warmup_steps = 4
weight_decay = 0.1
grad_clip = 0.5
eval_every = 5
eval_batches = 1
threads = 1
seed = 7
[checkpoint]
every = 10
[log]
every = 1
"#;

/// Runs a job of `world` ranks with `sets` (after `log.dir`); `mode` is `train` (rank 0
/// then writes the final parameters) or `reshard` (load the checkpoint, save it again at once).
fn job(name: &str, world: usize, sets: &[String], mode: &str) -> common::Scratch {
    let dir = common::scratch("ckpt", name);
    let config = dir.join("train.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let mut all = vec![format!("log.dir=\"{}\"", dir.display())];
    all.extend(sets.iter().cloned());
    let env = [
        ("ZRUN_CK_CONFIG", config.display().to_string()),
        ("ZRUN_CK_SETS", all.join("\n")),
        ("ZRUN_CK_DIR", dir.display().to_string()),
        ("ZRUN_CK_MODE", mode.to_string()),
    ];
    common::spawn_ranks("rank_process", name, world, &env);
    dir
}

fn sets(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Trains 20 steps saving at 10 and 20, then a second job resumes from step 10 into a new
/// log dir: its steps 11-20 and final parameters must equal the first job's bitwise.
fn resumes_bitwise(name: &str, extra: &[&str]) {
    let a = job(&format!("{name}-a"), 2, &sets(extra), "train");
    let ckpt = a.join("ckpt/step-00000010");
    assert!(
        ckpt.join("manifest.json").is_file(),
        "{name}: no checkpoint at step 10"
    );
    let mut resumed = sets(extra);
    resumed.push(format!("checkpoint.resume=\"{}\"", ckpt.display()));
    let b = job(&format!("{name}-b"), 2, &resumed, "train");
    for key in ["loss", "grad_norm"] {
        let want: Vec<(u64, f64)> = common::metric(&a, key)
            .into_iter()
            .filter(|(s, _)| *s > 10)
            .collect();
        let got = common::metric(&b, key);
        assert_eq!(want.len(), 10, "{name}: steps logged");
        assert_eq!(got, want, "{name}: {key} after resuming differs");
    }
    let (pa, pb) = (common::read_params(&a), common::read_params(&b));
    assert!(!pa.is_empty());
    for ((na, va), (nb, vb)) in pa.iter().zip(&pb) {
        assert_eq!(na, nb);
        let same = va.iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{name}: final {na} differs after resuming");
    }
    // The run really trained after resuming.
    let losses = common::metric(&b, "loss");
    assert!(
        losses[9].1 < common::metric(&a, "loss")[0].1 * 0.9,
        "{name}: loss did not fall"
    );
}

#[test]
fn fp32_runs_resume_bitwise_at_every_stage() {
    for stage in 0..4 {
        resumes_bitwise(&format!("fp32-s{stage}"), &[&format!("zero.stage={stage}")]);
    }
}

#[test]
fn bf16_runs_resume_bitwise_at_every_stage() {
    for stage in 0..4 {
        let stage_set = format!("zero.stage={stage}");
        resumes_bitwise(
            &format!("bf16-s{stage}"),
            &[&stage_set, "zero.precision=\"bf16\""],
        );
    }
}

#[test]
fn offloaded_and_fp16_runs_resume_bitwise() {
    // CPU AdamW at the step (stage 1, fp32), during backward with bf16 moments (stage 2, bf16,
    // no clipping), and fp16's loss scaler, whose scale grows every 3 clean steps.
    resumes_bitwise(
        "off-s1",
        &["zero.stage=1", "zero.offload_optimizer=\"cpu\""],
    );
    resumes_bitwise(
        "off-s2-bf16",
        &[
            "zero.stage=2",
            "zero.precision=\"bf16\"",
            "zero.offload_optimizer=\"cpu\"",
            "zero.optimizer_state_dtype=\"bf16\"",
            "train.grad_clip=0",
        ],
    );
    resumes_bitwise(
        "fp16-s3",
        &[
            "zero.stage=3",
            "zero.precision=\"fp16\"",
            "zero.initial_loss_scale=1024",
            "zero.loss_scale_window=3",
        ],
    );
}

#[test]
fn asynchronous_saves_resume_bitwise() {
    // The save at step 10 is written on a background thread while steps 11-20 run.
    resumes_bitwise("async-s2", &["zero.stage=2", "checkpoint.async=true"]);
}

/// Asserts two checkpoints hold the same master and moments, bit for bit.
fn assert_same_state(a: &Path, b: &Path, what: &str) {
    let (ca, cb) = (Checkpoint::open(a).unwrap(), Checkpoint::open(b).unwrap());
    assert_eq!(ca.first_difference(&cb).unwrap(), None, "{what}");
    assert_eq!(ca.manifest.data, cb.manifest.data.clone());
}

#[test]
fn a_stage3_checkpoint_loads_at_other_world_sizes_and_stages() {
    // 2 ranks at stage 3, global batch 12, saved at step 10.
    let src = job(
        "rs-src",
        2,
        &sets(&["zero.stage=3", "train.steps=10"]),
        "train",
    );
    let ckpt = src.join("ckpt/step-00000010");
    let resume = format!("checkpoint.resume=\"{}\"", ckpt.display());
    let continue_15 = |name: &str, world: usize, stage: u8, mb: usize| {
        let s = vec![
            format!("zero.stage={stage}"),
            format!("train.micro_batch={mb}"),
            "train.steps=15".into(),
            "checkpoint.every=0".into(),
            resume.clone(),
        ];
        common::metric(&job(name, world, &s, "train"), "loss")
    };
    // The reference: one rank resumed from the same checkpoint, same global batch.
    let want = continue_15("rs-ref", 1, 0, 12);
    assert_eq!(
        want.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        (11..=15).collect::<Vec<_>>()
    );
    // World size, stage, micro batch, and other settings of the loading run.
    let offload = ["zero.precision=\"bf16\"", "zero.offload_optimizer=\"cpu\""];
    let loads: [(usize, u8, usize, &[&str]); 4] = [
        (1, 0, 12, &[]),
        (3, 1, 4, &[]),
        (4, 2, 3, &[]),
        (2, 2, 6, &offload),
    ];
    for (world, stage, mb, extra) in loads {
        let name = format!(
            "rs-w{world}-s{stage}{}",
            if extra.is_empty() {
                ""
            } else {
                "-bf16-offload"
            }
        );
        // Load, then save again at once: the state is what was saved.
        let mut s = vec![
            format!("zero.stage={stage}"),
            format!("train.micro_batch={mb}"),
            resume.clone(),
        ];
        s.extend(extra.iter().map(|x| x.to_string()));
        let again = job(&format!("{name}-save"), world, &s, "reshard");
        assert_same_state(&ckpt, &again.join("ckpt/step-00000010"), &name);
        if world > 1 && extra.is_empty() {
            let got = continue_15(&name, world, stage, mb);
            assert_eq!(got.len(), want.len());
            for ((step, a), (_, b)) in got.iter().zip(&want) {
                let rel = (a - b).abs() / b.abs();
                assert!(rel <= 1e-5, "{name}: step {step} loss {a} vs {b} ({rel:e})");
            }
        }
    }
}

/// Hybrid sharding through the trainer: 4 ranks as 2 shard groups of 2 train like 4 ranks
/// sharding over all (same global batch, fp32: every step's loss within 1e-6), resume
/// bitwise, and their checkpoint loads into a full-shard layout of 2 ranks and back with its
/// state intact (the replicas' ranks store no model states, so nothing is stored twice).
#[test]
fn a_hybrid_run_trains_like_full_sharding_and_its_checkpoint_loads_into_other_layouts() {
    let base = ["zero.stage=3", "train.micro_batch=3", "train.steps=10"];
    let full = job("hy-full", 4, &sets(&base), "train");
    let mut hybrid_sets = sets(&base);
    hybrid_sets.push("zero.shard_group=2".into());
    let hybrid = job("hy-g2", 4, &hybrid_sets, "train");
    let (want, got) = (
        common::metric(&full, "loss"),
        common::metric(&hybrid, "loss"),
    );
    assert_eq!(got.len(), 10);
    for ((step, a), (_, b)) in got.iter().zip(&want) {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "step {step}: hybrid {a} vs full {b}"
        );
    }
    let ckpt = hybrid.join("ckpt/step-00000010");
    let m = Checkpoint::open(&ckpt).unwrap().manifest;
    assert_eq!(m.world_size, 4);
    for u in &m.units {
        let stored: u64 = u.shards.iter().map(|s| s.len).sum();
        assert_eq!(
            stored, u.numel,
            "unit {}: every element stored once",
            u.name
        );
        assert!(
            u.shards[2..].iter().all(|s| s.len == 0),
            "replica ranks store nothing"
        );
    }
    // Into 2 ranks sharding over both, and from there back into 2 groups of 2.
    let resume = |dir: &Path| format!("checkpoint.resume=\"{}\"", dir.display());
    // Same global batch (12) on 2 ranks.
    let two_sets = sets(&["zero.stage=3", "train.micro_batch=6", "train.steps=10"]);
    let two = job(
        "hy-to-w2",
        2,
        &[two_sets, vec![resume(&ckpt)]].concat(),
        "reshard",
    );
    let two_ckpt = two.join("ckpt/step-00000010");
    assert_same_state(&ckpt, &two_ckpt, "hybrid -> 2 ranks");
    let back = job(
        "hy-back",
        4,
        &[hybrid_sets.clone(), vec![resume(&two_ckpt)]].concat(),
        "reshard",
    );
    assert_same_state(&ckpt, &back.join("ckpt/step-00000010"), "2 ranks -> hybrid");
    // Stopped at step 5 and resumed, the hybrid run continues bitwise.
    let mut at5 = hybrid_sets.clone();
    at5.push("checkpoint.every=5".into());
    let first = job("hy-first", 4, &at5, "train");
    at5.push(resume(&first.join("ckpt/step-00000005")));
    let resumed = job("hy-resumed", 4, &at5, "train");
    let tail: Vec<(u64, f64)> = common::metric(&first, "loss")
        .into_iter()
        .filter(|(s, _)| *s > 5)
        .collect();
    assert_eq!(common::metric(&resumed, "loss"), tail);
}

#[test]
fn consolidated_file_loads_in_python_with_the_gathered_parameters() {
    let dir = job(
        "consolidate",
        2,
        &sets(&["zero.stage=3", "train.steps=5", "checkpoint.every=5"]),
        "train",
    );
    let out = dir.join("model.safetensors");
    let c = zrun_ckpt::consolidate(
        &dir.join("ckpt/step-00000005"),
        &out,
        zrun_ckpt::OutDtype::F32,
    )
    .unwrap();
    assert_eq!(c.step, 5);
    let script = "import json, sys\n\
        from safetensors.torch import load_file\n\
        t = load_file(sys.argv[1])\n\
        print(json.dumps({k: [list(v.shape), str(v.dtype), v.flatten().tolist()] for k, v in t.items()}))\n";
    let py = std::env::var("VIRTUAL_ENV")
        .map(|v| format!("{v}/bin/python"))
        .unwrap_or_else(|_| "python3".into());
    let o = std::process::Command::new(&py)
        .args(["-c", script, &out.display().to_string()])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {py}: {e}"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let loaded: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let want = common::read_params(&dir);
    assert_eq!(
        loaded.as_object().unwrap().len(),
        want.len(),
        "tensor count"
    );
    for (name, values) in &want {
        let t = &loaded[name.as_str()];
        assert_eq!(t[1], "torch.float32", "{name}");
        let n: u64 = t[0]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        assert_eq!(n as usize, values.len(), "{name}: shape {}", t[0]);
        let got: Vec<f32> = t[2]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let same = got
            .iter()
            .zip(values)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{name}: consolidated values differ from the gathered parameters"
        );
    }
}

/// One rank of the jobs above (started by them, not on its own).
#[test]
#[ignore = "entry point of the rank processes the checkpoint tests start"]
fn rank_process() {
    if !common::is_rank() {
        return;
    }
    let env = |k: &str| std::env::var(k).unwrap();
    let sets: Vec<String> = env("ZRUN_CK_SETS").lines().map(str::to_string).collect();
    let comm = common::rank_comm();
    let rank = comm.rank();
    let run = || -> anyhow::Result<()> {
        let cfg = Config::load(Path::new(&env("ZRUN_CK_CONFIG")), &sets)?;
        let mut run = Run::new(&cfg, comm, &zrun_comm::Topology::single())?;
        if env("ZRUN_CK_MODE") == "reshard" {
            let r = run
                .restore()?
                .ok_or_else(|| anyhow::anyhow!("nothing to resume"))?;
            // This rank's CPU generator is now the one the same rank saved.
            let saved = Checkpoint::open(&r.dir)?;
            let want = saved.reader().rng(rank, "cpu")?;
            let now = zrun_torch_ext::rng::state(tch::Device::Cpu)?;
            if rank < saved.manifest.world_size {
                anyhow::ensure!(
                    want.as_deref() == Some(&now[..]),
                    "rank {rank}: the random generator's state was not restored"
                );
            }
            run.save(&Position {
                step: r.step,
                next_sample: r.next_sample,
                lr: 0.0,
            })?;
            return Ok(());
        }
        // A generator state of this rank's own, which its checkpoints must carry.
        tch::manual_seed(1000 + rank as i64);
        let _ = tch::Tensor::randn([3], (tch::Kind::Float, tch::Device::Cpu));
        run.train()?;
        let params = run.engine_mut().full_parameters()?;
        if rank == 0 {
            common::write_params(Path::new(&env("ZRUN_CK_DIR")), params)?;
        }
        Ok(())
    };
    common::end_rank(run());
}
