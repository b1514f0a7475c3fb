//! nanoGPT-style token files: uint16 little-endian, memory-mapped, validated at open.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use super::corpus::{Corpus, TokenStore};
use super::{DataError, DataOptions};

/// Bytes per scan chunk of the max-token check (even, so chunks hold whole tokens).
const SCAN_CHUNK: usize = 1 << 20;

/// Opens a `.bin` file, or a directory with `train.bin` and optionally `val.bin`.
pub(crate) fn open(path: &Path, opts: &DataOptions) -> Result<Corpus, DataError> {
    if !path.exists() {
        return Err(DataError::NotFound {
            path: path.to_path_buf(),
            expected: "a uint16 token .bin file, or a directory holding train.bin (and \
                       optionally val.bin) as nanoGPT's prepare.py writes them",
        });
    }
    let label = format!("tokens {}", path.display());
    let (t, seed) = (opts.seq_len, opts.seed);
    if path.is_dir() {
        let train_path = path.join("train.bin");
        if !train_path.is_file() {
            return Err(DataError::NotFound {
                path: train_path,
                expected: "train.bin (uint16 little-endian tokens) in the data.path directory",
            });
        }
        let train = map_u16(&train_path, opts.vocab_size)?;
        let val_path = path.join("val.bin");
        if val_path.is_file() {
            let val = map_u16(&val_path, opts.vocab_size)?;
            return Corpus::with_eval_file(label, (train, &train_path), (val, &val_path), t, seed);
        }
        return Corpus::with_held_out(label, train, &train_path, t, seed, opts.eval_fraction);
    }
    let store = map_u16(path, opts.vocab_size)?;
    Corpus::with_held_out(label, store, path, t, seed, opts.eval_fraction)
}

/// Maps a uint16 token file after checking its size and that every token is below
/// `vocab_size`.
fn map_u16(path: &Path, vocab_size: usize) -> Result<TokenStore, DataError> {
    let io = |op| {
        move |source| DataError::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    let file = File::open(path).map_err(io("open"))?;
    let bytes = file.metadata().map_err(io("stat"))?.len();
    if bytes % 2 != 0 {
        return Err(DataError::OddSize {
            path: path.to_path_buf(),
            bytes,
        });
    }
    // SAFETY: the map is read-only and the file is not written while training reads it
    // (token files are prepared once, before the job); a concurrent truncation would be a
    // misuse of the data directory that no reader can guard against.
    let map = unsafe { Mmap::map(&file) }.map_err(io("memory-map"))?;
    if let Some((token, offset)) = max_token(&map) {
        if usize::from(token) >= vocab_size {
            return Err(DataError::TokenOutOfRange {
                path: path.to_path_buf(),
                token,
                offset,
                vocab_size,
            });
        }
    }
    Ok(TokenStore::U16(map))
}

/// The largest uint16 little-endian token and the token offset of its first occurrence;
/// None for an empty slice. One vectorizable pass per chunk, then a search of the one chunk
/// where the maximum first appears.
pub(crate) fn max_token(bytes: &[u8]) -> Option<(u16, u64)> {
    let mut best: Option<(u16, usize)> = None;
    for (i, chunk) in bytes.chunks(SCAN_CHUNK).enumerate() {
        let m = chunk
            .chunks_exact(2)
            .map(|p| u16::from_le_bytes([p[0], p[1]]))
            .fold(0u16, u16::max);
        let better = match best {
            None => chunk.len() >= 2,
            Some((b, _)) => m > b,
        };
        if better {
            best = Some((m, i));
        }
    }
    let (max, chunk) = best?;
    let base = chunk * SCAN_CHUNK;
    let within = bytes[base..]
        .chunks_exact(2)
        .position(|p| u16::from_le_bytes([p[0], p[1]]) == max)?;
    Some((max, (base / 2 + within) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(tokens: &[u16]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn max_token_finds_the_first_largest_across_chunks() {
        assert_eq!(max_token(&[]), None);
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
        assert_eq!(max_token(&le(&tokens)), Some((t, i as u64)));
        assert_eq!(
            max_token(&le(&[0x0102])),
            Some((0x0102, 0)),
            "little-endian"
        );
    }
}
