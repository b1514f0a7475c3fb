#!/bin/bash
# mpirun on one host: mpirun starts the ranks and each zrun trains as one of them, reading
# OpenMPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK (README, "Launcher or rank"). No zrun
# launcher runs, so there is no supervision (--max-restarts) and no `[rank R]` prefix.
#
#   examples/mpirun/run.sh                                   # 2 ranks, examples/train.toml
#   NP=8 examples/mpirun/run.sh --set train.steps=500        # arguments go to every zrun
#   # what it runs:
#   mpirun -np 2 -x MASTER_PORT zrun examples/train.toml
#
# Collectives: the default build uses the tcp backend (nccl with `--features cuda` on GPUs):
# rank 0 hosts the rendezvous store on MASTER_ADDR:MASTER_PORT, 127.0.0.1:29500 when mpirun
# gives neither. The MPI backend (`--set dist.backend=mpi`: collectives through MPI itself, no
# store) needs a zrun built with `cargo build --release -p zrun --features mpi` (OpenMPI's
# headers and libclang at build time); other builds exit 2 with
#   zrun: error: dist.backend = "mpi" but this zrun was built without MPI; rebuild with
#   `cargo build --release --features mpi` (needs OpenMPI, see make setup), or set
#   dist.backend = "tcp" (or "auto")
# (one line; `zrun --dry-run configs/tiny-cpu.toml --set dist.backend=mpi` prints it).
#
# Environment (optional): ZRUN (default `zrun` on PATH, else this checkout's
# target/release/zrun), CONFIG (default examples/train.toml), NP (ranks, default 2),
# MASTER_PORT (the store's port when 29500 is taken). As root, OpenMPI also wants
# --allow-run-as-root (or OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1); more
# ranks than cores want --oversubscribe: put such flags in MPIRUN_ARGS.

set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ -z "${ZRUN:-}" ]; then
    if command -v zrun >/dev/null; then ZRUN=zrun; else
        source "$root/scripts/env.sh"; ZRUN="$root/target/release/zrun"
    fi
fi
CONFIG=${CONFIG:-$root/examples/train.toml}
export MASTER_PORT=${MASTER_PORT:-29500}

# shellcheck disable=SC2086 # MPIRUN_ARGS is a list of flags
exec mpirun ${MPIRUN_ARGS:-} -np "${NP:-2}" -x MASTER_PORT "$ZRUN" "$CONFIG" "$@"
