"""`zrun prepare` against Python `tokenizers`' `encode_batch` over the same JSON Lines file,
the same tokenizer and the same threads, interleaved; the token streams must be equal.

Input: a deterministic JSON Lines corpus (`--mb`, default 64 MB) of documents drawn from a word
bigram chain over the English documentation Python ships (`pydoc_data.topics`), paragraphs of
varied length with numbers, code and punctuation; of the words, 2% are swapped for accented,
Cyrillic, CJK or emoji ones, 3% for random numbers and 1% for random identifiers (URL and hash
fragments that a web corpus is full of, and that no cache of pre-tokens holds). Tokenizer: a GPT-2-style byte-level BPE (`--vocab`, default 32768) trained by
Python `tokenizers` on the corpus's first 8 MB, `<|endoftext|>` after every document.

Each round runs, one after the other:
- zrun: `zrun prepare --tokenizer T corpus.jsonl -o DIR --val-fraction 0` (one process: read,
  encode on rayon's pool, write the shards); tokens/s from the run's own summary line, wall
  time from here;
- python: read the file line by line with `json.loads`, `Tokenizer.encode_batch` on batches of
  `--batch` texts (its rayon pool), each document's ids plus the end-of-text id written as
  uint16 with numpy to one file; tokens/s from its own clock (tokenizer load to file closed);
- python-fast (reported, not the target): the same with `encode_batch_fast` (no offsets);
- zrun-library (reported): zrun with ZRUN_PREPARE_LIBRARY=1, every document through the
  tokenizers crate's `encode_fast` instead of zrun's byte-level path.
Both get RAYON_NUM_THREADS = `--threads` (and TOKENIZERS_PARALLELISM=true). After the first
round zrun's shards, concatenated, are compared with the Python file token for token.

    python benches/prepare_speed.py [--rounds 3] [--mb 64] [--threads 2] [--vocab 32768] [--json]

Prints a table, then one JSON line (`--json`: only that) with each side's median tokens/s and
the ratio zrun / python: the median over rounds of each round's ratio (the target is >= 1.5 on
2 cores).
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_up, ensure_zrun, load_average, torch_env  # noqa: E402

EXTRA = ["café", "naïve", "Zürich", "déjà", "señor", "Москва", "данные", "東京", "日本語",
         "数据", "한국어", "🙂", "🚀", "Ωmega", "straße", "fiancée", "coöperate", "→", "≤", "…"]
ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./"

# The Python side, run as its own process: argv = tokenizer, corpus, output, batch, fast.
PYTHON_SIDE = r"""
import json, sys, time
import numpy as np
from tokenizers import Tokenizer
tok_path, corpus, out, batch, fast = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
t0 = time.perf_counter()
tok = Tokenizer.from_file(tok_path)
eos = tok.token_to_id("<|endoftext|>")
encode = tok.encode_batch_fast if fast else tok.encode_batch
tokens = docs = 0
with open(corpus, encoding="utf-8") as f, open(out, "wb") as w:
    texts = []
    def flush():
        global tokens, docs
        ids = []
        for e in encode(texts):
            ids.extend(e.ids)
            ids.append(eos)
        np.array(ids, dtype=np.uint16).tofile(w)
        tokens += len(ids)
        docs += len(texts)
        texts.clear()
    for line in f:
        if line.strip():
            texts.append(json.loads(line)["text"])
            if len(texts) == batch:
                flush()
    flush()
secs = time.perf_counter() - t0
print(json.dumps({"tokens": tokens, "documents": docs, "seconds": secs}))
"""


def corpus(path, mb, seed=0):
    """Writes the deterministic JSON Lines corpus (module docs); returns its documents."""
    import pydoc_data.topics as topics

    words = " ".join(topics.topics[k] for k in sorted(topics.topics)).split()
    follow = {}
    for a, b in zip(words, words[1:]):
        follow.setdefault(a, []).append(b)
    rng = random.Random(seed)
    size, docs = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1_000_000:
            paragraphs = []
            for _ in range(rng.choice([1, 1, 2, 3, 5, 8, 13])):
                w = rng.choice(words)
                out = []
                for _ in range(rng.randint(20, 400)):
                    r = rng.random()
                    if r < 0.02:
                        out.append(rng.choice(EXTRA))
                    elif r < 0.05:
                        out.append(str(rng.randrange(10 ** rng.randint(1, 7))))
                    elif r < 0.06:
                        out.append("".join(rng.choices(ALNUM, k=rng.randint(3, 12))))
                    else:
                        out.append(w)
                    w = rng.choice(follow.get(w) or words)
                paragraphs.append(" ".join(out))
            line = json.dumps({"id": docs, "text": "\n\n".join(paragraphs),
                               "url": f"https://example.org/{docs}"}, ensure_ascii=docs % 2 == 0)
            f.write(line + "\n")
            size += len(line) + 1
            docs += 1
    return docs


def train_tokenizer(corpus_path, out, vocab):
    """A GPT-2-style byte-level BPE trained on the corpus's first 8 MB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    def texts():
        n = 0
        with open(corpus_path, encoding="utf-8") as f:
            for line in f:
                n += len(line)
                if n > 8_000_000:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(out))
    return tok.get_vocab_size()


def run_zrun(zrun, tok, data, out, env):
    t0 = time.perf_counter()
    p = subprocess.run([str(zrun), "prepare", "--tokenizer", str(tok), str(data), "-o", str(out),
                        "--val-fraction", "0"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"zrun prepare failed ({p.returncode}): {p.stderr.strip()}")
    line = p.stdout.strip()
    m = re.search(r"\((\d+) tokens\).*; ([\d.]+) s, (\d+) tokens/s", line)
    docs = int(re.search(r"(\d+) document\(s\),", line).group(1))
    return {"tokens": int(m.group(1)), "documents": docs, "seconds": float(m.group(2)),
            "tokens_per_s": int(m.group(3)), "wall_s": wall}


def run_python(tok, data, out, batch, fast, env):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", PYTHON_SIDE, str(tok), str(data), str(out),
                        str(batch), "1" if fast else "0"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"python side failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["tokens_per_s"] = int(r["tokens"] / r["seconds"])
    r["wall_s"] = wall
    return r


def zrun_tokens(out):
    """The train shards of a zrun prepare, concatenated, as uint16."""
    import numpy as np

    index = json.loads((out / "index.json").read_text())
    parts = [np.fromfile(out / s["file"], dtype=np.uint16, offset=1024) for s in index["train"]]
    return np.concatenate(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1000, help="texts per encode_batch call")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    say = (lambda *a: None) if args.json else print
    import numpy as np

    work = Path(tempfile.mkdtemp(prefix="zrun-prepare-speed-"))
    zrun = ensure_zrun(work)
    data, tok = work / "corpus.jsonl", work / "tokenizer.json"
    t0 = time.perf_counter()
    docs = corpus(data, args.mb)
    vocab = train_tokenizer(data, tok, args.vocab)
    say(f"# corpus: {data.stat().st_size / 1e6:.1f} MB, {docs} documents; tokenizer: "
        f"byte-level BPE, vocab {vocab} (asked {args.vocab}); made in "
        f"{time.perf_counter() - t0:.0f} s")
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="true",
               **torch_env())
    load = [load_average()]
    runs = {"zrun": [], "python": [], "python-fast": [], "zrun-library": []}
    equal = None
    for r in range(args.rounds):
        zr = run_zrun(zrun, tok, data, work / "zrun-out", env)
        py = run_python(tok, data, work / "python.bin", args.batch, False, env)
        pf = run_python(tok, data, work / "python-fast.bin", args.batch, True, env)
        zl = run_zrun(zrun, tok, data, work / "zrun-library",
                      dict(env, ZRUN_PREPARE_LIBRARY="1"))
        for name, res in [("zrun", zr), ("python", py), ("python-fast", pf), ("zrun-library", zl)]:
            runs[name].append(res)
            say(f"round {r + 1} {name:12s} {res['tokens']:>11,} tokens {res['seconds']:7.2f} s "
                f"{res['tokens_per_s']:>10,} tokens/s  (wall {res['wall_s']:.2f} s)")
        if equal is None:
            p = np.fromfile(work / "python.bin", dtype=np.uint16)
            others = {"zrun": zrun_tokens(work / "zrun-out"),
                      "zrun-library": zrun_tokens(work / "zrun-library"),
                      "python-fast": np.fromfile(work / "python-fast.bin", dtype=np.uint16)}
            differ = [k for k, z in others.items() if len(z) != len(p) or not (z == p).all()]
            equal = not differ
            say(f"# tokens equal to python's: {equal}" + ("" if equal else f" ({differ} differ)"))
    load.append(load_average())
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    # Each round's zrun / python: the two ran back to back, under the same load.
    ratios = [round(z["tokens_per_s"] / p["tokens_per_s"], 2)
              for z, p in zip(runs["zrun"], runs["python"])]
    result = {
        "bench": "prepare_speed", "date": time.strftime("%Y-%m-%d"),
        "corpus_mb": round(data.stat().st_size / 1e6, 1), "documents": docs,
        "tokens": runs["zrun"][0]["tokens"], "vocab": vocab, "threads": args.threads,
        "rounds": args.rounds, "tokens_equal": equal,
        "zrun_tokens_per_s": int(med["zrun"]), "python_tokens_per_s": int(med["python"]),
        "python_fast_tokens_per_s": int(med["python-fast"]),
        "zrun_library_tokens_per_s": int(med["zrun-library"]),
        "ratio": statistics.median(ratios), "ratio_per_round": ratios,
        "ratio_vs_fast": round(med["zrun"] / med["python-fast"], 2),
        "load_before_after": [round(x, 2) for x in load],
    }
    say(f"# median tokens/s: zrun {med['zrun']:,.0f}, python encode_batch {med['python']:,.0f} "
        f"(zrun / python per round {ratios}, median x{result['ratio']}), python encode_batch_fast {med['python-fast']:,.0f} "
        f"(x{result['ratio_vs_fast']}), zrun through the library {med['zrun-library']:,.0f}; "
        f"load {load[0]:.1f} -> {load[1]:.1f}")
    print(json.dumps(result))
    clean_up(work, args.keep)
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
