#!/bin/bash
# Two nodes behind a slow link, on one machine: scripts/testbed.sh makes two network
# namespaces joined by a veth pair limited to RATE in each direction, and starts one
# `zrun --nnodes 2` in each. The same stage-3 job runs twice: sharded over all 4 ranks
# (zero.shard_group = "all": every all-gather and reduce-scatter crosses the link), then
# sharded within each node and replicated across the two (zero.shard_group = "node": only one
# all-reduce of each gradient shard crosses it). Needs root.
#
#   examples/two-nodes/testbed.sh                                   # 200mbit, 2 ranks per node
#   RATE=1gbit examples/two-nodes/testbed.sh --set train.steps=20   # arguments go to both jobs
#
# Environment (optional): ZRUN (default this checkout's target/release/zrun), CONFIG (default
# configs/bench-cpu.toml at micro-batch 2), RATE (default 200mbit), NPROC (ranks per node,
# default 2). Prints each job's final line and its step-time table; exits 77 with the
# testbed's reason where namespaces cannot be made.

set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export ZRUN=${ZRUN:-$root/target/release/zrun}
CONFIG=${CONFIG:-$root/configs/bench-cpu.toml}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for group in all node; do
    echo "== zero.shard_group = \"$group\""
    "$root/scripts/testbed.sh" --rate "${RATE:-200mbit}" --nproc "${NPROC:-2}" -- "$CONFIG" \
        --set zero.stage=3 --set train.micro_batch=2 --set train.steps=12 \
        --set train.eval_every=0 --set checkpoint.every=0 \
        --set "zero.shard_group=\"$group\"" "$@" 2>&1 | grep -E 'ms/step|\[rank 0\] rank |final:|testbed'
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
