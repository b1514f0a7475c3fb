//! Token and text sources on real files: epoch coverage, splits, seeding, targets and the
//! error messages users see.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use zrun_train::data::{Cursor, DataOptions, DataSource, Dataset, Loader, Split};

fn write_u16(path: &Path, tokens: &[u16]) {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

fn tokens_opts(path: PathBuf, seq_len: usize, vocab_size: usize, seed: u64) -> DataOptions {
    DataOptions {
        source: DataSource::Tokens { path },
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
        source: DataSource::Text { path },
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
        source: DataSource::Text { path },
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
}
