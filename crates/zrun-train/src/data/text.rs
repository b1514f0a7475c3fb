//! UTF-8 text: one file (memory-mapped) or a directory of `*.txt` files, sorted by name and
//! concatenated, as byte-level tokens 0..=255; or, with `data.tokenizer`, encoded at open by
//! a Hugging Face tokenizer, each file a document (see `tokenizer`).

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::corpus::{Corpus, TokenStore};
use super::prepare::Format;
use super::tokenizer::Tokenizer;
use super::{DataError, DataOptions};

/// Opens a text file or a directory of `*.txt` files, encoded by `tokenizer` when given;
/// the last `eval_fraction` of windows are the eval split.
pub(crate) fn open(
    path: &Path,
    tokenizer: Option<&Path>,
    opts: &DataOptions,
) -> Result<Corpus, DataError> {
    if let Some(kind) = documents_kind(path) {
        return Err(DataError::TextOfDocuments {
            path: path.to_path_buf(),
            kind,
        });
    }
    if let Some(tokenizer) = tokenizer {
        return open_encoded(path, tokenizer, opts);
    }
    if opts.vocab_size < 256 {
        return Err(DataError::TextVocab {
            vocab_size: opts.vocab_size,
        });
    }
    present(path)?;
    let label = format!("text {}", path.display());
    let store = if path.is_dir() {
        let files = txt_files(path)?;
        let mut bytes = Vec::new();
        for file in &files {
            let start = bytes.len();
            let mut f = super::open_regular(file).map_err(io(file, "open"))?;
            std::io::Read::read_to_end(&mut f, &mut bytes).map_err(io(file, "read"))?;
            check_utf8(file, &bytes[start..])?;
        }
        TokenStore::OwnedBytes(bytes)
    } else {
        let file = super::open_regular(path).map_err(io(path, "open"))?;
        // SAFETY: the map is read-only and the file is not written while training reads it
        // (corpora are prepared before the job); a concurrent truncation would be a misuse
        // of the data directory that no reader can guard against.
        let map = unsafe { Mmap::map(&file) }.map_err(io(path, "memory-map"))?;
        check_utf8(path, &map)?;
        TokenStore::Bytes(map)
    };
    Corpus::with_held_out(
        label,
        store,
        path,
        opts.seq_len,
        opts.seed,
        opts.eval_fraction,
    )
}

/// What a file named like `zrun prepare`'s document inputs holds (JSON Lines or Parquet, by
/// prepare's own reading of the name); `None` for text.
fn documents_kind(path: &Path) -> Option<&'static str> {
    match super::prepare::format_of(path) {
        Ok(Format::JsonLines(_)) => Some("JSON Lines"),
        Ok(Format::Parquet) => Some("Parquet"),
        Ok(Format::Text) | Err(_) => None,
    }
}

/// Refuses a `data.path` of text that does not exist.
pub(crate) fn present(path: &Path) -> Result<(), DataError> {
    if path.exists() {
        return Ok(());
    }
    Err(DataError::NotFound {
        path: path.to_path_buf(),
        expected: "a UTF-8 text file, or a directory of *.txt files",
    })
}

/// Opens text encoded by the tokenizer at `tokenizer`, whose vocabulary must fit
/// `model.vocab_size`.
fn open_encoded(path: &Path, tokenizer: &Path, opts: &DataOptions) -> Result<Corpus, DataError> {
    let tok = Tokenizer::load(tokenizer, "data.tokenizer")?;
    tok.fits(opts.vocab_size)?;
    present(path)?;
    let files = if path.is_dir() {
        txt_files(path)?
    } else {
        vec![path.to_path_buf()]
    };
    let mut ids = Vec::new();
    tok.encode_files(&files, "data.path", |batch| {
        ids.extend_from_slice(batch);
        Ok(())
    })?;
    let label = format!(
        "text {} encoded by {} (vocabulary {}; {} document(s), {})",
        path.display(),
        tokenizer.display(),
        tok.vocab_size(),
        files.len(),
        tok.separator()
    );
    Corpus::with_held_out(
        label,
        TokenStore::Ids(ids),
        path,
        opts.seq_len,
        opts.seed,
        opts.eval_fraction,
    )
}

/// The directory's `*.txt` files, sorted by name.
fn txt_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir, "list directory"))? {
        let p = entry.map_err(io(dir, "list directory"))?.path();
        if p.is_file() && p.extension().is_some_and(|e| e == "txt") {
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(DataError::NoTextFiles {
            path: dir.to_path_buf(),
        });
    }
    files.sort();
    Ok(files)
}

fn check_utf8(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    std::str::from_utf8(bytes)
        .map(|_| ())
        .map_err(|e| DataError::InvalidUtf8 {
            key: "data.path",
            path: path.to_path_buf(),
            offset: e.valid_up_to() as u64,
        })
}

fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> DataError + 'a {
    move |source| DataError::Io {
        key: "data.path",
        path: path.to_path_buf(),
        op,
        source,
    }
}
