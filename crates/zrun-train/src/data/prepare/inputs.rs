//! The inputs of `zrun prepare`: which files (directories expanded), in which format, and
//! plain text read piece by piece.
//!
//! Formats come from the file name: `.jsonl`, `.ndjson` and `.json` (JSON Lines, one object
//! per line) optionally followed by `.gz` or `.zst`; `.parquet`; anything else is UTF-8
//! text, one document per file. A directory stands for its files with those endings
//! (`.txt` for text) found recursively (not through linked directories), sorted by path. A text file whose first bytes are a
//! compressed or Parquet file's signature is refused rather than read as text.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::super::DataError;
use super::batches::{Halt, Origin, Sink};
use super::error::PrepareError;

/// How a JSON Lines file is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compression {
    /// Not at all.
    None,
    /// gzip (`.gz`), one or more members.
    Gzip,
    /// Zstandard (`.zst`).
    Zstd,
}

/// An input file's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// UTF-8 text, the whole file one document.
    Text,
    /// One JSON object per line.
    JsonLines(Compression),
    /// A Parquet file.
    Parquet,
}

/// One input file.
#[derive(Clone, Debug)]
pub(super) struct Input {
    /// The file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// How to read it.
    pub format: Format,
}

/// Compressions that zrun does not read: (ending, name, the command that turns the file into
/// one it reads).
const UNREAD: [(&str, &str, &str); 4] = [
    (".bz2", "bzip2", "bunzip2 -k"),
    (".xz", "xz", "unxz -k"),
    (".lz4", "lz4", "lz4 -d"),
    (".zip", "zip", "unzip"),
];

/// The format named by a file's name; an error for a compression zrun does not read.
pub(crate) fn format_of(path: &Path) -> Result<Format, String> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let (stem, compression) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = name.strip_suffix(".zst").or(name.strip_suffix(".zstd")) {
        (s, Compression::Zstd)
    } else {
        (name.as_str(), Compression::None)
    };
    let json = [".jsonl", ".ndjson", ".json"]
        .iter()
        .any(|e| stem.ends_with(e));
    if json {
        return Ok(Format::JsonLines(compression));
    }
    if compression != Compression::None {
        return Err(format!(
            "a compressed file that is not JSON Lines; zrun reads .jsonl.gz and .jsonl.zst, \
             and text uncompressed: decompress it ({}) or name it .jsonl.* if it holds JSON \
             Lines",
            if compression == Compression::Gzip {
                "gunzip -k"
            } else {
                "unzstd"
            }
        ));
    }
    if stem.ends_with(".parquet") {
        return Ok(Format::Parquet);
    }
    for (ending, what, command) in UNREAD {
        if stem.ends_with(ending) {
            return Err(format!(
                "{what} compression is not read; decompress it ({command}), or recompress \
                 it with gzip or zstd"
            ));
        }
    }
    Ok(Format::Text)
}

/// Whether a file found in an input directory is an input: JSON Lines, Parquet or `.txt`.
fn listed(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'));
    let txt = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("txt"));
    !hidden && (txt || matches!(format_of(path), Ok(Format::JsonLines(_) | Format::Parquet)))
}

/// Entries of input directories that are not read: files of other kinds (not hidden ones),
/// linked directories (not followed), FIFOs and devices.
#[derive(Debug, Default)]
pub(super) struct Unread {
    /// How many.
    pub count: u64,
    /// The first found.
    pub first: Option<PathBuf>,
}

/// The input files, directories expanded (recursively, sorted by path), in order, and what
/// the directories hold besides.
pub(super) fn expand(paths: &[PathBuf]) -> Result<(Vec<Input>, Unread), PrepareError> {
    let mut out = Vec::new();
    let mut unread = Unread::default();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|e| PrepareError::Input {
            path: path.clone(),
            problem: format!("cannot read: {e}; check the path"),
        })?;
        if meta.is_dir() {
            let mut files = Vec::new();
            walk(path, &mut files, &mut unread)?;
            files.sort();
            if files.is_empty() {
                return Err(PrepareError::Input {
                    path: path.clone(),
                    problem: "the directory holds no .jsonl, .json, .ndjson (optionally .gz \
                              or .zst), .parquet or .txt file; name the files themselves"
                        .into(),
                });
            }
            for f in files {
                out.push(input(f)?);
            }
        } else {
            out.push(input(path.clone())?);
        }
    }
    Ok((out, unread))
}

fn input(path: PathBuf) -> Result<Input, PrepareError> {
    let bad = |problem: String| PrepareError::Input {
        path: path.clone(),
        problem,
    };
    let format = format_of(&path).map_err(bad)?;
    let bytes = std::fs::metadata(&path)
        .map_err(|e| bad(format!("cannot read: {e}; check the path")))?
        .len();
    Ok(Input {
        path,
        bytes,
        format,
    })
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>, unread: &mut Unread) -> Result<(), PrepareError> {
    let list_error = |e: std::io::Error| PrepareError::Input {
        path: dir.to_path_buf(),
        problem: format!("cannot list the directory: {e}"),
    };
    for entry in std::fs::read_dir(dir).map_err(list_error)? {
        let entry = entry.map_err(list_error)?;
        let path = entry.path();
        // Linked directories are not followed (a link to a parent would never end); linked
        // files are read.
        if entry.file_type().map_err(list_error)?.is_dir() {
            walk(&path, files, unread)?;
        } else if path.is_file() && listed(&path) {
            files.push(path);
        } else if !entry.file_name().to_string_lossy().starts_with('.') {
            unread.count += 1;
            if unread.first.as_ref().is_none_or(|f| &path < f) {
                unread.first = Some(path);
            }
        }
    }
    Ok(())
}

/// A reader that adds the bytes it reads to a shared count (the progress line's MB/s).
pub(super) struct Counted<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R> Counted<R> {
    pub(super) fn new(inner: R, count: Arc<AtomicU64>) -> Counted<R> {
        Counted { inner, count }
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// File signatures that mean a file named as text is not text.
const SIGNATURES: [(&[u8], &str); 5] = [
    (
        &[0x1f, 0x8b],
        "gzip-compressed: name it .jsonl.gz if it holds JSON Lines, or gunzip it",
    ),
    (
        &[0x28, 0xb5, 0x2f, 0xfd],
        "zstd-compressed: name it .jsonl.zst if it holds JSON Lines, or unzstd it",
    ),
    (b"PAR1", "a Parquet file: name it .parquet"),
    (b"BZh", "bzip2-compressed: bunzip2 it"),
    (&[0xfd, b'7', b'z', b'X', b'Z', 0], "xz-compressed: unxz it"),
];

/// Reads a text file as one document, in pieces of at most `piece_bytes` cut by [`cut`]
/// (one piece when the file is no larger).
pub(super) fn read_text(
    input: &Input,
    index: u32,
    count: &Arc<AtomicU64>,
    sink: &mut Sink,
) -> Result<(), Halt> {
    let path = &input.path;
    let io = |source| DataError::Io {
        key: "input",
        path: path.clone(),
        op: "read",
        source,
    };
    let mut file = Counted::new(crate::data::open_regular(path).map_err(io)?, count.clone());
    let limit = sink.piece_bytes();
    let mut buf: Vec<u8> = Vec::new();
    let (mut offset, mut first, mut eof) = (0u64, true, false);
    loop {
        while !eof && buf.len() <= limit {
            let want = (limit + 1 - buf.len()) as u64;
            let n = (&mut file).take(want).read_to_end(&mut buf).map_err(io)?;
            eof = n == 0;
        }
        if first {
            if let Some((_, what)) = SIGNATURES.iter().find(|(s, _)| buf.starts_with(s)) {
                return Err(PrepareError::Input {
                    path: path.clone(),
                    problem: format!("read as text by its name, but it is {what}"),
                }
                .into());
            }
        }
        let last = buf.len() <= limit;
        let end = if last { buf.len() } else { cut(&buf, limit) };
        let text = std::str::from_utf8(&buf[..end]).map_err(|e| DataError::InvalidUtf8 {
            key: "input",
            path: path.clone(),
            offset: offset + e.valid_up_to() as u64,
        })?;
        let origin = Origin::Bytes(offset, offset + end as u64);
        sink.piece(index, origin, text.to_owned(), first, last)?;
        if last {
            return Ok(());
        }
        buf.drain(..end);
        offset += end as u64;
        first = false;
    }
}

fn space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

/// Where to end a piece of at most `limit` bytes of `text` (UTF-8, longer than `limit`):
/// after the last line break that stands alone between two other characters (`x\ny`), where
/// the pre-tokenizers of GPT-2 and Llama 3 split anyway, so the pieces encode as the whole
/// would; else after the last line break, else after the last space or tab, else at the last
/// character boundary.
pub(crate) fn cut(text: &[u8], limit: usize) -> usize {
    let head = &text[..limit];
    let alone = (2..=limit)
        .rev()
        .find(|&p| head[p - 1] == b'\n' && !space(head[p - 2]) && !space(text[p]));
    let line = || head.iter().rposition(|&b| b == b'\n').map(|i| i + 1);
    let blank = || {
        head.iter()
            .rposition(|&b| b == b' ' || b == b'\t')
            .map(|i| i + 1)
    };
    let boundary = || (1..=limit).rev().find(|&p| text[p] & 0xc0 != 0x80);
    alone
        .or_else(line)
        .or_else(blank)
        .or_else(boundary)
        .unwrap_or(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_follow_the_name() {
        let f = |n: &str| format_of(Path::new(n));
        assert_eq!(f("a.jsonl"), Ok(Format::JsonLines(Compression::None)));
        assert_eq!(f("d/A.JSONL.GZ"), Ok(Format::JsonLines(Compression::Gzip)));
        assert_eq!(f("a.json.zst"), Ok(Format::JsonLines(Compression::Zstd)));
        assert_eq!(f("a.ndjson"), Ok(Format::JsonLines(Compression::None)));
        assert_eq!(f("train-00000-of-00042.parquet"), Ok(Format::Parquet));
        assert_eq!(f("book.txt"), Ok(Format::Text));
        assert_eq!(f("README"), Ok(Format::Text));
        assert!(f("a.jsonl.bz2").unwrap_err().contains("bunzip2"));
        assert!(f("a.txt.gz").unwrap_err().contains("gunzip"));
        assert!(listed(Path::new("x/a.txt")) && listed(Path::new("x/b.parquet")));
        assert!(!listed(Path::new("x/README.md")) && !listed(Path::new("x/.a.jsonl")));
    }

    #[test]
    fn directories_are_listed_sorted_without_following_linked_directories() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("b/c")).unwrap();
        for f in [
            "b/c/z.parquet",
            "b/a.jsonl.zst",
            "a.txt",
            "notes.md",
            "b/.hidden.jsonl",
        ] {
            std::fs::write(d.path().join(f), "").unwrap();
        }
        std::os::unix::fs::symlink(d.path(), d.path().join("b/loop")).unwrap();
        let (inputs, unread) = expand(&[d.path().to_path_buf()]).unwrap();
        let got: Vec<PathBuf> = inputs
            .into_iter()
            .map(|i| i.path.strip_prefix(d.path()).unwrap().to_path_buf())
            .collect();
        let want: Vec<PathBuf> = ["a.txt", "b/a.jsonl.zst", "b/c/z.parquet"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(got, want);
        // notes.md and the link are not read, and counted; the hidden file is not counted.
        assert_eq!(unread.count, 2, "{unread:?}");
        let e = expand(&[d.path().join("b/c/none")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("b/c/none") && e.contains("cannot read"), "{e}");
    }

    #[test]
    fn pieces_end_where_the_pre_tokenizers_split() {
        // A line break between two characters first, the latest one within the limit.
        let t = b"ab\ncd\n\nef\ngh ij";
        assert_eq!(cut(t, 12), 10); // "ab\ncd\n\nef\n" | "gh ij"
        assert_eq!(cut(t, 9), 3); // "\n\n" is not alone
                                  // Else any line break, else a space, else a character boundary.
        assert_eq!(cut(b"a\n\n\nbc", 4), 4);
        assert_eq!(cut(b"ab cd", 4), 3);
        let s = "aé€x".as_bytes(); // a, é (2 bytes), € (3 bytes)
        assert_eq!(cut(s, 5), 3);
        assert_eq!(cut(s, 6), 6);
    }
}
