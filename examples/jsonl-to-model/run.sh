#!/bin/bash
# From a JSON Lines file to a trained model: a gzipped JSONL corpus, a byte-level BPE tokenizer
# trained on it with Python `tokenizers`, `zrun prepare` into token shards, a small Llama
# trained from scratch on 2 CPU ranks, then `zrun sample` and `zrun export --hf`.
#
#   examples/jsonl-to-model/run.sh                     # everything under runs/jsonl-to-model/
#   OUT=/tmp/j examples/jsonl-to-model/run.sh --set train.steps=50   # arguments go to the training run
#   # what it runs (out = runs/jsonl-to-model):
#   .venv/bin/python examples/jsonl-to-model/make_corpus.py examples/finetune-hf/fables.txt $out/corpus.jsonl.gz
#   .venv/bin/python examples/jsonl-to-model/train_tokenizer.py $out/tokenizer.json $out/corpus.jsonl.gz --vocab-size 512
#   zrun prepare --tokenizer $out/tokenizer.json $out/corpus.jsonl.gz -o $out/data --shard-tokens 500 --val-fraction 0.125
#   zrun --nproc 2 examples/jsonl-to-model/train.toml  # data.path = $out/data
#   zrun sample $out/run/ckpt --prompt "The Fox" --max-new-tokens 30 --greedy
#   zrun export $out/run/ckpt --hf $out/export
#   zrun sample $out/export --prompt "The Fox" --max-new-tokens 30 --temperature 0.7 --top-k 5
#
# The corpus stands for yours: eight fables, one JSON object each ({"id", "title", "text"}).
# zrun prepare streams it through the tokenizer into 4 train shards of at most 500 tokens (1,561
# tokens) and 1 val shard (the eighth fable), appending <|endoftext|> after every document. The
# training windows are fixed 64-token pieces of so small a corpus, so 200 steps learn them by
# heart: the loss falls from about 6.2 (ln 512) through 5.3 at step 10 to about 0.01 at step
# 200, the held-out fable's eval loss rises (nothing generalises from 1,561 tokens), and greedy
# generation from the corpus' first words, where the first window starts, recites the first
# fable.
#
# Environment (optional): ZRUN (default `zrun` on PATH, else this checkout's
# target/release/zrun), PYTHON (default this checkout's .venv/bin/python, from `make setup`),
# NPROC (ranks, default 2), OUT (default runs/jsonl-to-model), PROMPT (default "The Fox").

set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ -z "${ZRUN:-}" ]; then
    if command -v zrun >/dev/null; then ZRUN=zrun; else
        source "$root/scripts/env.sh"; ZRUN="$root/target/release/zrun"
    fi
fi
py=${PYTHON:-$root/.venv/bin/python}
out=${OUT:-runs/jsonl-to-model}
prompt=${PROMPT:-The Fox}

rm -rf "$out/data" "$out/run" "$out/export"
mkdir -p "$out"
echo "== a JSON Lines corpus, gzipped"
"$py" "$here/make_corpus.py" "$root/examples/finetune-hf/fables.txt" "$out/corpus.jsonl.gz"

echo "== a byte-level BPE tokenizer trained on it"
"$py" "$here/train_tokenizer.py" "$out/tokenizer.json" "$out/corpus.jsonl.gz" --vocab-size 512

echo "== zrun prepare"
"$ZRUN" prepare --tokenizer "$out/tokenizer.json" "$out/corpus.jsonl.gz" -o "$out/data" \
    --shard-tokens 500 --val-fraction 0.125

echo "== zrun --nproc ${NPROC:-2}: train from the shards"
"$ZRUN" --nproc "${NPROC:-2}" "$here/train.toml" \
    --set "data.path=\"$out/data\"" --set "data.tokenizer=\"$out/tokenizer.json\"" \
    --set "log.dir=\"$out/run\"" "$@"
"$py" - "$out/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
a, b = rows[0], rows[-1]
print(f"loss: step {a['step']} {a['loss']:.3f} -> step {b['step']} {b['loss']:.3f}")
PY

echo "== zrun sample --greedy"
"$ZRUN" sample "$out/run/ckpt" --prompt "$prompt" --max-new-tokens 30 --greedy

echo "== zrun export --hf"
"$ZRUN" export "$out/run/ckpt" --hf "$out/export"

echo "== zrun sample of the export --temperature 0.7 --top-k 5"
"$ZRUN" sample "$out/export" --prompt "$prompt" --max-new-tokens 30 --temperature 0.7 --top-k 5
