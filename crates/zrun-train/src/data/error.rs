//! The data module's error type: every message is one line naming the file or config key,
//! the problem and the fix.

use std::path::PathBuf;

/// Errors from opening a data source or reading batches from it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// `data.path` (or a file it implies, such as `train.bin`) does not exist.
    #[error("data.path {}: not found; expected {expected}", path.display())]
    NotFound {
        /// The missing path.
        path: PathBuf,
        /// What should be there.
        expected: &'static str,
    },
    /// A file or directory could not be read.
    #[error("{key} {}: cannot {op}: {source}; check that it exists and is readable", path.display())]
    Io {
        /// Where the path was given (`data.path`, `input`).
        key: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// What was attempted ("open", "memory-map", "read", "list directory").
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A token file whose size is not a whole number of uint16 tokens.
    #[error(
        "data.path {}: size {bytes} bytes is odd, but a token file without a header must \
         hold uint16 little-endian tokens (2 bytes each); regenerate it, e.g. \
         np.array(ids, dtype=np.uint16).tofile(path), or write it with zrun prepare",
        path.display()
    )]
    OddSize {
        /// The token file.
        path: PathBuf,
        /// Its size in bytes.
        bytes: u64,
    },
    /// Too few tokens for one train window and one eval window.
    #[error(
        "data.path {}: {tokens} tokens are too few for {what} at model.seq_len \
         {seq_len}; need at least {needed} tokens: use more data or lower model.seq_len",
        path.display()
    )]
    TooFewTokens {
        /// The file (or text directory) that is too short.
        path: PathBuf,
        /// Tokens it holds.
        tokens: u64,
        /// Tokens it needs.
        needed: u64,
        /// The sequence length the windows are cut at.
        seq_len: usize,
        /// What the tokens must cover ("one train and one eval window", ...).
        what: &'static str,
    },
    /// A token id that the model's embedding cannot hold.
    #[error(
        "data.path {}: token {token} at offset {offset} >= model.vocab_size {vocab_size}; {}",
        path.display(),
        vocab_fix(*token)
    )]
    TokenOutOfRange {
        /// The token file.
        path: PathBuf,
        /// The largest token in the file.
        token: u32,
        /// Token offset (not byte offset) of its first occurrence.
        offset: u64,
        /// The configured vocabulary size.
        vocab_size: usize,
    },
    /// A text file that is not valid UTF-8.
    #[error(
        "{key} {}: invalid UTF-8 at byte offset {offset}; text is read as UTF-8: re-encode \
         the file (e.g. iconv -t UTF-8) or tokenize it into a .bin token file",
        path.display()
    )]
    InvalidUtf8 {
        /// Where the path was given (`data.path`, `input`).
        key: &'static str,
        /// The text file.
        path: PathBuf,
        /// Byte offset of the first invalid sequence.
        offset: u64,
    },
    /// A text directory without any `*.txt` file.
    #[error(
        "data.path {}: no *.txt files in this directory; add UTF-8 .txt files or point \
         data.path at one text file",
        path.display()
    )]
    NoTextFiles {
        /// The directory.
        path: PathBuf,
    },
    /// A text source pointed at a file of documents that `zrun prepare` reads.
    #[error(
        "data.path {}: a {kind} file, but data.source = \"text\" trains on a file's raw \
         text (for JSON its keys and quotes too); encode its documents with zrun prepare \
         --tokenizer tokenizer.json -o DIR {} and set data.source = \"tokens\", data.path = \
         DIR (or rename it to .txt if its raw text is what to train on)",
        path.display(),
        path.display()
    )]
    TextOfDocuments {
        /// The file.
        path: PathBuf,
        /// What its name says it holds: "JSON Lines", "Parquet".
        kind: &'static str,
    },
    /// The text source needs 256 byte tokens.
    #[error(
        "model.vocab_size {vocab_size} is below 256, but the text source uses byte-level \
         tokens 0..=255; set model.vocab_size to at least 256"
    )]
    TextVocab {
        /// The configured vocabulary size.
        vocab_size: usize,
    },
    /// A token file whose llm.c header disagrees with the file.
    #[error(
        "data.path {}: {problem}; write the file again, e.g. with zrun prepare or llm.c's \
         write_datafile (header: 256 little-endian int32 [magic, version, token count, then \
         zeros]: 20240520, 1 for uint16 tokens or 20240801, 7 for uint32; then the tokens)",
        path.display()
    )]
    Header {
        /// The token file.
        path: PathBuf,
        /// What the header says against what the file holds.
        problem: String,
    },
    /// A token-shard directory's `index.json` that breaks the format (index.rs).
    #[error(
        "data.path {}: {problem}; prepare the directory again with zrun prepare",
        path.display()
    )]
    Index {
        /// The index file.
        path: PathBuf,
        /// The field and what is wrong with it.
        problem: String,
    },
    /// A shard that disagrees with its directory's `index.json`: missing, another size,
    /// another header or another content.
    #[error(
        "data.path {}: {problem} (listed in {}); the shard directory changed since zrun \
         prepare wrote it: prepare it again",
        path.display(),
        index.display()
    )]
    Shard {
        /// The shard file.
        path: PathBuf,
        /// The index that lists it.
        index: PathBuf,
        /// What differs.
        problem: String,
    },
    /// A `tokenizer.json` that cannot be read or parsed.
    #[error(
        "{key} {}: cannot load the tokenizer: {reason}; give a Hugging Face tokenizer.json \
         (what tokenizer.save(path) or save_pretrained(dir) writes)",
        path.display()
    )]
    Tokenizer {
        /// Where the path was given (`data.tokenizer`, `--tokenizer`).
        key: &'static str,
        /// The tokenizer file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A run's tokenizer that is not the one its token shards were prepared with.
    #[error(
        "data.tokenizer {} (or model.init_from's tokenizer.json, where data.tokenizer is \
         unset): not the tokenizer the shards were made with ({} records {recorded}, SHA-256 \
         {recorded_sha}..., this file's is {sha}...); its ids would mean other text, and it \
         is recorded with the checkpoints and exported as the model's: name the file zrun \
         prepare used",
        path.display(),
        index.display()
    )]
    TokenizerMismatch {
        /// The run's tokenizer file.
        path: PathBuf,
        /// The shard index.
        index: PathBuf,
        /// The tokenizer's name the index records.
        recorded: String,
        /// The start of the SHA-256 the index records.
        recorded_sha: String,
        /// The start of the run's tokenizer's SHA-256.
        sha: String,
    },
    /// A tokenizer whose ids do not fit the model's embedding.
    #[error(
        "data.tokenizer {}: its vocabulary has {tokenizer_vocab} tokens, more than \
         model.vocab_size {vocab_size}; set model.vocab_size to at least {tokenizer_vocab} \
         (--set model.vocab_size={tokenizer_vocab})",
        path.display()
    )]
    TokenizerVocab {
        /// The tokenizer file.
        path: PathBuf,
        /// Its largest id + 1.
        tokenizer_vocab: usize,
        /// The configured vocabulary size.
        vocab_size: usize,
    },
    /// A separator token that the tokenizer does not have.
    #[error(
        "{key} {token}: not in the vocabulary of {}; name one of its tokens, or give \
         {key} none to join documents without a separator",
        tokenizer.display()
    )]
    UnknownToken {
        /// The flag that named it (`--eos`).
        key: &'static str,
        /// The token as given.
        token: String,
        /// The tokenizer file.
        tokenizer: PathBuf,
    },
    /// The tokenizer failed on a document.
    #[error(
        "{}: the tokenizer {} cannot encode it: {reason}; check that the text and the \
         tokenizer belong together",
        path.display(),
        tokenizer.display()
    )]
    Encode {
        /// The text file.
        path: PathBuf,
        /// The tokenizer file.
        tokenizer: PathBuf,
        /// The tokenizer's error.
        reason: String,
    },
    /// An output file that cannot be written.
    #[error(
        "{}: cannot {op}: {source}; check that the output directory (-o) can be created and \
         is writable and that the disk has room",
        path.display()
    )]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// What was attempted ("create", "write", "rename", ...).
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A token id too wide for the file's dtype.
    #[error(
        "{}: token {token} does not fit a uint16 token file; write it as uint32 (a \
         vocabulary above 65536 tokens)",
        path.display()
    )]
    TokenTooWide {
        /// The token file.
        path: PathBuf,
        /// The token.
        token: u32,
    },
    /// More tokens than an llm.c header counts.
    #[error(
        "{}: {tokens} tokens are more than the 2147483647 an llm.c header counts; split the \
         input over several output directories",
        path.display()
    )]
    TooManyTokens {
        /// The token file.
        path: PathBuf,
        /// Tokens written.
        tokens: u64,
    },
    /// The synthetic chain's branching factor is out of range.
    #[error(
        "data.branching {branching} is invalid for model.vocab_size {vocab_size}: it must be \
         in 1..={vocab_size} and branching * vocab_size <= {max_transitions}; pick a smaller \
         data.branching (e.g. 4..64)"
    )]
    Branching {
        /// The configured branching factor.
        branching: usize,
        /// The configured vocabulary size.
        vocab_size: usize,
        /// The largest transition table the chain builds.
        max_transitions: usize,
    },
    /// An option outside its valid range.
    #[error("{key} = {value} is invalid: {requirement}")]
    Invalid {
        /// The config key (`model.vocab_size`, `data.eval_fraction`, ...).
        key: &'static str,
        /// The offending value as written.
        value: String,
        /// What it must be.
        requirement: &'static str,
    },
    /// A token file with more windows than a shuffle index can address.
    #[error(
        "data.path {}: {windows} windows of model.seq_len {seq_len} exceed the 2^32 windows an \
         epoch shuffle supports; raise model.seq_len or split the file",
        path.display()
    )]
    TooManyWindows {
        /// The token file.
        path: PathBuf,
        /// Its window count.
        windows: u64,
        /// The sequence length.
        seq_len: usize,
    },
    /// Power iteration for the synthetic chain's stationary distribution did not converge.
    #[error(
        "synthetic chain (model.vocab_size {vocab_size}, data.branching {branching}): the \
         stationary distribution did not converge in {iterations} iterations (residual \
         {residual:e}); raise data.branching or change data.seed"
    )]
    NotConverged {
        /// The configured vocabulary size.
        vocab_size: usize,
        /// The configured branching factor.
        branching: usize,
        /// Iterations run.
        iterations: usize,
        /// L1 norm of piP - pi at the end.
        residual: f64,
    },
    /// A loader built with an impossible batch schedule.
    #[error(
        "data loader: {what}; check the launcher's rank and world size and the micro-batch \
         and gradient-accumulation settings"
    )]
    Schedule {
        /// What is wrong.
        what: String,
    },
    /// libtorch refused to build a batch tensor.
    #[error(
        "data: building a {shape:?} int64 batch tensor failed: {source}; check free host memory"
    )]
    Tensor {
        /// The tensor's shape.
        shape: Vec<i64>,
        /// libtorch's error.
        #[source]
        source: tch::TchError,
    },
}
/// What to do about a token beyond the vocabulary: raise it, unless no tokenizer has that
/// many tokens (the largest have a few hundred thousand), when the file is not token ids.
fn vocab_fix(token: u32) -> String {
    if token >= 1 << 24 {
        return "no tokenizer has that many tokens: the file holds something else than token \
                ids (or ids of another width); write it with zrun prepare"
            .into();
    }
    format!(
        "raise model.vocab_size to at least {}",
        u64::from(token) + 1
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absurd_token_is_not_answered_with_a_larger_vocabulary() {
        assert_eq!(vocab_fix(50257), "raise model.vocab_size to at least 50258");
        assert!(vocab_fix(u32::MAX).contains("something else than token ids"));
    }
}
