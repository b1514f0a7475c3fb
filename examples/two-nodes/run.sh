#!/bin/bash
# Two nodes without a scheduler: start one zrun on each node, the same command but --node-rank.
#
#   # on h0 (node 0, which hosts the rendezvous store on h0:29500):
#   zrun --nnodes 2 --node-rank 0 --master-addr h0 --nproc 8 examples/train.toml
#   # on h1:
#   zrun --nnodes 2 --node-rank 1 --master-addr h0 --nproc 8 examples/train.toml
#
# Start them in any order within --rdzv-timeout-s (default 300 s); ranks 0-7 run on h0 and
# 8-15 on h1, and a node that fails or is stopped stops the other. Export the same secret
# ZRUN_JOB_TOKEN on both nodes to keep other jobs out of the store; add the same
# --max-restarts N on both to restart the group from the newest checkpoint. checkpoint.dir
# (default <log.dir>/ckpt) must be one directory both nodes see.
#
# This script runs that pair on one machine, node 0 and node 1 both on 127.0.0.1:
#
#   examples/two-nodes/run.sh                                     # 2 nodes x 1 rank
#   NPROC=2 examples/two-nodes/run.sh --set train.steps=50        # arguments go to both zruns
#
# Environment (optional): ZRUN (default `zrun` on PATH, else this checkout's
# target/release/zrun), CONFIG (default configs/tiny-cpu.toml: the CPU demo's model),
# NPROC (ranks per node, default 1), MASTER_PORT (default 29500).

set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ -z "${ZRUN:-}" ]; then
    if command -v zrun >/dev/null; then ZRUN=zrun; else
        source "$root/scripts/env.sh"; ZRUN="$root/target/release/zrun"
    fi
fi
CONFIG=${CONFIG:-$root/configs/tiny-cpu.toml}
port=${MASTER_PORT:-29500}
token=${ZRUN_JOB_TOKEN:-loopback-$$-$RANDOM}
# Each zrun gives its ranks this machine's cores / NPROC threads, as if it were alone on its
# node; here both "nodes" share the cores, and libtorch threads that outnumber the cores spin
# against each other (10x slower steps on 2 cores). Split the cores between the two nodes.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    t=$(( $(nproc) / (2 * ${NPROC:-1}) ))
    export OMP_NUM_THREADS=$(( t > 0 ? t : 1 ))
fi

node() {
    ZRUN_JOB_TOKEN=$token "$ZRUN" --nnodes 2 --node-rank "$1" --master-addr 127.0.0.1 \
        --master-port "$port" --nproc "${NPROC:-1}" "$CONFIG" "${@:2}"
}

node 1 "$@" &    # node 1 first: it waits for node 0's store
n1=$!
node 0 "$@"      # Ctrl-C reaches both zruns: each stops its ranks
rc0=$?
if [ "$rc0" -ne 0 ]; then
    # a node 0 that never got its store up leaves node 1 waiting --rdzv-timeout-s for it
    kill -INT "$n1" 2>/dev/null
fi
wait "$n1"
rc1=$?
echo "two-nodes: node 0 exited $rc0, node 1 exited $rc1"
[ "$rc0" -ne 0 ] && exit "$rc0"
exit "$rc1"
