//! Token and text sources on real files: epoch coverage, splits, seeding, targets and the
//! error messages users see.

zrun_torch_ext::end_tests_without_destructors!();

use std::path::{Path, PathBuf};
use std::sync::Arc;

use zrun_train::data::{
    Cursor, DataOptions, DataSource, Dataset, Loader, Split, TokenDtype, TokenWriter,
};

fn write_u16(path: &Path, tokens: &[u16]) {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

fn tokens_opts(path: PathBuf, seq_len: usize, vocab_size: usize, seed: u64) -> DataOptions {
    DataOptions {
        source: DataSource::Tokens {
            path,
            tokenizer: None,
        },
        seq_len,
        vocab_size,
        seed,
        eval_fraction: 0.1,
    }
}

fn rows(x: &tch::Tensor) -> Vec<Vec<i64>> {
    (0..x.size()[0])
        .map(|i| Vec::<i64>::try_from(x.get(i)).unwrap())
        .collect()
}

fn open_err(opts: &DataOptions) -> String {
    Dataset::open(opts).unwrap_err().to_string()
}

#[test]
fn one_epoch_over_all_ranks_reads_every_train_window_once_and_no_eval_window() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.bin");
    // Token i is i, so a window is identified by its first token. T = 8, 53 windows:
    // floor(5.3) = 5 held out for eval, 48 for train.
    let t = 8;
    let tokens: Vec<u16> = (0..53 * t as u16 + 1).collect();
    write_u16(&file, &tokens);
    let ds = Arc::new(Dataset::open(&tokens_opts(file, t, 1000, 7)).unwrap());
    assert_eq!(ds.len(Split::Train), Some(48));
    assert_eq!(ds.len(Split::Eval), Some(5));
    assert!(ds.loss_floor().is_none());

    // Two ranks, micro batch 3, 2 micro-steps: G = 12, so 4 steps are one epoch.
    let mut loaders: Vec<Loader> = (0..2)
        .map(|r| Loader::new(ds.clone(), r, 2, 3, 2, Cursor::default()))
        .collect();
    let mut seen = vec![0u32; 53];
    for _step in 0..4 {
        for l in loaders.iter_mut() {
            for _micro in 0..2 {
                let (x, y) = l.next_micro_batch().unwrap();
                assert_eq!(x.size(), [3, 8]);
                for (xi, yi) in rows(&x).iter().zip(rows(&y)) {
                    let start = xi[0] as usize;
                    assert_eq!(start % t, 0, "windows start at multiples of T");
                    seen[start / t] += 1;
                    // Inputs and targets are the file's tokens, targets shifted by one.
                    let file_x: Vec<i64> =
                        tokens[start..start + t].iter().map(|&v| v.into()).collect();
                    let file_y: Vec<i64> = tokens[start + 1..start + t + 1]
                        .iter()
                        .map(|&v| v.into())
                        .collect();
                    assert_eq!(xi, &file_x);
                    assert_eq!(yi, file_y);
                }
            }
        }
    }
    assert_eq!(&seen[..48], &[1; 48][..], "every train window exactly once");
    assert_eq!(&seen[48..], &[0; 5][..], "no eval window in train");
    assert_eq!(loaders[0].cursor(), Cursor { next_sample: 48 });

    // Eval batches of both ranks together are the held-out windows 48..53 (wrapping past 5).
    let mut eval_starts = Vec::new();
    for l in &loaders {
        for xi in rows(&l.eval_batch(0).unwrap().0) {
            eval_starts.push(xi[0] as usize / t);
        }
    }
    eval_starts.sort_unstable();
    assert_eq!(eval_starts, vec![48, 48, 49, 50, 51, 52]);
}

#[test]
fn shuffles_depend_on_the_seed_only() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.bin");
    let tokens: Vec<u16> = (0..4001).map(|i| (i * 7 % 1000) as u16).collect();
    write_u16(&file, &tokens);
    let batch = |seed| {
        let ds = Dataset::open(&tokens_opts(file.clone(), 16, 1000, seed)).unwrap();
        ds.samples(Split::Train, &(0..32).collect::<Vec<u64>>())
            .unwrap()
            .0
    };
    assert!(batch(1).equal(&batch(1)));
    assert!(!batch(1).equal(&batch(2)));
}

#[test]
fn a_directory_with_val_bin_uses_it_as_the_eval_split() {
    let dir = tempfile::tempdir().unwrap();
    let train: Vec<u16> = (0..41).collect(); // 10 windows of T = 4
    let val: Vec<u16> = (1000..1013).collect(); // 3 windows
    write_u16(&dir.path().join("train.bin"), &train);
    write_u16(&dir.path().join("val.bin"), &val);
    let ds = Dataset::open(&tokens_opts(dir.path().into(), 4, 2000, 0)).unwrap();
    assert_eq!(
        (ds.len(Split::Train), ds.len(Split::Eval)),
        (Some(10), Some(3))
    );
    let (x, y) = ds.samples(Split::Eval, &[0, 1, 2, 3]).unwrap();
    assert_eq!(
        rows(&x),
        vec![
            vec![1000, 1001, 1002, 1003],
            vec![1004, 1005, 1006, 1007],
            vec![1008, 1009, 1010, 1011],
            vec![1000, 1001, 1002, 1003],
        ]
    );
    assert_eq!(rows(&y)[2], vec![1009, 1010, 1011, 1012]);
    let (x, _) = ds
        .samples(Split::Train, &(0..10).collect::<Vec<u64>>())
        .unwrap();
    let mut starts: Vec<i64> = rows(&x).iter().map(|r| r[0]).collect();
    starts.sort_unstable();
    assert_eq!(
        starts,
        (0..10).map(|w| w * 4).collect::<Vec<i64>>(),
        "all of train.bin"
    );

    // Without val.bin the directory's train.bin is split.
    std::fs::remove_file(dir.path().join("val.bin")).unwrap();
    let ds = Dataset::open(&tokens_opts(dir.path().into(), 4, 2000, 0)).unwrap();
    assert_eq!(
        (ds.len(Split::Train), ds.len(Split::Eval)),
        (Some(9), Some(1))
    );
}

#[test]
fn text_sources_are_utf8_bytes_of_sorted_txt_files() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = ("héllo wörld, ".repeat(5), "zürich ✓ ".repeat(5));
    std::fs::write(dir.path().join("b.txt"), &b).unwrap();
    std::fs::write(dir.path().join("a.txt"), &a).unwrap();
    std::fs::write(dir.path().join("skip.md"), "\u{0}ignored").unwrap();
    let expected: Vec<i64> = format!("{a}{b}").bytes().map(i64::from).collect();
    let opts = |path: PathBuf| DataOptions {
        source: DataSource::Text {
            path,
            tokenizer: None,
        },
        seq_len: 10,
        vocab_size: 256,
        seed: 3,
        eval_fraction: 0.2,
    };
    let ds = Dataset::open(&opts(dir.path().into())).unwrap();
    let windows = (expected.len() as u64 - 1) / 10;
    let eval = (windows as f64 * 0.2) as u64;
    assert_eq!(ds.len(Split::Eval), Some(eval));
    assert_eq!(ds.len(Split::Train), Some(windows - eval));
    let n = ds.len(Split::Train).unwrap();
    let (x, y) = ds
        .samples(Split::Train, &(0..n).collect::<Vec<u64>>())
        .unwrap();
    let mut got: Vec<(Vec<i64>, Vec<i64>)> = rows(&x).into_iter().zip(rows(&y)).collect();
    got.sort();
    let mut want: Vec<(Vec<i64>, Vec<i64>)> = (0..n as usize)
        .map(|w| {
            (
                expected[w * 10..w * 10 + 10].to_vec(),
                expected[w * 10 + 1..w * 10 + 11].to_vec(),
            )
        })
        .collect();
    want.sort();
    assert_eq!(got, want);

    // One file works the same way, memory-mapped.
    let ds = Dataset::open(&opts(dir.path().join("a.txt"))).unwrap();
    let (x, _) = ds.samples(Split::Eval, &[0]).unwrap();
    let w = ds.len(Split::Train).unwrap() as usize;
    let a_bytes: Vec<i64> = a.bytes().map(i64::from).collect();
    assert_eq!(
        rows(&x)[0],
        a_bytes[w * 10..w * 10 + 10].to_vec(),
        "eval is the tail"
    );
}

#[test]
fn token_file_errors_name_the_file_the_problem_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.bin");
    let e = open_err(&tokens_opts(missing, 4, 256, 0));
    assert!(
        e.contains("data.path") && e.contains("nope.bin") && e.contains("not found"),
        "{e}"
    );

    let e = open_err(&tokens_opts(dir.path().into(), 4, 256, 0));
    assert!(e.contains("train.bin") && e.contains("not found"), "{e}");

    let odd = dir.path().join("odd.bin");
    std::fs::write(&odd, [1u8, 0, 2]).unwrap();
    let e = open_err(&tokens_opts(odd, 4, 256, 0));
    assert!(
        e.contains("odd.bin") && e.contains("3 bytes") && e.contains("uint16"),
        "{e}"
    );

    let short = dir.path().join("short.bin");
    write_u16(&short, &[1; 8]); // one window of T = 4 needs 5, two need 9
    let e = open_err(&tokens_opts(short.clone(), 4, 256, 0));
    assert!(
        e.contains("short.bin") && e.contains("8 tokens") && e.contains("at least 9"),
        "{e}"
    );
    let empty = dir.path().join("empty.bin");
    write_u16(&empty, &[]);
    let e = open_err(&tokens_opts(empty, 4, 256, 0));
    assert!(e.contains("empty.bin") && e.contains("0 tokens"), "{e}");

    let big = dir.path().join("gpt2.bin");
    let mut tokens = vec![5u16; 100];
    tokens[17] = 50_256;
    tokens[60] = 50_256;
    tokens[3] = 300;
    write_u16(&big, &tokens);
    let e = open_err(&tokens_opts(big.clone(), 4, 256, 0));
    let want = format!(
        "data.path {}: token 50256 at offset 17 >= model.vocab_size 256; raise \
         model.vocab_size to at least 50257",
        big.display()
    );
    assert_eq!(e, want);
    assert!(Dataset::open(&tokens_opts(big, 4, 50_257, 0)).is_ok());

    // A too-short val.bin is named as such.
    let d2 = tempfile::tempdir().unwrap();
    write_u16(&d2.path().join("train.bin"), &[1; 50]);
    write_u16(&d2.path().join("val.bin"), &[1; 3]);
    let e = open_err(&tokens_opts(d2.path().into(), 4, 256, 0));
    assert!(
        e.contains("val.bin") && e.contains("eval window") && e.contains("at least 5"),
        "{e}"
    );
}

#[test]
fn text_errors_name_the_file_the_key_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let opts = |path: PathBuf, vocab_size| DataOptions {
        source: DataSource::Text {
            path,
            tokenizer: None,
        },
        seq_len: 4,
        vocab_size,
        seed: 0,
        eval_fraction: 0.1,
    };
    let good = dir.path().join("good.txt");
    std::fs::write(&good, "plenty of text here").unwrap();
    let e = open_err(&opts(good, 100));
    assert!(
        e.contains("model.vocab_size 100") && e.contains("at least 256"),
        "{e}"
    );

    let bad = dir.path().join("bad.txt");
    let mut bytes = "ok text é".as_bytes().to_vec();
    let offset = bytes.len();
    bytes.extend([0xff, b'x']);
    std::fs::write(&bad, &bytes).unwrap();
    let e = open_err(&opts(bad.clone(), 256));
    assert!(e.contains("bad.txt") && e.contains("UTF-8"), "{e}");
    assert!(e.contains(&format!("byte offset {offset}")), "{e}");
    // In a directory, the bad file is named.
    let e = open_err(&opts(dir.path().into(), 256));
    assert!(
        e.contains("bad.txt") && e.contains(&format!("byte offset {offset}")),
        "{e}"
    );

    let empty_dir = tempfile::tempdir().unwrap();
    let e = open_err(&opts(empty_dir.path().into(), 256));
    assert!(
        e.contains("no *.txt files") && e.contains("data.path"),
        "{e}"
    );

    // A file of documents for zrun prepare is refused (its raw JSON would be trained on),
    // with the command that encodes it; the same text as .txt is read.
    let line = "{\"text\": \"plenty of text here\"}\n";
    for name in ["docs.jsonl", "docs.JSON.gz", "docs.parquet"] {
        let p = dir.path().join(name);
        std::fs::write(&p, line).unwrap();
        let e = open_err(&opts(p, 256));
        assert!(
            e.contains(name)
                && e.contains("zrun prepare")
                && e.contains("data.source = \"tokens\""),
            "{e}"
        );
    }
    let txt = dir.path().join("docs.txt");
    std::fs::write(&txt, line).unwrap();
    Dataset::open(&opts(txt, 256)).unwrap();
}

/// A token file with llm.c's header, written through the public writer.
fn write_headered(path: &Path, dtype: TokenDtype, tokens: &[u32]) {
    let mut w = TokenWriter::create(path, dtype).unwrap();
    w.write(tokens).unwrap();
    assert_eq!(w.finish().unwrap(), tokens.len() as u64);
}

#[test]
fn headered_files_of_either_dtype_read_as_their_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u16> = (0..4001).map(|i| (i * 7 % 1000) as u16).collect();
    let wide: Vec<u32> = tokens.iter().map(|&t| u32::from(t)).collect();
    let plain = dir.path().join("plain.bin");
    let u16_file = dir.path().join("u16.bin");
    let u32_file = dir.path().join("u32.bin");
    write_u16(&plain, &tokens);
    write_headered(&u16_file, TokenDtype::U16, &wide);
    write_headered(&u32_file, TokenDtype::U32, &wide);
    let batch = |path: &PathBuf, split| {
        let ds = Dataset::open(&tokens_opts(path.clone(), 16, 1000, 5)).unwrap();
        ds.samples(split, &(0..32).collect::<Vec<u64>>()).unwrap()
    };
    for split in [Split::Train, Split::Eval] {
        let (x, y) = batch(&plain, split);
        for file in [&u16_file, &u32_file] {
            let (x2, y2) = batch(file, split);
            assert!(x.equal(&x2) && y.equal(&y2), "{}", file.display());
        }
    }
    let summary = |path: &PathBuf| {
        Dataset::open(&tokens_opts(path.clone(), 16, 1000, 5))
            .unwrap()
            .summary()
    };
    assert!(summary(&plain).contains("(uint16, no header)"));
    assert!(summary(&u32_file).contains("(uint32, llm.c header)"));

    // uint32 ids above 65535 come back whole, and the vocabulary still bounds them.
    let big: Vec<u32> = (0..201).map(|i| 65_530 + i * 300).collect();
    let big_file = dir.path().join("big.bin");
    write_headered(&big_file, TokenDtype::U32, &big);
    let ds = Dataset::open(&tokens_opts(big_file.clone(), 4, 200_000, 0)).unwrap();
    let (x, _) = ds.samples(Split::Eval, &[0]).unwrap();
    let w = ds.len(Split::Train).unwrap() as usize;
    let want: Vec<i64> = big[w * 4..w * 4 + 4].iter().map(|&t| t.into()).collect();
    assert_eq!(rows(&x)[0], want);
    let e = open_err(&tokens_opts(big_file.clone(), 4, 100_000, 0));
    let want = format!(
        "data.path {}: token 125530 at offset 200 >= model.vocab_size 100000; raise \
         model.vocab_size to at least 125531",
        big_file.display()
    );
    assert_eq!(e, want);
}

#[test]
fn a_header_that_disagrees_with_the_file_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cut.bin");
    write_headered(&file, TokenDtype::U32, &[1; 100]);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 8]).unwrap();
    let e = open_err(&tokens_opts(file.clone(), 4, 256, 0));
    assert!(!e.contains('\n'), "{e}");
    assert!(
        e.starts_with(&format!("data.path {}: ", file.display()))
            && e.contains("header says 100 uint32 tokens")
            && e.contains("1424 bytes")
            && e.contains("file has 1416 bytes")
            && e.contains("zrun prepare"),
        "{e}"
    );
    let mut unknown = bytes.clone();
    unknown[4] = 9;
    std::fs::write(&file, &unknown).unwrap();
    let e = open_err(&tokens_opts(file, 4, 256, 0));
    assert!(e.contains("version 9"), "{e}");
}

/// A word-level tokenizer.json over `words` (ids in order), `[UNK]` next, then
/// `<|endoftext|>`.
fn word_tokenizer(dir: &Path, words: &[&str]) -> PathBuf {
    let mut vocab: Vec<String> = words
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{w:?}: {i}"))
        .collect();
    let (unk, eot) = (words.len(), words.len() + 1);
    vocab.push(format!("\"[UNK]\": {unk}"));
    vocab.push(format!("\"<|endoftext|>\": {eot}"));
    let json = format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "normalizer": null,
            "added_tokens": [{{"id": {eot}, "content": "<|endoftext|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}}],
            "pre_tokenizer": {{"type": "WhitespaceSplit"}}, "post_processor": null,
            "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "[UNK]"}}}}"#,
        vocab.join(", ")
    );
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    path
}

#[test]
fn text_encoded_by_a_tokenizer_is_its_documents_each_ended_by_eos() {
    let dir = tempfile::tempdir().unwrap();
    let tok = word_tokenizer(dir.path(), &["a", "b", "c"]);
    let texts = dir.path().join("texts");
    std::fs::create_dir(&texts).unwrap();
    std::fs::write(texts.join("1.txt"), "a b c ".repeat(10)).unwrap();
    std::fs::write(texts.join("2.txt"), "c c zz ".repeat(5)).unwrap();
    let opts = |vocab_size| DataOptions {
        source: DataSource::Text {
            path: texts.clone(),
            tokenizer: Some(tok.clone()),
        },
        seq_len: 4,
        vocab_size,
        seed: 0,
        eval_fraction: 0.2,
    };
    let mut want: Vec<i64> = [0, 1, 2].repeat(10);
    want.push(4);
    want.extend([2, 2, 3].repeat(5));
    want.push(4);
    let ds = Dataset::open(&opts(5)).unwrap();
    let windows = (want.len() as u64 - 1) / 4;
    let eval = ds.len(Split::Eval).unwrap();
    assert_eq!(ds.len(Split::Train).unwrap() + eval, windows);
    let (x, y) = ds
        .samples(Split::Eval, &(0..eval).collect::<Vec<u64>>())
        .unwrap();
    let first = (windows - eval) as usize;
    for (k, (xi, yi)) in rows(&x).iter().zip(rows(&y)).enumerate() {
        let w = (first + k) * 4;
        assert_eq!(xi, &want[w..w + 4]);
        assert_eq!(yi, want[w + 1..w + 5]);
    }
    assert!(ds.summary().contains("each ended by <|endoftext|> (id 4)"));

    // The tokenizer's 5 ids do not fit 4 embedding rows.
    let e = open_err(&opts(4));
    assert_eq!(
        e,
        format!(
            "data.tokenizer {}: its vocabulary has 5 tokens, more than model.vocab_size 4; \
             set model.vocab_size to at least 5 (--set model.vocab_size=5)",
            tok.display()
        )
    );
    std::fs::write(&tok, "not json").unwrap();
    let e = open_err(&opts(5));
    assert!(
        e.starts_with("data.tokenizer ") && e.contains("cannot load the tokenizer"),
        "{e}"
    );
}
