#!/usr/bin/env bash
# Side-by-side collective bandwidth: `zrun bench comm` (tcp backend by default) and PyTorch's
# gloo (torch.distributed from the project's .venv), same sizes, same dtype, same process count.
#
#   benches/comm.sh                                   # 2 ranks, 1M,16M,64M fp32 elements
#   benches/comm.sh --nproc 2 --sizes 64M --dtype fp32 [--backend tcp] [--iters 5]
#
# ZRUN_BIN overrides the zrun binary (default target/release/zrun, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

NPROC=2 SIZES=1M,16M,64M DTYPE=fp32 BACKEND=tcp ITERS=5
while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) NPROC=$2; shift 2 ;;
        --sizes) SIZES=$2; shift 2 ;;
        --dtype) DTYPE=$2; shift 2 ;;
        --backend) BACKEND=$2; shift 2 ;;
        --iters) ITERS=$2; shift 2 ;;
        *) echo "usage: $0 [--nproc N] [--sizes 1M,16M,64M] [--dtype fp32|bf16|fp16] [--backend tcp|mpi] [--iters N]" >&2; exit 2 ;;
    esac
done

ZRUN_BIN=${ZRUN_BIN:-target/release/zrun}
if [ ! -x "$ZRUN_BIN" ]; then
    cargo build --release -p zrun
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$ZRUN_BIN" bench comm --nproc "$NPROC" --backend "$BACKEND" --sizes "$SIZES" --dtype "$DTYPE" --iters "$ITERS" --json >"$TMP/zrun.jsonl"
python benches/comm_gloo.py --nproc "$NPROC" --sizes "$SIZES" --dtype "$DTYPE" --iters "$ITERS" --json >"$TMP/gloo.jsonl"

python - "$TMP/zrun.jsonl" "$TMP/gloo.jsonl" "$NPROC" "$DTYPE" <<'PY'
import json, sys
z = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
g = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
print(f"# nproc {sys.argv[3]}  dtype {sys.argv[4]}  (busbw in GB/s; time in ms)")
for name, rows in ((f"zrun {z[0]['backend'] if z else ''}", z), ("gloo", g)):
    print(f"## {name}")
    print(f"{'op':>15} {'size(B)':>12} {'time(ms)':>10} {'algbw':>9} {'busbw':>9} {'#wrong':>7}")
    for r in rows:
        print(f"{r['op']:>15} {r['bytes']:>12} {r['time_s']*1e3:>10.2f} {r['algbw_gbps']:>9.3f} {r['busbw_gbps']:>9.3f} {r['wrong']:>7}")
print("## side by side")
print(f"{'op':>15} {'size(B)':>12} {'zrun busbw':>11} {'gloo busbw':>11} {'ratio':>7}")
# Both emit the same order (each size: all_gather, reduce_scatter, all_reduce); gloo trims
# sizes not divisible by nproc to the next multiple below, so pair rows by position and op.
for r, o in zip(z, g):
    if r["op"] != o["op"]:
        continue
    ratio = r["busbw_gbps"] / o["busbw_gbps"] if o["busbw_gbps"] > 0 else float("inf")
    print(f"{r['op']:>15} {r['bytes']:>12} {r['busbw_gbps']:>11.3f} {o['busbw_gbps']:>11.3f} {ratio:>6.2f}x")
PY
