#!/bin/bash
# A Hugging Face model through zrun and back: a small Llama made with transformers, fine-tuned
# on 2 CPU ranks at ZeRO stage 3, exported, and run by transformers and by `zrun sample`.
#
#   examples/finetune-hf/run.sh                        # everything under runs/finetune-hf/
#   OUT=/tmp/ft examples/finetune-hf/run.sh --set train.steps=50   # arguments go to the training run
#   # what it runs (out = runs/finetune-hf):
#   .venv/bin/python examples/finetune-hf/make_model.py examples/finetune-hf/fables.txt $out/model
#   zrun --nproc 2 examples/finetune-hf/train.toml     # model.init_from = $out/model
#   zrun export $out/run/ckpt --hf $out/export
#   .venv/bin/python examples/finetune-hf/generate.py $out/export "The Fox" 20
#   zrun sample $out/export --prompt "The Fox" --max-new-tokens 20 --greedy
#   zrun sample $out/export --prompt "The Fox" --max-new-tokens 20 --temperature 0.7 --top-k 5
#
# make_model.py trains a byte-level BPE tokenizer (512 tokens) on fables.txt and saves a
# 4-layer Llama (0.8M parameters, random weights) beside it. zrun reads config.json and
# model.safetensors (each rank only its slices) and encodes the text with the tokenizer.json
# next to them. The training windows are fixed 32-token pieces of a 4.6 KB text, so 150 steps
# learn them by heart: the loss falls from about 6.2 (ln 512) through 5.2 at step 10 to about
# 0.02 at step 150 (the held-out end of the text, never trained on, gets a high eval loss), and
# greedy generation from the text's first words recites it. transformers and `zrun sample --greedy` pick the same tokens; the script
# stops with exit code 1 when they do not.
#
# Environment (optional): ZRUN (default `zrun` on PATH, else this checkout's
# target/release/zrun), PYTHON (default this checkout's .venv/bin/python, from `make setup`),
# NPROC (ranks, default 2), OUT (default runs/finetune-hf), PROMPT (default "The Fox").

set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ -z "${ZRUN:-}" ]; then
    if command -v zrun >/dev/null; then ZRUN=zrun; else
        source "$root/scripts/env.sh"; ZRUN="$root/target/release/zrun"
    fi
fi
py=${PYTHON:-$root/.venv/bin/python}
out=${OUT:-runs/finetune-hf}
prompt=${PROMPT:-The Fox}
export HF_HUB_OFFLINE=1

rm -rf "$out/model" "$out/run" "$out/export"
echo "== a Llama and its tokenizer, made with transformers"
"$py" "$here/make_model.py" "$here/fables.txt" "$out/model"

echo "== zrun --nproc ${NPROC:-2}: fine-tune at stage 3"
"$ZRUN" --nproc "${NPROC:-2}" "$here/train.toml" \
    --set "model.init_from=\"$out/model\"" --set "data.path=\"$here/fables.txt\"" \
    --set "log.dir=\"$out/run\"" "$@"
"$py" - "$out/run/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
a, b = rows[0], rows[-1]
print(f"loss: step {a['step']} {a['loss']:.3f} -> step {b['step']} {b['loss']:.3f}")
EOF

echo "== zrun export"
"$ZRUN" export "$out/run/ckpt" --hf "$out/export"

echo "== transformers, greedy"
hf=$("$py" "$here/generate.py" "$out/export" "$prompt" 20)
echo "$hf"
echo "== zrun sample --greedy"
zr=$("$ZRUN" sample "$out/export" --prompt "$prompt" --max-new-tokens 20 --greedy)
echo "$zr"
if [ "$(head -n -1 <<<"$hf")" != "$zr" ]; then
    echo "finetune-hf: transformers and zrun sample --greedy generated different text" >&2
    exit 1
fi
echo "== zrun sample --temperature 0.7 --top-k 5"
"$ZRUN" sample "$out/export" --prompt "$prompt" --max-new-tokens 20 --temperature 0.7 --top-k 5
