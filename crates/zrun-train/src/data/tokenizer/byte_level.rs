//! A faster path through byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's and the like)
//! that gives the library's ids without its bookkeeping.
//!
//! The `tokenizers` crate keeps, for every byte of every pre-token, where it came from
//! (`NormalizedString`), and builds an `Encoding` of strings, offsets and masks per document:
//! in a profile of `zrun prepare` over English JSON Lines those took about two thirds of the
//! time, the BPE merges a sixth. For a tokenizer without a normalizer whose pre-tokenizer is
//! `ByteLevel` (its regex or none, no prefix space), optionally after `Split` steps (a regex or a
//! string, `Isolated`, not inverted), the ids are the model's tokens of each pre-token mapped
//! to GPT-2's byte alphabet, in order. This path cuts the text with the same regexes and the
//! same engine (fancy-regex, as the library uses them: stop at the first engine error), maps
//! the bytes, and asks the library's own model for each pre-token's ids, remembered per thread
//! (most pre-tokens of natural text repeat). A piece holding one of the tokenizer's added
//! tokens goes through the library whole, as does any tokenizer this does not recognise.
//!
//! On 2 cores over 64 MB of English-like JSON Lines (benches/README.md): 4.5M tokens/s, against
//! 1.9M through the library's `encode_fast` and 1.0M for Python's `encode_batch`.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::AhoCorasick;
use fancy_regex::Regex;
use serde_json::Value;
use tokenizers::Model;

/// GPT-2's pre-tokenizer regex, as the library's `ByteLevel` compiles it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Pre-tokens remembered per thread, at most (about 100 bytes each).
const CACHE_ENTRIES: usize = 200_000;

/// A recognised byte-level tokenizer's pre-tokenization.
#[derive(Debug)]
pub(super) struct ByteLevel {
    /// Regexes applied in turn, each to every piece the previous ones left.
    splits: Vec<Regex>,
    /// Matches any added token (such pieces go through the library).
    added: Option<AhoCorasick>,
    /// Tells this tokenizer's cache entries from another's on a shared thread.
    id: u64,
    /// Byte -> GPT-2's printable character.
    chars: [char; 256],
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Pre-token -> its ids.
type Ids = ahash::AHashMap<Box<str>, Box<[u32]>>;

thread_local! {
    /// Pre-token -> ids, for the tokenizer with id `.0`.
    static CACHE: RefCell<(u64, Ids)> = RefCell::new((0, Ids::new()));
}

impl ByteLevel {
    /// The fast path for the tokenizer.json `json` when its pipeline is one this reproduces
    /// (module docs); `added` are its added tokens' contents.
    pub(super) fn detect(json: &Value, added: &[String]) -> Option<ByteLevel> {
        if !json.get("normalizer").is_none_or(Value::is_null) {
            return None;
        }
        let model = json.get("model")?;
        let dropout = model.get("dropout").and_then(Value::as_f64);
        if model.get("type")? != "BPE" || dropout.is_some_and(|p| p > 0.0) {
            return None;
        }
        let pre = json.get("pre_tokenizer")?;
        let steps: Vec<&Value> = match pre.get("type")?.as_str()? {
            "Sequence" => pre.get("pretokenizers")?.as_array()?.iter().collect(),
            _ => vec![pre],
        };
        let (last, split_steps) = steps.split_last()?;
        let mut splits = Vec::new();
        for s in split_steps {
            splits.push(split_regex(s)?);
        }
        if last.get("type")? != "ByteLevel" || last.get("add_prefix_space")? != false {
            return None;
        }
        if last.get("use_regex").is_none_or(|v| v == true) {
            splits.push(Regex::new(GPT2).ok()?);
        }
        let added = if added.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(added).ok()?)
        };
        Some(ByteLevel {
            splits,
            added,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            chars: bytes_char(),
        })
    }

    /// Appends the ids of `text` (no template) to `out`; Ok(false) when the text holds an
    /// added token and must go through the library instead.
    pub(super) fn encode(
        &self,
        model: &impl Model,
        text: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<bool> {
        if self.added.as_ref().is_some_and(|a| a.is_match(text)) {
            return Ok(false);
        }
        CACHE.with(|cache| {
            let mut cache = cache.borrow_mut();
            if cache.0 != self.id {
                *cache = (self.id, Ids::new());
            }
            let map = &mut cache.1;
            let mut mapped = String::new();
            self.each(0, text, &mut |pre: &str| {
                if let Some(ids) = map.get(pre) {
                    out.extend_from_slice(ids);
                    return Ok(());
                }
                mapped.clear();
                mapped.extend(pre.bytes().map(|b| self.chars[b as usize]));
                let ids: Box<[u32]> = model.tokenize(&mapped)?.iter().map(|t| t.id).collect();
                out.extend_from_slice(&ids);
                if map.len() < CACHE_ENTRIES {
                    map.insert(pre.into(), ids);
                }
                Ok(())
            })
        })?;
        Ok(true)
    }

    /// Calls `f` on every non-empty pre-token of `text` in order: the pieces between the
    /// match boundaries of `splits[level]`, each cut further by the next levels.
    fn each(
        &self,
        level: usize,
        text: &str,
        f: &mut dyn FnMut(&str) -> tokenizers::Result<()>,
    ) -> tokenizers::Result<()> {
        let Some(re) = self.splits.get(level) else {
            return if text.is_empty() { Ok(()) } else { f(text) };
        };
        let mut prev = 0;
        // As the library's SysRegex: the first engine error (a backtracking limit) ends the
        // matches, and the rest is one piece.
        for m in re.find_iter(text).map_while(Result::ok) {
            if prev != m.start() {
                self.each(level + 1, &text[prev..m.start()], f)?;
            }
            self.each(level + 1, &text[m.start()..m.end()], f)?;
            prev = m.end();
        }
        if prev != text.len() {
            self.each(level + 1, &text[prev..], f)?;
        }
        Ok(())
    }
}

/// A `Split` step's regex, when it is one this path reproduces.
fn split_regex(step: &Value) -> Option<Regex> {
    if step.get("type")? != "Split"
        || step.get("behavior")? != "Isolated"
        || step.get("invert")? != false
    {
        return None;
    }
    let pattern = step.get("pattern")?;
    let source = match (pattern.get("Regex"), pattern.get("String")) {
        (Some(r), _) => r.as_str()?.to_string(),
        (None, Some(s)) => fancy_regex::escape(s.as_str()?).into_owned(),
        _ => return None,
    };
    Regex::new(&source).ok()
}

/// GPT-2's map from bytes to printable characters (its encoder.py's `bytes_to_unicode`).
fn bytes_char() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    let mut chars = ['\0'; 256];
    let mut n = 0;
    for b in 0..=255u8 {
        chars[b as usize] = if printable(b) {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("below 512")
        };
    }
    chars
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE tokenizer.json: GPT-2's alphabet, a few merges, `<|endoftext|>`, and
    /// the given pre-tokenizer.
    fn bpe(pre_tokenizer: Value) -> Value {
        let chars = bytes_char();
        let mut vocab = serde_json::Map::new();
        for (i, c) in chars.iter().enumerate() {
            vocab.insert(c.to_string(), i.into());
        }
        let merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ċ Ċ", "Ġ Ġ"];
        for (i, m) in merges.iter().enumerate() {
            vocab.insert(m.replace(' ', ""), (256 + i).into());
        }
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 263, "content": "<|endoftext|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": pre_tokenizer,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": false, "use_regex": true},
            "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges}
        })
    }

    #[test]
    fn the_fast_path_gives_the_librarys_ids() {
        let gpt2 = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": true});
        let split = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}| ?\p{L}+|\s+(?!\S)|\s+|."},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
             "use_regex": false}]});
        let texts = [
            "the theme in a thin tin",
            "  leading spaces,\n\n\ntrailing   \t\r\n",
            "héllo 日本語 🙂 12345678 don't WE'LL 3.14",
            "",
            " ",
            "x<|endoftext|>y",
        ];
        for pre in [gpt2, split] {
            let json = bpe(pre);
            let lib = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
            let fast = ByteLevel::detect(&json, &["<|endoftext|>".into()]).expect("recognised");
            for t in texts {
                let want = lib.encode_fast(t, false).unwrap().get_ids().to_vec();
                let mut got = Vec::new();
                match fast.encode(lib.get_model(), t, &mut got).unwrap() {
                    true => assert_eq!(got, want, "{t:?}"),
                    false => assert!(t.contains("<|endoftext|>"), "{t:?}"),
                }
            }
        }
    }

    #[test]
    fn other_pipelines_are_left_to_the_library() {
        let mut json = bpe(serde_json::json!({"type": "ByteLevel", "add_prefix_space": true}));
        assert!(ByteLevel::detect(&json, &[]).is_none());
        json["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
        assert!(ByteLevel::detect(&json, &[]).is_none());
        json["pre_tokenizer"] = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false});
        assert!(ByteLevel::detect(&json, &[]).is_some());
        json["normalizer"] = serde_json::json!({"type": "NFC"});
        assert!(ByteLevel::detect(&json, &[]).is_none());
        json["normalizer"] = Value::Null;
        json["model"]["dropout"] = 0.1.into();
        assert!(ByteLevel::detect(&json, &[]).is_none());
    }

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let c = bytes_char();
        assert_eq!(
            (c[b'a' as usize], c[b' ' as usize], c[b'\n' as usize]),
            ('a', 'Ġ', 'Ċ')
        );
        assert_eq!((c[0], c[0xad], c[0xff]), ('Ā', 'Ń', 'ÿ'));
    }
}
