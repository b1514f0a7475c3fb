//! `zrun prepare --tokenizer tokenizer.json INPUT... -o DIR`: documents from text, JSON Lines
//! (plain, `.gz`, `.zst`) and Parquet files encoded by a Hugging Face tokenizer on every core
//! into token shards (`DIR/train-NNNNN.bin`, `DIR/val-NNNNN.bin`, llm.c's header; uint16
//! tokens when the vocabulary has at most 65536 of them, uint32 otherwise) and
//! `DIR/index.json`, ready for `data.source = "tokens"` with `data.path = DIR`. SIGINT, SIGTERM
//! or SIGHUP removes what the run wrote (and `DIR`, when it made it), leaves a previous output
//! as it was, and exits 128+N with one line (export.rs has the signal handling).

mod progress;

use std::path::PathBuf;
use std::time::Instant;

use zrun_train::data::{Eos, PrepareOptions, ShardIndex};

use crate::export::{catch_signals, interrupted, stopped};
use crate::launch::{output, BadInput, Level};

/// Flags of `zrun prepare`.
#[derive(clap::Args, Debug, Clone)]
pub struct PrepareArgs {
    /// The Hugging Face tokenizer.json to encode with.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Files or directories, read in the order given: *.jsonl, *.json, *.ndjson (one JSON
    /// object per line; .gz or .zst compressed too), *.parquet, and text (any other file: one
    /// document each). A directory stands for those files in it, recursively, sorted by path
    /// (text as *.txt).
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// The directory to write the shards and index.json into (created if missing). It must be
    /// new, empty, or hold only a previous zrun prepare's output, which is replaced.
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    pub output: PathBuf,
    /// The JSON key or Parquet column that holds each document's text.
    #[arg(long, default_value = "text", value_name = "NAME")]
    pub field: String,
    /// Share of the documents written to the val shards, in [0, 0.5]: document k (0-based, in
    /// input order) goes to val when floor((k+1)F) > floor(kF), one in 1/F spread evenly; 0
    /// writes no val shards (training then holds out data.eval_fraction of the train shards).
    #[arg(long, default_value_t = 0.05, value_name = "F")]
    pub val_fraction: f64,
    /// The token appended after every document: `auto` (the tokenizer's end-of-text token,
    /// e.g. <|endoftext|>, unless its template already marks each document, as Llama 3's
    /// <|begin_of_text|> does), `none`, or a token of the vocabulary.
    #[arg(long, default_value = "auto", value_name = "TOKEN")]
    pub eos: Eos,
    /// Tokens per shard (every shard but the last of a split holds exactly this many), with
    /// an optional K, M or G suffix (thousands, millions, billions).
    #[arg(long, default_value = "100M", value_name = "N", value_parser = parse_count)]
    pub shard_tokens: u64,
    /// Stop after this many documents (a quick look at a large corpus).
    #[arg(long, value_name = "N")]
    pub limit_docs: Option<u64>,
    /// Count and skip bad input instead of stopping: JSON Lines lines that are not JSON or
    /// lack the field, null Parquet values, Parquet files without the column, and the rest of
    /// a file whose compressed stream or row group cannot be decoded.
    #[arg(long)]
    pub skip_bad: bool,
}

/// `100M` -> 100000000: an integer with an optional K, M or G (powers of 1000), or a decimal
/// with one of them (`2.5M`).
fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, scale) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let scale = match c.to_ascii_uppercase() {
                'K' => 1e3,
                'M' => 1e6,
                'G' => 1e9,
                _ => return Err(format!("{s:?}: the suffix must be K, M or G, e.g. 100M")),
            };
            (&t[..i], scale)
        }
        _ => (t, 1.0),
    };
    let bad = || format!("{s:?} is not a token count; give e.g. 100M or 5000000");
    if scale == 1.0 {
        return num.parse::<u64>().map_err(|_| bad());
    }
    let v: f64 = num.parse().map_err(|_| bad())?;
    let n = (v * scale).round();
    if !(0.0..1e19).contains(&n) {
        return Err(bad());
    }
    Ok(n as u64)
}

/// Runs `zrun prepare`; every failure (tokenizer, inputs, output directory) is bad input
/// (exit code 2).
pub fn run(args: &PrepareArgs) -> anyhow::Result<u8> {
    let mut opts = PrepareOptions::new(
        args.tokenizer.clone(),
        args.inputs.clone(),
        args.output.clone(),
    );
    opts.field = args.field.clone();
    opts.val_fraction = args.val_fraction;
    opts.eos = args.eos.clone();
    opts.shard_tokens = args.shard_tokens;
    opts.limit_docs = args.limit_docs;
    opts.skip_bad = args.skip_bad;
    catch_signals()?;
    let existed = args.output.exists();
    let start = Instant::now();
    let mut shown = progress::Shown::start();
    let stop = || interrupted().is_some();
    let result = zrun_train::data::prepare(&opts, &mut |p| shown.update(p), &stop);
    shown.finish();
    let Some(p) = result.map_err(|e| BadInput(e.to_string()))? else {
        let removed = if existed {
            format!(
                "the partial output (its .tmp shards) from {}, which holds what it held before",
                args.output.display()
            )
        } else {
            format!("the partial output {}", args.output.display())
        };
        return Ok(stopped("prepare", &removed));
    };
    let secs = start.elapsed().as_secs_f64();
    if let Some((n, first)) = &p.textless {
        output::say(
            Level::Warn,
            &format!(
                "warning: {n} of {} document(s) encoded to no token of their own (the first at {first}): --tokenizer {} drops what its vocabulary lacks; their text is not in the shards",
                p.documents,
                args.tokenizer.display()
            ),
        );
    }
    if let Some((n, first)) = &p.unread {
        output::say(
            Level::Warn,
            &format!(
                "note: {n} entr{} of the input directories not read (only .jsonl, .json, .ndjson, optionally .gz or .zst, .parquet and .txt files are; linked directories are not followed), the first {}",
                if *n == 1 { "y" } else { "ies" },
                first.display()
            ),
        );
    }
    let ix = &p.index;
    if let Some(why) = zrun_train::data::too_many_to_map(ix.train.len() + ix.val.len()) {
        output::say(
            Level::Warn,
            &format!(
                "warning: {}: {why}; training on this machine refuses the directory as it is",
                p.index_path.display()
            ),
        );
    }
    let (train, val) = (ShardIndex::tokens(&ix.train), ShardIndex::tokens(&ix.val));
    let val_part = if ix.val.is_empty() {
        "no val shards".to_string()
    } else {
        format!(
            "{} val shard(s) ({val} tokens, {} document(s))",
            ix.val.len(),
            p.val_documents
        )
    };
    let skipped = if p.skipped > 0 {
        format!(", {} bad record(s) skipped", p.skipped)
    } else {
        String::new()
    };
    println!(
        "wrote {}: {} train shard(s) ({train} tokens) and {val_part}, at most {} tokens \
         each, {}, vocabulary {}, {} document(s){skipped}, {}; {:.1} s, {:.0} tokens/s",
        p.index_path.display(),
        ix.train.len(),
        args.shard_tokens,
        p.dtype.name(),
        ix.vocab_size,
        p.documents,
        p.separator,
        secs,
        (train + val) as f64 / secs.max(1e-9),
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_decimal_suffixes() {
        assert_eq!(
            parse_count("100M"),
            Ok(zrun_train::data::DEFAULT_SHARD_TOKENS)
        );
        assert_eq!(parse_count("2.5k"), Ok(2_500));
        assert_eq!(parse_count("1G"), Ok(1_000_000_000));
        assert_eq!(parse_count("4096"), Ok(4096));
        assert!(parse_count("10X").unwrap_err().contains("K, M or G"));
        assert!(parse_count("M").is_err() && parse_count("-1").is_err());
    }
}
