//! Training data as the ecosystem ships it, through the real `zrun` binary: llm.c's token
//! files (GPT-2 and Llama-3 headers, written by numpy as llm.c's `data_common.py` writes
//! them) read token for token and trained on; a header of an unknown format refused; a
//! token-shard directory read as its shards concatenated, resumed and resharded at the exact
//! data position; a shard missing, truncated or replaced refused in one line; a corpus that
//! Python wrote as JSON Lines (plain, gzip, zstd) and Parquet, prepared with a Hugging Face
//! tokenizer, read back as Python's tokens and trained on by 2 ranks that are killed and
//! resume bit for bit.

zrun_torch_ext::end_tests_without_destructors!();

mod common;
// The Python side of tests/prepare.rs; its other scripts and texts go unused here.
#[allow(dead_code)]
#[path = "prepare/python.rs"]
mod python;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    demo_sets, rank_pid, read_by_loader, read_json, rejects, root, scratch, signal, stderr, write,
    zrun, Job,
};
use zrun_train::data::{
    xxh3_of, DataOptions, DataSource, Dataset, ShardIndex, ShardRecord, Split, TokenDtype,
    TokenWriter, TokenizerRecord,
};

/// llm.c's `dev/data/data_common.py` `write_datafile`, as it is, then the ids it wrote as
/// JSON: `python make.py DIR NAME MODEL N VOCAB SEED` writes DIR/NAME and DIR/NAME.json.
const WRITE_DATAFILE: &str = r#"
import json, sys
import numpy as np

HEADERS_INFO = {
    "gpt-2": {"magic": 20240520, "version": 1, "token_dtype": np.uint16},
    "llama-3": {"magic": 20240801, "version": 7, "token_dtype": np.uint32},
}

def write_datafile(filename, toks, model_desc="gpt-2"):
    assert len(toks) < 2**31, "token count too large"
    info = HEADERS_INFO[model_desc]
    header = np.zeros(256, dtype=np.int32)
    header[0] = info["magic"]
    header[1] = info["version"]
    header[2] = len(toks)
    toks_np = np.array(toks, dtype=info["token_dtype"])
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(toks_np.tobytes())

d, name, model, n, vocab, seed = sys.argv[1:7]
rng = np.random.default_rng(int(seed))
toks = rng.integers(0, int(vocab), size=int(n))
toks[0] = int(vocab) - 1
write_datafile(f"{d}/{name}", toks.tolist(), model)
json.dump(toks.tolist(), open(f"{d}/{name}.json", "w"))
"#;

/// Writes DIR/NAME with llm.c's writer (`model` "gpt-2" or "llama-3"): `n` seeded tokens
/// below `vocab`, the first `vocab - 1`. Returns the path and the tokens.
fn llm_c_file(dir: &Path, name: &str, model: &str, n: usize, vocab: u32) -> (PathBuf, Vec<u32>) {
    let py = root().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/setup.sh",
        py.display()
    );
    let script = write(dir, "write_datafile.py", WRITE_DATAFILE.as_bytes());
    let d = dir.display().to_string();
    let (n, vocab) = (n.to_string(), vocab.to_string());
    let out = Command::new(py)
        .args([&script, &d, name, model, &n, &vocab, "7"])
        .output()
        .unwrap();
    assert!(out.status.success(), "python: {}", stderr(&out));
    let ids = std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap();
    (dir.join(name), serde_json::from_str(&ids).unwrap())
}

fn tokens_options(path: PathBuf, seq_len: usize, vocab_size: usize) -> DataOptions {
    DataOptions {
        source: DataSource::Tokens {
            path,
            tokenizer: None,
        },
        seq_len,
        vocab_size,
        seed: 0,
        eval_fraction: 0.1,
    }
}

/// A config of `steps` steps of the tiny GPT (`model` overrides) on the token data at `data`.
fn train_config(dir: &Path, model: &str, data: &Path, steps: u64) -> String {
    let toml = format!(
        "[model]\nseq_len = 16\n{model}\n[data]\nsource = \"tokens\"\npath = \"{}\"\n\
         [train]\nsteps = {steps}\nmicro_batch = 2\neval_batches = 1\neval_every = 0\n\
         [dist]\ndevice = \"cpu\"\n[log]\ndir = \"{}\"\nevery = 1\n",
        data.display(),
        dir.join("run").display()
    );
    write(dir, "train.toml", toml.as_bytes())
}

#[test]
fn llm_c_token_files_are_read_token_for_token_and_train() {
    let d = scratch("shards-llmc");
    let (llama, want) = llm_c_file(&d, "llama3.bin", "llama-3", 3000, 128_256);
    assert_eq!(read_by_loader(llama.clone(), 128_256), want);
    let (gpt2, want) = llm_c_file(&d, "gpt2.bin", "gpt-2", 3000, 50_257);
    assert_eq!(read_by_loader(gpt2, 50_257), want);
    // The issue's reproduction: a Llama-3 vocabulary trains on the file's tokens.
    let cfg = train_config(&d, "vocab_size = 128256\nd_model = 32", &llama, 3);
    let out = zrun(&[&cfg]);
    assert!(out.status.success(), "{}", stderr(&out));
    // A model too small for the file's tokens is still refused.
    let cfg = train_config(&d, "vocab_size = 128255", &llama, 1);
    rejects(&[&cfg], &["llama3.bin", "token 128255 at offset 0"]);
}

#[test]
fn a_header_of_an_unknown_format_is_refused() {
    let d = scratch("shards-unknown");
    let mut bytes = vec![0u8; 1024];
    for (i, w) in [20240999i32, 3, 500].iter().enumerate() {
        bytes[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    bytes.extend((0..500u16).flat_map(|t| t.to_le_bytes()));
    let file = d.join("other.bin");
    std::fs::write(&file, bytes).unwrap();
    let cfg = train_config(&d, "", &file, 1);
    rejects(
        &[&cfg],
        &["other.bin", "magic 20240999, version 3", "20240801"],
    );
}

/// Writes `train` and `val` shards into `dir` with the index that lists them.
fn shard_dir(dir: &Path, dtype: TokenDtype, train: &[&[u32]], val: &[&[u32]]) {
    std::fs::create_dir_all(dir).unwrap();
    let shards = |split: &str, parts: &[&[u32]]| -> Vec<ShardRecord> {
        let mut out = Vec::new();
        for (i, tokens) in parts.iter().enumerate() {
            let file = format!("{split}-{i:05}.bin");
            let mut w = TokenWriter::create(&dir.join(&file), dtype).unwrap();
            w.write(tokens).unwrap();
            w.finish().unwrap();
            let bytes = std::fs::read(dir.join(&file)).unwrap();
            out.push(ShardRecord {
                file,
                tokens: tokens.len() as u64,
                documents: 1,
                bytes: bytes.len() as u64,
                xxh3: xxh3_of(&bytes),
            });
        }
        out
    };
    ShardIndex {
        format: "zrun-token-shards".into(),
        version: 1,
        dtype: dtype.name().into(),
        vocab_size: 256,
        tokenizer: TokenizerRecord {
            name: "tokenizer.json".into(),
            sha256: "0".repeat(64),
        },
        eos: None,
        inputs: vec![],
        train: shards("train", train),
        val: shards("val", val),
    }
    .write(dir)
    .unwrap();
}

/// Every window of a split, as rows of T + 1 tokens.
fn windows(ds: &Dataset, split: Split) -> Vec<Vec<i64>> {
    let n = ds.len(split).unwrap();
    let (x, y) = ds.samples(split, &(0..n).collect::<Vec<u64>>()).unwrap();
    let t = ds.seq_len();
    let x = Vec::<i64>::try_from(x.flatten(0, -1)).unwrap();
    let y = Vec::<i64>::try_from(y.flatten(0, -1)).unwrap();
    (0..n as usize)
        .map(|i| {
            let mut w = x[i * t..(i + 1) * t].to_vec();
            w.push(y[(i + 1) * t - 1]);
            w
        })
        .collect()
}

#[test]
fn a_shard_directory_reads_as_one_llm_c_file_of_its_tokens() {
    let d = scratch("shards-windows");
    // The baseline: one train and one val file, written by llm.c's writer.
    let one = d.join("one");
    std::fs::create_dir_all(&one).unwrap();
    let (_, train) = llm_c_file(&one, "train.bin", "gpt-2", 2000, 256);
    let (_, val) = llm_c_file(&one, "val.bin", "gpt-2", 300, 256);
    // The same tokens in shards of 333 tokens (windows of T = 16 cross the boundaries).
    let (tp, vp): (Vec<&[u32]>, Vec<&[u32]>) =
        (train.chunks(333).collect(), val.chunks(333).collect());
    let shards = d.join("shards");
    shard_dir(&shards, TokenDtype::U16, &tp, &vp);
    let want = Dataset::open(&tokens_options(one, 16, 256)).unwrap();
    let got = Dataset::open(&tokens_options(shards.join("index.json"), 16, 256)).unwrap();
    for split in [Split::Train, Split::Eval] {
        assert_eq!(got.len(split), want.len(split), "{split:?}");
        assert_eq!(windows(&got, split), windows(&want, split), "{split:?}");
    }
}

/// A token stream in blocks of 64 (the tiny model's seq_len): each block one token repeated
/// or uniform noise, by a coin. The model soon predicts the repeats, so a batch's loss follows
/// how many repeated blocks it holds: batches at different data positions have clearly
/// different losses.
fn stream(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    let mut next = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let (repeat, token) = (next() % 2 == 0, next() % 256);
        for _ in 0..64 {
            out.push(if repeat { token } else { next() % 256 });
        }
    }
    out.truncate(n);
    out
}

/// Per-step (step, loss) of a run's metrics.jsonl.
fn losses(dir: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64()?, v["loss"].as_f64()?))
        })
        .collect()
}

/// `zrun --nproc N configs/tiny-cpu.toml` on the token data at `data`, with `sets`.
fn tiny(nproc: usize, data: &Path, sets: Vec<String>, extra: &[&str]) -> std::process::Output {
    let a = tiny_args(nproc, data, sets, extra);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    zrun(&refs)
}

/// The arguments of [`tiny`].
fn tiny_args(nproc: usize, data: &Path, sets: Vec<String>, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["--nproc", &nproc.to_string(), "configs/tiny-cpu.toml"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(sets);
    // min_lr = lr: a learning rate that does not depend on train.steps after the warmup, so
    // that a run stopped at train.steps = 6 and resumed to 12 is the 12-step run.
    for s in [
        "train.lr=1e-2".to_string(),
        "train.min_lr=1e-2".to_string(),
        "data.source=\"tokens\"".to_string(),
        format!("data.path=\"{}\"", data.display()),
    ]
    .iter()
    .map(String::as_str)
    .chain(extra.iter().copied())
    {
        a.extend(["--set".to_string(), s.to_string()]);
    }
    a
}

#[test]
fn resume_and_reshard_from_shards_keep_the_data_position() {
    let d = scratch("shards-resume");
    let data = d.join("data");
    let train = stream(9000, 1);
    let val = stream(1200, 2);
    let (a, rest) = train.split_at(3001);
    let (b, c) = rest.split_at(2500);
    shard_dir(&data, TokenDtype::U16, &[a, b, c], &[&val]);
    // 140 train windows of 64 tokens; 12 steps of 16 samples cross an epoch.
    let reference = d.join("reference");
    let o = tiny(2, &data, demo_sets(&reference, 12, 6), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = losses(&reference);
    assert_eq!(want.len(), 12, "{want:?}");

    // Two ranks for 6 steps, then the same two resume: bit for bit the reference.
    let run = d.join("run");
    let o = tiny(2, &data, demo_sets(&run, 6, 6), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let copy = d.join("resharded");
    let cp = Command::new("cp").arg("-r").arg(&run).arg(&copy).output();
    assert!(cp.unwrap().status.success());
    let o = tiny(2, &data, demo_sets(&run, 12, 6), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("at step 6"), "{}", stderr(&o));
    assert_eq!(losses(&run), want);

    // One rank with the same global batch resumes the two ranks' checkpoint: the same
    // samples; only the order of the sums in the loss and gradients differs.
    let mut sets = demo_sets(&copy, 12, 6);
    sets.extend(["--set".into(), "train.micro_batch=16".into()]);
    let o = tiny(1, &data, sets, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = losses(&copy);
    assert_eq!(got.len(), 12);
    for ((s, l), (_, w)) in got.iter().zip(&want).skip(6) {
        assert!(
            (l - w).abs() <= 1e-4 * w,
            "step {s}: {l} vs {w}\n{got:?}\n{want:?}"
        );
    }
    // A data position off by one step would be seen: consecutive steps differ by far more.
    for pair in want[6..].windows(2) {
        assert!((pair[0].1 - pair[1].1).abs() > 1e-3 * pair[0].1, "{want:?}");
    }

    // The shards prepared again (same sizes, other tokens): the resume is refused.
    let other = stream(9000, 3);
    let (a, rest) = other.split_at(3001);
    let (b, c) = rest.split_at(2500);
    shard_dir(&data, TokenDtype::U16, &[a, b, c], &[&val]);
    let o = tiny(2, &data, demo_sets(&run, 14, 6), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let line = stderr(&o).lines().last().unwrap_or_default().to_string();
    assert!(
        line.contains("the token shards' index.json changed"),
        "{line}"
    );
}

#[test]
fn a_shard_missing_truncated_or_replaced_is_one_line() {
    let d = scratch("shards-bad");
    let data = d.join("data");
    let t = stream(3000, 4);
    let make = || {
        let _ = std::fs::remove_dir_all(&data);
        shard_dir(
            &data,
            TokenDtype::U16,
            &[&t[..1000], &t[1000..]],
            &[&t[..200]],
        );
    };
    let cfg = train_config(&d, "", &data, 1);
    make();
    std::fs::remove_file(data.join("train-00001.bin")).unwrap();
    rejects(&[&cfg], &["train-00001.bin", "missing", "index.json"]);

    make();
    let p = data.join("val-00000.bin");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    rejects(&[&cfg], &["val-00000.bin", "truncated", "index.json"]);

    // Same size, other tokens: what another tokenizer writes.
    make();
    let p = data.join("train-00000.bin");
    let mut w = TokenWriter::create(&p, TokenDtype::U16).unwrap();
    w.write(&stream(1000, 5)).unwrap();
    w.finish().unwrap();
    rejects(
        &[&cfg],
        &[
            "train-00000.bin",
            "content differs from what the index records",
        ],
    );
}

/// The tokens of a split ("train" or "val") of a uint16 token-shard directory, shard after
/// shard as its index.json lists them, each after its llm.c header (GPT-2's magic, version 1).
fn split_tokens(dir: &Path, split: &str) -> Vec<u32> {
    let index = read_json(&dir.join("index.json"));
    let mut out = Vec::new();
    for s in index[split].as_array().unwrap() {
        let b = std::fs::read(dir.join(s["file"].as_str().unwrap())).unwrap();
        let word = |i: usize| i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!((word(0), word(1)), (20240520, 1), "{s}");
        assert_eq!(b.len(), 1024 + 2 * word(2) as usize, "{s}");
        out.extend(
            b[1024..]
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
        );
    }
    out
}

/// Asserts two token streams are equal; on a difference, says where (the streams are long).
fn same_tokens(got: &[u32], want: &[u32], what: &str) {
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    assert!(
        got.len() == want.len() && first.is_none(),
        "{what}: {} tokens read, {} from Python, first difference at {first:?}: {:?} vs {:?}",
        got.len(),
        want.len(),
        first.map(|i| &got[i.saturating_sub(3)..(i + 3).min(got.len())]),
        first.map(|i| &want[i.saturating_sub(3)..(i + 3).min(want.len())]),
    );
}

/// The corpus of tests/prepare.rs (400 documents of mixed text written by Python as JSON
/// Lines, gzip, zstd and Parquet; a small byte-level BPE trained by Python `tokenizers`),
/// prepared into shards of 3000 tokens that hold Python's encoding of each document followed
/// by <|endoftext|> (tests/prepare.rs checks each input format, thread counts and the index
/// in detail). Two ranks train from the directory; rank 1 is SIGKILLed after a checkpoint,
/// the job ends, the same command resumes, and every step's loss equals an uninterrupted
/// run's bit for bit.
#[test]
fn a_prepared_corpus_trains_on_two_ranks_killed_and_resumed_bit_for_bit() {
    let d = scratch("shards-corpus");
    let want = python::python(&d, python::Script::Corpus, &["0.1"]);
    let tok = d.join("tokenizer.json").display().to_string();
    let data = d.join("data");
    let mut args: Vec<String> = ["prepare", "--tokenizer", &tok, "-o"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(data.display().to_string());
    for f in ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"] {
        args.push(d.join(f).display().to_string());
    }
    args.extend(["--shard-tokens", "3000", "--val-fraction", "0.1"].map(String::from));
    let o = zrun(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    let index = read_json(&data.join("index.json"));
    let shards = index["train"].as_array().unwrap().len();
    assert!(
        shards >= 10,
        "{shards} train shards: windows cross boundaries"
    );
    let vocab = index["vocab_size"].as_u64().unwrap() as usize;
    for split in ["train", "val"] {
        same_tokens(
            &split_tokens(&data, split),
            &python::ids(&want[split]),
            split,
        );
    }

    // 40 steps of 16 windows of 64 tokens, about one epoch (shard boundaries every 3000
    // tokens fall inside windows), a checkpoint every 5.
    let vocab_set = format!("model.vocab_size={vocab}");
    let extra = [vocab_set.as_str()];
    let reference = d.join("reference");
    let o = tiny(2, &data, demo_sets(&reference, 40, 5), &extra);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = losses(&reference);
    assert_eq!(want.len(), 40, "{want:?}");

    // The same run, rank 1 SIGKILLed once step 8 is logged (checkpoint 5 is on disk; the
    // run is far from its end, 30 ms a step).
    let run = d.join("run");
    let a = tiny_args(2, &data, demo_sets(&run, 40, 5), &extra);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let id = format!("shards-corpus-{}", std::process::id());
    let mut job = Job::start(&refs, &[("ZRUN_RUN_ID", &id)]);
    let rank1 = rank_pid(&id, 1);
    let logged = job.wait_for(Duration::from_secs(60), |t| t.contains("step 8/40 "));
    assert!(logged, "step 8 never came:\n{}", job.text());
    signal(rank1, libc::SIGKILL);
    let status = job.exit_within(Duration::from_secs(60));
    assert!(!status.success(), "{}", job.text());
    let saved: Vec<u64> = zrun_ckpt::complete(&run.join("ckpt"))
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert!(
        saved.contains(&5) && !saved.contains(&40),
        "{saved:?}\n{}",
        job.text()
    );
    let resumed_at = saved.iter().copied().max().unwrap();
    common::assert_job_gone(&id);

    // The same command again resumes from the newest checkpoint and ends as the reference.
    let o = zrun(&refs);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("at step {resumed_at}")),
        "{}",
        stderr(&o)
    );
    assert_eq!(losses(&run), want);
}
