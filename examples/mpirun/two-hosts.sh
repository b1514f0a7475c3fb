#!/bin/bash
# mpirun on two hosts, 8 ranks each: run this on h0 (mpirun reaches h1 over ssh).
#
#   H0=h0 H1=h1 examples/mpirun/two-hosts.sh                    # tcp (CPU) or nccl (GPU) backend
#   H0=h0 H1=h1 examples/mpirun/two-hosts.sh --set dist.backend=mpi   # collectives through MPI
#   # what it runs:
#   mpirun -np 16 -H h0:8,h1:8 -x MASTER_ADDR=h0 -x MASTER_PORT=29500 zrun examples/train.toml
#
# Each process trains as one rank from OpenMPI's variables (OMPI_COMM_WORLD_RANK, _SIZE,
# _LOCAL_RANK, _LOCAL_SIZE). The tcp and nccl backends meet at rank 0's rendezvous store, so
# every rank must be told where it is: -x MASTER_ADDR=h0 (without it a job over several hosts
# can only use the MPI backend). The MPI backend needs zrun built with
# `cargo build --release -p zrun --features mpi` (add `,cuda` on GPUs) on every host.
# zrun, the config and the data must be at the same paths on both hosts (a shared file
# system), and so must checkpoint.dir, which every rank writes.
#
# Environment: H0, H1 (the hosts, default h0 and h1), NPROC (ranks per host, default 8),
# ZRUN (default `zrun` on PATH), CONFIG (default examples/train.toml relative to the
# working directory), MASTER_PORT (default 29500), MPIRUN_ARGS (extra mpirun flags).

set -eu
H0=${H0:-h0}
H1=${H1:-h1}
N=${NPROC:-8}
ZRUN=${ZRUN:-zrun}
CONFIG=${CONFIG:-examples/train.toml}

# shellcheck disable=SC2086 # MPIRUN_ARGS is a list of flags
exec mpirun ${MPIRUN_ARGS:-} -np $((2 * N)) -H "$H0:$N,$H1:$N" \
    -x MASTER_ADDR="$H0" -x MASTER_PORT="${MASTER_PORT:-29500}" \
    "$ZRUN" "$CONFIG" "$@"
