//! A finite token corpus cut into windows, with a held-out eval part and per-epoch shuffles.
//!
//! Window j of a token array holds tokens `[j*T, j*T + T + 1)` (stride T, one token of
//! overlap), so there are `(n - 1) / T` windows. Train sample k is window `perm_e[k % n]` of
//! epoch `e = k / n`, where `perm_e` is a Fisher-Yates shuffle seeded by `(seed, e)`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use memmap2::Mmap;

use super::rng::{shuffle, Rng};
use super::shards::Shards;
use super::token_file::{Layout, TokenDtype};
use super::{DataError, Split};

/// Salt of the per-epoch shuffle seeds.
const SALT_EPOCH: u64 = 0x65706f6368; // "epoch"
/// Epoch permutations kept in memory (the current one and the next, across a boundary).
const CACHED_EPOCHS: usize = 2;

/// Token storage: a memory-mapped token file, a shard directory's split, or bytes or ids,
/// mapped or owned.
#[derive(Debug)]
pub(crate) enum TokenStore {
    /// A token file (little-endian uint16 or uint32 after any header), memory-mapped.
    Mapped {
        /// The whole file.
        map: Mmap,
        /// Where its tokens are and their dtype.
        layout: Layout,
    },
    /// The shards of one split of a token-shard directory, as one stream.
    Shards(Shards),
    /// Byte tokens, memory-mapped.
    Bytes(Mmap),
    /// Byte tokens in memory (several text files concatenated).
    OwnedBytes(Vec<u8>),
    /// Token ids in memory (text encoded by a tokenizer).
    Ids(Vec<u32>),
}

impl TokenStore {
    /// Number of tokens.
    pub(crate) fn len(&self) -> u64 {
        match self {
            TokenStore::Mapped { layout, .. } => layout.tokens,
            TokenStore::Shards(s) => s.len(),
            TokenStore::Bytes(m) => m.len() as u64,
            TokenStore::OwnedBytes(v) => v.len() as u64,
            TokenStore::Ids(v) => v.len() as u64,
        }
    }

    /// The element type, for the summary: "uint32, llm.c header", "uint16, no header".
    pub(crate) fn describe(&self) -> String {
        match self {
            TokenStore::Mapped { layout, .. } => format!(
                "{}, {}",
                layout.dtype.name(),
                if layout.header {
                    "llm.c header"
                } else {
                    "no header"
                }
            ),
            TokenStore::Shards(_) => "token shards".into(),
            TokenStore::Bytes(_) | TokenStore::OwnedBytes(_) => "bytes".into(),
            TokenStore::Ids(_) => "token ids".into(),
        }
    }

    /// Appends tokens `[start, start + count)` to `out`.
    fn extend(&self, start: usize, count: usize, out: &mut Vec<i64>) {
        match self {
            TokenStore::Mapped { map, layout } => {
                let w = layout.dtype.bytes();
                let body = &map[layout.start + w * start..layout.start + w * (start + count)];
                decode(body, layout.dtype, out);
            }
            TokenStore::Shards(s) => s.extend(start as u64, count, out),
            TokenStore::Ids(v) => out.extend(v[start..start + count].iter().map(|&x| i64::from(x))),
            TokenStore::Bytes(m) => {
                out.extend(m[start..start + count].iter().map(|&x| i64::from(x)))
            }
            TokenStore::OwnedBytes(v) => {
                out.extend(v[start..start + count].iter().map(|&x| i64::from(x)))
            }
        }
    }
}

/// Appends the little-endian tokens of `dtype` in `body` to `out`.
pub(crate) fn decode(body: &[u8], dtype: TokenDtype, out: &mut Vec<i64>) {
    match dtype {
        TokenDtype::U16 => out.extend(
            body.chunks_exact(2)
                .map(|p| i64::from(u16::from_le_bytes([p[0], p[1]]))),
        ),
        TokenDtype::U32 => out.extend(
            body.chunks_exact(4)
                .map(|p| i64::from(u32::from_le_bytes([p[0], p[1], p[2], p[3]]))),
        ),
    }
}

/// Where the eval windows come from.
#[derive(Debug)]
enum EvalPart {
    /// A separate store (`val.bin`, the val shards) with its own windows, and where it came
    /// from for the summary ("from val.bin").
    Separate(TokenStore, String),
    /// The last windows of the train store, from window `first` on.
    HeldOut {
        /// Index of the first held-out window.
        first: u64,
    },
}

/// A windowed token corpus with a train and an eval split.
#[derive(Debug)]
pub(crate) struct Corpus {
    /// What it was opened from, for the summary line.
    label: String,
    train: TokenStore,
    eval: EvalPart,
    train_windows: u64,
    eval_windows: u64,
    seq_len: usize,
    seed: u64,
    /// Recently used epoch permutations, newest last.
    perms: Mutex<Vec<(u64, Arc<Vec<u32>>)>>,
}

/// Windows of stride `t` in `n` tokens.
pub(crate) fn window_count(n: u64, t: usize) -> u64 {
    n.saturating_sub(1) / t as u64
}

impl Corpus {
    /// A corpus whose eval split is a separate token store (`val.bin`, the val shards);
    /// `eval_from` says which for the summary ("from val.bin").
    pub(crate) fn with_eval_file(
        label: String,
        train: (TokenStore, &Path),
        eval: (TokenStore, &Path),
        eval_from: String,
        seq_len: usize,
        seed: u64,
    ) -> Result<Corpus, DataError> {
        let train_windows = window_count(train.0.len(), seq_len);
        let eval_windows = window_count(eval.0.len(), seq_len);
        for (store, path, windows, what) in [
            (&train.0, train.1, train_windows, "one train window"),
            (&eval.0, eval.1, eval_windows, "one eval window"),
        ] {
            if windows == 0 {
                return Err(too_few(
                    path,
                    store.len(),
                    seq_len as u64 + 1,
                    seq_len,
                    what,
                ));
            }
        }
        check_window_count(train.1, train_windows, seq_len)?;
        Ok(Corpus {
            label,
            train: train.0,
            eval: EvalPart::Separate(eval.0, eval_from),
            train_windows,
            eval_windows,
            seq_len,
            seed,
            perms: Mutex::new(Vec::new()),
        })
    }

    /// A corpus whose last `eval_fraction` of windows (at least one) are held out for eval.
    pub(crate) fn with_held_out(
        label: String,
        store: TokenStore,
        path: &Path,
        seq_len: usize,
        seed: u64,
        eval_fraction: f64,
    ) -> Result<Corpus, DataError> {
        let windows = window_count(store.len(), seq_len);
        if windows < 2 {
            let needed = 2 * seq_len as u64 + 1;
            let what = "one train and one eval window";
            return Err(too_few(path, store.len(), needed, seq_len, what));
        }
        let eval_windows = ((windows as f64 * eval_fraction) as u64).clamp(1, windows - 1);
        let train_windows = windows - eval_windows;
        check_window_count(path, train_windows, seq_len)?;
        Ok(Corpus {
            label,
            train: store,
            eval: EvalPart::HeldOut {
                first: train_windows,
            },
            train_windows,
            eval_windows,
            seq_len,
            seed,
            perms: Mutex::new(Vec::new()),
        })
    }

    /// Number of windows in a split.
    pub(crate) fn windows(&self, split: Split) -> u64 {
        match split {
            Split::Train => self.train_windows,
            Split::Eval => self.eval_windows,
        }
    }

    /// One line describing the corpus.
    pub(crate) fn summary(&self) -> String {
        let eval = match &self.eval {
            EvalPart::Separate(_, from) => from.as_str(),
            EvalPart::HeldOut { .. } => "held out from the end of train",
        };
        format!(
            "{}: {} train tokens, {} train windows and {} eval windows ({eval}) of seq_len {}",
            self.label,
            self.train.len(),
            self.train_windows,
            self.eval_windows,
            self.seq_len
        )
    }

    /// The window index (in its store) of sample `k` of `split`.
    pub(crate) fn window_index(&self, split: Split, k: u64) -> u64 {
        match split {
            Split::Train => {
                let perm = self.permutation(k / self.train_windows);
                u64::from(perm[(k % self.train_windows) as usize])
            }
            Split::Eval => {
                let w = k % self.eval_windows;
                match self.eval {
                    EvalPart::Separate(..) => w,
                    EvalPart::HeldOut { first } => first + w,
                }
            }
        }
    }

    /// Appends the T + 1 tokens of sample `k` of `split` to `out`.
    pub(crate) fn window(&self, split: Split, k: u64, out: &mut Vec<i64>) {
        let store = match (split, &self.eval) {
            (Split::Eval, EvalPart::Separate(val, _)) => val,
            _ => &self.train,
        };
        let w = self.window_index(split, k) as usize;
        store.extend(w * self.seq_len, self.seq_len + 1, out);
    }

    /// The shuffle of train windows for `epoch`, cached.
    fn permutation(&self, epoch: u64) -> Arc<Vec<u32>> {
        let mut cache = self.perms.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, perm)) = cache.iter().find(|(e, _)| *e == epoch) {
            return Arc::clone(perm);
        }
        // Window counts were checked to fit in u32 at open.
        let mut perm: Vec<u32> = (0..self.train_windows as u32).collect();
        shuffle(
            &mut perm,
            &mut Rng::from_words(&[self.seed, SALT_EPOCH, epoch]),
        );
        let perm = Arc::new(perm);
        if cache.len() >= CACHED_EPOCHS {
            cache.remove(0);
        }
        cache.push((epoch, Arc::clone(&perm)));
        perm
    }
}

fn too_few(path: &Path, tokens: u64, needed: u64, seq_len: usize, what: &'static str) -> DataError {
    DataError::TooFewTokens {
        path: PathBuf::from(path),
        tokens,
        needed,
        seq_len,
        what,
    }
}

fn check_window_count(path: &Path, windows: u64, seq_len: usize) -> Result<(), DataError> {
    if windows > u64::from(u32::MAX) {
        return Err(DataError::TooManyWindows {
            path: path.to_path_buf(),
            windows,
            seq_len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(n: usize, t: usize, frac: f64) -> Corpus {
        let bytes: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let store = TokenStore::OwnedBytes(bytes);
        Corpus::with_held_out("test".into(), store, Path::new("mem"), t, 9, frac).unwrap()
    }

    #[test]
    fn held_out_split_sizes() {
        // 101 tokens, T = 10: 10 windows; 25% -> 2 eval windows (floor), 8 train.
        let c = corpus(101, 10, 0.25);
        assert_eq!((c.windows(Split::Train), c.windows(Split::Eval)), (8, 2));
        // A zero fraction still holds out one window.
        let c = corpus(101, 10, 0.0);
        assert_eq!((c.windows(Split::Train), c.windows(Split::Eval)), (9, 1));
        // 100 tokens, T = 10: only 9 windows (the last needs token 100).
        let c = corpus(100, 10, 0.0);
        assert_eq!(c.windows(Split::Train) + c.windows(Split::Eval), 9);
    }

    #[test]
    fn each_epoch_is_a_fresh_permutation() {
        let c = corpus(1001, 10, 0.1);
        let n = c.windows(Split::Train);
        let epoch = |e: u64| -> Vec<u64> {
            (e * n..(e + 1) * n)
                .map(|k| c.window_index(Split::Train, k))
                .collect()
        };
        let (e0, e1, e2) = (epoch(0), epoch(1), epoch(2));
        let e0_again = epoch(0);
        let mut sorted = e0.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..n).collect::<Vec<_>>());
        assert_ne!(e0, e1);
        assert_ne!(e1, e2);
        assert_ne!(e0, sorted, "shuffled, not in file order");
        assert_eq!(e0, e0_again, "evicted epochs are rebuilt identically");
    }
}
