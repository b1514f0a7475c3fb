//! `zrun prepare --tokenizer tokenizer.json INPUT... -o DIR [--val-fraction F] [--eos TOKEN]`:
//! UTF-8 text files, one document each, encoded by a Hugging Face tokenizer into
//! `DIR/train.bin` and `DIR/val.bin` (llm.c's header; uint16 tokens when the vocabulary has at
//! most 65536 of them, uint32 otherwise), ready for `data.source = "tokens"`.

use std::path::PathBuf;

use zrun_train::data::{Eos, PrepareOptions};

/// Flags of `zrun prepare`.
#[derive(clap::Args, Debug, Clone)]
pub struct PrepareArgs {
    /// The Hugging Face tokenizer.json to encode with.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// UTF-8 text files; each is one document, encoded in the order given.
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// The directory to write train.bin and val.bin into (created if missing).
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    pub output: PathBuf,
    /// Share of the tokens, taken from the end, written to val.bin, in [0, 0.5]; 0 writes no
    /// val.bin (training then holds out data.eval_fraction of train.bin).
    #[arg(long, default_value_t = 0.05, value_name = "F")]
    pub val_fraction: f64,
    /// The token appended after every document: `auto` (the tokenizer's end-of-text token,
    /// e.g. <|endoftext|>, unless its template already marks each document, as Llama 3's
    /// <|begin_of_text|> does), `none`, or a token of the vocabulary.
    #[arg(long, default_value = "auto", value_name = "TOKEN")]
    pub eos: Eos,
}

/// Runs `zrun prepare`; every failure (tokenizer, inputs, output directory) is bad input
/// (exit code 2).
pub fn run(args: &PrepareArgs) -> anyhow::Result<u8> {
    let p = zrun_train::data::prepare(&PrepareOptions {
        tokenizer: args.tokenizer.clone(),
        inputs: args.inputs.clone(),
        out_dir: args.output.clone(),
        val_fraction: args.val_fraction,
        eos: args.eos.clone(),
    })
    .map_err(zrun_train::Error::Data)?;
    let val = match &p.val_path {
        Some(path) => format!(" and {} ({} tokens)", path.display(), p.val_tokens),
        None => String::new(),
    };
    println!(
        "wrote {} ({} tokens){val}: {}, vocabulary {}, {} document(s), {}",
        p.train_path.display(),
        p.train_tokens,
        p.dtype.name(),
        p.vocab_size,
        p.documents,
        p.separator
    );
    Ok(0)
}
