//! `zrun prepare` and tokenizers end to end: token files equal to what Python's `tokenizers`
//! encodes, uint32 files for large vocabularies read back by the data loader, headerless
//! files still training, and one-line errors (exit code 2) for bad tokenizers, inputs,
//! outputs and headers.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use zrun_train::data::{DataOptions, DataSource, Dataset, Split};

/// Trains a byte-level BPE on the texts, saves DIR/tokenizer.json and writes DIR/ids.json,
/// the texts encoded one after the other as `zrun prepare` separates them. Style `gpt2`:
/// GPT-2's pre-tokenizer, each text followed by <|endoftext|>; style `llama3`: Llama 3's split
/// pattern (case-insensitive groups, digits in threes, look-ahead) and a template that starts
/// each text with <|begin_of_text|>, and nothing after it.
const BPE: &str = r#"
import json, sys
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
out, style, texts = sys.argv[1], sys.argv[2], sys.argv[3:]
tok = Tokenizer(models.BPE())
if style == "gpt2":
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>"]
else:
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
tok.train(texts, trainer)
if style == "gpt2":
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    end = [tok.token_to_id("<|endoftext|>")]
else:
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=bos + " $A", special_tokens=[(bos, tok.token_to_id(bos))])
    end = []
tok.save(out + "/tokenizer.json")
ids = []
for t in texts:
    with open(t, encoding="utf-8", newline="") as f:
        ids += tok.encode(f.read()).ids + end
json.dump(ids, open(out + "/ids.json", "w"))
"#;

/// A word-level tokenizer of 70,000 words `w0`..`w69999` and `[UNK]` (so ids need uint32);
/// writes DIR/tokenizer.json and DIR/ids.json, the encoding of the text file.
const WORDS: &str = r#"
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers
out, text = sys.argv[1], sys.argv[2]
vocab = {f"w{i}": i for i in range(70000)}
vocab["[UNK]"] = 70000
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(out + "/tokenizer.json")
with open(text, encoding="utf-8", newline="") as f:
    json.dump(tok.encode(f.read()).ids, open(out + "/ids.json", "w"))
"#;

/// Runs a Python script of the project's .venv (where scripts/setup.sh installs
/// `tokenizers`) with `args`, returning DIR/ids.json.
fn python(dir: &Path, script: &str, args: &[&str]) -> Vec<u32> {
    let py = root().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/setup.sh (it installs tokenizers)",
        py.display()
    );
    let file = write(dir, "make.py", script.as_bytes());
    let out = Command::new(py)
        .arg(file)
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "python: {}", stderr(&out));
    serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap()
}

/// Deterministic text with ASCII, accents, CJK, emoji, digit runs, contractions, runs of
/// spaces, tabs and newlines (CRLF too).
fn text(seed: u64, words: usize) -> String {
    const VOCAB: [&str; 16] = [
        "the",
        "quick",
        "WE'LL\r\n",
        "12345",
        "héllo",
        "naïve",
        "日本語",
        "🙂",
        "42",
        "3.14",
        "don't",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "Zürich,",
    ];
    let mut s = String::new();
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    for _ in 0..words {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(VOCAB[(x >> 60) as usize]);
        s.push(' ');
    }
    s
}

/// A token file's header version (0 without a header) and tokens.
fn read_bin(path: &Path) -> (i32, Vec<u32>) {
    let b = std::fs::read(path).unwrap();
    let word = |i: usize| i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(word(0), 20240520, "{} has no header", path.display());
    let (version, count) = (word(1), word(2) as usize);
    let width = if version == 1 { 2 } else { 4 };
    assert_eq!(b.len(), 1024 + count * width, "{}", path.display());
    let ids = b[1024..]
        .chunks_exact(width)
        .map(|c| match c {
            [a, b] => u32::from(u16::from_le_bytes([*a, *b])),
            _ => u32::from_le_bytes(c.try_into().unwrap()),
        })
        .collect();
    (version, ids)
}

/// Every token of a token file, read through the data loader: with T = 1 and one train
/// window, window 0 is the train split and windows 1.. the eval split, in file order.
fn read_by_loader(path: PathBuf, vocab_size: usize) -> Vec<u32> {
    let ds = Dataset::open(&DataOptions {
        source: DataSource::Tokens { path },
        seq_len: 1,
        vocab_size,
        seed: 0,
        eval_fraction: 0.999_999,
    })
    .unwrap();
    assert_eq!(ds.len(Split::Train), Some(1));
    let n = ds.len(Split::Eval).unwrap();
    let (x0, _) = ds.samples(Split::Train, &[0]).unwrap();
    let (x, y) = ds
        .samples(Split::Eval, &(0..n).collect::<Vec<u64>>())
        .unwrap();
    let mut all = Vec::<i64>::try_from(x0.flatten(0, -1)).unwrap();
    all.extend(Vec::<i64>::try_from(x.flatten(0, -1)).unwrap());
    all.push(Vec::<i64>::try_from(y.flatten(0, -1)).unwrap()[n as usize - 1]);
    all.into_iter().map(|t| t as u32).collect()
}

/// Runs zrun, expects exit code 2 and one `zrun: error:` line holding every needle.
fn rejects(args: &[&str], needles: &[&str]) {
    let out = zrun(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("zrun: error:")).collect();
    assert_eq!(lines.len(), 1, "expected one error line: {err}");
    for n in needles {
        assert!(lines[0].contains(n), "{:?} lacks {n:?}", lines[0]);
    }
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
    let want = python(&d, BPE, &["gpt2", &a, &b]);
    let tok = d.join("tokenizer.json").display().to_string();
    let out_dir = d.join("data").display().to_string();
    let out = zrun(&["prepare", "--tokenizer", &tok, &a, &b, "-o", &out_dir]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (v_train, mut got) = read_bin(&d.join("data/train.bin"));
    let (v_val, val) = read_bin(&d.join("data/val.bin"));
    assert_eq!((v_train, v_val), (1, 1), "vocabulary 400: uint16");
    // The default --val-fraction: the last 5% of the tokens.
    let n_val = (want.len() as f64 * 0.05).round() as usize;
    assert_eq!(val.len(), n_val);
    got.extend(val);
    assert_eq!(got.len(), want.len());
    assert_eq!(got, want, "zrun prepare and Python's tokenizers differ");
    // The vocabulary: the largest id + 1 (training stops early on a small corpus).
    let json = read_json(&d.join("tokenizer.json"));
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let vocab_size = vocab.values().map(|v| v.as_u64().unwrap()).max().unwrap() + 1;
    let line = stdout(&out);
    assert_eq!(line.lines().count(), 1, "{line}");
    for needle in [
        format!("({} tokens)", want.len() - n_val),
        format!("({n_val} tokens)"),
        "uint16".into(),
        format!("vocabulary {vocab_size},"),
        "2 document(s)".into(),
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
    let b = write(&d, "b.txt", text(4, 500).as_bytes());
    let want = python(&d, BPE, &["llama3", &a, &b]);
    let tok = d.join("tokenizer.json").display().to_string();
    let out_dir = d.join("data").display().to_string();
    let args = ["prepare", "--tokenizer", &tok, &a, &b, "-o", &out_dir];
    let out = zrun(&[&args[..], &["--val-fraction", "0"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(read_bin(&d.join("data/train.bin")), (1, want.clone()));
    assert!(
        stdout(&out).contains("each marked by the tokenizer's template"),
        "{}",
        stdout(&out)
    );
    // --eos appends a token of the user's choice as well.
    let out = zrun(
        &[
            &args[..],
            &["--val-fraction", "0", "--eos", "<|end_of_text|>"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let (_, got) = read_bin(&d.join("data/train.bin"));
    assert_eq!(got.len(), want.len() + 2);
    assert!(stdout(&out).contains("each ended by <|end_of_text|>"));
}

#[test]
fn a_vocabulary_above_65536_gives_uint32_files_the_loader_reads_back() {
    let d = scratch("prepare-words");
    let words: Vec<String> = (0..3000u32)
        .map(|i| match i % 7 {
            0 => "unknown".to_string(),
            _ => format!("w{}", (i * 7919) % 70_000),
        })
        .collect();
    let t = write(&d, "t.txt", words.join(" ").as_bytes());
    let want = python(&d, WORDS, &[&t]);
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
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("uint32"), "{}", stdout(&out));
    assert!(!d.join("data/val.bin").exists());
    let train = d.join("data/train.bin");
    assert_eq!(read_bin(&train), (2, want.clone()));
    assert_eq!(read_by_loader(train.clone(), 70_001), want);
    // A model whose vocabulary is too small for the file's tokens is refused.
    let e = Dataset::open(&DataOptions {
        source: DataSource::Tokens { path: train },
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
    rejects(
        &["prepare", "--tokenizer", &missing, &text, "-o", &out_dir],
        &["--tokenizer", "missing.json", "tokenizer.json"],
    );
    let invalid = write(&d, "invalid.json", b"{\"model\": 3}");
    rejects(
        &["prepare", "--tokenizer", &invalid, &text, "-o", &out_dir],
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
    rejects(
        &["prepare", "--tokenizer", &tok, &gone, "-o", &out_dir],
        &["input", "gone.txt", "cannot read"],
    );
    let latin1 = write(&d, "latin1.txt", b"caf\xe9 au lait");
    rejects(
        &["prepare", "--tokenizer", &tok, &latin1, "-o", &out_dir],
        &["latin1.txt", "invalid UTF-8", "byte offset 3"],
    );
    let blocker = write(&d, "blocker", b"a file, not a directory");
    let inside = format!("{blocker}/out");
    rejects(
        &["prepare", "--tokenizer", &tok, &text, "-o", &inside],
        &["blocker/out", "cannot create directory", "-o"],
    );
    rejects(
        &[
            "prepare",
            "--tokenizer",
            &tok,
            &text,
            "-o",
            &out_dir,
            "--eos",
            "<nope>",
        ],
        &["--eos <nope>", "tokenizer.json"],
    );
    // A good run after all that: 2 tokens, no end-of-text token in this vocabulary.
    let out = zrun(&[
        "prepare",
        "--tokenizer",
        &tok,
        &text,
        "-o",
        &out_dir,
        "--val-fraction",
        "0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(read_bin(&d.join("out/train.bin")), (1, vec![0, 1]));
}
