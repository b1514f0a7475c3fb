//! `zrun prepare`: documents from text, JSON Lines and Parquet files, encoded by a tokenizer
//! on every core, into a directory of token shards and its `index.json` (index.rs).
//!
//! ```text
//! reader thread ──batches of pieces──> encoder (rayon, all cores) ──ids──> writer thread
//!   inputs in order, document k           Tokenizer::encode_pieces          train-NNNNN.bin.tmp
//!   to val iff floor((k+1)F) > floor(kF)  (order kept)                      val-NNNNN.bin.tmp
//! ```
//!
//! Two batches wait at most between the stages, so memory stays near a few batches of a few
//! MiB plus the tokenizer's working memory for the pieces in flight, whatever the input's size:
//! documents longer than [`PIECE_BYTES`] are encoded in pieces ([`inputs::cut`] says where, and
//! why the tokens almost always equal the whole document's). The output is the same for any
//! thread count. Shards hold exactly `shard_tokens` tokens but the last of each split; they are
//! written as `NAME.tmp`, and only a run that read every input moves them into place and writes
//! the index, last (outdir.rs); a failed run removes its temporary files, and so does one told
//! to stop (a signal to `zrun prepare`), which the encoder asks after every batch.

mod batches;
mod error;
mod inputs;
mod jsonl;
mod outdir;
mod parquet;
#[cfg(test)]
mod tests;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;

use sha2::Digest;

pub use error::PrepareError;
pub(crate) use inputs::{cut, format_of, Format};

use super::index::{InputRecord, ShardIndex, TokenizerRecord, FORMAT, VERSION};
use super::token_file::TokenDtype;
use super::tokenizer::{Eos, Piece, Tokenizer};
use batches::{Batch, Halt, Meta, Origin, Sink};
use inputs::Input;
use outdir::OutDir;
use writer::SplitWriter;

/// The default `--shard-tokens`: 100M tokens (200 MB of uint16).
pub const DEFAULT_SHARD_TOKENS: u64 = 100_000_000;
/// The largest piece of a document encoded at once, in bytes: the tokenizer holds a few
/// hundred bytes per byte of text while it works, so about 50 MB per core.
pub const PIECE_BYTES: usize = 256 << 10;

/// What `zrun prepare` is asked to do.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// The Hugging Face `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// Files and directories, read in this order (inputs.rs).
    pub inputs: Vec<PathBuf>,
    /// The output directory (created if missing; a previous prepare's output is replaced).
    pub out_dir: PathBuf,
    /// The JSON key or Parquet column holding the text.
    pub field: String,
    /// Share of the documents written to the val shards, in [0, 0.5] (batches.rs).
    pub val_fraction: f64,
    /// The token appended after every document.
    pub eos: Eos,
    /// Tokens per shard (the last of a split holds fewer), in 1..=2147483647.
    pub shard_tokens: u64,
    /// Stop after this many documents.
    pub limit_docs: Option<u64>,
    /// Count and skip bad lines, rows and files instead of stopping.
    pub skip_bad: bool,
    /// The largest piece of a document encoded at once ([`PIECE_BYTES`]).
    pub piece_bytes: usize,
}

impl PrepareOptions {
    /// The defaults: field `text`, 5% val, end-of-text `auto`, 100M-token shards.
    pub fn new(tokenizer: PathBuf, inputs: Vec<PathBuf>, out_dir: PathBuf) -> PrepareOptions {
        PrepareOptions {
            tokenizer,
            inputs,
            out_dir,
            field: "text".into(),
            val_fraction: 0.05,
            eos: Eos::Auto,
            shard_tokens: DEFAULT_SHARD_TOKENS,
            limit_docs: None,
            skip_bad: false,
            piece_bytes: PIECE_BYTES,
        }
    }
}

/// Where a run stands, reported after every batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    /// Documents encoded.
    pub documents: u64,
    /// Tokens encoded.
    pub tokens: u64,
    /// Input bytes read (compressed bytes for compressed inputs).
    pub bytes_read: u64,
    /// The inputs' total size.
    pub bytes_total: u64,
}

/// What `zrun prepare` wrote.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// `DIR/index.json`.
    pub index_path: PathBuf,
    /// Its content: shards, tokens and documents of each split.
    pub index: ShardIndex,
    /// Documents read.
    pub documents: u64,
    /// Of them, in the val shards.
    pub val_documents: u64,
    /// Bad lines, rows or files skipped (`--skip-bad`).
    pub skipped: u64,
    /// Documents with text that encoded to no token of their own (only the tokens an empty
    /// document gets): the tokenizer dropped their text. With the first one's place.
    pub textless: Option<(u64, String)>,
    /// Entries of input directories not read (other kinds of file, linked directories,
    /// FIFOs, devices): how many, and the first by path.
    pub unread: Option<(u64, PathBuf)>,
    /// The shards' element type.
    pub dtype: TokenDtype,
    /// How documents are separated, in words.
    pub separator: String,
}

/// Encodes `opts.inputs` into token shards in `opts.out_dir`; `progress` is called after
/// every batch. `stop` is asked after every batch and once more before the output is put in
/// place: when it answers true, the run ends there with `None`, its temporary files removed
/// (and the directory, when this run made it), a previous output in the directory as it was.
pub fn prepare(
    opts: &PrepareOptions,
    progress: &mut dyn FnMut(&Progress),
    stop: &dyn Fn() -> bool,
) -> Result<Option<Prepared>, PrepareError> {
    check(opts)?;
    let (inputs, unread) = inputs::expand(&opts.inputs)?;
    let mut tok = Tokenizer::load(&opts.tokenizer, "--tokenizer")?;
    tok.set_eos(&opts.eos, "--eos")?;
    let sha256 = std::fs::read(&opts.tokenizer)
        .map(|b| format!("{:x}", sha2::Sha256::digest(&b)))
        .map_err(|source| super::DataError::Io {
            key: "--tokenizer",
            path: opts.tokenizer.clone(),
            op: "read",
            source,
        })?;
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let mut out = OutDir::open(&opts.out_dir)?;
    let (train, val, counts) = pipeline(opts, &tok, &inputs, out.path(), dtype, progress, stop)?;
    if counts.stopped || stop() {
        return Ok(None);
    }
    if let Some((n, first)) = &counts.textless {
        if *n == counts.with_text {
            return Err(PrepareError::Unencodable {
                tokenizer: opts.tokenizer.clone(),
                documents: *n,
                first: first.clone(),
            });
        }
    }
    // Removes what is left of the temporary files however this ends (before `out`, which
    // then removes the directory when this run made it).
    let mut staged = Staged(Vec::new());
    let (train, train_tmps) = train.finish()?;
    staged.0.extend(train_tmps);
    let (val, val_tmps) = val.finish()?;
    staged.0.extend(val_tmps);
    // Only end-of-text tokens (empty documents) are no corpus either.
    if train.is_empty() || counts.with_text == 0 {
        return Err(PrepareError::Empty {
            documents: counts.documents,
            skipped: counts.skipped,
        });
    }
    let index = ShardIndex {
        format: FORMAT.into(),
        version: VERSION,
        dtype: dtype.name().into(),
        vocab_size: tok.vocab_size() as u64,
        tokenizer: TokenizerRecord {
            name: opts.tokenizer.display().to_string(),
            sha256,
        },
        eos: tok.eos().map(|(t, _)| t.to_string()),
        inputs: inputs[..counts.inputs_read]
            .iter()
            .map(|i| InputRecord {
                name: i.path.display().to_string(),
                bytes: i.bytes,
            })
            .collect(),
        train,
        val,
    };
    if stop() {
        return Ok(None);
    }
    let index_path = out.commit(&index)?;
    Ok(Some(Prepared {
        index_path,
        index,
        documents: counts.documents,
        val_documents: counts.val_documents,
        skipped: counts.skipped,
        textless: counts.textless,
        unread: unread.first.map(|f| (unread.count, f)),
        dtype,
        separator: tok.separator(),
    }))
}

fn check(opts: &PrepareOptions) -> Result<(), PrepareError> {
    let flag = |flag, value: String, requirement| {
        Err(PrepareError::Flag {
            flag,
            value,
            requirement,
        })
    };
    if !(0.0..=0.5).contains(&opts.val_fraction) {
        return flag(
            "--val-fraction",
            opts.val_fraction.to_string(),
            "the share of documents for the val shards must be in [0, 0.5], e.g. 0.05",
        );
    }
    if !(1..=i32::MAX as u64).contains(&opts.shard_tokens) {
        return flag(
            "--shard-tokens",
            opts.shard_tokens.to_string(),
            "a shard holds 1 to 2147483647 tokens (llm.c's header counts them in an int32), \
             e.g. 100M",
        );
    }
    if opts.limit_docs == Some(0) {
        return flag("--limit-docs", "0".into(), "give at least 1 document");
    }
    if opts.field.is_empty() {
        return flag(
            "--field",
            "\"\"".into(),
            "name the JSON key or Parquet column of the text",
        );
    }
    if opts.piece_bytes < 16 {
        return flag(
            "piece size",
            opts.piece_bytes.to_string(),
            "at least 16 bytes",
        );
    }
    Ok(())
}

/// Temporary files removed when dropped (those already renamed are gone).
struct Staged(Vec<PathBuf>);

impl Drop for Staged {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Counts {
    documents: u64,
    val_documents: u64,
    /// Documents holding more than white space.
    with_text: u64,
    /// Of them, those the tokenizer encoded to nothing of their own, and the first's place.
    textless: Option<(u64, String)>,
    skipped: u64,
    /// Inputs read, from the first (all but with `--limit-docs`).
    inputs_read: usize,
    /// The encoder stopped when asked to, before the inputs' end.
    stopped: bool,
}

/// Runs the three stages (module docs); returns the two splits' writers, unfinished.
fn pipeline(
    opts: &PrepareOptions,
    tok: &Tokenizer,
    inputs: &[Input],
    dir: &Path,
    dtype: TokenDtype,
    progress: &mut dyn FnMut(&Progress),
    stop: &dyn Fn() -> bool,
) -> Result<(SplitWriter, SplitWriter, Counts), PrepareError> {
    let bytes_read = Arc::new(AtomicU64::new(0));
    let (batch_tx, batch_rx) = sync_channel(2);
    let (ids_tx, ids_rx) = sync_channel(2);
    let train = SplitWriter::new(dir, "train", dtype, opts.shard_tokens);
    let val = SplitWriter::new(dir, "val", dtype, opts.shard_tokens);
    std::thread::scope(|s| {
        let count = bytes_read.clone();
        let reader = s.spawn(move || {
            let mut sink = Sink::new(
                batch_tx,
                opts.piece_bytes,
                opts.val_fraction,
                opts.limit_docs,
                count.clone(),
            );
            let read = read_all(opts, inputs, &count, &mut sink);
            (sink.counts(), read)
        });
        let writer = s.spawn(move || write_all(ids_rx, train, val));
        let total = inputs.iter().map(|i| i.bytes).sum();
        let encoded = encode_all(batch_rx, ids_tx, tok, inputs, total, progress, stop);
        let ((documents, skipped), inputs_read) = reader
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        let written = writer
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        // The writer's own error first: the encoder stops when the writer is gone.
        let (train, val) = written?;
        let e = encoded?;
        Ok((
            train,
            val,
            Counts {
                documents,
                val_documents: e.val_documents,
                with_text: e.with_text,
                textless: e.textless,
                skipped,
                inputs_read,
                stopped: e.stopped,
            },
        ))
    })
}

/// The reader thread: every input's documents into the sink, in order; returns how many
/// inputs, from the first, were read (all but when `--limit-docs` stopped it: up to the one of
/// the last document).
fn read_all(
    opts: &PrepareOptions,
    inputs: &[Input],
    count: &Arc<AtomicU64>,
    sink: &mut Sink,
) -> usize {
    for (i, input) in inputs.iter().enumerate() {
        let i = i as u32;
        let read = match input.format {
            Format::Text => inputs::read_text(input, i, count, sink),
            Format::JsonLines(c) => {
                jsonl::read(input, i, c, &opts.field, opts.skip_bad, count, sink)
            }
            Format::Parquet => parquet::read(input, i, &opts.field, opts.skip_bad, sink),
        };
        match read {
            Ok(()) => {}
            Err(Halt::Done) => {
                let _ = sink.flush();
                return sink.last_input().map_or(0, |i| i as usize + 1);
            }
            Err(Halt::Error(e)) => {
                sink.fail(e);
                return i as usize;
            }
        }
    }
    let _ = sink.flush();
    inputs.len()
}

/// Encoded pieces on their way to the writer.
type Encoded = (Vec<Meta>, Vec<Vec<u32>>);

/// What the encoder counted.
#[derive(Default)]
struct EncodedCounts {
    /// Documents sent to val.
    val_documents: u64,
    /// Documents holding more than white space.
    with_text: u64,
    /// Of them, those encoded to no more tokens than an empty document, and the first's place.
    textless: Option<(u64, String)>,
    /// `stop` answered true: the encoder left before the last batch.
    stopped: bool,
}

/// The document being encoded: tokens so far, whether it holds text, where it starts.
struct Doc {
    tokens: usize,
    text: bool,
    start: Option<Meta>,
}

/// The encoder, on the calling thread (rayon's pool does the work). It leaves when `stop`
/// answers true after a batch; the reader and the writer then end as their channels close.
fn encode_all(
    batches: Receiver<Result<Batch, PrepareError>>,
    out: SyncSender<Encoded>,
    tok: &Tokenizer,
    inputs: &[Input],
    bytes_total: u64,
    progress: &mut dyn FnMut(&Progress),
    stop: &dyn Fn() -> bool,
) -> Result<EncodedCounts, PrepareError> {
    let mut p = Progress {
        bytes_total,
        ..Progress::default()
    };
    let mut c = EncodedCounts::default();
    // What a document of no text encodes to (the template's tokens and the end of text): a
    // document with text that gets no more lost its text to the tokenizer.
    let empty = Piece {
        text: "",
        first: true,
        last: true,
    };
    let blank = tok.encode_pieces(&[empty]).map_or(0, |ids| ids[0].len());
    let mut doc = Doc {
        tokens: 0,
        text: false,
        start: None,
    };
    for batch in batches {
        let batch = batch?;
        let pieces: Vec<Piece<'_>> = batch
            .texts
            .iter()
            .zip(&batch.meta)
            .map(|(text, m)| Piece {
                text,
                first: m.first,
                last: m.last,
            })
            .collect();
        let ids = tok
            .encode_pieces(&pieces)
            .map_err(|(i, reason)| PrepareError::Encode {
                at: place(inputs, &batch.meta[i]),
                tokenizer: tok.path().to_path_buf(),
                reason,
            })?;
        for ((m, text), ids) in batch.meta.iter().zip(&batch.texts).zip(&ids) {
            if m.first {
                doc = Doc {
                    tokens: 0,
                    text: false,
                    start: Some(*m),
                };
            }
            doc.tokens += ids.len();
            doc.text |= !text.trim().is_empty();
            if m.last && doc.text {
                c.with_text += 1;
                if doc.tokens <= blank {
                    let first = || (0, doc.start.map_or(String::new(), |s| place(inputs, &s)));
                    c.textless.get_or_insert_with(first).0 += 1;
                }
            }
        }
        let started = batch.meta.iter().filter(|m| m.first);
        p.documents += started.clone().count() as u64;
        c.val_documents += started.filter(|m| m.val).count() as u64;
        p.tokens += ids.iter().map(|v| v.len() as u64).sum::<u64>();
        p.bytes_read = batch.bytes_read;
        if out.send((batch.meta, ids)).is_err() {
            break; // the writer failed: its error is the one reported
        }
        progress(&p);
        if stop() {
            c.stopped = true;
            break;
        }
    }
    Ok(c)
}

/// The writer thread: each piece's ids into its split's shards.
fn write_all(
    encoded: Receiver<Encoded>,
    mut train: SplitWriter,
    mut val: SplitWriter,
) -> Result<(SplitWriter, SplitWriter), PrepareError> {
    for (meta, ids) in encoded {
        for (m, ids) in meta.iter().zip(&ids) {
            let w = if m.val { &mut val } else { &mut train };
            if m.first {
                w.start_document();
            }
            w.write(ids)?;
        }
    }
    Ok((train, val))
}

/// A piece's place for messages: `a.jsonl:12`, `b.parquet row 7`, `c.txt bytes 0..262144`.
fn place(inputs: &[Input], m: &Meta) -> String {
    let path = inputs[m.input as usize].path.display();
    match m.origin {
        Origin::Line(n) => format!("{path}:{n}"),
        Origin::Row(r) => format!("{path} row {r}"),
        Origin::Bytes(a, b) => format!("{path} bytes {a}..{b}"),
    }
}
