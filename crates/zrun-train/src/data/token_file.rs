//! The token file formats: llm.c's headers, which record the dtype, or nanoGPT's headerless
//! uint16.
//!
//! ```text
//! header: 256 little-endian int32 (1024 bytes)
//!   [0] magic    [1] version    [2] number of tokens N    [3..256] zero
//!   20240520     1              GPT-2 (llm.c): uint16 tokens
//!   20240801     7              Llama-3 (llm.c): uint32 tokens
//!   20240520     2              uint32 tokens as zrun wrote them before (still read)
//! then N little-endian tokens of that dtype (file size 1024 + N * 2 or 1024 + N * 4)
//! ```
//!
//! This is what llm.c's `dev/data/data_common.py` (`write_datafile`) writes; [`TokenWriter`]
//! writes the GPT-2 header for uint16 and the Llama-3 header for uint32. A file that starts
//! with either magic is read with its header, and its size must agree with the count.
//!
//! Any other file is headerless uint16 (nanoGPT's `prepare.py`). The magics read as two uint16
//! tokens are 55432, 308 (20240520) and 55713, 308 (20240801): no file of GPT-2's (50257) or
//! Llama 2's (32000) vocabulary holds a token above 50256, so such a file is never taken for a
//! headered one. A headerless file of a vocabulary above 55432 could start with those tokens:
//! write those with a header (`zrun prepare`).
//!
//! One exception keeps a header of another format from being trained on as tokens: a file
//! whose first 1024 bytes look like a header (int32 word 0 nonzero, words 3..256 all zero) is
//! refused with the magic and version it holds. Read as uint16 tokens, words 3..256 are tokens
//! 6..511: a headerless token file would have to hold 506 zero tokens in a row at its very
//! start (GPT-2's token 0 is `!`), which no tokenized corpus does, while every header written
//! as llm.c writes them (a few int32 values, then zeros) matches.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::DataError;

/// The magic of llm.c's GPT-2 header (uint16 tokens, version 1; zrun's old uint32 files:
/// version 2).
pub(crate) const MAGIC_GPT2: i32 = 20240520;
/// The magic of llm.c's Llama-3 header (uint32 tokens, version 7).
pub(crate) const MAGIC_LLAMA3: i32 = 20240801;
/// The Llama-3 header's version.
const VERSION_LLAMA3: i32 = 7;
/// Bytes of the header: 256 int32.
pub(crate) const HEADER_BYTES: usize = 1024;

/// Element type of the tokens in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    /// 2 bytes per token: vocabularies of up to 65536 tokens (llm.c's GPT-2 header).
    U16,
    /// 4 bytes per token (llm.c's Llama-3 header).
    U32,
}

impl TokenDtype {
    /// The smallest dtype that holds every id of a vocabulary of `vocab_size` tokens.
    pub fn for_vocab(vocab_size: usize) -> TokenDtype {
        if vocab_size <= 1 << 16 {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    /// Bytes per token.
    pub fn bytes(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The header's magic this dtype is written with: 20240520 (GPT-2) or 20240801 (Llama-3).
    pub fn magic(self) -> i32 {
        match self {
            TokenDtype::U16 => MAGIC_GPT2,
            TokenDtype::U32 => MAGIC_LLAMA3,
        }
    }

    /// The header's version this dtype is written with: 1 (GPT-2) or 7 (Llama-3).
    pub fn version(self) -> i32 {
        match self {
            TokenDtype::U16 => 1,
            TokenDtype::U32 => VERSION_LLAMA3,
        }
    }

    /// "uint16" or "uint32".
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "uint16",
            TokenDtype::U32 => "uint32",
        }
    }

    /// The dtype of a header's (magic, version); None for a pair no writer uses.
    fn from_header(magic: i32, version: i32) -> Option<TokenDtype> {
        match (magic, version) {
            (MAGIC_GPT2, 1) => Some(TokenDtype::U16),
            (MAGIC_GPT2, 2) | (MAGIC_LLAMA3, VERSION_LLAMA3) => Some(TokenDtype::U32),
            _ => None,
        }
    }
}

/// Where the tokens of a file are: their dtype and the byte range after any header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Element type.
    pub dtype: TokenDtype,
    /// Byte offset of the first token (0 headerless, 1024 with a header).
    pub start: usize,
    /// Number of tokens.
    pub tokens: u64,
    /// Whether the file has llm.c's header.
    pub header: bool,
}

/// Whether 1024 bytes look like a header of some format: int32 word 0 nonzero and words
/// 3..256 zero (see the module docs for why token data does not).
fn looks_like_header(h: &[u8]) -> bool {
    h.len() >= HEADER_BYTES
        && h[..4].iter().any(|&b| b != 0)
        && h[12..HEADER_BYTES].iter().all(|&b| b == 0)
}

/// Reads the layout of a token file from its first bytes and its size: a header that says
/// something other than the file holds, or a header of an unknown format, is an error naming
/// the file, the header and the size.
pub(crate) fn layout(path: &Path, bytes: &[u8]) -> Result<Layout, DataError> {
    let size = bytes.len() as u64;
    let word = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let bad = |problem: String| DataError::Header {
        path: path.to_path_buf(),
        problem,
    };
    let magic = if bytes.len() >= 4 { word(0) } else { 0 };
    if magic != MAGIC_GPT2 && magic != MAGIC_LLAMA3 {
        if looks_like_header(bytes) {
            return Err(bad(format!(
                "its first {HEADER_BYTES} bytes look like a token-file header (int32 magic \
                 {magic}, version {}, count {}, then zeros), but the magic is neither llm.c's \
                 GPT-2 {MAGIC_GPT2} nor its Llama-3 {MAGIC_LLAMA3}, so it is not read as \
                 headerless uint16 tokens",
                word(1),
                word(2)
            )));
        }
        if !size.is_multiple_of(2) {
            return Err(DataError::OddSize {
                path: path.to_path_buf(),
                bytes: size,
            });
        }
        return Ok(Layout {
            dtype: TokenDtype::U16,
            start: 0,
            tokens: size / 2,
            header: false,
        });
    }
    if bytes.len() < HEADER_BYTES {
        return Err(bad(format!(
            "starts with the token-file magic {magic} but has {size} bytes, fewer than the \
             {HEADER_BYTES}-byte header"
        )));
    }
    let (version, count) = (word(1), word(2));
    let dtype = TokenDtype::from_header(magic, version).ok_or_else(|| {
        let known = if magic == MAGIC_GPT2 {
            "1 (uint16 tokens) and 2 (uint32 tokens)"
        } else {
            "7 (uint32 tokens)"
        };
        bad(format!(
            "its header has magic {magic} with version {version}, but only {known} exist \
             for that magic"
        ))
    })?;
    let expected = HEADER_BYTES as i64 + i64::from(count) * dtype.bytes() as i64;
    if count < 0 || expected != size as i64 {
        return Err(bad(format!(
            "its header says {count} {} tokens ({HEADER_BYTES} + {count} x {} = {expected} \
             bytes) but the file has {size} bytes",
            dtype.name(),
            dtype.bytes(),
        )));
    }
    Ok(Layout {
        dtype,
        start: HEADER_BYTES,
        tokens: count as u64,
        header: true,
    })
}

/// The 1024-byte header of a file of `tokens` tokens of `dtype`.
pub(crate) fn header(dtype: TokenDtype, tokens: u64) -> Option<[u8; HEADER_BYTES]> {
    let count = i32::try_from(tokens).ok()?;
    let mut h = [0u8; HEADER_BYTES];
    for (i, v) in [dtype.magic(), dtype.version(), count]
        .into_iter()
        .enumerate()
    {
        h[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    Some(h)
}

/// Writes a token file with llm.c's header (GPT-2's for uint16, Llama-3's for uint32), token
/// by token; the count goes into the header at
/// [`TokenWriter::finish`], which also flushes and syncs the file.
#[derive(Debug)]
pub struct TokenWriter {
    path: PathBuf,
    out: BufWriter<File>,
    dtype: TokenDtype,
    tokens: u64,
}

impl TokenWriter {
    /// Creates (or truncates) `path` and writes a header with a zero count.
    pub fn create(path: &Path, dtype: TokenDtype) -> Result<TokenWriter, DataError> {
        let file = File::create(path).map_err(write_error(path, "create"))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let zero = header(dtype, 0).expect("0 fits");
        out.write_all(&zero).map_err(write_error(path, "write"))?;
        Ok(TokenWriter {
            path: path.to_path_buf(),
            out,
            dtype,
            tokens: 0,
        })
    }

    /// Appends tokens; a token that does not fit the dtype is an error.
    pub fn write(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        let mut buf = Vec::with_capacity(tokens.len() * self.dtype.bytes());
        for &t in tokens {
            match self.dtype {
                TokenDtype::U32 => buf.extend_from_slice(&t.to_le_bytes()),
                TokenDtype::U16 => {
                    let t = u16::try_from(t).map_err(|_| DataError::TokenTooWide {
                        path: self.path.clone(),
                        token: t,
                    })?;
                    buf.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        self.out
            .write_all(&buf)
            .map_err(write_error(&self.path, "write"))?;
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Writes the count into the header, flushes and syncs; returns the token count.
    pub fn finish(self) -> Result<u64, DataError> {
        let path = self.path;
        let h = header(self.dtype, self.tokens).ok_or_else(|| DataError::TooManyTokens {
            path: path.clone(),
            tokens: self.tokens,
        })?;
        let mut file = self
            .out
            .into_inner()
            .map_err(|e| write_error(&path, "write")(e.into_error()))?;
        use std::io::Seek;
        file.seek(std::io::SeekFrom::Start(0))
            .and_then(|_| file.write_all(&h))
            .and_then(|()| file.sync_all())
            .map_err(write_error(&path, "write"))?;
        Ok(self.tokens)
    }
}

/// Maps an I/O error on an output file to [`DataError::Write`].
pub(crate) fn write_error<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> DataError + 'a {
    move |source| DataError::Write {
        path: path.to_path_buf(),
        op,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_magics_read_as_uint16_are_above_gpt2s_vocabulary() {
        let tokens = |m: i32| {
            let b = m.to_le_bytes();
            [
                u16::from_le_bytes([b[0], b[1]]),
                u16::from_le_bytes([b[2], b[3]]),
            ]
        };
        assert_eq!(tokens(MAGIC_GPT2), [55432, 308]);
        assert_eq!(tokens(MAGIC_LLAMA3), [55713, 308]);
    }

    #[test]
    fn dtype_follows_the_vocabulary() {
        assert_eq!(TokenDtype::for_vocab(50257), TokenDtype::U16);
        assert_eq!(TokenDtype::for_vocab(65536), TokenDtype::U16);
        assert_eq!(TokenDtype::for_vocab(65537), TokenDtype::U32);
        assert_eq!(TokenDtype::for_vocab(128256), TokenDtype::U32);
    }

    #[test]
    fn writer_and_layout_agree() {
        let dir = tempfile::tempdir().unwrap();
        for dtype in [TokenDtype::U16, TokenDtype::U32] {
            let p = dir.path().join(format!("{}.bin", dtype.name()));
            let mut w = TokenWriter::create(&p, dtype).unwrap();
            w.write(&[1, 2, 65535]).unwrap();
            w.write(&[7]).unwrap();
            assert_eq!(w.finish().unwrap(), 4);
            let bytes = std::fs::read(&p).unwrap();
            assert_eq!(bytes.len(), HEADER_BYTES + 4 * dtype.bytes());
            let l = layout(&p, &bytes).unwrap();
            assert_eq!(
                (l.dtype, l.start, l.tokens, l.header),
                (dtype, 1024, 4, true)
            );
            let words: Vec<i32> = bytes[..12]
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let want = match dtype {
                TokenDtype::U16 => [20240520, 1, 4],
                TokenDtype::U32 => [20240801, 7, 4],
            };
            assert_eq!(words, want, "llm.c's header for {}", dtype.name());
            assert!(bytes[12..HEADER_BYTES].iter().all(|&b| b == 0));
        }
        let p = dir.path().join("narrow.bin");
        let mut w = TokenWriter::create(&p, TokenDtype::U16).unwrap();
        let e = w.write(&[65536]).unwrap_err().to_string();
        assert!(e.contains("65536") && e.contains("uint16"), "{e}");
    }

    #[test]
    fn headerless_and_bad_headers() {
        let p = Path::new("x.bin");
        let l = layout(p, &[1, 0, 2, 0]).unwrap();
        assert_eq!(
            (l.dtype, l.start, l.tokens, l.header),
            (TokenDtype::U16, 0, 2, false)
        );
        assert!(layout(p, &[1, 0, 2])
            .unwrap_err()
            .to_string()
            .contains("odd"));
        let mut h = header(TokenDtype::U32, 10).unwrap().to_vec();
        h.extend([0u8; 36]);
        let e = layout(p, &h).unwrap_err().to_string();
        assert!(
            e.contains("x.bin")
                && e.contains("header says 10 uint32 tokens")
                && e.contains("1064 bytes")
                && e.contains("file has 1060 bytes")
                && !e.contains('\n'),
            "{e}"
        );
        h[4] = 3;
        let e = layout(p, &h).unwrap_err().to_string();
        assert!(e.contains("magic 20240801 with version 3"), "{e}");
        let e = layout(p, &h[..12]).unwrap_err().to_string();
        assert!(
            e.contains("12 bytes") && e.contains("1024-byte header"),
            "{e}"
        );
        assert!(header(TokenDtype::U16, 1 << 31).is_none());
    }

    /// `words` as little-endian int32, then zeros up to 1024 bytes, then `tail`.
    fn headered(words: &[i32], tail: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_BYTES];
        for (i, w) in words.iter().enumerate() {
            h[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        h.extend_from_slice(tail);
        h
    }

    #[test]
    fn every_header_llm_c_writes_and_zruns_old_one_are_read() {
        let p = Path::new("x.bin");
        let cases = [
            (20240520, 1, TokenDtype::U16),
            (20240801, 7, TokenDtype::U32),
            (20240520, 2, TokenDtype::U32),
        ];
        for (magic, version, dtype) in cases {
            let bytes = headered(&[magic, version, 3], &vec![9u8; 3 * dtype.bytes()]);
            let l = layout(p, &bytes).unwrap();
            assert_eq!(
                (l.dtype, l.start, l.tokens, l.header),
                (dtype, 1024, 3, true)
            );
        }
        let e = layout(p, &headered(&[20240801, 1, 0], &[])).unwrap_err();
        assert!(e.to_string().contains("only 7 (uint32 tokens)"), "{e}");
    }

    #[test]
    fn a_header_of_an_unknown_format_is_refused_not_read_as_tokens() {
        let p = Path::new("odd-format.bin");
        let e = layout(p, &headered(&[20240999, 3, 100], &[1, 0, 2, 0]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("odd-format.bin")
                && e.contains("magic 20240999, version 3")
                && e.contains("neither llm.c's GPT-2 20240520 nor its Llama-3 20240801")
                && !e.contains('\n'),
            "{e}"
        );
        // Token data is not a header: a nonzero token anywhere in 6..512, a zero first word,
        // or fewer than 1024 bytes keep a file headerless uint16.
        let mut tokens = headered(&[20240999, 3, 100], &[]);
        tokens[1022] = 1;
        assert!(!layout(p, &tokens).unwrap().header);
        assert!(!layout(p, &headered(&[0, 3, 100], &[])).unwrap().header);
        assert!(!layout(p, &headered(&[7], &[])[..1022]).unwrap().header);
    }
}
