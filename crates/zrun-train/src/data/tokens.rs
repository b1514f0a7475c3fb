//! Token files: llm.c's header with a uint16 or uint32 dtype, or nanoGPT's headerless uint16
//! (see `token_file`); memory-mapped and validated at open.

use std::path::Path;

use memmap2::Mmap;

use super::corpus::{Corpus, TokenStore};
use super::shards;
use super::token_file::{self, TokenDtype};
use super::{DataError, DataOptions};

/// Bytes per scan chunk of the max-token check (a multiple of 4, so chunks hold whole tokens).
const SCAN_CHUNK: usize = 1 << 20;

/// Opens a shard directory (a directory holding `index.json`, or that file), a `.bin` file,
/// or a directory with `train.bin` and optionally `val.bin`.
/// `tokenizer` is the run's ([`super::DataSource::Tokens`]): a shard directory's index must
/// record its SHA-256; with token files that record none, it must load and fit the model.
pub(crate) fn open(
    path: &Path,
    tokenizer: Option<&Path>,
    opts: &DataOptions,
) -> Result<Corpus, DataError> {
    present(path)?;
    if let Some(dir) = shards::shard_dir(path) {
        return shards::open(&dir, tokenizer, opts);
    }
    if let Some(t) = tokenizer {
        super::tokenizer::Tokenizer::load(t, "data.tokenizer")?.fits(opts.vocab_size)?;
    }
    let (t, seed) = (opts.seq_len, opts.seed);
    if path.is_dir() {
        let train_path = path.join("train.bin");
        if !train_path.is_file() {
            return Err(DataError::NotFound {
                path: train_path,
                expected: "train.bin (a token file) in the data.path directory, or index.json \
                           in a token-shard directory",
            });
        }
        let train = map(&train_path, opts.vocab_size)?;
        let label = format!("tokens {} ({})", path.display(), train.describe());
        let val_path = path.join("val.bin");
        if val_path.is_file() {
            let val = map(&val_path, opts.vocab_size)?;
            let (train, val) = ((train, &*train_path), (val, &*val_path));
            return Corpus::with_eval_file(label, train, val, "from val.bin".into(), t, seed);
        }
        return Corpus::with_held_out(label, train, &train_path, t, seed, opts.eval_fraction);
    }
    let store = map(path, opts.vocab_size)?;
    let label = format!("tokens {} ({})", path.display(), store.describe());
    Corpus::with_held_out(label, store, path, t, seed, opts.eval_fraction)
}

/// Refuses a `data.path` of tokens that does not exist.
pub(crate) fn present(path: &Path) -> Result<(), DataError> {
    if path.exists() {
        return Ok(());
    }
    Err(DataError::NotFound {
        path: path.to_path_buf(),
        expected: "a token-shard directory (with index.json) or its index.json, a token .bin \
                   file, or a directory holding train.bin (and optionally val.bin) as zrun \
                   prepare or nanoGPT's prepare.py writes them",
    })
}

/// Maps a token file after checking its header (if any) against its size and that every
/// token is below `vocab_size`.
fn map(path: &Path, vocab_size: usize) -> Result<TokenStore, DataError> {
    let io = |op| {
        move |source| DataError::Io {
            key: "data.path",
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    let file = super::open_regular(path).map_err(io("open"))?;
    // SAFETY: the map is read-only and the file is not written while training reads it
    // (token files are prepared once, before the job); a concurrent truncation would be a
    // misuse of the data directory that no reader can guard against.
    let map = unsafe { Mmap::map(&file) }.map_err(io("memory-map"))?;
    let layout = token_file::layout(path, &map)?;
    let body = &map[layout.start..];
    if !layout.header && looks_like_u32(body) {
        return Err(DataError::Header {
            path: path.to_path_buf(),
            problem: format!(
                "it has no header, so its tokens are read as uint16, but every second uint16 of its first {} is 0, as in uint32 tokens: it holds uint32 tokens without a header",
                (body.len() / 2).min(U32_PROBE_WORDS)
            ),
        });
    }
    if let Some((token, offset)) = max_token(body, layout.dtype) {
        if token as usize >= vocab_size {
            return Err(DataError::TokenOutOfRange {
                path: path.to_path_buf(),
                token,
                offset,
                vocab_size,
            });
        }
    }
    Ok(TokenStore::Mapped { map, layout })
}

/// Words of a headerless file [`looks_like_u32`] reads.
const U32_PROBE_WORDS: usize = 1 << 20;

/// Whether a headerless file's bytes are uint32 tokens read as uint16: every odd uint16 of
/// its first [`U32_PROBE_WORDS`] (at least 64 of them) is 0 (the high halves of tokens below
/// 65536) and some even one is not. Real uint16 data does not hold token 0 at every second
/// place.
fn looks_like_u32(body: &[u8]) -> bool {
    let words = (body.len() / 2).min(U32_PROBE_WORDS) / 2 * 2;
    let probe = &body[..2 * words];
    words >= 128
        && probe.chunks_exact(4).all(|p| p[2] == 0 && p[3] == 0)
        && probe.chunks_exact(4).any(|p| p[0] != 0 || p[1] != 0)
}

/// A little-endian token type of a file.
trait Token: Copy + Ord + Into<u32> {
    const BYTES: usize;
    const ZERO: Self;
    fn from_le(b: &[u8]) -> Self;
}

impl Token for u16 {
    const BYTES: usize = 2;
    const ZERO: u16 = 0;
    fn from_le(b: &[u8]) -> u16 {
        u16::from_le_bytes([b[0], b[1]])
    }
}

impl Token for u32 {
    const BYTES: usize = 4;
    const ZERO: u32 = 0;
    fn from_le(b: &[u8]) -> u32 {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// The largest little-endian token of `dtype` and the token offset of its first occurrence;
/// None for an empty slice.
pub(crate) fn max_token(bytes: &[u8], dtype: TokenDtype) -> Option<(u32, u64)> {
    max_token_with(bytes, dtype, |_| {})
}

/// [`max_token`], handing each chunk of `bytes` to `on_chunk` in order as it is scanned (so
/// a hash of the file can share the pass).
pub(crate) fn max_token_with(
    bytes: &[u8],
    dtype: TokenDtype,
    on_chunk: impl FnMut(&[u8]),
) -> Option<(u32, u64)> {
    match dtype {
        TokenDtype::U16 => max_of::<u16>(bytes, on_chunk),
        TokenDtype::U32 => max_of::<u32>(bytes, on_chunk),
    }
}

/// One vectorizable pass per chunk, then a search of the one chunk where the maximum first
/// appears.
fn max_of<T: Token>(bytes: &[u8], mut on_chunk: impl FnMut(&[u8])) -> Option<(u32, u64)> {
    let mut best: Option<(T, usize)> = None;
    for (i, chunk) in bytes.chunks(SCAN_CHUNK).enumerate() {
        on_chunk(chunk);
        let m = chunk
            .chunks_exact(T::BYTES)
            .map(T::from_le)
            .fold(T::ZERO, T::max);
        let better = match best {
            None => chunk.len() >= T::BYTES,
            Some((b, _)) => m > b,
        };
        if better {
            best = Some((m, i));
        }
    }
    let (max, chunk) = best?;
    let base = chunk * SCAN_CHUNK;
    let within = bytes[base..]
        .chunks_exact(T::BYTES)
        .position(|p| T::from_le(p) == max)?;
    Some((max.into(), (base / T::BYTES + within) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(tokens: &[u16]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn uint32_tokens_without_a_header_are_told_from_uint16() {
        let tokens: Vec<u32> = (0..1000u32).map(|i| 1 + (i * 37) % 255).collect();
        let wide: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert!(looks_like_u32(&wide));
        // The same values as uint16, too few words, and all zeros are uint16 data.
        let narrow: Vec<u16> = tokens.iter().map(|&t| t as u16).collect();
        assert!(!looks_like_u32(&le(&narrow)));
        assert!(!looks_like_u32(&wide[..4 * 63]));
        assert!(!looks_like_u32(&vec![0u8; 4096]));
        // One token of 65536 or more in the probe: not uint32 below 65536 either way.
        let mut big = tokens.clone();
        big[500] = 70_000;
        let big: Vec<u8> = big.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert!(!looks_like_u32(&big));
        // Read as data: refused, naming the file.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wide.bin");
        std::fs::write(&path, &wide).unwrap();
        let Err(e) = map(&path, 256) else {
            panic!("uint32 tokens read as uint16")
        };
        let e = e.to_string();
        assert!(
            e.contains("wide.bin") && e.contains("uint32 tokens without a header"),
            "{e}"
        );
    }

    #[test]
    fn max_token_finds_the_first_largest_across_chunks() {
        assert_eq!(max_token(&[], TokenDtype::U16), None);
        let mut tokens = vec![7u16; 3 * SCAN_CHUNK / 2 + 5];
        let late = SCAN_CHUNK / 2 + 100; // in the second chunk
        tokens[late] = 50_256;
        tokens[late + 3] = 50_256;
        tokens[10] = 50_000;
        let expected = tokens
            .iter()
            .enumerate()
            .max_by_key(|(i, &t)| (t, usize::MAX - i));
        let (i, &t) = expected.unwrap();
        assert_eq!(
            max_token(&le(&tokens), TokenDtype::U16),
            Some((u32::from(t), i as u64))
        );
        assert_eq!(
            max_token(&le(&[0x0102]), TokenDtype::U16),
            Some((0x0102, 0)),
            "little-endian"
        );
        let wide: Vec<u8> = [5u32, 128_000, 70_000, 128_000]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        assert_eq!(max_token(&wide, TokenDtype::U32), Some((128_000, 1)));
    }
}
