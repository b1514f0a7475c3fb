//! The reader side of `zrun prepare`: documents numbered in input order, each assigned to
//! train or val, cut into pieces of bounded size, and grouped into batches for the encoder.
//!
//! Document k (0-based, counted over all inputs) goes to val iff
//! `floor((k + 1) * F) > floor(k * F)` in f64 arithmetic, F = `--val-fraction`: one document in
//! 1/F, spread evenly, decided without knowing how many follow (F = 0.05: documents 19, 39,
//! ...). A document longer than the piece size is cut ([`super::inputs::cut`]) and its pieces
//! are encoded as parts of one document.

use std::sync::mpsc::SyncSender;

use super::error::PrepareError;
use super::inputs::cut;

/// Text bytes per batch handed to the encoder, at most (one piece may be larger).
const BATCH_BYTES: usize = 4 << 20;
/// Pieces per batch, at most.
const BATCH_PIECES: usize = 4096;

/// Where a piece comes from, for messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// A JSON Lines line (1-based).
    Line(u64),
    /// A Parquet row (0-based).
    Row(u64),
    /// A byte range of a text file.
    Bytes(u64, u64),
}

/// One piece's place: its input, origin, split and position in its document.
#[derive(Clone, Copy, Debug)]
pub(super) struct Meta {
    /// Index into the inputs.
    pub input: u32,
    /// Where in the input.
    pub origin: Origin,
    /// It starts a document.
    pub first: bool,
    /// It ends a document.
    pub last: bool,
    /// The document goes to val.
    pub val: bool,
}

/// Pieces for the encoder, in input order.
#[derive(Debug, Default)]
pub(super) struct Batch {
    /// The pieces' text.
    pub texts: Vec<String>,
    /// Their places, one per text.
    pub meta: Vec<Meta>,
    /// Input bytes read when the batch was sent (progress).
    pub bytes_read: u64,
}

/// Why reading stopped early: `--limit-docs` reached or the encoder gone (both end the reader
/// quietly), or an error.
#[derive(Debug)]
pub(super) enum Halt {
    /// Stop reading; not an error.
    Done,
    /// Stop with this error.
    Error(PrepareError),
}

impl<E: Into<PrepareError>> From<E> for Halt {
    fn from(e: E) -> Halt {
        Halt::Error(e.into())
    }
}

/// Whether document `k` goes to val at fraction `f` (module docs).
pub(super) fn is_val(k: u64, f: f64) -> bool {
    ((k + 1) as f64 * f).floor() > (k as f64 * f).floor()
}

/// Collects documents into batches and sends them to the encoder.
pub(super) struct Sink {
    tx: SyncSender<Result<Batch, PrepareError>>,
    batch: Batch,
    batch_bytes: usize,
    piece_bytes: usize,
    val_fraction: f64,
    limit: Option<u64>,
    documents: u64,
    skipped: u64,
    /// The input of the latest document.
    last_input: Option<u32>,
    val: bool,
    bytes_read: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Sink {
    /// A sink sending to `tx`; pieces of at most `piece_bytes`, documents until `limit`.
    pub(super) fn new(
        tx: SyncSender<Result<Batch, PrepareError>>,
        piece_bytes: usize,
        val_fraction: f64,
        limit: Option<u64>,
        bytes_read: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) -> Sink {
        Sink {
            tx,
            batch: Batch::default(),
            batch_bytes: 0,
            piece_bytes,
            val_fraction,
            limit,
            documents: 0,
            skipped: 0,
            last_input: None,
            val: false,
            bytes_read,
        }
    }

    /// The largest piece, in bytes.
    pub(super) fn piece_bytes(&self) -> usize {
        self.piece_bytes
    }

    /// Documents so far, and bad records skipped (`--skip-bad`).
    pub(super) fn counts(&self) -> (u64, u64) {
        (self.documents, self.skipped)
    }

    /// The input of the latest document, if any.
    pub(super) fn last_input(&self) -> Option<u32> {
        self.last_input
    }

    /// Counts a bad record skipped.
    pub(super) fn skip(&mut self) {
        self.skipped += 1;
    }

    /// Starts a document of input `input`: [`Halt::Done`] when `--limit-docs` documents were
    /// read.
    fn begin(&mut self, input: u32) -> Result<(), Halt> {
        if self.limit.is_some_and(|n| self.documents >= n) {
            return Err(Halt::Done);
        }
        self.last_input = Some(input);
        self.val = is_val(self.documents, self.val_fraction);
        self.documents += 1;
        Ok(())
    }

    /// A whole document, cut into pieces when longer than the piece size.
    pub(super) fn document(
        &mut self,
        input: u32,
        origin: Origin,
        text: String,
    ) -> Result<(), Halt> {
        if text.len() <= self.piece_bytes {
            return self.piece(input, origin, text, true, true);
        }
        let mut rest = text.as_str();
        let mut first = true;
        while rest.len() > self.piece_bytes {
            let end = cut(rest.as_bytes(), self.piece_bytes);
            self.piece(input, origin, rest[..end].to_owned(), first, false)?;
            rest = &rest[end..];
            first = false;
        }
        self.piece(input, origin, rest.to_owned(), first, true)
    }

    /// One piece of a document, in order; `first` starts a new document.
    pub(super) fn piece(
        &mut self,
        input: u32,
        origin: Origin,
        text: String,
        first: bool,
        last: bool,
    ) -> Result<(), Halt> {
        if first {
            self.begin(input)?;
        }
        self.batch_bytes += text.len();
        self.batch.texts.push(text);
        self.batch.meta.push(Meta {
            input,
            origin,
            first,
            last,
            val: self.val,
        });
        if self.batch_bytes >= BATCH_BYTES || self.batch.texts.len() >= BATCH_PIECES {
            self.flush()?;
        }
        Ok(())
    }

    /// Sends what is collected.
    pub(super) fn flush(&mut self) -> Result<(), Halt> {
        if self.batch.texts.is_empty() {
            return Ok(());
        }
        let mut batch = std::mem::take(&mut self.batch);
        batch.bytes_read = self.bytes_read.load(std::sync::atomic::Ordering::Relaxed);
        self.batch_bytes = 0;
        self.tx.send(Ok(batch)).map_err(|_| Halt::Done)
    }

    /// Sends an error to the encoder (which stops).
    pub(super) fn fail(&self, e: PrepareError) {
        let _ = self.tx.send(Err(e));
    }

    /// Adds to the input bytes read (for readers that do not count through [`super::inputs::Counted`]).
    pub(super) fn add_bytes(&self, n: u64) {
        self.bytes_read
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn val_takes_one_document_in_one_over_f() {
        let picked = |f: f64, n: u64| (0..n).filter(|&k| is_val(k, f)).collect::<Vec<_>>();
        assert_eq!(picked(0.05, 60), [19, 39, 59]);
        assert_eq!(picked(0.25, 8), [3, 7]);
        assert_eq!(picked(0.5, 4), [1, 3]);
        assert!(picked(0.0, 1000).is_empty());
        // The first document always trains; a corpus of one document has no val.
        assert!(!is_val(0, 0.5));
        // floor(n F) of the first n documents.
        let n = picked(0.013, 100_000).len();
        assert_eq!(n, (100_000.0 * 0.013f64).floor() as usize);
    }

    #[test]
    fn long_documents_are_cut_into_pieces_of_one_document() {
        let (tx, rx) = std::sync::mpsc::sync_channel(8);
        let mut sink = Sink::new(tx, 8, 0.5, Some(2), Default::default());
        sink.document(0, Origin::Line(1), "ab\ncd\nef\ngh\nijk".into())
            .unwrap();
        sink.document(0, Origin::Line(2), "short".into()).unwrap();
        assert!(matches!(
            sink.document(0, Origin::Line(3), "over the limit".into()),
            Err(Halt::Done)
        ));
        sink.flush().unwrap();
        let b = rx.recv().unwrap().unwrap();
        assert_eq!(b.texts, ["ab\ncd\n", "ef\ngh\n", "ijk", "short"]);
        let flags: Vec<_> = b.meta.iter().map(|m| (m.first, m.last, m.val)).collect();
        assert_eq!(
            flags,
            [
                (true, false, false),
                (false, false, false),
                (false, true, false),
                (true, true, true)
            ]
        );
        assert_eq!(sink.counts(), (2, 0));
    }
}
