#!/bin/bash
# A model whose training state does not fit one rank unsharded: GPT-2 large shapes at ZeRO
# stage 3 with the optimizer offloaded to host memory (train.toml here).
#
#   examples/offload-larger-than-memory/run.sh                   # 2 ranks: dry run, then train
#   NPROC=8 examples/offload-larger-than-memory/run.sh --set train.steps=1000
#   # what it runs:
#   zrun --dry-run --nproc 2 examples/offload-larger-than-memory/train.toml   # bytes per rank
#   zrun --nproc 2 examples/offload-larger-than-memory/train.toml             # train
#
# On GPUs build with `cargo build --release -p zrun --features cuda`; dist.device = "auto"
# then trains on them. On a CPU-only machine the same commands run, slowly (bf16 matmuls on
# CPUs without AVX-512 are about 10x slower than fp32), and "device" memory is host memory too.
#
# The numbers. The dry run's first line gives Psi = 837,332,480 parameters. Model-state
# bytes per rank (README "Sharding and precision", docs/config.md), bf16 compute with bf16
# gradients (reduce_dtype = "bf16"), AdamW, W ranks:
#
#   one rank, unsharded (stage 0)   2Psi params + 2Psi grads + 4Psi fp32 master + 8Psi AdamW m,v
#                                   = 16Psi = 12,776.7 MiB, before any activation: more than a
#                                   12 GiB GPU holds, and all but 3 GiB of a 16 GiB one
#   stage 3, W = 2                  16Psi/W = 6,388.3 MiB per rank, the dry run's (with
#                                   --set zero.offload_optimizer='"none"')
#                                   "params 798.5, grads 798.5, master 1597.1, optimizer 3194.2"
#                                   (2Psi/W, 2Psi/W, 4Psi/W, 8Psi/W)
#   + offload_optimizer = "cpu"     master + optimizer, 12Psi/W = 4,791.3 MiB per rank, live in
#                                   host memory (the dry run's "params 798.5, grads 0.0, master
#                                   0.0, optimizer 0.0, on the host 4791.3"), and with
#                                   grad_accum = 1 the gradients too: each unit's shard goes
#                                   to the host (an fp32 copy, 4Psi/W = 1,597.1 MiB) as soon
#                                   as it is reduced. The GPU keeps the params, 2Psi/W = 798.5
#                                   MiB per rank (199.6 MiB at W = 8), plus the units being
#                                   gathered (bf16: 37.5 MiB per block, 123 MiB for the
#                                   embedding and for the head; `prefetch` = 1 holds two), the
#                                   gradient of the unit being reduced, and the activations (one
#                                   block's input per layer with activation checkpointing: 1.25
#                                   MiB each at micro_batch 4 x 128 tokens).
#
# The dry run prints the offloaded master and optimizer bytes as "on the host" (in the rank's
# total, 5589.8 MiB); it does not list the host's fp32 gradient shard, which `zrun estimate`
# counts under "fixed buffers" (1.56 GiB). The table printed at the end of the run shows the
# master and optimizer under "host (offloaded)", and summary.json has them per rank as
# ranks[r].memory.host.
#
# Environment (optional): ZRUN (default `zrun` on PATH, else this checkout's
# target/release/zrun), NPROC (ranks, default 2). Arguments go to both zrun commands.

set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ -z "${ZRUN:-}" ]; then
    if command -v zrun >/dev/null; then ZRUN=zrun; else
        source "$root/scripts/env.sh"; ZRUN="$root/target/release/zrun"
    fi
fi
n=${NPROC:-2}

echo "== zrun --dry-run --nproc $n (per-unit lines left out)"
"$ZRUN" --dry-run --nproc "$n" "$here/train.toml" "$@" | grep -v '^  unit '
echo "== zrun --nproc $n"
"$ZRUN" --nproc "$n" "$here/train.toml" "$@"
