//! Training and eval data: synthetic Markov chain, token files (uint16 or uint32, with
//! llm.c's header or nanoGPT's headerless uint16), UTF-8 text as bytes or encoded by a
//! Hugging Face tokenizer, token-shard directories, and `zrun prepare`, which writes them from
//! JSON Lines, Parquet and text.
//!
//! A [`Dataset`] maps a global sample index to one sequence window, deterministically from
//! the seed, so any rank can read any sample without coordination. A [`Loader`] turns the
//! global batch schedule into one rank's micro-batches:
//!
//! ```text
//! step at cursor c consumes G = grad_accum * world_size * micro_batch samples [c, c + G);
//! micro-step m of rank r reads c + m*(world_size*micro_batch) + r*micro_batch + [0, micro_batch)
//! ```
//!
//! so one rank with micro batch 4b, two ranks with 2b, or four micro-steps of b all train on
//! the same samples per step.

mod corpus;
mod error;
mod index;
mod loader;
mod prepare;
mod rng;
mod shards;
mod synthetic;
mod text;
mod token_file;
mod tokenizer;
mod tokens;

use std::path::PathBuf;

use tch::Tensor;

pub use error::DataError;
pub use index::{
    xxh3_hex, xxh3_of, InputRecord, ShardIndex, ShardRecord, TokenizerRecord, INDEX_FILE,
};
pub use loader::Loader;
pub use prepare::{
    prepare, PrepareError, PrepareOptions, Prepared, Progress, DEFAULT_SHARD_TOKENS, PIECE_BYTES,
};
pub use shards::{shard_dir, too_many_to_map};
pub use token_file::{TokenDtype, TokenWriter};
pub use tokenizer::{tokenizer_path, Eos, Tokenizer};

use corpus::Corpus;
use synthetic::MarkovChain;

/// Which data source.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// Seeded sparse Markov chain over the vocabulary; `branching` successors per state.
    Synthetic {
        /// Successors per state (`data.branching`).
        branching: usize,
    },
    /// Token file(s): a `.bin` file, or a directory with `train.bin` and optionally
    /// `val.bin`; each with llm.c's header (uint16 or uint32) or headerless uint16 as
    /// nanoGPT writes them. Memory-mapped.
    Tokens {
        /// The `.bin` file or the directory (`data.path`).
        path: PathBuf,
        /// The run's tokenizer (`data.tokenizer`, or the model's): not read by the loader,
        /// but recorded with the checkpoints and exported, so it must be the one the tokens
        /// were made with (a shard index's SHA-256), or at least fit the model.
        tokenizer: Option<PathBuf>,
    },
    /// UTF-8 text: a file, or a directory of `*.txt` files (sorted, concatenated); byte-level
    /// tokens 0..=255, or encoded by a tokenizer.
    Text {
        /// The text file or directory (`data.path`).
        path: PathBuf,
        /// A Hugging Face `tokenizer.json` to encode the text with (`data.tokenizer`); none:
        /// bytes.
        tokenizer: Option<PathBuf>,
    },
}

/// Everything a [`Dataset`] needs; the trainer fills it from its config.
#[derive(Clone, Debug)]
pub struct DataOptions {
    /// Which data source.
    pub source: DataSource,
    /// Tokens per sequence (T); a sample holds T + 1 tokens.
    pub seq_len: usize,
    /// The model's vocabulary size; every token must be below it.
    pub vocab_size: usize,
    /// Seed of the synthetic chain, its samples and the per-epoch shuffles.
    pub seed: u64,
    /// Fraction of windows held out for eval when there is no `val.bin` (at least one).
    pub eval_fraction: f64,
}

/// A split of a dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Training samples.
    Train,
    /// Held-out samples for evaluation.
    Eval,
}

/// Where a rank's reader stands; serializable so a checkpoint can resume the exact stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Cursor {
    /// Global index of the next training sample of the job.
    pub next_sample: u64,
}

/// Refuses a `data.path` that does not exist, with the error a rank opening it gives: cheap
/// enough for the launcher to check once before any rank starts (the ranks check the rest).
pub fn check_path(cfg: &crate::config::Config) -> Result<(), DataError> {
    use crate::config::DataKind;
    match (cfg.data.source, cfg.data.path.as_deref()) {
        (DataKind::Tokens, Some(p)) => tokens::present(p),
        (DataKind::Text, Some(p)) => text::present(p),
        _ => Ok(()),
    }
}

/// The concrete source behind a [`Dataset`].
#[derive(Debug)]
enum Source {
    Synthetic(MarkovChain),
    Corpus(Corpus),
}

/// An opened, validated data source: global sample index -> (inputs, targets).
#[derive(Debug)]
pub struct Dataset {
    source: Source,
    seq_len: usize,
    vocab_size: usize,
}

impl Dataset {
    /// Opens and validates the source: files exist and hold enough in-range tokens, or the
    /// synthetic chain is built and its stationary distribution computed.
    pub fn open(opts: &DataOptions) -> Result<Dataset, DataError> {
        if opts.seq_len == 0 {
            return Err(DataError::Invalid {
                key: "model.seq_len",
                value: "0".into(),
                requirement: "the sequence length must be at least 1",
            });
        }
        if opts.vocab_size == 0 || opts.vocab_size > u32::MAX as usize {
            return Err(DataError::Invalid {
                key: "model.vocab_size",
                value: opts.vocab_size.to_string(),
                requirement: "the vocabulary size must be in 1..=4294967295",
            });
        }
        if !(0.0..1.0).contains(&opts.eval_fraction) {
            return Err(DataError::Invalid {
                key: "data.eval_fraction",
                value: opts.eval_fraction.to_string(),
                requirement: "the held-out fraction must be in [0, 1), e.g. 0.1",
            });
        }
        let source = match &opts.source {
            DataSource::Synthetic { branching } => {
                Source::Synthetic(MarkovChain::build(opts.vocab_size, *branching, opts.seed)?)
            }
            DataSource::Tokens { path, tokenizer } => {
                Source::Corpus(tokens::open(path, tokenizer.as_deref(), opts)?)
            }
            DataSource::Text { path, tokenizer } => {
                Source::Corpus(text::open(path, tokenizer.as_deref(), opts)?)
            }
        };
        Ok(Dataset {
            source,
            seq_len: opts.seq_len,
            vocab_size: opts.vocab_size,
        })
    }

    /// Exact loss floor (nats/token) when known: the synthetic chain's entropy rate; None
    /// otherwise.
    pub fn loss_floor(&self) -> Option<f64> {
        match &self.source {
            Source::Synthetic(chain) => Some(chain.entropy_rate()),
            Source::Corpus(_) => None,
        }
    }

    /// Number of distinct samples (sequence windows) in a split; None for the infinite
    /// synthetic stream.
    pub fn len(&self, split: Split) -> Option<u64> {
        match &self.source {
            Source::Synthetic(_) => None,
            Source::Corpus(corpus) => Some(corpus.windows(split)),
        }
    }

    /// Tokens per sequence (T).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The vocabulary size every token is below.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// One line describing the source, for the training log.
    pub fn summary(&self) -> String {
        match &self.source {
            Source::Synthetic(chain) => format!(
                "synthetic Markov chain: vocab {}, branching {}, loss floor {:.4} nats/token \
                 (uniform would be {:.4})",
                self.vocab_size,
                chain.branching(),
                chain.entropy_rate(),
                (self.vocab_size as f64).ln()
            ),
            Source::Corpus(corpus) => corpus.summary(),
        }
    }

    /// Samples with the given global indices -> (inputs (B, T) int64, targets (B, T) int64),
    /// on the CPU; targets are inputs shifted left by one token.
    ///
    /// Train index k maps to one window: for files, window `perm_e[k % n]` of epoch
    /// `e = k / n` (a seeded shuffle per epoch); for the synthetic chain, a walk seeded by
    /// `(seed, k)`. Eval indices wrap modulo the eval split's length.
    pub fn samples(&self, split: Split, indices: &[u64]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.seq_len;
        let mut inputs = Vec::with_capacity(indices.len() * t);
        let mut targets = Vec::with_capacity(indices.len() * t);
        let mut window = Vec::with_capacity(t + 1);
        for &k in indices {
            window.clear();
            match &self.source {
                Source::Synthetic(chain) => chain.walk(split, k, t, &mut window),
                Source::Corpus(corpus) => corpus.window(split, k, &mut window),
            }
            inputs.extend_from_slice(&window[..t]);
            targets.extend_from_slice(&window[1..]);
        }
        let shape = [indices.len() as i64, t as i64];
        let to_tensor = |v: &[i64]| {
            Tensor::f_from_slice(v)
                .and_then(|x| x.f_reshape(shape))
                .map_err(|source| DataError::Tensor {
                    shape: shape.to_vec(),
                    source,
                })
        };
        Ok((to_tensor(&inputs)?, to_tensor(&targets)?))
    }
}

/// Opens `path` for reading, refusing what is not a regular file ([`zrun_ckpt::open_regular`]:
/// opened without blocking, so a FIFO or a device is an error, not a wait or an endless read);
/// the error says what it is. Returns the file and its length.
fn open_regular_len(path: &std::path::Path) -> std::io::Result<(std::fs::File, u64)> {
    match zrun_ckpt::open_regular(path)? {
        zrun_ckpt::Opened::File(file, len) => Ok((file, len)),
        zrun_ckpt::Opened::Missing => Err(std::io::Error::from_raw_os_error(libc::ENOENT)),
        zrun_ckpt::Opened::NotRegular(what) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file"),
        )),
    }
}

/// Opens `path` for reading, refusing what is not a regular file (see [`open_regular_len`]).
pub fn open_regular(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    open_regular_len(path).map(|(file, _)| file)
}

/// The whole of the regular file `path` (see [`open_regular`]) when it holds at most `max`
/// bytes; a larger one is an error saying so, before anything is read.
pub fn read_at_most(path: &std::path::Path, max: u64) -> std::io::Result<Vec<u8>> {
    let (file, len) = open_regular_len(path)?;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{len} bytes, more than the {max} such a file may have"),
        ));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, max + 1), &mut bytes)?;
    Ok(bytes)
}

/// The whole of the regular file `path` (see [`open_regular`]).
pub fn read_regular(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut open_regular(path)?, &mut bytes)?;
    Ok(bytes)
}

/// The data options of a run of `cfg` on a model of `seq_len` and `vocab_size`.
pub(crate) fn options_of(
    cfg: &crate::config::Config,
    seq_len: i64,
    vocab_size: i64,
) -> DataOptions {
    let d = &cfg.data;
    let path = d.path.clone().unwrap_or_default();
    DataOptions {
        source: match d.source {
            crate::config::DataKind::Synthetic => DataSource::Synthetic {
                branching: d.branching,
            },
            crate::config::DataKind::Tokens => DataSource::Tokens {
                path,
                tokenizer: tokenizer_path(d, cfg.model.init_from.as_deref()),
            },
            crate::config::DataKind::Text => DataSource::Text {
                path,
                tokenizer: tokenizer_path(d, cfg.model.init_from.as_deref()),
            },
        },
        seq_len: seq_len as usize,
        vocab_size: vocab_size as usize,
        seed: d.seed,
        eval_fraction: d.eval_fraction,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic(seed: u64) -> Dataset {
        Dataset::open(&DataOptions {
            source: DataSource::Synthetic { branching: 4 },
            seq_len: 16,
            vocab_size: 50,
            seed,
            eval_fraction: 0.1,
        })
        .unwrap()
    }

    #[test]
    fn read_at_most_refuses_a_larger_file_before_reading_it() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("tokenizer.json");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_at_most(&p, 10).unwrap(), b"0123456789");
        let e = read_at_most(&p, 9).unwrap_err().to_string();
        assert!(e.contains("10 bytes, more than the 9"), "{e}");
        let e = read_at_most(std::path::Path::new("/dev/zero"), 9)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    /// A FIFO, a device or a directory given as data is an error at once: a FIFO's open
    /// waited for a writer forever.
    #[test]
    fn what_is_not_a_regular_file_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("train.bin");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (sent, got) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || {
            for source in [
                DataSource::Tokens {
                    path: path.clone(),
                    tokenizer: None,
                },
                DataSource::Text {
                    path,
                    tokenizer: None,
                },
                DataSource::Tokens {
                    path: "/dev/zero".into(),
                    tokenizer: None,
                },
            ] {
                let opened = Dataset::open(&DataOptions {
                    source,
                    seq_len: 16,
                    vocab_size: 256,
                    seed: 0,
                    eval_fraction: 0.1,
                });
                let _ = sent.send(opened.err().map(|e| e.to_string()));
            }
        });
        for want in [
            "a FIFO, not a regular file",
            "a FIFO",
            "a device, not a regular file",
        ] {
            let e = got
                .recv_timeout(std::time::Duration::from_secs(20))
                .expect("opening the data blocked");
            let e = e.expect("refused");
            assert!(e.contains(want) && e.contains("data.path"), "{e}");
        }
    }

    #[test]
    fn cursor_round_trips_through_json() {
        let c = Cursor {
            next_sample: 123_456_789_012,
        };
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(json, r#"{"next_sample":123456789012}"#);
        assert_eq!(serde_json::from_str::<Cursor>(&json).unwrap(), c);
    }

    #[test]
    fn synthetic_targets_are_inputs_shifted_and_seeded() {
        let ds = synthetic(3);
        let (x, y) = ds.samples(Split::Train, &[0, 5, 9]).unwrap();
        assert_eq!(x.size(), [3, 16]);
        assert_eq!(y.size(), [3, 16]);
        assert_eq!(x.kind(), tch::Kind::Int64);
        assert!(x.narrow(1, 1, 15).equal(&y.narrow(1, 0, 15)));
        // Same seed and index -> the same sample, whatever batch it is read in.
        let (x5, _) = ds.samples(Split::Train, &[5]).unwrap();
        assert!(x5.get(0).equal(&x.get(1)));
        let (x_again, y_again) = synthetic(3).samples(Split::Train, &[0, 5, 9]).unwrap();
        assert!(x_again.equal(&x) && y_again.equal(&y));
        // Another seed or the eval split -> other samples.
        let (x_other, _) = synthetic(4).samples(Split::Train, &[0, 5, 9]).unwrap();
        assert!(!x_other.equal(&x));
        let (x_eval, _) = ds.samples(Split::Eval, &[0, 5, 9]).unwrap();
        assert!(!x_eval.equal(&x));
        assert!(ds.len(Split::Train).is_none());
        let max = x.max().int64_value(&[]);
        assert!((0..50).contains(&max));
    }

    #[test]
    fn invalid_options_name_their_key() {
        let mut opts = DataOptions {
            source: DataSource::Synthetic { branching: 4 },
            seq_len: 0,
            vocab_size: 50,
            seed: 0,
            eval_fraction: 0.1,
        };
        let e = Dataset::open(&opts).unwrap_err().to_string();
        assert!(
            e.contains("model.seq_len = 0") && e.contains("at least 1"),
            "{e}"
        );
        opts.seq_len = 8;
        opts.eval_fraction = 1.0;
        let e = Dataset::open(&opts).unwrap_err().to_string();
        assert!(
            e.contains("data.eval_fraction") && e.contains("[0, 1)"),
            "{e}"
        );
        opts.eval_fraction = 0.1;
        opts.source = DataSource::Synthetic { branching: 51 };
        let e = Dataset::open(&opts).unwrap_err().to_string();
        assert!(
            e.contains("data.branching 51") && e.contains("model.vocab_size 50"),
            "{e}"
        );
        opts.source = DataSource::Synthetic { branching: 0 };
        assert!(Dataset::open(&opts)
            .unwrap_err()
            .to_string()
            .contains("data.branching 0"));
    }
}
