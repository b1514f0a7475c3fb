#!/usr/bin/env bash
# CPU AdamW side by side: `zrun bench adam` (fp32 and bf16 state, bf16 parameter copy written)
# against torch.optim.AdamW(fused=True), the same fused step followed by the half-precision
# parameter copy (what zrun's one pass also writes), and AdamW(foreach=True), from the project's
# .venv, same sizes and thread counts, plus a STREAM-style triad bandwidth to read Gparam/s
# against.
#
#   benches/adam.sh                                   # 10M,50M params; 1,2 threads; 3 rounds
#   benches/adam.sh --params 50M --threads 2 --repeat 5 [--half bf16|fp16|none] [--iters 10]
#
# The rounds interleave zrun and torch and every figure is the best over rounds (the machine
# is shared). ZRUN_BIN overrides the zrun binary (default target/release/zrun, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

PARAMS=10M,50M THREADS=1,2 REPEAT=3 HALF=bf16 ITERS=10
while [ $# -gt 0 ]; do
    case "$1" in
        --params) PARAMS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --repeat) REPEAT=$2; shift 2 ;;
        --half) HALF=$2; shift 2 ;;
        --iters) ITERS=$2; shift 2 ;;
        *) echo "usage: $0 [--params 10M,50M] [--threads 1,2] [--repeat N] [--half bf16|fp16|none] [--iters N]" >&2; exit 2 ;;
    esac
done

ZRUN_BIN=${ZRUN_BIN:-target/release/zrun}
if [ ! -x "$ZRUN_BIN" ]; then
    cargo build --release -p zrun
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp "$ZRUN_BIN" "$TMP/zrun"

echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for _ in $(seq "$REPEAT"); do
    for s in fp32 bf16; do
        "$TMP/zrun" bench adam --params "$PARAMS" --threads "$THREADS" --state-dtype "$s" \
            --half "$HALF" --iters "$ITERS" --json >>"$TMP/zrun.jsonl"
    done
    python benches/adam.py --params "$PARAMS" --threads "$THREADS" --iters "$ITERS" --half "$HALF" \
        --json >>"$TMP/torch.jsonl"
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

python - "$TMP/zrun.jsonl" "$TMP/torch.jsonl" "$HALF" "$REPEAT" <<'PY'
import json, sys
best = {}
def keep(key, val):
    best[key] = max(best.get(key, 0.0), val)
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        keep((f"zrun_{r['state_dtype']}", r["params"], r["threads"]), r["gparams_per_s"])
triad = {}
for line in open(sys.argv[2]):
    if line.startswith("{"):
        r = json.loads(line)
        if r["impl"] == "triad":
            triad[r["threads"]] = max(triad.get(r["threads"], 0.0), r["gb_per_s"])
        else:
            keep((r["impl"], r["params"], r["threads"]), r["gparams_per_s"])
half = sys.argv[3]
print(f"# best of {sys.argv[4]} rounds; zrun writes the {half} parameter copy in its one pass;"
      f" torch_fused does not, fused+copy does it after the step")
for t, gb in sorted(triad.items()):
    print(f"triad bandwidth, {t} thread(s): {gb:.2f} GB/s (12 B/element, STREAM convention)")
impls = ["zrun_fp32", "zrun_bf16", "torch_fused", "torch_fused_copy", "torch_foreach"]
heads = ["zrun_fp32", "zrun_bf16", "torch_fused", "fused+copy", "torch_foreach"]
ratios = [("fp32/fused", 0, 2), ("bf16/fused", 1, 2), ("fp32/f+copy", 0, 3), ("bf16/f+copy", 1, 3)]
print(f"{'params':>10} {'threads':>7} " + " ".join(f"{h:>13}" for h in heads)
      + " " + " ".join(f"{r[0]:>11}" for r in ratios))
for (n, t) in sorted({(k[1], k[2]) for k in best}):
    row = [best.get((i, n, t), float("nan")) for i in impls]
    print(f"{n:>10} {t:>7} " + " ".join(f"{x:>13.3f}" for x in row)
          + " " + " ".join(f"{row[a] / row[b]:>10.2f}x" for _, a, b in ratios))
print("(Gparam/s; bytes per element moved: zrun fp32 state 28 + 2 copy, bf16 state 20 + 2 copy;"
      " torch fused 28, fused+copy 28 + 6)")
PY
