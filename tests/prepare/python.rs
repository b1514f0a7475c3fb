//! The independent side of the prepare tests: Python's `tokenizers` (and pyarrow, gzip) in the
//! project's .venv, which scripts/setup.sh installs.

use std::path::Path;
use std::process::Command;

use crate::common::{root, stderr, write};

/// Trains a byte-level BPE on the texts (`make(style, texts)`), saves DIR/tokenizer.json and
/// returns it with the token ids appended after every document. Style `gpt2`: GPT-2's
/// pre-tokenizer, each text followed by <|endoftext|>; style `llama3`: Llama 3's split pattern
/// (case-insensitive groups, digits in threes, look-ahead) and a template that starts each text
/// with <|begin_of_text|>, and nothing after it.
const TOKENIZER: &str = r#"
import hashlib, json, math, sys
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
def make(out, style, texts, vocab_size=400):
    tok = Tokenizer(models.BPE())
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = ["<|endoftext|>"]
    else:
        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                   r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if style == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        end = [tok.token_to_id("<|endoftext|>")]
    else:
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(
            single=bos + " $A", special_tokens=[(bos, tok.token_to_id(bos))])
        end = []
    tok.save(out + "/tokenizer.json")
    return tok, end
"#;

/// Text files, each one document: DIR/ids.json holds each file's ids as `zrun prepare`
/// separates them (a list per document).
const FILES: &str = r#"
out, style, files = sys.argv[1], sys.argv[2], sys.argv[3:]
texts = [open(f, encoding="utf-8", newline="").read() for f in files]
tok, end = make(out, style, texts)
json.dump([tok.encode(t).ids + end for t in texts], open(out + "/ids.json", "w"))
"#;

/// A corpus of 400 documents of mixed text (accents, CJK, emoji, quotes, backslashes, tabs,
/// U+2028, CRLF, an empty document, a special token inside the text) written as a.jsonl (extra
/// keys, a nested "text" key, blank lines, escaped and raw UTF-8), b.jsonl.gz (gzip),
/// c.jsonl.zst (zstd, through pyarrow) and d.parquet (row groups of 30, snappy). DIR/ids.json:
/// {"train": ids, "val": ids, "documents": 400, "sha256": the tokenizer's} with the val rule of
/// `--val-fraction` argv[2]. Also bad inputs: nocol.parquet (no "text" column), ints.parquet
/// ("text" holds integers), nulls.parquet (a null text).
const CORPUS: &str = r#"
import gzip, random
import pyarrow as pa, pyarrow.parquet as pq
out, frac = sys.argv[1], float(sys.argv[2])
rng = random.Random(7)
words = ["the", "quick", "WE'LL", "12345", "héllo", "naïve", "日本語", "🙂", "42", "3.14",
         "don't", "Zürich,", 'say "hi"', "back\\slash", "tab\there", "a\u2028b", "<|endoftext|>x"]
def doc():
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
             for _ in range(rng.randint(1, 6))]
    return rng.choice(["\n", "\n\n", "\r\n"]).join(lines)
docs = [doc() for _ in range(400)]
docs[5] = ""
tok, end = make(out, "gpt2", docs, 500)
def lines(ds, i0):
    s = ""
    for i, d in enumerate(ds):
        row = {"id": i0 + i, "meta": {"text": 1, "n": [1, 2]}, "text": d}
        s += json.dumps(row, ensure_ascii=(i % 2 == 0)) + "\n"
        if i % 17 == 3:
            s += "\n"
    return s.encode()
open(out + "/a.jsonl", "wb").write(lines(docs[:100], 0))
gzip.open(out + "/b.jsonl.gz", "wb").write(lines(docs[100:200], 100))
zst = pa.compress(lines(docs[200:300], 200), codec="zstd", asbytes=True)
open(out + "/c.jsonl.zst", "wb").write(zst)
pq.write_table(pa.table({"id": list(range(300, 400)), "text": docs[300:]}),
               out + "/d.parquet", row_group_size=30, compression="snappy")
pq.write_table(pa.table({"id": [1], "content": ["x"]}), out + "/nocol.parquet")
pq.write_table(pa.table({"text": [1, 2]}), out + "/ints.parquet")
pq.write_table(pa.table({"text": ["a", None]}), out + "/nulls.parquet")
want = {"train": [], "val": [], "documents": len(docs),
        "sha256": hashlib.sha256(open(out + "/tokenizer.json", "rb").read()).hexdigest()}
for k, d in enumerate(docs):
    split = "val" if math.floor((k + 1) * frac) > math.floor(k * frac) else "train"
    want[split] += tok.encode(d).ids + end
json.dump(want, open(out + "/ids.json", "w"))
"#;

/// A word-level tokenizer of 70,000 words `w0`..`w69999` and `[UNK]` (so ids need uint32);
/// writes DIR/tokenizer.json and DIR/ids.json, the encoding of the text file.
const WORDS: &str = r#"
from tokenizers import Tokenizer, models, pre_tokenizers
out, text = sys.argv[1], sys.argv[2]
vocab = {f"w{i}": i for i in range(70000)}
vocab["[UNK]"] = 70000
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(out + "/tokenizer.json")
with open(text, encoding="utf-8", newline="") as f:
    json.dump(tok.encode(f.read()).ids, open(out + "/ids.json", "w"))
"#;

/// Which script.
pub enum Script {
    /// Text files, one document each: `[style, files...]`.
    Files,
    /// The mixed-format corpus: `[val_fraction]`.
    Corpus,
    /// The 70,000-word tokenizer: `[text file]`.
    Words,
}

/// Runs a script in the project's .venv with DIR and `args`; returns DIR/ids.json.
pub fn python(dir: &Path, script: Script, args: &[&str]) -> serde_json::Value {
    let py = root().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/setup.sh (it installs tokenizers and pyarrow)",
        py.display()
    );
    let body = match script {
        Script::Files => FILES,
        Script::Corpus => CORPUS,
        Script::Words => WORDS,
    };
    let file = write(dir, "make.py", format!("{TOKENIZER}{body}").as_bytes());
    let out = Command::new(py)
        .arg(file)
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "python: {}", stderr(&out));
    let ids = std::fs::read_to_string(dir.join("ids.json")).unwrap();
    serde_json::from_str(&ids).unwrap()
}

/// Token ids of a JSON array.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

/// Deterministic text with ASCII, accents, CJK, emoji, digit runs, contractions, runs of
/// spaces, tabs and newlines (CRLF too).
pub fn text(seed: u64, words: usize) -> String {
    const VOCAB: [&str; 16] = [
        "the",
        "quick",
        "WE'LL\r\n",
        "12345",
        "héllo",
        "naïve",
        "日本語",
        "🙂",
        "42",
        "3.14",
        "don't",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "Zürich,",
    ];
    let mut s = String::new();
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    for _ in 0..words {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(VOCAB[(x >> 60) as usize]);
        s.push(' ');
    }
    s
}

/// A text of about `bytes` bytes in lines of [`text`] (trimmed), for documents that
/// `zrun prepare` encodes in pieces.
pub fn book(seed: u64, bytes: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < bytes {
        s.push_str(text(seed * 100_003 + i, 14).trim());
        s.push('\n');
        i += 1;
    }
    s
}
