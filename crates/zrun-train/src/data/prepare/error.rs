//! `zrun prepare`'s errors: one line each, naming the file (and line, row or byte) and the fix.

use std::path::PathBuf;

use super::super::DataError;

/// Why `zrun prepare` stopped.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The tokenizer, a text file or an output file (the data module's errors).
    #[error(transparent)]
    Data(#[from] DataError),
    /// A flag outside its range.
    #[error("{flag} {value} is invalid: {requirement}")]
    Flag {
        /// The flag (`--val-fraction`).
        flag: &'static str,
        /// Its value as given.
        value: String,
        /// What it must be.
        requirement: &'static str,
    },
    /// An input that is not a readable file or directory, or holds no input file.
    #[error("input {}: {problem}", path.display())]
    Input {
        /// The path as given.
        path: PathBuf,
        /// What is wrong and what to do.
        problem: String,
    },
    /// A JSON Lines line that is not a JSON object or holds no text under `--field`.
    #[error(
        "{}:{line}: {problem}; fix the line, name the text's key with --field, or pass \
         --skip-bad to count and skip such lines",
        path.display()
    )]
    Line {
        /// The JSON Lines file.
        path: PathBuf,
        /// The line (1-based).
        line: u64,
        /// What is wrong with it.
        problem: String,
    },
    /// A compressed stream or a Parquet file that cannot be decoded from some point on.
    #[error(
        "{}: {at}: cannot {op}: {problem}; check the file (gzip -t, zstd -t, or read it with \
         pyarrow), download it again, or pass --skip-bad to skip the rest of the file",
        path.display()
    )]
    Unreadable {
        /// The input file.
        path: PathBuf,
        /// Where ("after line 12", "row group 3 (rows 3000..4000)", "the footer").
        at: String,
        /// What was attempted ("decompress (gzip)", "read Parquet").
        op: &'static str,
        /// The decoder's error, in one line.
        problem: String,
    },
    /// A Parquet file without the text column, or whose column is not a string column.
    #[error(
        "{}: {problem} (its columns: {columns}); name the text column with --field, or pass \
         --skip-bad to skip such files",
        path.display()
    )]
    Column {
        /// The Parquet file.
        path: PathBuf,
        /// What is wrong with the column.
        problem: String,
        /// The file's top-level columns and their types.
        columns: String,
    },
    /// A null where a Parquet file's text column should hold a string.
    #[error(
        "{}: row {row} (row group {row_group}): column {field:?} is null; pass --skip-bad to \
         count and skip null rows",
        path.display()
    )]
    Null {
        /// The Parquet file.
        path: PathBuf,
        /// The row (0-based, in the file).
        row: u64,
        /// Its row group.
        row_group: usize,
        /// The column.
        field: String,
    },
    /// The tokenizer failed on a document.
    #[error(
        "{at}: the tokenizer {} cannot encode it: {reason}; check that the text and the \
         tokenizer belong together",
        tokenizer.display()
    )]
    Encode {
        /// The document ("a.jsonl:12", "b.parquet row 7", "c.txt bytes 0..262144").
        at: String,
        /// The tokenizer file.
        tokenizer: PathBuf,
        /// The tokenizer's error.
        reason: String,
    },
    /// The output directory holds a file that `zrun prepare` did not write.
    #[error(
        "-o {}: it holds {name:?}, which zrun prepare does not write; give a new or empty \
         directory, or one that only a previous zrun prepare wrote into (its output is \
         replaced)",
        dir.display()
    )]
    Foreign {
        /// The output directory.
        dir: PathBuf,
        /// The first foreign entry.
        name: String,
    },
    /// Every document with text encoded to no token of its own: the tokenizer cannot encode
    /// the inputs' text.
    #[error(
        "--tokenizer {}: every one of the {documents} document(s) with text encoded to no \
         token (the first at {first}): the tokenizer drops what its vocabulary lacks (it has \
         no unknown token); give the tokenizer of the model these shards are for",
        tokenizer.display()
    )]
    Unencodable {
        /// The tokenizer file.
        tokenizer: PathBuf,
        /// Documents with text.
        documents: u64,
        /// Where the first one is.
        first: String,
    },
    /// The inputs hold no text (only empty or white-space documents), or none for the train
    /// split.
    #[error(
        "the inputs hold no text: of {documents} document(s) read, none gave the train split \
         more than white space{}; check --field and the inputs",
        if *skipped > 0 { format!(" ({skipped} bad record(s) were skipped, --skip-bad)") } else { String::new() }
    )]
    Empty {
        /// Documents read.
        documents: u64,
        /// Bad records skipped.
        skipped: u64,
    },
}
