use super::super::index::INDEX_FILE;
use super::super::token_file::HEADER_BYTES;
use super::super::tokenizer::tests::word_level;
use super::*;

/// A token file's header version and tokens.
fn read(path: &Path) -> (i32, Vec<u32>) {
    let b = std::fs::read(path).unwrap();
    let version = i32::from_le_bytes(b[4..8].try_into().unwrap());
    let count = i32::from_le_bytes(b[8..12].try_into().unwrap()) as usize;
    let body = &b[HEADER_BYTES..];
    let ids: Vec<u32> = if version == 1 {
        body.chunks_exact(2)
            .map(|p| u32::from(u16::from_le_bytes([p[0], p[1]])))
            .collect()
    } else {
        body.chunks_exact(4)
            .map(|p| u32::from_le_bytes(p.try_into().unwrap()))
            .collect()
    };
    assert_eq!(ids.len(), count);
    (version, ids)
}

/// Every token of a split, shard after shard.
fn split(dir: &Path, shards: &[super::super::index::ShardRecord]) -> Vec<u32> {
    shards
        .iter()
        .flat_map(|s| read(&dir.join(&s.file)).1)
        .collect()
}

fn run(opts: &PrepareOptions) -> Result<Prepared, PrepareError> {
    prepare(opts, &mut |_| {}, &|| false).map(|p| p.expect("not asked to stop"))
}

#[test]
fn documents_split_into_train_and_val_shards() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&["a", "b", "c"], &["<|endoftext|>"])).unwrap();
    // Six documents, one per line; with F = 0.25 documents 3 (and 7, ...) go to val.
    let lines = ["a b c", "b", "c c x", "a a", "b c", "a"];
    let jsonl: String = lines
        .iter()
        .map(|l| format!("{{\"id\": 1, \"text\": \"{l}\"}}\n"))
        .collect();
    let input = dir.path().join("docs.jsonl");
    // A byte-order mark first and a blank line last are skipped.
    std::fs::write(&input, format!("\u{feff}{jsonl}\n")).unwrap();
    let out = dir.path().join("out");
    let mut opts = PrepareOptions::new(tok, vec![input], out.clone());
    opts.val_fraction = 0.25;
    opts.shard_tokens = 4;
    let p = run(&opts).unwrap();
    // a=0 b=1 c=2 [UNK]=3 <|endoftext|>=4
    let train = [0, 1, 2, 4, 1, 4, 2, 2, 3, 4, 1, 2, 4, 0, 4];
    assert_eq!(split(&out, &p.index.train), train);
    assert_eq!(split(&out, &p.index.val), [0, 0, 4]);
    let shards: Vec<_> = p
        .index
        .train
        .iter()
        .map(|s| (s.file.as_str(), s.tokens, s.documents))
        .collect();
    assert_eq!(
        shards,
        [
            ("train-00000.bin", 4, 1),
            ("train-00001.bin", 4, 2),
            ("train-00002.bin", 4, 1),
            ("train-00003.bin", 3, 1)
        ]
    );
    assert_eq!((p.documents, p.val_documents, p.skipped), (6, 1, 0));
    assert_eq!(p.index.eos.as_deref(), Some("<|endoftext|>"));
    assert_eq!(ShardIndex::read(&out).unwrap(), p.index);
    let names = |d: &Path| {
        let mut n: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    assert_eq!(names(&out).len(), 6, "{:?}", names(&out));

    // Again without val and in one shard: the old shards are replaced.
    opts.val_fraction = 0.0;
    opts.shard_tokens = 100;
    let p = run(&opts).unwrap();
    assert_eq!(p.index.train.len(), 1);
    assert!(p.index.val.is_empty());
    assert_eq!(names(&out), [INDEX_FILE, "train-00000.bin"]);
    assert_eq!(split(&out, &p.index.train).len(), 18);

    // --limit-docs: the first two documents; the index names the input they came from.
    let more = dir.path().join("more.jsonl");
    std::fs::write(&more, "{\"text\": \"c\"}\n").unwrap();
    opts.inputs.push(more);
    assert_eq!(run(&opts).unwrap().index.inputs.len(), 2);
    opts.limit_docs = Some(2);
    let p = run(&opts).unwrap();
    assert_eq!(split(&out, &p.index.train), [0, 1, 2, 4, 1, 4]);
    assert_eq!(p.index.inputs.len(), 1);

    opts.val_fraction = 0.9;
    let e = run(&opts).unwrap_err().to_string();
    assert!(
        e.contains("--val-fraction 0.9") && e.contains("[0, 0.5]"),
        "{e}"
    );
}

#[test]
fn long_documents_in_pieces_encode_as_a_whole() {
    let dir = tempfile::tempdir().unwrap();
    let words: Vec<String> = (0..50).map(|i| format!("w{i}")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&refs, &["<|endoftext|>"])).unwrap();
    let text: String = (0..400)
        .map(|i| format!("w{}{}", i % 53, if i % 7 == 6 { "\n" } else { " " }))
        .collect();
    let input = dir.path().join("book.txt");
    std::fs::write(&input, &text).unwrap();
    let mut opts = PrepareOptions::new(tok.clone(), vec![input], dir.path().join("out"));
    opts.val_fraction = 0.0;
    let whole = run(&opts).unwrap();
    let want = split(&opts.out_dir, &whole.index.train);
    assert_eq!(want.len(), 401);
    opts.piece_bytes = 100;
    let pieces = run(&opts).unwrap();
    assert_eq!(split(&opts.out_dir, &pieces.index.train), want);
    assert_eq!(pieces.documents, 1);
}

#[test]
fn a_large_vocabulary_writes_uint32() {
    let dir = tempfile::tempdir().unwrap();
    let words: Vec<String> = (0..70_000).map(|i| format!("w{i}")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&refs, &[])).unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "w0 w69999 w65536 w7").unwrap();
    let mut opts = PrepareOptions::new(tok, vec![text], dir.path().join("out"));
    opts.val_fraction = 0.0;
    let p = run(&opts).unwrap();
    assert_eq!((p.dtype, p.index.vocab_size), (TokenDtype::U32, 70_001));
    assert_eq!(p.index.dtype, "uint32");
    let (_, ids) = read(&opts.out_dir.join("train-00000.bin"));
    assert_eq!(ids, [0, 69_999, 65_536, 7]);
}

#[test]
fn bad_inputs_and_outputs_name_the_file_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&["a"], &[])).unwrap();
    let good = dir.path().join("good.txt");
    std::fs::write(&good, "a a a").unwrap();
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    let out = dir.path().join("out");
    let mut opts = PrepareOptions::new(tok, vec![good.clone(), latin1], out.clone());
    opts.shard_tokens = 1;
    let e = run(&opts).unwrap_err().to_string();
    assert!(
        e.starts_with("input ") && e.contains("latin1.txt") && e.contains("byte offset 3"),
        "{e}"
    );
    // A failed run leaves nothing behind, not even the directory it made.
    assert!(
        !out.exists(),
        "{:?}",
        std::fs::read_dir(&out).map(|d| d.count())
    );
    opts.inputs = vec![dir.path().join("missing.txt")];
    let e = run(&opts).unwrap_err().to_string();
    assert!(
        e.contains("missing.txt") && e.contains("cannot read"),
        "{e}"
    );
    // A directory with someone else's file is refused and kept as it is.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.md"), "mine").unwrap();
    opts.inputs = vec![good];
    let e = run(&opts).unwrap_err().to_string();
    assert!(e.contains("\"notes.md\"") && e.contains("-o"), "{e}");
    assert!(out.join("notes.md").exists());
    // The output "directory" is a file.
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    opts.out_dir = file.join("sub");
    let e = run(&opts).unwrap_err().to_string();
    assert!(e.contains("file/sub") && e.contains("-o"), "{e}");
}

/// A tokenizer without an unknown token drops what its vocabulary lacks: documents that lose
/// all their text are counted and placed, and when every document does, nothing is written.
#[test]
fn documents_the_tokenizer_cannot_encode_are_counted_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(
        &tok,
        r#"{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 2, "content": "<|endoftext|>", "single_word": false,
              "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "<|endoftext|>": 2},
                      "merges": [], "unk_token": null}}"#,
    )
    .unwrap();
    let docs = |name: &str, lines: &[&str]| {
        let path = dir.path().join(name);
        let text: String = lines
            .iter()
            .map(|l| format!("{{\"text\": \"{l}\"}}\n"))
            .collect();
        std::fs::write(&path, text).unwrap();
        path
    };
    let some = docs("some.jsonl", &["a b", "x y", "a", "yx"]);
    let mut opts = PrepareOptions::new(tok.clone(), vec![some], dir.path().join("some"));
    opts.val_fraction = 0.0;
    let p = run(&opts).unwrap();
    let (n, first) = p.textless.expect("counted");
    assert_eq!(n, 2);
    assert!(first.ends_with("some.jsonl:2"), "{first}");
    assert_eq!(
        split(&dir.path().join("some"), &p.index.train),
        [0, 1, 2, 2, 0, 2, 2]
    );
    // Every document lost: an error naming the tokenizer and the first one, no output.
    let none = docs("none.jsonl", &["x y", "z"]);
    let out = dir.path().join("none");
    let opts = PrepareOptions::new(tok, vec![none], out.clone());
    let e = run(&opts).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.json")
            && e.contains("every one of the 2 document(s)")
            && e.contains("none.jsonl:1"),
        "{e}"
    );
    // The directory this run created is gone with it.
    assert!(!out.exists());
}

/// A line past the longest one document may hold (here a small gzip that expands to one line
/// of 257 MiB) is refused naming the file and line, or skipped with `--skip-bad`, without
/// being held whole.
#[test]
fn a_line_longer_than_a_document_may_be_is_refused_or_skipped() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&["a", "b"], &["<|endoftext|>"])).unwrap();
    let input = dir.path().join("bomb.jsonl.gz");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&input).unwrap(),
        flate2::Compression::fast(),
    );
    gz.write_all(b"{\"text\": \"").unwrap();
    let chunk = vec![b'a'; 1 << 20];
    for _ in 0..(super::jsonl::MAX_LINE_BYTES >> 20) + 1 {
        gz.write_all(&chunk).unwrap();
    }
    gz.write_all(b"\"}\n{\"text\": \"a b\"}\n").unwrap();
    gz.finish().unwrap();
    let mut opts = PrepareOptions::new(tok, vec![input], dir.path().join("out"));
    opts.val_fraction = 0.0;
    let e = run(&opts).unwrap_err().to_string();
    assert!(
        e.contains("bomb.jsonl.gz:1:") && e.contains("longer than 256 MiB"),
        "{e}"
    );
    opts.skip_bad = true;
    let p = run(&opts).unwrap();
    assert_eq!((p.documents, p.skipped), (1, 1));
    assert_eq!(split(&dir.path().join("out"), &p.index.train), [0, 1, 3]);
}

#[test]
fn inputs_of_empty_documents_or_only_bad_records_are_no_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&["a"], &["<|endoftext|>"])).unwrap();
    let out = dir.path().join("out");
    // Empty and white-space documents: each would give only its end-of-text token.
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(
        &empty,
        "{\"text\": \"\"}\n{\"text\": \" \\n\"}\n".repeat(10),
    )
    .unwrap();
    let opts = PrepareOptions::new(tok.clone(), vec![empty], out.clone());
    let e = run(&opts).unwrap_err().to_string();
    assert!(
        e.contains("no text: of 20 document(s) read, none") && !e.contains("skipped"),
        "{e}"
    );
    assert!(!out.exists(), "nothing is left");
    // Only bad records, skipped: the count says why nothing is left.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": 5}\nnot json\n").unwrap();
    let mut opts = PrepareOptions::new(tok, vec![bad], out.clone());
    opts.skip_bad = true;
    let e = run(&opts).unwrap_err().to_string();
    assert!(
        e.contains("(2 bad record(s) were skipped, --skip-bad)"),
        "{e}"
    );
}

#[test]
fn what_an_input_directory_holds_besides_inputs_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&["a"], &["<|endoftext|>"])).unwrap();
    let corpus = dir.path().join("corpus");
    let other = dir.path().join("other");
    std::fs::create_dir_all(&corpus).unwrap();
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(corpus.join("a.jsonl"), "{\"text\": \"a a\"}\n").unwrap();
    std::fs::write(other.join("b.jsonl"), "{\"text\": \"a\"}\n").unwrap();
    // Read: a.jsonl. Not read: README.md, a linked directory, a FIFO; a hidden file is not
    // counted.
    std::fs::write(corpus.join("README.md"), "# corpus").unwrap();
    std::fs::write(corpus.join(".gitattributes"), "").unwrap();
    std::os::unix::fs::symlink(&other, corpus.join("linked")).unwrap();
    let fifo =
        std::ffi::CString::new(corpus.join("f.jsonl").as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let mut opts = PrepareOptions::new(tok, vec![corpus.clone()], dir.path().join("out"));
    opts.val_fraction = 0.0;
    let p = run(&opts).unwrap();
    assert_eq!(p.documents, 1);
    assert_eq!(p.unread, Some((3, corpus.join("README.md"))));
}

/// What training makes of `dir` as data.path: its train and eval tokens, or its error.
fn opened(dir: &Path) -> Result<Vec<u32>, String> {
    use crate::data::{DataOptions, DataSource, Dataset, Split};
    let opts = DataOptions {
        source: DataSource::Tokens {
            path: dir.to_path_buf(),
            tokenizer: None,
        },
        seq_len: 1,
        vocab_size: 8,
        seed: 0,
        eval_fraction: 0.25,
    };
    let ds = Dataset::open(&opts).map_err(|e| e.to_string())?;
    let mut tokens = Vec::new();
    for split in [Split::Train, Split::Eval] {
        let n = ds.len(split).ok_or("no such split")?;
        let (x, _) = ds
            .samples(split, &(0..n).collect::<Vec<u64>>())
            .map_err(|e| e.to_string())?;
        tokens.extend(Vec::<i64>::try_from(x.flatten(0, -1)).unwrap());
    }
    Ok(tokens.into_iter().map(|t| t as u32).collect())
}

#[test]
fn a_commit_killed_at_any_step_leaves_one_whole_output_or_a_refused_one() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&["a", "b"], &[])).unwrap();
    let prepared = |name: &str, text: &str| {
        let input = dir.path().join(format!("{name}.txt"));
        std::fs::write(&input, text).unwrap();
        let mut opts = PrepareOptions::new(tok.clone(), vec![input], dir.path().join(name));
        opts.val_fraction = 0.0;
        opts.shard_tokens = 4;
        run(&opts).unwrap().index
    };
    // The previous output, three shards of a (0), and this run's, two shards of b (1).
    prepared("old", &"a ".repeat(12));
    let new = prepared("new", &"b ".repeat(8));
    let (old_tokens, new_tokens) = (
        opened(&dir.path().join("old")),
        opened(&dir.path().join("new")),
    );
    assert!(old_tokens.as_ref().is_ok_and(|t| t.iter().all(|&t| t == 0)));
    assert!(new_tokens.as_ref().is_ok_and(|t| t.iter().all(|&t| t == 1)));
    let old_index = std::fs::read(dir.path().join("old").join(INDEX_FILE)).unwrap();
    // Over a shard directory and over the older layout (train.bin alone).
    for older in [false, true] {
        for k in 0.. {
            let d = dir.path().join(format!("case-{older}-{k}"));
            std::fs::create_dir(&d).unwrap();
            if older {
                let from = dir.path().join("old/train-00000.bin");
                std::fs::copy(from, d.join("train.bin")).unwrap();
            } else {
                for e in std::fs::read_dir(dir.path().join("old")).unwrap() {
                    let e = e.unwrap();
                    std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
                }
            }
            let before = opened(&d);
            let mut out = OutDir::open(&d).unwrap();
            for s in &new.train {
                let from = dir.path().join("new").join(&s.file);
                std::fs::copy(from, d.join(writer::tmp_name(&s.file))).unwrap();
            }
            let staged = new.write_staged(&d).unwrap();
            let steps = out.steps(&new, &staged);
            if k > steps.len() {
                break;
            }
            // Killed after k steps.
            for s in &steps[..k] {
                s.run().unwrap();
            }
            let at = format!("older {older}, killed after {k} of {} steps", steps.len());
            let index = std::fs::read(d.join(INDEX_FILE)).ok();
            match opened(&d) {
                Ok(tokens) if tokens == new_tokens.clone().unwrap() => {}
                Ok(tokens) => {
                    assert_eq!(Ok(tokens), before, "{at}: the previous output");
                    assert!(index.is_none() || index == Some(old_index.clone()), "{at}");
                }
                Err(e) => {
                    assert!(!older, "{at}: the older layout stays readable: {e}");
                    assert!(e.contains("prepare it again"), "{at}: {e}");
                }
            }
            // The index is never gone; a previous output stays readable until the new one is.
            assert!(older || index.is_some(), "{at}: no index.json");
            if k == 0 || older && index.is_none() {
                assert_eq!(opened(&d), before, "{at}");
            }
            if k == steps.len() {
                assert_eq!(opened(&d), new_tokens, "{at}");
                let mut names: Vec<String> = std::fs::read_dir(&d)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect();
                names.sort();
                assert_eq!(names, [INDEX_FILE, "train-00000.bin", "train-00001.bin"]);
            }
        }
    }
}

#[test]
fn a_run_asked_to_stop_leaves_the_directory_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, word_level(&["a"], &[])).unwrap();
    let input = dir.path().join("a.txt");
    std::fs::write(&input, "a ".repeat(64)).unwrap();
    let out = dir.path().join("out");
    let mut opts = PrepareOptions::new(tok, vec![input], out.clone());
    opts.val_fraction = 0.0;
    opts.shard_tokens = 4;
    opts.piece_bytes = 16;
    // Asked after the first batch, or only before the output is put in place.
    let asked = std::cell::Cell::new(0);
    for stop_at in [1, 2] {
        asked.set(0);
        let stop = || {
            asked.set(asked.get() + 1);
            asked.get() >= stop_at
        };
        let p = prepare(&opts, &mut |_| {}, &stop).unwrap();
        assert!(p.is_none());
        assert!(!out.exists(), "the directory this run made is removed");
    }
    // Over a previous output: that output as it was, file for file.
    run(&opts).unwrap();
    let files = || {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let before = files();
    opts.shard_tokens = 8;
    let p = prepare(&opts, &mut |_| {}, &|| true).unwrap();
    assert!(p.is_none());
    assert_eq!(files(), before);
}
