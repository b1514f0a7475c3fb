//! UTF-8 text as byte-level tokens 0..=255: one file (memory-mapped) or a directory of
//! `*.txt` files, sorted by name and concatenated.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::corpus::{Corpus, TokenStore};
use super::{DataError, DataOptions};

/// Opens a text file or a directory of `*.txt` files; the last `eval_fraction` of windows
/// are the eval split.
pub(crate) fn open(path: &Path, opts: &DataOptions) -> Result<Corpus, DataError> {
    if opts.vocab_size < 256 {
        return Err(DataError::TextVocab {
            vocab_size: opts.vocab_size,
        });
    }
    if !path.exists() {
        return Err(DataError::NotFound {
            path: path.to_path_buf(),
            expected: "a UTF-8 text file, or a directory of *.txt files",
        });
    }
    let label = format!("text {}", path.display());
    let store = if path.is_dir() {
        let files = txt_files(path)?;
        let mut bytes = Vec::new();
        for file in &files {
            let start = bytes.len();
            let mut f = File::open(file).map_err(io(file, "open"))?;
            std::io::Read::read_to_end(&mut f, &mut bytes).map_err(io(file, "read"))?;
            check_utf8(file, &bytes[start..])?;
        }
        TokenStore::OwnedBytes(bytes)
    } else {
        let file = File::open(path).map_err(io(path, "open"))?;
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
            path: path.to_path_buf(),
            offset: e.valid_up_to() as u64,
        })
}

fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> DataError + 'a {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}
