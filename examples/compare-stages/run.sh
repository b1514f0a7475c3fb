#!/bin/bash
# The same model and data at ZeRO stage 2 and stage 3, into two log dirs, then one set of
# charts comparing them.
#
#   examples/compare-stages/run.sh                             # runs/compare-stages/{stage2,stage3,plots}
#   RUNS=/tmp/cmp examples/compare-stages/run.sh --set train.steps=100   # arguments go to both runs
#   # what it runs:
#   zrun --nproc 2 examples/compare-stages/train.toml --set zero.stage=2 --set log.dir=runs/compare-stages/stage2
#   zrun --nproc 2 examples/compare-stages/train.toml --set zero.stage=3 --set log.dir=runs/compare-stages/stage3
#   zrun plot runs/compare-stages/stage2 runs/compare-stages/stage3 -o runs/compare-stages/plots
#
# What to see: the loss curves lie on each other (every stage trains the same model as one
# rank with the same global batch; tests/equivalence in zrun-train checks it to 1e-5), while
# the memory chart shows stage 3 keeping a 1/W slice of the parameters and gathering each unit
# while it computes, and the throughput and step-time charts show what the gathers cost.
# Charts: loss, loss_tokens, throughput, memory, breakdown, each as .png and .svg.
#
# Environment (optional): ZRUN (default `zrun` on PATH, else this checkout's
# target/release/zrun), NPROC (ranks, default 2), RUNS (default runs/compare-stages).

set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ -z "${ZRUN:-}" ]; then
    if command -v zrun >/dev/null; then ZRUN=zrun; else
        source "$root/scripts/env.sh"; ZRUN="$root/target/release/zrun"
    fi
fi
runs=${RUNS:-runs/compare-stages}

for stage in 2 3; do
    echo "== stage $stage"
    "$ZRUN" --nproc "${NPROC:-2}" "$here/train.toml" --set zero.stage=$stage \
        --set "log.dir=\"$runs/stage$stage\"" "$@"
done
"$ZRUN" plot "$runs/stage2" "$runs/stage3" -o "$runs/plots"
