//! `zrun prepare` and tokenizers end to end: shards equal to what Python's `tokenizers`
//! encodes for text, JSON Lines (plain, gzip, zstd) and Parquet inputs, the same bytes for any
//! thread count, val shards by document, uint32 shards for large vocabularies read back by the
//! data loader, headerless files still training, and one-line errors (exit code 2) for bad
//! tokenizers, inputs, outputs and headers.

zrun_torch_ext::end_tests_without_destructors!();

mod common;
#[path = "prepare/failures.rs"]
mod failures;
#[path = "prepare/interrupt.rs"]
mod interrupt;
#[path = "prepare/python.rs"]
mod python;

use common::*;
use python::{book, ids, python, text, Script};

use std::path::Path;

use zrun_train::data::{DataOptions, DataSource, Dataset};

/// A token file's width in bytes (2 for uint16, 4 for uint32) and its tokens; the header is
/// one of llm.c's (20240520 version 1, 20240801 version 7) or zrun's older uint32 one
/// (20240520 version 2).
fn read_bin(path: &Path) -> (usize, Vec<u32>) {
    let b = std::fs::read(path).unwrap();
    let word = |i: usize| i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    let width = match (word(0), word(1)) {
        (20240520, 1) => 2,
        (20240801, 7) | (20240520, 2) => 4,
        other => panic!("{}: header {other:?}", path.display()),
    };
    let count = word(2) as usize;
    assert_eq!(b.len(), 1024 + count * width, "{}", path.display());
    let ids = b[1024..]
        .chunks_exact(width)
        .map(|c| match c {
            [a, b] => u32::from(u16::from_le_bytes([*a, *b])),
            _ => u32::from_le_bytes(c.try_into().unwrap()),
        })
        .collect();
    (width, ids)
}

/// The tokens of a split ("train" or "val"), shard after shard as DIR/index.json lists them;
/// checks each shard's record against its file and that all but the last hold `shard_tokens`.
fn read_split(dir: &Path, split: &str, shard_tokens: usize) -> Vec<u32> {
    let index = read_json(&dir.join("index.json"));
    let shards = index[split].as_array().unwrap();
    let mut all = Vec::new();
    for (i, s) in shards.iter().enumerate() {
        let file = s["file"].as_str().unwrap();
        assert_eq!(file, format!("{split}-{i:05}.bin"));
        let (width, ids) = read_bin(&dir.join(file));
        assert_eq!(width, if index["dtype"] == "uint16" { 2 } else { 4 });
        assert_eq!(s["tokens"].as_u64(), Some(ids.len() as u64), "{file}");
        assert_eq!(s["bytes"].as_u64(), Some((1024 + width * ids.len()) as u64));
        if i + 1 < shards.len() {
            assert_eq!(ids.len(), shard_tokens, "{file} is not full");
        }
        all.extend(ids);
    }
    all
}

/// Checks that a `zrun prepare` succeeded and printed nothing on stderr (no progress off a
/// terminal in a short run, no warning such as the byte-level path disagreeing with the
/// library).
fn prepared(out: &std::process::Output) {
    assert!(out.status.success(), "{}", stderr(out));
    assert_eq!(stderr(out), "", "stderr of a good run");
}

/// Runs zrun with extra environment variables.
fn zrun_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    zrun_child(args, env).wait_with_output().unwrap()
}

/// A training config of 2 steps of the tiny model on `data`, logging into `dir`.
fn train_config(dir: &Path, model: &str, data: &str) -> String {
    let toml = format!(
        "[model]\nseq_len = 16\n{model}\n[data]\n{data}\n[train]\nsteps = 2\nmicro_batch = 2\n\
         eval_batches = 1\n[dist]\ndevice = \"cpu\"\n[log]\ndir = \"{}\"\nevery = 1\n",
        dir.join("run").display()
    );
    write(dir, "train.toml", toml.as_bytes())
}

#[test]
fn prepare_writes_what_python_tokenizers_encodes_token_for_token() {
    let d = scratch("prepare-bpe");
    let a = write(&d, "a.txt", text(1, 1500).as_bytes());
    let b = write(&d, "b.txt", text(2, 600).as_bytes());
    // Over 256 KiB: encoded in pieces, which give the whole file's tokens.
    let big = write(&d, "big.txt", book(3, 300_000).as_bytes());
    let want = python(&d, Script::Files, &["gpt2", &a, &b, &big]);
    let docs: Vec<Vec<u32>> = want.as_array().unwrap().iter().map(ids).collect();
    let tok = d.join("tokenizer.json").display().to_string();
    let out_dir = d.join("data").display().to_string();
    let out = zrun(&[
        "prepare",
        "--tokenizer",
        &tok,
        &a,
        &b,
        &big,
        "-o",
        &out_dir,
        "--shard-tokens",
        "40k",
        "--val-fraction",
        "0.5",
    ]);
    prepared(&out);
    // --val-fraction 0.5: documents 1, 3, ... go to val.
    let train = read_split(&d.join("data"), "train", 40_000);
    let val = read_split(&d.join("data"), "val", 40_000);
    assert_eq!(
        train,
        [&docs[0][..], &docs[2][..]].concat(),
        "train differs"
    );
    assert_eq!(val, docs[1], "val differs");
    assert!(train.len() > 80_000, "{} tokens: three shards", train.len());
    // The vocabulary: the largest id + 1 (training stops early on a small corpus).
    let json = read_json(&d.join("tokenizer.json"));
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let vocab_size = vocab.values().map(|v| v.as_u64().unwrap()).max().unwrap() + 1;
    let line = stdout(&out);
    assert_eq!(line.lines().count(), 1, "{line}");
    for needle in [
        format!("3 train shard(s) ({} tokens)", train.len()),
        format!("1 val shard(s) ({} tokens, 1 document(s))", val.len()),
        "at most 40000 tokens each".into(),
        "uint16".into(),
        format!("vocabulary {vocab_size},"),
        "3 document(s)".into(),
        "<|endoftext|>".into(),
    ] {
        assert!(line.contains(&needle), "{line} lacks {needle}");
    }

    // The same tokenizer encodes data.source = "text" for training.
    let cfg = train_config(
        &d,
        "vocab_size = 512",
        &format!("source = \"text\"\npath = \"{a}\"\ntokenizer = \"{tok}\""),
    );
    let out = zrun(&[&cfg]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(d.join("run/metrics.jsonl").exists());
}

#[test]
fn a_template_that_starts_each_document_replaces_the_end_of_text_token() {
    let d = scratch("prepare-llama3");
    let a = write(&d, "a.txt", text(3, 1200).as_bytes());
    let big = write(&d, "big.txt", book(4, 280_000).as_bytes());
    let want = python(&d, Script::Files, &["llama3", &a, &big]);
    let docs: Vec<Vec<u32>> = want.as_array().unwrap().iter().map(ids).collect();
    let tok = d.join("tokenizer.json").display().to_string();
    let out_dir = d.join("data").display().to_string();
    let args = ["prepare", "--tokenizer", &tok, &a, &big, "-o", &out_dir];
    let out = zrun(&[&args[..], &["--val-fraction", "0"]].concat());
    prepared(&out);
    // The book in pieces starts with <|begin_of_text|> once.
    assert_eq!(read_split(&d.join("data"), "train", 0), docs.concat());
    let line = stdout(&out);
    assert!(
        line.contains("each marked by the tokenizer's template"),
        "{line}"
    );
    assert!(line.contains("no val shards"), "{line}");
    // --eos appends a token of the user's choice as well.
    let out = zrun(
        &[
            &args[..],
            &["--val-fraction", "0", "--eos", "<|end_of_text|>"],
        ]
        .concat(),
    );
    prepared(&out);
    let got = read_split(&d.join("data"), "train", 0);
    assert_eq!(got.len(), docs.concat().len() + 2);
    assert!(stdout(&out).contains("each ended by <|end_of_text|>"));
}

#[test]
fn json_lines_gzip_zstd_and_parquet_equal_python_tokenizers_for_any_thread_count() {
    let d = scratch("prepare-corpus");
    let want = python(&d, Script::Corpus, &["0.1"]);
    let tok = d.join("tokenizer.json").display().to_string();
    let inputs: Vec<String> = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]
        .iter()
        .map(|f| d.join(f).display().to_string())
        .collect();
    let prepare = |out: &str, inputs: &[&str], threads: &str| {
        let out_dir = d.join(out).display().to_string();
        let args = [
            &["prepare", "--tokenizer", &tok, "-o", &out_dir][..],
            inputs,
            &["--shard-tokens", "4096", "--val-fraction", "0.1"],
        ]
        .concat();
        let out = zrun_env(&args, &[("RAYON_NUM_THREADS", threads)]);
        assert!(out.status.success(), "{}", stderr(&out));
        (stdout(&out), stderr(&out))
    };
    // A previous prepare's files (the older layout, a killed run's shard) are replaced.
    std::fs::create_dir_all(d.join("one")).unwrap();
    write(&d.join("one"), "train.bin", b"old");
    write(&d.join("one"), "train-00009.bin.tmp", b"killed");
    let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    let (line, err) = prepare("one", &refs, "1");
    assert_eq!(err, "", "stderr of a good run");
    assert_eq!(
        read_split(&d.join("one"), "train", 4096),
        ids(&want["train"])
    );
    assert_eq!(read_split(&d.join("one"), "val", 4096), ids(&want["val"]));
    assert!(
        line.contains("400 document(s)") && line.contains(", 40 document(s))"),
        "{line}"
    );
    let index = read_json(&d.join("one/index.json"));
    assert_eq!(index["tokenizer"]["sha256"], want["sha256"]);
    assert_eq!(index["eos"], "<|endoftext|>");
    let documents: u64 = ["train", "val"]
        .iter()
        .flat_map(|s| index[s].as_array().unwrap())
        .map(|s| s["documents"].as_u64().unwrap())
        .sum();
    assert_eq!(documents, 400);
    let inputs_listed: Vec<(String, u64)> = index["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap().into(),
                i["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    let sizes: Vec<(String, u64)> = inputs
        .iter()
        .map(|f| (f.clone(), std::fs::metadata(f).unwrap().len()))
        .collect();
    assert_eq!(inputs_listed, sizes);
    let mut names: Vec<_> = std::fs::read_dir(d.join("one"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let shards = index["train"].as_array().unwrap().len() + 1;
    assert_eq!(names.len(), shards + 1, "{names:?}");
    assert!(!names
        .iter()
        .any(|n| n == "train.bin" || n.ends_with(".tmp")));

    // Two threads, and the inputs as a directory (sorted by name): the same bytes.
    let corpus = d.join("corpus");
    std::fs::create_dir_all(corpus.join("sub")).unwrap();
    for (i, f) in inputs.iter().enumerate() {
        let name = Path::new(f).file_name().unwrap();
        let to = if i == 3 {
            corpus.join("sub")
        } else {
            corpus.clone()
        };
        std::fs::copy(f, to.join(name)).unwrap();
    }
    write(&corpus, "README.md", b"not an input");
    let (_, err) = prepare("two", &[&corpus.display().to_string()], "2");
    // README.md is not read, and said so in one line.
    assert!(
        err.lines().count() == 1 && err.contains("1 entry of the input directories not read"),
        "{err}"
    );
    let two = read_json(&d.join("two/index.json"));
    assert_eq!(
        (&two["train"], &two["val"]),
        (&index["train"], &index["val"])
    );
    for n in names.iter().filter(|n| n.ends_with(".bin")) {
        let same = std::fs::read(d.join("one").join(n)).unwrap()
            == std::fs::read(d.join("two").join(n)).unwrap();
        assert!(same, "{n} differs between 1 and 2 threads");
    }

    // Training reads the directory: train shards, and the val shards for eval.
    let one = d.join("one").display().to_string();
    let cfg = train_config(
        &d,
        "vocab_size = 512",
        &format!("source = \"tokens\"\npath = \"{one}\""),
    );
    let out = zrun(&[&cfg]);
    assert!(out.status.success(), "{}", stderr(&out));
    let metrics = std::fs::read_to_string(d.join("run/metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"step\":2"), "{metrics}");
}

#[test]
fn a_vocabulary_above_65536_gives_uint32_shards_the_loader_reads_back() {
    let d = scratch("prepare-words");
    let words: Vec<String> = (0..3000u32)
        .map(|i| match i % 7 {
            0 => "unknown".to_string(),
            _ => format!("w{}", (i * 7919) % 70_000),
        })
        .collect();
    let t = write(&d, "t.txt", words.join(" ").as_bytes());
    let want = ids(&python(&d, Script::Words, &[&t]));
    assert!(want.iter().any(|&i| i > 65_535) && want.contains(&70_000));
    let tok = d.join("tokenizer.json").display().to_string();
    let out_dir = d.join("data").display().to_string();
    let out = zrun(&[
        "prepare",
        "--tokenizer",
        &tok,
        &t,
        "-o",
        &out_dir,
        "--val-fraction",
        "0",
    ]);
    prepared(&out);
    assert!(stdout(&out).contains("uint32"), "{}", stdout(&out));
    assert_eq!(read_split(&d.join("data"), "train", 0), want);
    let shard = d.join("data/train-00000.bin");
    assert_eq!(read_by_loader(shard.clone(), 70_001), want);
    // A model whose vocabulary is too small for the file's tokens is refused.
    let e = Dataset::open(&DataOptions {
        source: DataSource::Tokens {
            path: shard,
            tokenizer: None,
        },
        seq_len: 4,
        vocab_size: 65_536,
        seed: 0,
        eval_fraction: 0.1,
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("token 70000") && e.contains("at least 70001"),
        "{e}"
    );

    // data.tokenizer with more tokens than model.vocab_size: one line, both numbers.
    let cfg = train_config(
        &d,
        "",
        &format!("source = \"text\"\npath = \"{t}\"\ntokenizer = \"{tok}\""),
    );
    rejects(
        &[&cfg],
        &[
            "data.tokenizer",
            "tokenizer.json",
            "70001 tokens",
            "model.vocab_size 256",
            "--set model.vocab_size=70001",
        ],
    );
}

#[test]
fn headerless_uint16_files_still_train_and_bad_headers_are_refused() {
    let d = scratch("prepare-headers");
    let ids: Vec<u8> = (0..4000u32)
        .flat_map(|i| ((i * 37 % 256) as u16).to_le_bytes())
        .collect();
    let plain = write(&d, "plain.bin", &ids);
    let cfg = train_config(&d, "", &format!("source = \"tokens\"\npath = \"{plain}\""));
    let out = zrun(&[&cfg]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(d.join("run/metrics.jsonl").exists());

    // A header that counts 5000 uint16 tokens on a file of 4000.
    let mut bad = Vec::new();
    for v in [20240520i32, 1, 5000] {
        bad.extend(v.to_le_bytes());
    }
    bad.resize(1024, 0);
    bad.extend(&ids);
    let bin = write(&d, "short.bin", &bad);
    let cfg = train_config(&d, "", &format!("source = \"tokens\"\npath = \"{bin}\""));
    rejects(
        &[&cfg],
        &[
            "short.bin",
            "header says 5000 uint16 tokens",
            "11024 bytes",
            "file has 9024 bytes",
        ],
    );
    // data.tokenizer means nothing to the synthetic source.
    let cfg = train_config(&d, "", "source = \"synthetic\"\ntokenizer = \"t.json\"");
    rejects(&[&cfg], &["data.tokenizer", "synthetic", "remove it"]);
}

#[test]
fn prepare_errors_are_one_line_naming_the_file() {
    let d = scratch("prepare-errors");
    let text = write(&d, "ok.txt", b"hello world");
    let out_dir = d.join("out").display().to_string();
    let missing = d.join("missing.json").display().to_string();
    let prep = |tok: &str, input: &str, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["prepare", "--tokenizer", tok, input, "-o", &out_dir]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let check = |args: Vec<String>, needles: &[&str]| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        rejects(&refs, needles);
    };
    check(
        prep(&missing, &text, &[]),
        &["--tokenizer", "missing.json", "tokenizer.json"],
    );
    let invalid = write(&d, "invalid.json", b"{\"model\": 3}");
    check(
        prep(&invalid, &text, &[]),
        &["--tokenizer", "invalid.json", "cannot load"],
    );
    let tok = write(
        &d,
        "tokenizer.json",
        br#"{"version": "1.0", "added_tokens": [], "normalizer": null,
             "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
             "decoder": null, "truncation": null, "padding": null,
             "model": {"type": "WordLevel", "vocab": {"hello": 0, "[UNK]": 1},
                       "unk_token": "[UNK]"}}"#,
    );
    let gone = d.join("gone.txt").display().to_string();
    check(
        prep(&tok, &gone, &[]),
        &["input", "gone.txt", "cannot read"],
    );
    let latin1 = write(&d, "latin1.txt", b"caf\xe9 au lait");
    check(
        prep(&tok, &latin1, &[]),
        &["latin1.txt", "invalid UTF-8", "byte offset 3"],
    );
    // JSON Lines: not JSON, no such field, not a string; each names file:line.
    let jsonl = write(
        &d,
        "docs.jsonl",
        b"{\"text\": \"hello\"}\n\n{\"text\": \"hello\",}\n{\"id\": 1, \"body\": \"x\"}\n{\"text\": 5}\n",
    );
    check(
        prep(&tok, &jsonl, &[]),
        &["docs.jsonl:3:", "not a JSON object", "--skip-bad"],
    );
    check(
        prep(&tok, &jsonl, &["--field", "id"]),
        &[
            "docs.jsonl:1:",
            "no field \"id\"",
            "its keys: \"text\"",
            "--field",
        ],
    );
    // --skip-bad counts the three bad lines and keeps the good one.
    let out = zrun(
        &prep(&tok, &jsonl, &["--skip-bad", "--val-fraction", "0"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("3 bad record(s) skipped"),
        "{}",
        stdout(&out)
    );
    assert_eq!(read_split(&d.join("out"), "train", 0), [0]);
    // A compressed stream that is not one, a compression zrun does not read, a compressed
    // file named as text.
    let fake = write(&d, "fake.jsonl.gz", b"{\"text\": \"plain, not gzip\"}\n");
    check(
        prep(&tok, &fake, &[]),
        &["fake.jsonl.gz", "cannot decompress (gzip)", "--skip-bad"],
    );
    let bz2 = write(&d, "docs.jsonl.bz2", b"BZh9");
    check(
        prep(&tok, &bz2, &[]),
        &["docs.jsonl.bz2", "bzip2", "bunzip2"],
    );
    let gz_txt = write(&d, "gz.txt", &[0x1f, 0x8b, 8, 0]);
    check(prep(&tok, &gz_txt, &[]), &["gz.txt", "gzip-compressed"]);
    // Parquet: no such column, not a string column (each lists the columns), a null.
    let c = scratch("prepare-errors-parquet");
    python(&c, Script::Corpus, &["0"]);
    let nocol = c.join("nocol.parquet").display().to_string();
    check(
        prep(&tok, &nocol, &[]),
        &[
            "nocol.parquet",
            "no column \"text\"",
            "\"id\" Int64, \"content\" Utf8",
            "--field",
        ],
    );
    let ints = c.join("ints.parquet").display().to_string();
    check(
        prep(&tok, &ints, &[]),
        &[
            "ints.parquet",
            "column \"text\" is Int64, not a string column",
        ],
    );
    let nulls = c.join("nulls.parquet").display().to_string();
    check(
        prep(&tok, &nulls, &[]),
        &[
            "nulls.parquet",
            "row 1 (row group 0)",
            "is null",
            "--skip-bad",
        ],
    );
    // A directory holding someone else's file is refused and left as it is.
    let theirs = d.join("theirs");
    std::fs::create_dir_all(&theirs).unwrap();
    write(&theirs, "notes.md", b"mine");
    let theirs_s = theirs.display().to_string();
    rejects(
        &["prepare", "--tokenizer", &tok, &text, "-o", &theirs_s],
        &["theirs", "\"notes.md\"", "zrun prepare does not write"],
    );
    assert!(theirs.join("notes.md").exists());
    let blocker = write(&d, "blocker", b"a file, not a directory");
    let inside = format!("{blocker}/out");
    rejects(
        &["prepare", "--tokenizer", &tok, &text, "-o", &inside],
        &["blocker/out", "cannot create directory", "-o"],
    );
    check(
        prep(&tok, &text, &["--eos", "<nope>"]),
        &["--eos <nope>", "tokenizer.json"],
    );
    check(
        prep(&tok, &text, &["--shard-tokens", "3G"]),
        &["--shard-tokens 3000000000", "2147483647"],
    );
    // A good run after all that: 2 tokens, no end-of-text token in this vocabulary.
    let out = zrun(
        &prep(&tok, &text, &["--val-fraction", "0"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(read_split(&d.join("out"), "train", 0), [0, 1]);
}
