//! A token-shard directory (index.rs) opened for training: every shard checked against
//! `index.json`, memory-mapped, and the shards of a split read as one token stream.
//!
//! The train shards, concatenated in index order, are one token array; windows are cut over
//! it exactly as over one file (corpus.rs), so a window may start in one shard and end in the
//! next, and the sample order depends on the seed and the tokens only, not on how they were
//! split into shards. The val shards are the eval split the same way; without them a
//! fraction of the train windows is held out.
//!
//! At open each shard must exist, have the size the index records, carry llm.c's header with
//! the index's dtype and token count, hash (XXH3-128 of the whole file) to the index's value,
//! and hold only tokens below the model's vocabulary. The hash and the token scan share one
//! pass over the file; shards are checked on the rank's intra-op threads in parallel, and the
//! first failing shard in index order is the one reported.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use memmap2::Mmap;
use xxhash_rust::xxh3::Xxh3;

use super::corpus::{decode, Corpus, TokenStore};
use super::index::{is_shard_file, xxh3_hex, ShardIndex, ShardRecord, INDEX_FILE};
use super::token_file::{self, TokenDtype, HEADER_BYTES};
use super::tokens::max_token_with;
use super::{DataError, DataOptions};

/// The shards of one split, memory-mapped, as one token stream.
#[derive(Debug)]
pub(crate) struct Shards {
    /// Every shard file, whole (header included).
    maps: Vec<Mmap>,
    /// The token type of every shard.
    dtype: TokenDtype,
    /// `starts[i]`: the stream's index of shard i's first token; `starts[n]` is the total.
    starts: Vec<u64>,
}

impl Shards {
    /// Tokens in the stream.
    pub(crate) fn len(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Number of shards.
    pub(crate) fn count(&self) -> usize {
        self.maps.len()
    }

    /// Appends tokens `[start, start + count)` of the stream to `out`, from as many shards as
    /// they span. The range must lie inside the stream.
    pub(crate) fn extend(&self, start: u64, count: usize, out: &mut Vec<i64>) {
        let end = start + count as u64;
        // The last shard starting at or before `start` (empty shards before it are skipped).
        let mut i = self
            .starts
            .partition_point(|&s| s <= start)
            .saturating_sub(1);
        let mut pos = start;
        let w = self.dtype.bytes();
        while pos < end {
            let (first, next) = (self.starts[i], self.starts[i + 1]);
            let take = end.min(next) - pos;
            let at = HEADER_BYTES + w * (pos - first) as usize;
            decode(&self.maps[i][at..at + w * take as usize], self.dtype, out);
            pos += take;
            i += 1;
        }
    }
}

/// The token-shard directory `path` names (a directory holding `index.json`, or that file
/// itself); None for anything else (a token file, a directory of `train.bin` and `val.bin`).
pub fn shard_dir(path: &Path) -> Option<PathBuf> {
    if path.is_dir() {
        return path.join(INDEX_FILE).is_file().then(|| path.to_path_buf());
    }
    let named = path.file_name().is_some_and(|n| n == INDEX_FILE);
    named.then(|| match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    })
}

/// Opens a shard directory: the index, then every shard checked and mapped.
/// `tokenizer`, the run's, must be the file the shards were prepared with (the SHA-256 the
/// index records): it travels with the checkpoints and exports as the model's tokenizer.
pub(crate) fn open(
    dir: &Path,
    tokenizer: Option<&Path>,
    opts: &DataOptions,
) -> Result<Corpus, DataError> {
    let index = ShardIndex::read(dir)?;
    if let Some(t) = tokenizer {
        index.check_tokenizer(dir, t)?;
    }
    open_within(dir, index, opts, max_maps())
}

/// [`open`] of `index`, read from `dir`, in a process that maps at most `maps` memory
/// regions.
fn open_within(
    dir: &Path,
    index: ShardIndex,
    opts: &DataOptions,
    maps: usize,
) -> Result<Corpus, DataError> {
    let index_path = dir.join(INDEX_FILE);
    let dtype = index.token_dtype();
    unlisted(dir, &index_path, &index)?;
    if let Some(problem) = too_many_within(index.train.len() + index.val.len(), maps) {
        return Err(DataError::Index {
            path: index_path,
            problem,
        });
    }
    let check = Check {
        dir,
        index: &index_path,
        dtype,
        vocab_size: opts.vocab_size,
        index_vocab: index.vocab_size,
    };
    let threads = usize::try_from(tch::get_num_threads()).unwrap_or(1).max(1);
    let train = check.all(&index.train, threads)?;
    let (t, seed) = (opts.seq_len, opts.seed);
    let label = format!(
        "token shards {} ({} train and {} val shards, {}, llm.c header)",
        dir.display(),
        train.count(),
        index.val.len(),
        dtype.name()
    );
    if index.val.is_empty() {
        let store = TokenStore::Shards(train);
        return Corpus::with_held_out(label, store, &index_path, t, seed, opts.eval_fraction);
    }
    let val = check.all(&index.val, threads)?;
    Corpus::with_eval_file(
        label,
        (TokenStore::Shards(train), &index_path),
        (TokenStore::Shards(val), &index_path),
        "from the val shards".into(),
        t,
        seed,
    )
}

/// Why a process on this machine cannot map `shards` shards, when it cannot: more than
/// `vm.max_map_count` allows beside what the process maps for itself.
pub fn too_many_to_map(shards: usize) -> Option<String> {
    too_many_within(shards, max_maps())
}

/// [`too_many_to_map`] where a process maps at most `maps` regions.
fn too_many_within(shards: usize, maps: usize) -> Option<String> {
    (shards + MAP_HEADROOM > maps).then(|| format!(
        "{shards} shards, each memory-mapped, but a process here maps at most {maps} regions (vm.max_map_count) and needs about {MAP_HEADROOM} for itself: raise vm.max_map_count, or give it fewer shards (a larger --shard-tokens)"
    ))
}

/// Memory regions a rank maps besides its shards (libraries, threads, allocator arenas).
const MAP_HEADROOM: usize = 8192;

/// The most memory regions a process may map (`vm.max_map_count`; Linux's default when the
/// file cannot be read).
fn max_maps() -> usize {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65530)
}

/// Refuses a directory holding a shard of prepare's naming (`train-NNNNN.bin`,
/// `val-NNNNN.bin`) that `index` does not list: training would skip its tokens without a
/// word (an edited index, or shards of another prepare run mixed in).
fn unlisted(dir: &Path, index_path: &Path, index: &ShardIndex) -> Result<(), DataError> {
    let listed: std::collections::HashSet<&str> = index
        .train
        .iter()
        .chain(&index.val)
        .map(|r| r.file.as_str())
        .collect();
    let entries = std::fs::read_dir(dir).map_err(|source| DataError::Io {
        key: "data.path",
        path: dir.to_path_buf(),
        op: "list directory",
        source,
    })?;
    let mut extra: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| is_shard_file(n) && !listed.contains(n.as_str()))
        .collect();
    extra.sort();
    match extra.first() {
        None => Ok(()),
        Some(first) => Err(DataError::Index {
            path: index_path.to_path_buf(),
            problem: format!(
                "{first}{} in the directory but not listed in the index: the index was edited, or shards of another prepare were added (training would skip them)",
                match extra.len() {
                    1 => " is".to_string(),
                    n => format!(" and {} more shard files are", n - 1),
                }
            ),
        }),
    }
}

/// What every shard of one directory is checked against.
struct Check<'a> {
    dir: &'a Path,
    index: &'a Path,
    dtype: TokenDtype,
    vocab_size: usize,
    /// The tokenizer's vocabulary as the index records it: no shard holds a token past it.
    index_vocab: u64,
}

impl Check<'_> {
    /// Checks and maps `records` on up to `threads` threads; the first failure in index order.
    fn all(&self, records: &[ShardRecord], threads: usize) -> Result<Shards, DataError> {
        let next = AtomicUsize::new(0);
        let mut results: Vec<Option<Result<Mmap, DataError>>> = Vec::new();
        results.resize_with(records.len(), || None);
        let done: Vec<Vec<(usize, Result<Mmap, DataError>)>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads.min(records.len()))
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(r) = records.get(i) else { break };
                            mine.push((i, self.one(r)));
                        }
                        mine
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        for (i, r) in done.into_iter().flatten() {
            results[i] = Some(r);
        }
        let mut maps = Vec::with_capacity(records.len());
        let mut starts = vec![0u64];
        for (r, rec) in results.into_iter().zip(records) {
            maps.push(r.expect("every shard was checked")?);
            // The index's totals were checked to fit in u64.
            starts.push(starts[starts.len() - 1] + rec.tokens);
        }
        Ok(Shards {
            maps,
            dtype: self.dtype,
            starts,
        })
    }

    /// One shard: exists, its size, its header, its hash and its largest token.
    fn one(&self, rec: &ShardRecord) -> Result<Mmap, DataError> {
        let path = self.dir.join(&rec.file);
        let bad = |problem: String| DataError::Shard {
            path: path.clone(),
            index: self.index.to_path_buf(),
            problem,
        };
        let io = |op| {
            let path = path.clone();
            move |source| DataError::Io {
                key: "data.path",
                path,
                op,
                source,
            }
        };
        let meta = match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(bad("missing: the shard file does not exist".into()))
            }
            r => r.map_err(io("read"))?,
        };
        if !meta.is_file() {
            return Err(bad(
                "not a regular file (a directory, pipe or device)".into()
            ));
        }
        if meta.len() != rec.bytes {
            let how = if meta.len() < rec.bytes {
                "truncated: "
            } else {
                ""
            };
            return Err(bad(format!(
                "{how}{} bytes, but the index records {} ({} tokens)",
                meta.len(),
                rec.bytes,
                rec.tokens
            )));
        }
        let file = super::open_regular(&path).map_err(io("open"))?;
        // SAFETY: the map is read-only and shards are not written while training reads them
        // (they are prepared once, before the job); a concurrent truncation would be a misuse
        // of the data directory that no reader can guard against.
        let map = unsafe { Mmap::map(&file) }.map_err(io("memory-map"))?;
        // The pass below reads the file once, in order: ask for aggressive readahead (a
        // failed hint costs only speed).
        let _ = map.advise(memmap2::Advice::Sequential);
        let layout = token_file::layout(&path, &map)?;
        if !layout.header || layout.dtype != self.dtype || layout.tokens != rec.tokens {
            let has = if layout.header {
                format!(
                    "its header says {} {} tokens",
                    layout.tokens,
                    layout.dtype.name()
                )
            } else {
                "it has no llm.c header".into()
            };
            return Err(bad(format!(
                "{has}, but the index records {} {} tokens",
                rec.tokens,
                self.dtype.name()
            )));
        }
        let mut hasher = Xxh3::new();
        hasher.update(&map[..layout.start]);
        let max = max_token_with(&map[layout.start..], layout.dtype, |chunk| {
            hasher.update(chunk)
        });
        // Training reads windows at random: back to the kernel's default readahead.
        let _ = map.advise(memmap2::Advice::Normal);
        let digest = xxh3_hex(&hasher);
        if !digest.eq_ignore_ascii_case(&rec.xxh3) {
            return Err(bad(format!(
                "its content differs from what the index records (XXH3-128 {digest}, recorded \
                 {}): it was modified, or written by another prepare or tokenizer",
                rec.xxh3
            )));
        }
        if let Some((token, offset)) = max {
            if u64::from(token) >= self.index_vocab {
                return Err(bad(format!(
                    "holds token {token} (at token {offset}), but the index records vocab_size {}: the index was edited, or the shard written with another tokenizer",
                    self.index_vocab
                )));
            }
            if token as usize >= self.vocab_size {
                return Err(DataError::TokenOutOfRange {
                    path,
                    token,
                    offset,
                    vocab_size: self.vocab_size,
                });
            }
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::super::index::{xxh3_of, TokenizerRecord, FORMAT, VERSION};
    use super::super::{DataSource, Dataset, Split, TokenWriter};
    use super::*;

    /// Writes `train` and `val` shards of `dtype` into `dir` with the index that lists them.
    fn write_dir(dir: &Path, dtype: TokenDtype, train: &[&[u32]], val: &[&[u32]]) -> ShardIndex {
        let shards = |split: &str, parts: &[&[u32]]| -> Vec<ShardRecord> {
            let mut out = Vec::new();
            for (i, tokens) in parts.iter().enumerate() {
                let file = format!("{split}-{i:05}.bin");
                let mut w = TokenWriter::create(&dir.join(&file), dtype).unwrap();
                w.write(tokens).unwrap();
                w.finish().unwrap();
                let bytes = std::fs::read(dir.join(&file)).unwrap();
                out.push(ShardRecord {
                    file,
                    tokens: tokens.len() as u64,
                    documents: 1,
                    bytes: bytes.len() as u64,
                    xxh3: xxh3_of(&bytes),
                });
            }
            out
        };
        let index = ShardIndex {
            format: FORMAT.into(),
            version: VERSION,
            dtype: dtype.name().into(),
            vocab_size: 1000,
            tokenizer: TokenizerRecord {
                name: "tokenizer.json".into(),
                sha256: "0".repeat(64),
            },
            eos: None,
            inputs: vec![],
            train: shards("train", train),
            val: shards("val", val),
        };
        index.write(dir).unwrap();
        index
    }

    fn options(path: &Path, seq_len: usize, vocab_size: usize) -> DataOptions {
        DataOptions {
            source: DataSource::Tokens {
                path: path.to_path_buf(),
                tokenizer: None,
            },
            seq_len,
            vocab_size,
            seed: 3,
            eval_fraction: 0.2,
        }
    }

    fn open(path: &Path, seq_len: usize, vocab_size: usize) -> Result<Dataset, DataError> {
        Dataset::open(&options(path, seq_len, vocab_size))
    }

    /// Every sample of a split, as rows of T + 1 tokens.
    fn windows(ds: &Dataset, split: Split) -> Vec<Vec<i64>> {
        let n = ds.len(split).unwrap();
        let (x, y) = ds.samples(split, &(0..n).collect::<Vec<u64>>()).unwrap();
        let (x, y) = (Vec::<i64>::try_from(x.flatten(0, -1)).unwrap(), {
            Vec::<i64>::try_from(y.flatten(0, -1)).unwrap()
        });
        let t = ds.seq_len();
        (0..n as usize)
            .map(|i| {
                let mut w = x[i * t..(i + 1) * t].to_vec();
                w.push(y[(i + 1) * t - 1]);
                w
            })
            .collect()
    }

    /// A headerless uint16 file of `tokens`: the baseline, written without zrun's writer.
    fn plain(path: &Path, tokens: &[u32]) {
        let b: Vec<u8> = tokens
            .iter()
            .flat_map(|&t| (t as u16).to_le_bytes())
            .collect();
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn a_shard_directory_reads_as_its_shards_concatenated() {
        let dir = tempfile::tempdir().unwrap();
        let all: Vec<u32> = (0..700u32).map(|i| (i * 37 + i / 7) % 1000).collect();
        let val: Vec<u32> = (0..150u32).map(|i| (i * 11) % 1000).collect();
        // Shards of 7 tokens (windows of 10 cross nearly every boundary), an empty one, a
        // long one, one shard of val split in two.
        let (a, b) = all.split_at(7);
        let (b, c) = b.split_at(300);
        for dtype in [TokenDtype::U16, TokenDtype::U32] {
            let d = dir.path().join(dtype.name());
            std::fs::create_dir(&d).unwrap();
            write_dir(&d, dtype, &[a, &[], b, c], &[&val[..3], &val[3..]]);
            let one = dir.path().join("one");
            std::fs::create_dir_all(&one).unwrap();
            plain(&one.join("train.bin"), &all);
            plain(&one.join("val.bin"), &val);
            let want = open(&one, 10, 1000).unwrap();
            for path in [d.clone(), d.join(INDEX_FILE)] {
                let got = open(&path, 10, 1000).unwrap();
                for split in [Split::Train, Split::Eval] {
                    assert_eq!(got.len(split), want.len(split), "{split:?}");
                    assert_eq!(windows(&got, split), windows(&want, split), "{split:?}");
                }
                let s = got.summary();
                assert!(
                    s.contains("4 train and 2 val shards") && s.contains("from the val shards")
                );
            }
            // Without val shards: the same held-out windows as one file.
            std::fs::remove_dir_all(&d).unwrap();
            std::fs::create_dir(&d).unwrap();
            write_dir(&d, dtype, &[a, b, c], &[]);
            let file = dir.path().join("all.bin");
            plain(&file, &all);
            let (got, want) = (open(&d, 10, 1000).unwrap(), open(&file, 10, 1000).unwrap());
            for split in [Split::Train, Split::Eval] {
                assert_eq!(windows(&got, split), windows(&want, split), "{split:?}");
            }
        }
        // A directory without index.json is still train.bin (and val.bin).
        let e = open(dir.path(), 10, 1000).unwrap_err().to_string();
        assert!(e.contains("train.bin") && e.contains("not found"), "{e}");
    }

    #[test]
    fn a_shard_that_disagrees_with_the_index_is_one_line_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let t: Vec<u32> = (0..100).collect();
        let fresh = || {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    std::fs::remove_dir(&p).unwrap();
                } else {
                    std::fs::remove_file(&p).unwrap();
                }
            }
            write_dir(d, TokenDtype::U16, &[&t, &t[..50]], &[&t[..40]])
        };
        let err = || open(d, 8, 1000).unwrap_err().to_string();
        let check = |e: String, file: &str, needle: &str| {
            assert!(
                e.contains(&format!("{}:", d.join(file).display()))
                    && e.contains(needle)
                    && e.contains("index.json")
                    && !e.contains('\n'),
                "{needle}: {e}"
            );
        };
        fresh();
        assert!(open(d, 8, 1000).is_ok());
        std::fs::remove_file(d.join("train-00001.bin")).unwrap();
        check(err(), "train-00001.bin", "missing");
        // A directory in a shard's place is no shard at all, not a truncated one.
        std::fs::create_dir(d.join("train-00001.bin")).unwrap();
        check(err(), "train-00001.bin", "not a regular file");

        fresh();
        let p = d.join("val-00000.bin");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 2]).unwrap();
        check(
            err(),
            "val-00000.bin",
            "truncated: 1102 bytes, but the index records 1104",
        );

        // Same size, other tokens (as another tokenizer would write).
        fresh();
        let p = d.join("train-00000.bin");
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[1100] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        check(
            err(),
            "train-00000.bin",
            "content differs from what the index records",
        );

        // A shard of the other dtype, the index's size: its header disagrees.
        fresh();
        let p = d.join("train-00001.bin");
        let mut w = TokenWriter::create(&p, TokenDtype::U32).unwrap();
        w.write(&t[..25]).unwrap();
        w.finish().unwrap();
        check(
            err(),
            "train-00001.bin",
            "header says 25 uint32 tokens, but the index records 50 uint16",
        );

        // Tokens the model's vocabulary cannot hold: the shard and the offset in it.
        fresh();
        let e = open(d, 8, 60).unwrap_err().to_string();
        assert!(
            e.contains("train-00000.bin") && e.contains("token 99 at offset 99"),
            "{e}"
        );

        // The index edited: a vocabulary its shards exceed, a shard left out of it.
        let mut index = fresh();
        index.vocab_size = 60;
        index.write(d).unwrap();
        check(
            err(),
            "train-00000.bin",
            "holds token 99 (at token 99), but the index records vocab_size 60",
        );
        let mut index = fresh();
        index.train.remove(1);
        index.write(d).unwrap();
        let e = err();
        assert!(
            e.contains("train-00001.bin is in the directory but not listed in the index")
                && e.contains("index.json"),
            "{e}"
        );
    }

    #[test]
    fn more_shards_than_a_process_maps_are_refused_before_any_is_opened() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let t: Vec<u32> = (0..100).collect();
        let mut index = write_dir(d, TokenDtype::U16, &[&t], &[]);
        // Listed, not written: the count is refused before any shard is looked at.
        let rec = index.train[0].clone();
        index.train = (0..3)
            .map(|i| ShardRecord {
                file: format!("train-{i:05}.bin"),
                ..rec.clone()
            })
            .collect();
        index.write(d).unwrap();
        let opts = options(d, 8, 1000);
        let e = open_within(d, index.clone(), &opts, MAP_HEADROOM + 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("3 shards") && e.contains("vm.max_map_count"),
            "{e}"
        );
        // One region more and the count passes: the first missing shard is what fails.
        let e = open_within(d, index, &opts, MAP_HEADROOM + 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("train-00001.bin"), "{e}");
    }

    /// The open's cost on a large directory: `ZRUN_OPEN_COST_DIR=DIR ZRUN_OPEN_COST_GB=4 cargo
    /// test --release -p zrun-train --lib open_cost -- --ignored --nocapture` writes DIR once
    /// (uint16 shards of 250M tokens) and times `Dataset::open` on 1 and 2 threads.
    #[test]
    #[ignore = "writes gigabytes; a measurement, run by hand"]
    fn open_cost() {
        let dir = PathBuf::from(std::env::var("ZRUN_OPEN_COST_DIR").unwrap());
        let gb: f64 = std::env::var("ZRUN_OPEN_COST_GB").map_or(4.0, |v| v.parse().unwrap());
        let per_shard = 250_000_000usize;
        let shards = ((gb * 1e9 / 2.0) as usize).div_ceil(per_shard);
        if !dir.join(INDEX_FILE).exists() {
            std::fs::create_dir_all(&dir).unwrap();
            let mut x = 1u64;
            let mut records = Vec::new();
            for i in 0..shards {
                let mut bytes = token_file::header(TokenDtype::U16, per_shard as u64)
                    .unwrap()
                    .to_vec();
                bytes.reserve(2 * per_shard);
                for _ in 0..per_shard {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    bytes.extend_from_slice(&(((x >> 33) % 50257) as u16).to_le_bytes());
                }
                let file = format!("train-{i:05}.bin");
                std::fs::write(dir.join(&file), &bytes).unwrap();
                records.push(ShardRecord {
                    file,
                    tokens: per_shard as u64,
                    documents: 1,
                    bytes: bytes.len() as u64,
                    xxh3: xxh3_of(&bytes),
                });
            }
            let template = tempfile::tempdir().unwrap();
            let mut index = write_dir(template.path(), TokenDtype::U16, &[&[1, 2]], &[]);
            index.train = records;
            index.vocab_size = 50257;
            index.write(&dir).unwrap();
        }
        let bytes: u64 = ShardIndex::read(&dir)
            .unwrap()
            .train
            .iter()
            .map(|s| s.bytes)
            .sum();
        for threads in [1, 2] {
            tch::set_num_threads(threads);
            let t = std::time::Instant::now();
            let ds = open(&dir, 1024, 50257).unwrap();
            let s = t.elapsed().as_secs_f64();
            eprintln!(
                "open: {} shards, {:.2} GB, {threads} thread(s): {s:.2} s, {:.2} GB/s ({} windows)",
                shards,
                bytes as f64 / 1e9,
                bytes as f64 / 1e9 / s,
                ds.len(Split::Train).unwrap()
            );
        }
    }
}
