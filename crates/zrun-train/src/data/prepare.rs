//! `zrun prepare`: text files encoded by a tokenizer into `train.bin` and `val.bin`.
//!
//! Each input file is one document (separated as `tokenizer` describes), encoded in the
//! order given. The tokens stream into `train.bin.tmp` as they are encoded; the last
//! `val_fraction` of them (rounded) then move to `val.bin`, so memory stays near one batch of
//! documents whatever the corpus size. Both files carry llm.c's header with the dtype:
//! uint16 when the vocabulary has at most 65536 tokens, uint32 otherwise. Each file appears
//! under its final name only once complete (a rename); a failed run leaves no `.tmp` files.
//! A document is encoded whole, and the tokenizer holds a few hundred bytes per token of it
//! while it works (about 600 MB for a 3.5 MB file), so a large corpus is best given as many
//! files.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::token_file::{header, write_error, TokenDtype, TokenWriter, HEADER_BYTES};
use super::tokenizer::{Eos, Tokenizer};
use super::DataError;

/// What `zrun prepare` is asked to do.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// The Hugging Face `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// UTF-8 text files, one document each, in this order.
    pub inputs: Vec<PathBuf>,
    /// The output directory (created if missing).
    pub out_dir: PathBuf,
    /// Share of the tokens (the last ones) written to `val.bin`, in [0, 0.5]; 0 writes no
    /// `val.bin` (and removes an old one), and training then holds out `data.eval_fraction`.
    pub val_fraction: f64,
    /// The token appended after every document.
    pub eos: Eos,
}

/// What `zrun prepare` wrote.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// `DIR/train.bin`.
    pub train_path: PathBuf,
    /// Tokens in it.
    pub train_tokens: u64,
    /// `DIR/val.bin`, when written.
    pub val_path: Option<PathBuf>,
    /// Tokens in it.
    pub val_tokens: u64,
    /// Element type of both files.
    pub dtype: TokenDtype,
    /// The tokenizer's largest id + 1.
    pub vocab_size: usize,
    /// Documents (input files) encoded.
    pub documents: usize,
    /// How documents are separated, in words.
    pub separator: String,
}

/// Encodes `opts.inputs` and writes `train.bin` and `val.bin` into `opts.out_dir`.
pub fn prepare(opts: &PrepareOptions) -> Result<Prepared, DataError> {
    if !(0.0..=0.5).contains(&opts.val_fraction) {
        return Err(DataError::Invalid {
            key: "--val-fraction",
            value: opts.val_fraction.to_string(),
            requirement: "the share of tokens for val.bin must be in [0, 0.5], e.g. 0.05",
        });
    }
    let mut tok = Tokenizer::load(&opts.tokenizer, "--tokenizer")?;
    tok.set_eos(&opts.eos, "--eos")?;
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let dir = &opts.out_dir;
    std::fs::create_dir_all(dir).map_err(write_error(dir, "create directory"))?;
    let train_path = dir.join("train.bin");
    let val_path = dir.join("val.bin");
    let train_tmp = dir.join("train.bin.tmp");
    let val_tmp = dir.join("val.bin.tmp");
    let written = (|| -> Result<(u64, u64), DataError> {
        let mut writer = TokenWriter::create(&train_tmp, dtype)?;
        tok.encode_files(&opts.inputs, "input", |ids| writer.write(ids))?;
        let total = writer.finish()?;
        let val_tokens = (total as f64 * opts.val_fraction).round() as u64;
        if val_tokens > 0 {
            move_tail(&train_tmp, &val_tmp, dtype, total, val_tokens)?;
        }
        Ok((total, val_tokens))
    })();
    let (total, val_tokens) = written.inspect_err(|_| {
        let _ = std::fs::remove_file(&train_tmp);
        let _ = std::fs::remove_file(&val_tmp);
    })?;
    let val = if val_tokens > 0 {
        rename(&val_tmp, &val_path)?;
        Some(val_path)
    } else {
        // A val.bin left from an earlier run would become this data's eval split.
        match std::fs::remove_file(&val_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(write_error(&val_path, "remove the old")(e));
            }
            _ => None,
        }
    };
    rename(&train_tmp, &train_path)?;
    Ok(Prepared {
        train_path,
        train_tokens: total - val_tokens,
        val_path: val,
        val_tokens,
        dtype,
        vocab_size: tok.vocab_size(),
        documents: opts.inputs.len(),
        separator: tok.separator(),
    })
}

/// Moves the last `tail` of the `total` tokens of the token file `from` into a new token file
/// `to`, shortening `from` and rewriting both headers.
fn move_tail(
    from: &Path,
    to: &Path,
    dtype: TokenDtype,
    total: u64,
    tail: u64,
) -> Result<(), DataError> {
    let keep = total - tail;
    let w = dtype.bytes() as u64;
    let cut = HEADER_BYTES as u64 + keep * w;
    let mut src = OpenOptions::new()
        .read(true)
        .write(true)
        .open(from)
        .map_err(write_error(from, "open"))?;
    let mut dst = File::create(to).map_err(write_error(to, "create"))?;
    let tail_header = header(dtype, tail).expect("the tail is part of a counted file");
    dst.write_all(&tail_header)
        .and_then(|()| src.seek(SeekFrom::Start(cut)).map(drop))
        .and_then(|()| std::io::copy(&mut (&mut src).take(tail * w), &mut dst))
        .and_then(|_| dst.sync_all())
        .map_err(write_error(to, "write"))?;
    let keep_header = header(dtype, keep).expect("fewer tokens than a counted file");
    src.set_len(cut)
        .and_then(|()| src.seek(SeekFrom::Start(0)).map(drop))
        .and_then(|()| src.write_all(&keep_header))
        .and_then(|()| src.sync_all())
        .map_err(write_error(from, "write"))
}

fn rename(from: &Path, to: &Path) -> Result<(), DataError> {
    std::fs::rename(from, to).map_err(write_error(to, "rename into place"))
}

#[cfg(test)]
mod tests {
    use super::super::tokenizer::tests::word_level;
    use super::*;

    fn read(path: &Path) -> (i32, Vec<u32>) {
        let b = std::fs::read(path).unwrap();
        let version = i32::from_le_bytes(b[4..8].try_into().unwrap());
        let count = i32::from_le_bytes(b[8..12].try_into().unwrap()) as usize;
        let body = &b[HEADER_BYTES..];
        let ids: Vec<u32> = match version {
            1 => body
                .chunks_exact(2)
                .map(|p| u32::from(u16::from_le_bytes([p[0], p[1]])))
                .collect(),
            _ => body
                .chunks_exact(4)
                .map(|p| u32::from_le_bytes(p.try_into().unwrap()))
                .collect(),
        };
        assert_eq!(ids.len(), count);
        (version, ids)
    }

    #[test]
    fn documents_split_into_train_and_val() {
        let dir = tempfile::tempdir().unwrap();
        let tok = dir.path().join("tokenizer.json");
        std::fs::write(&tok, word_level(&["a", "b", "c"], &["<|endoftext|>"])).unwrap();
        let a = dir.path().join("a.txt");
        let b = dir.path().join("b.txt");
        std::fs::write(&a, "a b c a b c a b").unwrap();
        std::fs::write(&b, "c c x").unwrap();
        let out = dir.path().join("out");
        let mut opts = PrepareOptions {
            tokenizer: tok,
            inputs: vec![a, b],
            out_dir: out.clone(),
            val_fraction: 0.25,
            eos: Eos::Auto,
        };
        let p = prepare(&opts).unwrap();
        // a.txt: 8 words + EOS, b.txt: 3 words (x unknown) + EOS = 13 tokens; 3 to val.
        let all = [0, 1, 2, 0, 1, 2, 0, 1, 4, 2, 2, 3, 4];
        assert_eq!((p.train_tokens, p.val_tokens, p.documents), (10, 3, 2));
        assert_eq!((p.dtype, p.vocab_size), (TokenDtype::U16, 5));
        assert_eq!(read(&out.join("train.bin")), (1, all[..10].to_vec()));
        assert_eq!(read(&out.join("val.bin")), (1, all[10..].to_vec()));
        assert!(!out.join("train.bin.tmp").exists() && !out.join("val.bin.tmp").exists());

        // No val share: one file of everything, and the old val.bin is gone.
        opts.val_fraction = 0.0;
        let p = prepare(&opts).unwrap();
        assert_eq!((p.train_tokens, p.val_tokens), (13, 0));
        assert_eq!(read(&out.join("train.bin")).1, all);
        assert!(p.val_path.is_none() && !out.join("val.bin").exists());

        opts.val_fraction = 0.9;
        let e = prepare(&opts).unwrap_err().to_string();
        assert!(
            e.contains("--val-fraction = 0.9") && e.contains("[0, 0.5]"),
            "{e}"
        );
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
        let p = prepare(&PrepareOptions {
            tokenizer: tok,
            inputs: vec![text],
            out_dir: dir.path().join("out"),
            val_fraction: 0.0,
            eos: Eos::Auto,
        })
        .unwrap();
        assert_eq!((p.dtype, p.vocab_size), (TokenDtype::U32, 70_001));
        assert_eq!(read(&p.train_path), (2, vec![0, 69_999, 65_536, 7]));
    }

    #[test]
    fn bad_inputs_and_outputs_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let tok = dir.path().join("tokenizer.json");
        std::fs::write(&tok, word_level(&["a"], &[])).unwrap();
        let latin1 = dir.path().join("latin1.txt");
        std::fs::write(&latin1, b"caf\xe9").unwrap();
        let mut opts = PrepareOptions {
            tokenizer: tok,
            inputs: vec![latin1],
            out_dir: dir.path().join("out"),
            val_fraction: 0.0,
            eos: Eos::Auto,
        };
        let e = prepare(&opts).unwrap_err().to_string();
        assert!(
            e.starts_with("input ") && e.contains("latin1.txt") && e.contains("byte offset 3"),
            "{e}"
        );
        opts.inputs = vec![dir.path().join("missing.txt")];
        let e = prepare(&opts).unwrap_err().to_string();
        assert!(
            e.contains("missing.txt") && e.contains("cannot read"),
            "{e}"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path().join("out")).unwrap().collect();
        assert!(left.is_empty(), "a failed run leaves nothing behind");
        // The output "directory" is a file.
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        opts.out_dir = file.join("sub");
        let e = prepare(&opts).unwrap_err().to_string();
        assert!(e.contains("file/sub") && e.contains("-o"), "{e}");
    }
}
