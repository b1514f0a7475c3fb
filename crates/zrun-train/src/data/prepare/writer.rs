//! Token shards of one split: the split's token stream cut into files of exactly
//! `shard_tokens` tokens (the last one fewer), written as `NAME.tmp` (llm.c's header, synced)
//! and hashed once complete. Nothing is renamed here: [`super::outdir`] moves the finished
//! shards into place when the whole run has succeeded. Dropped before that, a writer removes
//! its temporary files.

use std::io::Read;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use super::super::index::{shard_file, xxh3_hex, ShardRecord};
use super::super::token_file::{write_error, TokenDtype, TokenWriter};
use super::super::DataError;

/// One split's shards being written.
pub(super) struct SplitWriter {
    dir: PathBuf,
    split: &'static str,
    dtype: TokenDtype,
    shard_tokens: u64,
    /// Complete shards: their records, in order.
    done: Vec<ShardRecord>,
    /// The shard being written, its temporary path and the documents starting in it.
    open: Option<(TokenWriter, PathBuf, u64)>,
    /// Documents started whose first token is not written yet.
    pending: u64,
    /// Temporary files this writer created and still owns.
    tmps: Vec<PathBuf>,
}

/// The temporary file of a shard.
pub(super) fn tmp_name(file: &str) -> String {
    format!("{file}.tmp")
}

impl SplitWriter {
    /// A writer of `DIR/{split}-NNNNN.bin` shards.
    pub(super) fn new(
        dir: &Path,
        split: &'static str,
        dtype: TokenDtype,
        shard_tokens: u64,
    ) -> Self {
        SplitWriter {
            dir: dir.to_path_buf(),
            split,
            dtype,
            shard_tokens,
            done: Vec::new(),
            open: None,
            pending: 0,
            tmps: Vec::new(),
        }
    }

    /// Marks the start of a document: it counts in the shard its first token lands in.
    pub(super) fn start_document(&mut self) {
        self.pending += 1;
    }

    /// Appends tokens, starting new shards as they fill.
    pub(super) fn write(&mut self, mut ids: &[u32]) -> Result<(), DataError> {
        while !ids.is_empty() {
            if self.open.is_none() {
                let file = self.file_name(self.done.len());
                let tmp = self.dir.join(tmp_name(&file));
                self.tmps.push(tmp.clone());
                self.open = Some((TokenWriter::create(&tmp, self.dtype)?, tmp, 0));
            }
            let (w, _, docs) = self.open.as_mut().expect("opened above");
            *docs += std::mem::take(&mut self.pending);
            let room = (self.shard_tokens - w.tokens()) as usize;
            let (now, rest) = ids.split_at(room.min(ids.len()));
            w.write(now)?;
            ids = rest;
            if w.tokens() == self.shard_tokens {
                self.close()?;
            }
        }
        Ok(())
    }

    /// Closes the last shard; returns the records and the temporary files holding them, in
    /// order. Documents without a token count in the last shard.
    pub(super) fn finish(mut self) -> Result<(Vec<ShardRecord>, Vec<PathBuf>), DataError> {
        if let Some((_, _, docs)) = self.open.as_mut() {
            *docs += std::mem::take(&mut self.pending);
        } else if let Some(last) = self.done.last_mut() {
            last.documents += std::mem::take(&mut self.pending);
        }
        if self.open.is_some() {
            self.close()?;
        }
        let tmps = std::mem::take(&mut self.tmps);
        Ok((std::mem::take(&mut self.done), tmps))
    }

    fn file_name(&self, i: usize) -> String {
        shard_file(self.split, i)
    }

    /// Finishes the open shard (header, sync) and hashes it.
    fn close(&mut self) -> Result<(), DataError> {
        let (w, tmp, documents) = self.open.take().expect("a shard is open");
        let tokens = w.finish()?;
        let (bytes, xxh3) = hash(&tmp)?;
        self.done.push(ShardRecord {
            file: self.file_name(self.done.len()),
            tokens,
            documents,
            bytes,
            xxh3,
        });
        Ok(())
    }
}

impl Drop for SplitWriter {
    fn drop(&mut self) {
        for t in &self.tmps {
            let _ = std::fs::remove_file(t);
        }
    }
}

/// A file's size and XXH3-128 (32 lowercase hex digits).
fn hash(path: &Path) -> Result<(u64, String), DataError> {
    let mut f = std::fs::File::open(path).map_err(write_error(path, "read back"))?;
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(write_error(path, "read back"))?;
        if n == 0 {
            return Ok((bytes, xxh3_hex(&h)));
        }
        h.update(&buf[..n]);
        bytes += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_hold_exactly_shard_tokens_and_count_documents_where_they_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SplitWriter::new(dir.path(), "train", TokenDtype::U16, 4);
        // Documents of 3, 5 and 1 tokens, then one without tokens: 9 tokens in 4 + 4 + 1.
        w.start_document();
        w.write(&[1, 2, 3]).unwrap();
        w.start_document();
        w.write(&[4, 5]).unwrap();
        w.write(&[6, 7, 8]).unwrap();
        w.start_document();
        w.write(&[9]).unwrap();
        w.start_document();
        let (records, tmps) = w.finish().unwrap();
        let got: Vec<_> = records
            .iter()
            .map(|r| (r.file.as_str(), r.tokens, r.documents, r.bytes))
            .collect();
        assert_eq!(
            got,
            [
                ("train-00000.bin", 4, 2, 1024 + 8),
                ("train-00001.bin", 4, 0, 1024 + 8),
                ("train-00002.bin", 1, 2, 1024 + 2)
            ]
        );
        assert_eq!(tmps[1], dir.path().join("train-00001.bin.tmp"));
        let bytes = std::fs::read(&tmps[1]).unwrap();
        let body: Vec<u16> = bytes[1024..]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(body, [5, 6, 7, 8]);
        let want = xxhash_rust::xxh3::xxh3_128(&bytes);
        assert_eq!(records[1].xxh3, format!("{want:032x}"));

        // A writer dropped before the end removes its files.
        let mut w = SplitWriter::new(dir.path(), "val", TokenDtype::U32, 2);
        w.write(&[1, 2, 3]).unwrap();
        assert!(dir.path().join("val-00001.bin.tmp").exists());
        drop(w);
        assert!(!dir.path().join("val-00000.bin.tmp").exists());
        assert!(!dir.path().join("val-00001.bin.tmp").exists());
    }
}
