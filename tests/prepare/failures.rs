//! `zrun prepare` failing late: a disk that runs out of room while the index is written, or a
//! signal while shards are written, leaves no partial output (the directory it made is
//! removed, a previous output stays whole).

use std::process::Output;

use crate::common::*;
use crate::interrupt::{interrupt_early, Seen};

/// A word-level tokenizer: "hello" is token 0, anything else 1; no end-of-text token.
const WORDS: &[u8] = br#"{"version": "1.0", "added_tokens": [], "normalizer": null,
    "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
    "truncation": null, "padding": null,
    "model": {"type": "WordLevel", "vocab": {"hello": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}"#;

#[test]
fn a_disk_full_at_the_index_leaves_no_partial_output() {
    let d = scratch("prepare-full");
    let tok = write(&d, "tokenizer.json", WORDS);
    // 200 tokens in shards of 4: 50 shards of 1,032 bytes (llm.c's header and 4 uint16
    // tokens) fit under a 4 KiB file limit; the index listing them (about 7 KB) does not.
    let text = write(&d, "words.txt", "hello ".repeat(200).as_bytes());
    let out = d.join("out");
    let out_s = out.display().to_string();
    let args = [
        "prepare",
        "--tokenizer",
        &tok,
        &text,
        "-o",
        &out_s,
        "--shard-tokens",
        "4",
        "--val-fraction",
        "0",
    ];
    let o = zrun_file_limit(&args, 4096, true);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let line = err.lines().find(|l| l.contains("zrun: error:")).unwrap();
    assert!(
        line.contains("index.json.tmp") && line.contains("disk has room"),
        "{line}"
    );
    assert!(!out.exists(), "the directory this run made is removed");

    // Over a previous output (one shard), the failed run leaves it as it was.
    let small = write(&d, "small.txt", b"hello hello");
    let o = zrun(&[
        "prepare",
        "--tokenizer",
        &tok,
        &small,
        "-o",
        &out_s,
        "--val-fraction",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = files_in(&out);
    assert_eq!(before.len(), 2, "index.json and train-00000.bin");
    let o = zrun_file_limit(&args, 4096, true);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(files_in(&out), before, "the previous output is whole");
}

#[test]
fn a_run_on_token_shards_refuses_a_tokenizer_they_were_not_made_with() {
    let d = scratch("prepare-run-tokenizer");
    let tok = write(&d, "tokenizer.json", WORDS);
    // Another tokenizer: "world" is token 1 there.
    let other = String::from_utf8(WORDS.to_vec())
        .unwrap()
        .replace(r#""[UNK]": 1"#, r#""world": 1, "[UNK]": 2"#);
    let other = write(&d, "other.json", other.as_bytes());
    let text = write(&d, "words.txt", "hello ".repeat(400).as_bytes());
    let data = d.join("data");
    let data_s = data.display().to_string();
    let args = ["prepare", "--tokenizer", &tok, &text, "-o", &data_s];
    let o = zrun(&[&args[..], &["--val-fraction", "0"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let run = |data: &str, tokenizer: &str, vocab: u32| {
        super::train_config(
            &d,
            &format!("vocab_size = {vocab}"),
            &format!("source = \"tokens\"\npath = \"{data}\"\ntokenizer = \"{tokenizer}\""),
        )
    };
    // The run's tokenizer is recorded with its checkpoints and exported as the model's: it
    // must be the one the shards were made with.
    rejects(
        &[&run(&data_s, &other, 8)],
        &[
            "other.json",
            "not the tokenizer the shards were made with",
            "index.json records",
        ],
    );
    let o = zrun(&[&run(&data_s, &tok, 8)]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A token file records no tokenizer: the run's must at least fit the model.
    let bin = data.join("train-00000.bin").display().to_string();
    rejects(
        &[&run(&bin, &other, 2)],
        &["other.json", "3 tokens, more than model.vocab_size 2"],
    );
}

#[test]
fn an_interrupted_prepare_removes_what_it_wrote_and_exits_128_plus_the_signal() {
    let d = scratch("prepare-interrupted");
    let tok = write(&d, "tokenizer.json", WORDS);
    // 4M tokens in 40 shards: a second or so of work.
    let text = write(&d, "words.txt", "hello world ".repeat(2_000_000).as_bytes());
    let out = d.join("out");
    let out_s = out.display().to_string();
    let args = [
        "prepare",
        "--tokenizer",
        &tok,
        &text,
        "-o",
        &out_s,
        "--shard-tokens",
        "100K",
        "--val-fraction",
        "0",
    ];
    // Shards being written, most of them still ahead (a previous output's index.json aside).
    let look = |previous: bool| {
        let out = out.clone();
        move |_| {
            let names: Vec<String> = std::fs::read_dir(&out).map_or(Vec::new(), |d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            });
            let index = |n: &&String| *n == "index.json.tmp" || !previous && *n == "index.json";
            let written = names.iter().filter(|n| n.ends_with(".bin.tmp")).count();
            match written {
                _ if names.iter().any(|n| index(&n)) => Seen::Late,
                0 => Seen::NotYet,
                1..=15 => Seen::Early,
                _ => Seen::Late,
            }
        }
    };
    let said = |o: &Output| -> Vec<String> {
        stderr(o)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(String::from)
            .collect()
    };
    let (o, _) = interrupt_early(&args, libc::SIGINT, look(false));
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let want = format!("zrun: prepare interrupted by SIGINT; removed the partial output {out_s}");
    assert_eq!(said(&o), [want]);
    assert!(!out.exists(), "the directory this run made is removed");
    // Over a previous output: that output is as it was, without a .tmp file.
    let o = zrun(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = files_in(&out);
    assert_eq!(before.len(), 41, "index.json and 40 shards");
    let (o, _) = interrupt_early(&args, libc::SIGTERM, look(true));
    assert_eq!(o.status.code(), Some(143), "{}", stderr(&o));
    let want = format!(
        "zrun: prepare interrupted by SIGTERM; removed the partial output (its .tmp shards) from \
         {out_s}, which holds what it held before"
    );
    assert_eq!(said(&o), [want]);
    assert_eq!(files_in(&out), before);
}
