//! Hugging Face tokenizers (`tokenizer.json`) and how documents are joined into one token
//! stream.
//!
//! Every document (a text file, a JSON line, a Parquet row) is encoded on its own, with the tokenizer's post-processor
//! (`add_special_tokens = true`, as `tokenizer.encode(text)` does in Python), so a tokenizer
//! whose template adds a beginning-of-text token (Llama 3's `<|begin_of_text|>`, Llama 2's
//! `<s>`) starts every document with it. A tokenizer whose template adds nothing (GPT-2's)
//! gets its end-of-text token appended to every document instead, as nanoGPT's
//! `prepare.py` does: the first of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>` that
//! its vocabulary holds. With neither, documents are joined as they are. `zrun prepare --eos`
//! names another token to append, or `none`.
//!
//! `zrun prepare` encodes long documents in pieces ([`Tokenizer::encode_pieces`]): the template's
//! tokens go around the whole document, not each piece. Byte-level BPE tokenizers (GPT-2's,
//! Llama 3's) take a faster path to the same ids (byte_level.rs).

mod byte_level;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use byte_level::ByteLevel;

use super::DataError;
use crate::config::DataConfig;

/// End-of-text tokens looked for when the tokenizer's template marks no document start.
const EOS_CANDIDATES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// Texts per `encode_batch` call, and their bytes at most (one text may be larger).
const BATCH_TEXTS: usize = 256;
const BATCH_BYTES: usize = 32 << 20;

/// The token appended after every document.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Eos {
    /// The tokenizer's end-of-text token when its template adds nothing (module docs).
    #[default]
    Auto,
    /// Nothing.
    None,
    /// This token (it must be in the vocabulary).
    Token(String),
}

impl std::str::FromStr for Eos {
    type Err = std::convert::Infallible;

    /// `auto`, `none`, or a token such as `<|endoftext|>`.
    fn from_str(s: &str) -> Result<Eos, Self::Err> {
        Ok(match s {
            "auto" => Eos::Auto,
            "none" => Eos::None,
            token => Eos::Token(token.to_string()),
        })
    }
}

/// A loaded `tokenizer.json`, with truncation and padding turned off (documents are encoded
/// whole) and the document separator resolved.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
    /// The template adds tokens to every sequence (a beginning-of-text token, say).
    templated: bool,
    /// Appended after every document: (token, id).
    eos: Option<(String, u32)>,
    /// The template's tokens before and after a sequence, for documents encoded in pieces.
    template: (Vec<u32>, Vec<u32>),
    /// The byte-level path, when this tokenizer is one it reproduces (byte_level.rs).
    fast: Option<ByteLevel>,
    /// Pieces still to encode both ways and compare; a difference turns the fast path off.
    checks: AtomicU32,
    /// The fast path is on.
    fast_on: AtomicBool,
}

/// Environment variable: `1` encodes every piece through the library, never the byte-level
/// path (to compare the two, or should the path ever disagree).
pub const LIBRARY_ENV: &str = "ZRUN_PREPARE_LIBRARY";

/// Pieces of a run encoded by both paths and compared before the fast path is trusted alone.
const CHECKED_PIECES: u32 = 64;

/// One piece of a document for [`Tokenizer::encode_pieces`]: a whole document is its first
/// and last piece.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece<'a> {
    /// The text.
    pub text: &'a str,
    /// It starts the document.
    pub first: bool,
    /// It ends the document.
    pub last: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("templated", &self.templated)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `path`; `key` names where it was given (`data.tokenizer`, `--tokenizer`) in
    /// errors. The separator is [`Eos::Auto`]'s until [`Tokenizer::set_eos`].
    pub fn load(path: &Path, key: &'static str) -> Result<Tokenizer, DataError> {
        let bad = |reason: String| DataError::Tokenizer {
            key,
            path: path.to_path_buf(),
            reason,
        };
        let bytes =
            crate::data::read_at_most(path, MAX_TOKENIZER_BYTES).map_err(|e| bad(e.to_string()))?;
        let mut inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| bad(one_line(&e.to_string())))?;
        inner
            .with_truncation(None)
            .map_err(|e| bad(one_line(&e.to_string())))?;
        inner.with_padding(None);
        // The largest id + 1, which is what an embedding must hold (ids may have gaps).
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        if vocab_size == 0 {
            return Err(bad("its vocabulary is empty".into()));
        }
        let ids = |text: &str, special: bool| -> Result<Vec<u32>, DataError> {
            Ok(inner
                .encode_fast(text, special)
                .map_err(|e| bad(one_line(&e.to_string())))?
                .get_ids()
                .to_vec())
        };
        let empty = ids("", true)?;
        let templated = !empty.is_empty();
        // The template around a probe's tokens splits into what goes before and after.
        let (with, without) = (ids("a", true)?, ids("a", false)?);
        let template = match with
            .windows(without.len().max(1))
            .position(|w| w == without)
        {
            Some(at) if !without.is_empty() => {
                (with[..at].to_vec(), with[at + without.len()..].to_vec())
            }
            _ => (empty, Vec::new()),
        };
        let added: Vec<String> = inner
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.clone())
            .collect();
        let library_only = std::env::var(LIBRARY_ENV).is_ok_and(|v| v == "1");
        let fast = serde_json::from_slice(&bytes)
            .ok()
            .filter(|_| !library_only)
            .and_then(|json| ByteLevel::detect(&json, &added));
        let mut t = Tokenizer {
            inner,
            path: path.to_path_buf(),
            vocab_size,
            templated,
            eos: None,
            template,
            fast_on: AtomicBool::new(fast.is_some()),
            fast,
            checks: AtomicU32::new(CHECKED_PIECES),
        };
        t.set_eos(&Eos::Auto, key)?;
        Ok(t)
    }

    /// Chooses the token appended after every document; a named token missing from the
    /// vocabulary is an error naming `key` (the flag or config key that gave it).
    pub fn set_eos(&mut self, eos: &Eos, key: &'static str) -> Result<(), DataError> {
        self.eos = match eos {
            Eos::None => None,
            Eos::Auto if self.templated => None,
            Eos::Auto => EOS_CANDIDATES
                .iter()
                .find_map(|&t| self.inner.token_to_id(t).map(|id| (t.to_string(), id))),
            Eos::Token(t) => {
                let id = self
                    .inner
                    .token_to_id(t)
                    .ok_or_else(|| DataError::UnknownToken {
                        key,
                        token: t.clone(),
                        tokenizer: self.path.clone(),
                    })?;
                Some((t.clone(), id))
            }
        };
        Ok(())
    }

    /// The token appended after every document and its id, if any.
    pub fn eos(&self) -> Option<(&str, u32)> {
        self.eos.as_ref().map(|(t, id)| (t.as_str(), *id))
    }

    /// Encodes pieces of documents in parallel on rayon's pool, each piece's ids in order.
    /// A whole document is `encode(text)` with the template's tokens, then the end-of-text
    /// token; a document in several pieces gets the template's leading tokens on its first
    /// piece, its trailing ones and the end-of-text token on its last, and the pieces are
    /// encoded without the template. Byte-level BPE tokenizers take the faster path of
    /// byte_level.rs, checked against the library on the first pieces of every run. On
    /// failure: the failing piece's position and the tokenizer's error in one line.
    pub(crate) fn encode_pieces(
        &self,
        pieces: &[Piece<'_>],
    ) -> Result<Vec<Vec<u32>>, (usize, String)> {
        use rayon::prelude::*;
        pieces
            .par_iter()
            .enumerate()
            .map(|(i, p)| {
                let mut ids = match self.encode_fast_path(p) {
                    Some(Ok(ids)) => Ok(ids),
                    None => self.encode_library(p),
                    Some(Err(e)) => Err(e),
                }
                .map_err(|e| (i, one_line(&e.to_string())))?;
                ids.extend(self.eos.as_ref().filter(|_| p.last).map(|(_, id)| *id));
                Ok(ids)
            })
            .collect()
    }

    /// A piece through the library: its ids with the template's tokens it gets.
    fn encode_library(&self, p: &Piece<'_>) -> tokenizers::Result<Vec<u32>> {
        let whole = p.first && p.last;
        let enc = self.inner.encode_fast(p.text, whole)?;
        let (before, after) = &self.template;
        let before: &[u32] = if p.first && !whole { before } else { &[] };
        let after: &[u32] = if p.last && !whole { after } else { &[] };
        Ok([before, enc.get_ids(), after].concat())
    }

    /// A piece through the byte-level path, when it applies (None: use the library).
    fn encode_fast_path(&self, p: &Piece<'_>) -> Option<tokenizers::Result<Vec<u32>>> {
        let fast = self.fast.as_ref()?;
        if !self.fast_on.load(Ordering::Relaxed) {
            return None;
        }
        let (before, after) = &self.template;
        let mut ids = Vec::with_capacity(p.text.len() / 3 + 4);
        if p.first {
            ids.extend_from_slice(before);
        }
        match fast.encode(self.inner.get_model(), p.text, &mut ids) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => return Some(Err(e)),
        }
        if p.last {
            ids.extend_from_slice(after);
        }
        let check = self
            .checks
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if check {
            let library = self.encode_library(p);
            if library.as_ref().ok() != Some(&ids) {
                if self.fast_on.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        "{}: the byte-level fast path disagrees with the tokenizers library \
                         on a document; encoding with the library (slower) from here on",
                        self.path.display()
                    );
                }
                return Some(library);
            }
        }
        Some(Ok(ids))
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The largest token id + 1 (added tokens included): what `model.vocab_size` must reach.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Refuses a tokenizer (`data.tokenizer`) whose ids a model of `vocab_size` cannot hold.
    pub fn fits(&self, vocab_size: usize) -> Result<(), DataError> {
        if self.vocab_size > vocab_size {
            return Err(DataError::TokenizerVocab {
                path: self.path.clone(),
                tokenizer_vocab: self.vocab_size,
                vocab_size,
            });
        }
        Ok(())
    }

    /// How documents are separated, for summaries: "each ended by <|endoftext|> (id 50256)".
    pub fn separator(&self) -> String {
        match (&self.eos, self.templated) {
            (Some((t, id)), _) => format!("each ended by {t} (id {id})"),
            (None, true) => "each marked by the tokenizer's template".into(),
            (None, false) => "joined without a separator".into(),
        }
    }

    /// Encodes documents (in parallel) and appends their tokens to `out`, each followed by the
    /// separator; `paths[i]` names `texts[i]` in errors. A document longer than
    /// [`super::PIECE_BYTES`] is encoded in pieces, as `zrun prepare` does: the library holds
    /// a few hundred bytes per byte of a text it encodes at once.
    pub fn encode_documents(
        &self,
        texts: &[&str],
        paths: &[&Path],
        out: &mut Vec<u32>,
    ) -> Result<(), DataError> {
        self.encode_documents_in(texts, paths, out, super::PIECE_BYTES)
    }

    /// [`Tokenizer::encode_documents`] in pieces of at most `limit` bytes.
    fn encode_documents_in(
        &self,
        texts: &[&str],
        paths: &[&Path],
        out: &mut Vec<u32>,
        limit: usize,
    ) -> Result<(), DataError> {
        let mut pieces: Vec<Piece<'_>> = Vec::new();
        let mut doc_of = Vec::new();
        for (d, text) in texts.iter().enumerate() {
            let mut rest: &str = text;
            let mut first = true;
            loop {
                let end = if rest.len() > limit {
                    super::prepare::cut(rest.as_bytes(), limit)
                } else {
                    rest.len()
                };
                let (piece, after) = rest.split_at(end);
                pieces.push(Piece {
                    text: piece,
                    first,
                    last: after.is_empty(),
                });
                doc_of.push(d);
                if after.is_empty() {
                    break;
                }
                (rest, first) = (after, false);
            }
        }
        let ids = self
            .encode_pieces(&pieces)
            .map_err(|(i, reason)| self.encode_error(paths[doc_of[i]], &reason))?;
        for v in ids {
            out.extend_from_slice(&v);
        }
        Ok(())
    }

    /// Reads and encodes text files in order, in batches of up to 32 MiB; `key` names them
    /// in errors (`data.path`, `input`). Calls `sink` with the tokens of each batch.
    pub fn encode_files(
        &self,
        files: &[PathBuf],
        key: &'static str,
        mut sink: impl FnMut(&[u32]) -> Result<(), DataError>,
    ) -> Result<(), DataError> {
        let mut ids = Vec::new();
        let mut start = 0;
        while start < files.len() {
            let mut texts = Vec::new();
            let mut bytes = 0;
            let mut end = start;
            while end < files.len() && texts.len() < BATCH_TEXTS && bytes < BATCH_BYTES {
                let text = read_text(&files[end], key)?;
                bytes += text.len();
                texts.push(text);
                end += 1;
            }
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let paths: Vec<&Path> = files[start..end].iter().map(PathBuf::as_path).collect();
            ids.clear();
            self.encode_documents(&refs, &paths, &mut ids)?;
            sink(&ids)?;
            start = end;
        }
        Ok(())
    }

    fn encode_error(&self, path: &Path, reason: &str) -> DataError {
        DataError::Encode {
            path: path.to_path_buf(),
            tokenizer: self.path.clone(),
            reason: one_line(reason),
        }
    }
}

/// The largest `tokenizer.json` read: the largest published ones are tens of MiB.
pub(crate) const MAX_TOKENIZER_BYTES: u64 = 512 << 20;

/// The tokenizer a run uses: `data.tokenizer` when set, else `tokenizer.json` in `init_from`
/// (the directory of the model the run starts from) when that file exists, else none.
pub fn tokenizer_path(cfg: &DataConfig, init_from: Option<&Path>) -> Option<PathBuf> {
    cfg.tokenizer.clone().or_else(|| {
        init_from
            .map(|dir| dir.join("tokenizer.json"))
            .filter(|p| p.is_file())
    })
}

/// A UTF-8 text file as a string; `key` names it in errors.
pub(crate) fn read_text(path: &Path, key: &'static str) -> Result<String, DataError> {
    let bytes = crate::data::read_regular(path).map_err(|source| DataError::Io {
        key,
        path: path.to_path_buf(),
        op: "read",
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| DataError::InvalidUtf8 {
        key,
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to() as u64,
    })
}

fn one_line(msg: &str) -> String {
    msg.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A word-level tokenizer.json: words split on whitespace, `[UNK]` for the rest, and the
    /// given added special tokens after the words.
    pub(crate) fn word_level(words: &[&str], special: &[&str]) -> String {
        let mut vocab: Vec<String> = words
            .iter()
            .enumerate()
            .map(|(i, w)| format!("{w:?}: {i}"))
            .collect();
        let unk = words.len();
        vocab.push(format!("\"[UNK]\": {unk}"));
        let added: Vec<String> = special
            .iter()
            .enumerate()
            .map(|(i, t)| {
                vocab.push(format!("{t:?}: {}", unk + 1 + i));
                format!(
                    r#"{{"id": {}, "content": {t:?}, "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}}"#,
                    unk + 1 + i
                )
            })
            .collect();
        format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null,
                "added_tokens": [{}], "normalizer": null,
                "pre_tokenizer": {{"type": "WhitespaceSplit"}}, "post_processor": null,
                "decoder": null,
                "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "[UNK]"}}}}"#,
            added.join(", "),
            vocab.join(", ")
        )
    }

    fn load(json: &str) -> Tokenizer {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer.json");
        std::fs::write(&p, json).unwrap();
        Tokenizer::load(&p, "--tokenizer").unwrap()
    }

    #[test]
    fn documents_end_with_the_end_of_text_token() {
        let mut t = load(&word_level(&["a", "b"], &["<|endoftext|>"]));
        assert_eq!(t.vocab_size(), 4);
        let mut out = Vec::new();
        let p = Path::new("x.txt");
        t.encode_documents(&["a b zz", "b"], &[p, p], &mut out)
            .unwrap();
        assert_eq!(out, [0, 1, 2, 3, 1, 3]);
        assert!(t.separator().contains("<|endoftext|> (id 3)"));
        t.set_eos(&Eos::None, "--eos").unwrap();
        out.clear();
        t.encode_documents(&["a", "b"], &[p, p], &mut out).unwrap();
        assert_eq!(out, [0, 1]);
        t.set_eos(&"b".parse().unwrap(), "--eos").unwrap();
        out.clear();
        t.encode_documents(&["a"], &[p], &mut out).unwrap();
        assert_eq!(out, [0, 1]);
        let e = t
            .set_eos(&Eos::Token("<nope>".into()), "--eos")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--eos <nope>") && e.contains("tokenizer.json"),
            "{e}"
        );
        // Without an end-of-text token, documents are joined as they are.
        let t = load(&word_level(&["a", "b"], &[]));
        assert!(t.separator().contains("without"));
    }

    #[test]
    fn long_documents_encode_in_pieces_as_a_whole() {
        let mut t = load(&word_level(&["a", "b"], &["<|endoftext|>"]));
        t.set_eos(&Eos::Auto, "--eos").unwrap();
        let long: String = (0..200)
            .map(|i| ["a b\n", "b\n", "a a b\n"][i % 3])
            .collect();
        let texts = [long.as_str(), "b a", long.as_str()];
        let p = Path::new("x.txt");
        let (mut whole, mut cut) = (Vec::new(), Vec::new());
        t.encode_documents_in(&texts, &[p; 3], &mut whole, usize::MAX)
            .unwrap();
        t.encode_documents_in(&texts, &[p; 3], &mut cut, 16)
            .unwrap();
        assert_eq!(cut, whole);
        // One end-of-text per document, not per piece.
        assert_eq!(cut.iter().filter(|&&i| i == 3).count(), 3);
    }

    #[test]
    fn tokenizer_path_prefers_the_config_key() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = DataConfig::default();
        assert_eq!(tokenizer_path(&cfg, Some(dir.path())), None);
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        assert_eq!(
            tokenizer_path(&cfg, Some(dir.path())),
            Some(dir.path().join("tokenizer.json"))
        );
        assert_eq!(tokenizer_path(&cfg, None), None);
        cfg.tokenizer = Some("other.json".into());
        assert_eq!(
            tokenizer_path(&cfg, Some(dir.path())),
            Some(PathBuf::from("other.json"))
        );
    }

    #[test]
    fn bad_tokenizer_files_are_one_line_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.json");
        let e = Tokenizer::load(&missing, "--tokenizer")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--tokenizer ") && e.contains("missing.json"),
            "{e}"
        );
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{\"model\":\n 3}").unwrap();
        let e = Tokenizer::load(&bad, "data.tokenizer")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("data.tokenizer ") && e.contains("bad.json") && !e.contains('\n'),
            "{e}"
        );
    }
}
