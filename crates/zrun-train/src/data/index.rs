//! The index of a token-shard directory, `DIR/index.json`, as `zrun prepare` writes it and
//! the loader reads it.
//!
//! ```text
//! {
//!   "format": "zrun-token-shards", "version": 1,
//!   "dtype": "uint16" | "uint32", "vocab_size": 50257,
//!   "tokenizer": { "name": "tokenizer.json", "sha256": "<64 hex digits>" },
//!   "eos": "<|endoftext|>" | null,
//!   "inputs": [ { "name": "corpus/a.jsonl.zst", "bytes": 123456 }, ... ],
//!   "train": [ { "file": "train-00000.bin", "tokens": 100000000, "documents": 81234,
//!                "bytes": 200001024, "xxh3": "<32 hex digits>" }, ... ],
//!   "val":   [ ... the same, "val-00000.bin", ... ]
//! }
//! ```
//!
//! Shards are token files in llm.c's header format (token_file.rs), named `train-NNNNN.bin` and
//! `val-NNNNN.bin` in order; every shard but the last of a split holds exactly the prepare's
//! `--shard-tokens` tokens. `bytes` is the file's size and `xxh3` the XXH3-128 of its whole
//! content (header included), so a shard that was replaced, truncated or written by another
//! tokenizer is found before training. The index is untrusted input: [`ShardIndex::read`]
//! checks every field before anything is opened (names are plain file names inside the
//! directory, sizes agree with token counts, totals fit in u64).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::token_file::{write_error, TokenDtype, HEADER_BYTES};
use super::DataError;

/// The index's file name inside a shard directory.
pub const INDEX_FILE: &str = "index.json";
/// The `format` field's value.
pub const FORMAT: &str = "zrun-token-shards";
/// The `version` this build writes and reads.
pub const VERSION: u32 = 1;
/// The largest index read (bytes): about a million shards.
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// The file name of shard `i` of `split` (`train` or `val`): `train-00000.bin`.
pub fn shard_file(split: &str, i: usize) -> String {
    format!("{split}-{i:05}.bin")
}

/// Whether `name` has the form [`shard_file`] writes: `train-` or `val-`, five or more
/// digits, `.bin`.
pub fn is_shard_file(name: &str) -> bool {
    ["train-", "val-"].iter().any(|p| {
        name.strip_prefix(p)
            .and_then(|r| r.strip_suffix(".bin"))
            .is_some_and(|d| d.len() >= 5 && d.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// A shard's `xxh3` field: the XXH3-128 `hasher` holds, as 32 lowercase hex digits.
pub fn xxh3_hex(hasher: &xxhash_rust::xxh3::Xxh3) -> String {
    format!("{:032x}", hasher.digest128())
}

/// A shard's `xxh3` field for a file's whole content `bytes`.
pub fn xxh3_of(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// The tokenizer the shards were written with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerRecord {
    /// The tokenizer file's name as given to `zrun prepare` (for messages).
    pub name: String,
    /// SHA-256 of the tokenizer file's bytes, 64 lowercase hex digits.
    pub sha256: String,
}

/// One input file of the prepare.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRecord {
    /// The path as given to `zrun prepare`.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
}

/// One shard file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// The file's name inside the directory (`train-00000.bin`).
    pub file: String,
    /// Tokens in it.
    pub tokens: u64,
    /// Documents that start in it.
    pub documents: u64,
    /// The file's size: the 1024-byte header plus the tokens.
    pub bytes: u64,
    /// XXH3-128 of the whole file, 32 lowercase hex digits.
    pub xxh3: String,
}

/// `DIR/index.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardIndex {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`] for this build.
    pub version: u32,
    /// "uint16" or "uint32": every shard's token type.
    pub dtype: String,
    /// The tokenizer's vocabulary size (largest id + 1).
    pub vocab_size: u64,
    /// The tokenizer the shards were written with.
    pub tokenizer: TokenizerRecord,
    /// The token appended after every document, if any.
    pub eos: Option<String>,
    /// The inputs, in the order they were read.
    pub inputs: Vec<InputRecord>,
    /// The training shards, in order.
    pub train: Vec<ShardRecord>,
    /// The validation shards, in order (may be empty).
    pub val: Vec<ShardRecord>,
}

impl ShardIndex {
    /// The shards' token type.
    pub fn token_dtype(&self) -> TokenDtype {
        if self.dtype == "uint32" {
            TokenDtype::U32
        } else {
            TokenDtype::U16
        }
    }

    /// Tokens of a split's shards.
    pub fn tokens(shards: &[ShardRecord]) -> u64 {
        shards.iter().map(|s| s.tokens).sum()
    }

    /// Reads and checks `dir/index.json`: one line naming the index and the field on any
    /// problem. Does not open the shards.
    pub fn read(dir: &Path) -> Result<ShardIndex, DataError> {
        let path = dir.join(INDEX_FILE);
        let bad = |problem: String| DataError::Index {
            path: path.clone(),
            problem,
        };
        let meta = std::fs::metadata(&path).map_err(|source| DataError::Io {
            key: "data.path",
            path: path.clone(),
            op: "read",
            source,
        })?;
        if meta.len() > MAX_INDEX_BYTES {
            return Err(bad(format!(
                "{} bytes is larger than any index zrun writes ({} MiB at most)",
                meta.len(),
                MAX_INDEX_BYTES >> 20
            )));
        }
        let text = super::read_regular(&path).map_err(|source| DataError::Io {
            key: "data.path",
            path: path.clone(),
            op: "read",
            source,
        })?;
        let index: ShardIndex =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not a shard index: {e}")))?;
        index.check().map_err(bad)?;
        Ok(index)
    }

    /// Writes `dir/index.json` through a temporary file and a rename, synced.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, DataError> {
        let tmp = self.write_staged(dir)?;
        let path = dir.join(INDEX_FILE);
        std::fs::rename(&tmp, &path).map_err(write_error(&path, "rename into place"))?;
        Ok(path)
    }

    /// Writes the index to `dir/index.json.tmp`, synced, and returns that path; a write that
    /// fails (a full disk) removes what it wrote.
    pub(crate) fn write_staged(&self, dir: &Path) -> Result<PathBuf, DataError> {
        use std::io::Write;
        let tmp = dir.join(format!("{INDEX_FILE}.tmp"));
        let mut text = serde_json::to_vec_pretty(self).expect("an index serialises");
        text.push(b'\n');
        let written = std::fs::File::create(&tmp)
            .map_err(write_error(&tmp, "create"))
            .and_then(|mut f| {
                f.write_all(&text).map_err(write_error(&tmp, "write"))?;
                f.sync_all().map_err(write_error(&tmp, "sync"))
            });
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map(|()| tmp)
    }

    /// Refuses `tokenizer` (the run's, `dir`'s index being this one) unless it is the file
    /// the shards were prepared with: the SHA-256 of its bytes is the one recorded.
    pub(crate) fn check_tokenizer(&self, dir: &Path, tokenizer: &Path) -> Result<(), DataError> {
        use sha2::Digest;
        let max = super::tokenizer::MAX_TOKENIZER_BYTES;
        let bytes = super::read_at_most(tokenizer, max).map_err(|source| DataError::Io {
            key: "data.tokenizer",
            path: tokenizer.to_path_buf(),
            op: "read",
            source,
        })?;
        let sha256 = format!("{:x}", sha2::Sha256::digest(&bytes));
        if sha256 == self.tokenizer.sha256 {
            return Ok(());
        }
        Err(DataError::TokenizerMismatch {
            path: tokenizer.to_path_buf(),
            index: dir.join(INDEX_FILE),
            recorded: self.tokenizer.name.clone(),
            recorded_sha: self.tokenizer.sha256.chars().take(12).collect(),
            sha: sha256.chars().take(12).collect(),
        })
    }

    /// Every rule of the format; the problem in words.
    fn check(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format is {:?}, want {FORMAT:?}", self.format));
        }
        if self.version != VERSION {
            return Err(format!(
                "version {} is not {VERSION}, the version this zrun reads and \
                 writes",
                self.version
            ));
        }
        let width = match self.dtype.as_str() {
            "uint16" => 2u64,
            "uint32" => 4,
            other => {
                return Err(format!(
                    "dtype {other:?} is neither \"uint16\" nor \"uint32\""
                ))
            }
        };
        if self.vocab_size == 0 || self.vocab_size > u64::from(u32::MAX) {
            return Err(format!(
                "vocab_size {} is outside 1..=4294967295",
                self.vocab_size
            ));
        }
        if width == 2 && self.vocab_size > 1 << 16 {
            return Err(format!(
                "vocab_size {} does not fit dtype uint16",
                self.vocab_size
            ));
        }
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex(&self.tokenizer.sha256, 64) {
            return Err(format!(
                "tokenizer.sha256 {:?} is not 64 hex digits",
                self.tokenizer.sha256
            ));
        }
        if self.train.is_empty() {
            return Err("it lists no train shards".into());
        }
        let mut names = std::collections::HashSet::new();
        for (split, shards) in [("train", &self.train), ("val", &self.val)] {
            let mut total: u64 = 0;
            for (i, s) in shards.iter().enumerate() {
                let at = format!("{split}[{i}] ({:?})", s.file);
                let plain = Path::new(&s.file)
                    .file_name()
                    .is_some_and(|n| n == s.file.as_str())
                    && s.file != INDEX_FILE
                    && !s.file.starts_with('.');
                if !plain {
                    return Err(format!(
                        "{at}: a shard must be a plain file name inside the directory"
                    ));
                }
                if !names.insert(s.file.as_str()) {
                    return Err(format!("{at}: the file is listed twice"));
                }
                let want = s
                    .tokens
                    .checked_mul(width)
                    .and_then(|b| b.checked_add(HEADER_BYTES as u64));
                if want != Some(s.bytes) {
                    return Err(format!(
                        "{at}: {} bytes do not hold the header and {} {} tokens",
                        s.bytes, s.tokens, self.dtype
                    ));
                }
                if s.tokens > i32::MAX as u64 {
                    return Err(format!(
                        "{at}: {} tokens are more than llm.c's header can count",
                        s.tokens
                    ));
                }
                if !hex(&s.xxh3, 32) {
                    return Err(format!("{at}: xxh3 {:?} is not 32 hex digits", s.xxh3));
                }
                total = total
                    .checked_add(s.tokens)
                    .ok_or_else(|| format!("{at}: the token total overflows"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_are_what_prepare_writes() {
        assert_eq!(shard_file("train", 7), "train-00007.bin");
        assert_eq!(shard_file("val", 123456), "val-123456.bin");
        for name in [shard_file("train", 0), shard_file("val", 123456)] {
            assert!(is_shard_file(&name), "{name}");
        }
        for name in [
            "train-1.bin",
            "train-00001.bin.tmp",
            "test-00001.bin",
            "train-0000a.bin",
            "train.bin",
        ] {
            assert!(!is_shard_file(name), "{name}");
        }
    }

    fn index() -> ShardIndex {
        let shard = |file: &str, tokens: u64| ShardRecord {
            file: file.into(),
            tokens,
            documents: 3,
            bytes: HEADER_BYTES as u64 + 2 * tokens,
            xxh3: "0".repeat(32),
        };
        ShardIndex {
            format: FORMAT.into(),
            version: VERSION,
            dtype: "uint16".into(),
            vocab_size: 50257,
            tokenizer: TokenizerRecord {
                name: "tokenizer.json".into(),
                sha256: "a".repeat(64),
            },
            eos: Some("<|endoftext|>".into()),
            inputs: vec![InputRecord {
                name: "a.jsonl".into(),
                bytes: 10,
            }],
            train: vec![shard("train-00000.bin", 100), shard("train-00001.bin", 7)],
            val: vec![shard("val-00000.bin", 5)],
        }
    }

    #[test]
    fn an_index_round_trips_and_bad_fields_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let ix = index();
        ix.write(dir.path()).unwrap();
        assert_eq!(ShardIndex::read(dir.path()).unwrap(), ix);
        assert_eq!(ShardIndex::tokens(&ix.train), 107);

        type Edit = Box<dyn Fn(&mut ShardIndex)>;
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|i| i.train[0].file = "../x.bin".into()),
                "plain file name",
            ),
            (
                Box::new(|i| i.val[0].file = "train-00001.bin".into()),
                "listed twice",
            ),
            (
                Box::new(|i| i.train[1].bytes += 1),
                "do not hold the header",
            ),
            (Box::new(|i| i.dtype = "int8".into()), "dtype \"int8\""),
            (
                Box::new(|i| i.vocab_size = 70000),
                "does not fit dtype uint16",
            ),
            (Box::new(|i| i.version = 9), "version 9"),
            (Box::new(|i| i.train.clear()), "no train shards"),
            (
                Box::new(|i| i.tokenizer.sha256 = "xyz".into()),
                "tokenizer.sha256",
            ),
        ];
        for (edit, needle) in cases {
            let mut bad = index();
            edit(&mut bad);
            bad.write(dir.path()).unwrap();
            let e = ShardIndex::read(dir.path()).unwrap_err().to_string();
            // One problem, one fix.
            assert!(
                e.contains(needle) && e.contains("index.json") && e.matches("again").count() == 1,
                "{needle}: {e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
        std::fs::write(dir.path().join(INDEX_FILE), b"{\"format\": 1}").unwrap();
        let e = ShardIndex::read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a shard index"), "{e}");
    }
}
