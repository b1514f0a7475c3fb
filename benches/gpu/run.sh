#!/bin/bash
# GPU validation of zrun (benches/gpu/checks.py says what each check does).
#
#   benches/gpu/run.sh pack            here: build with --features cuda, strip, put the binary
#                                      in .gpu/ (git-ignored) for the device tool's carry
#   bash benches/gpu/run.sh [CHECKS]   on the GPU machine (repo root, carry [".gpu"]): point
#                                      the loader at its torch and NCCL, run the checks
#                                      (default all: u,x,a,i,l,j,p,c,m,n,e,K,k,d,b,g,f,h; + runs checks side by side), write $OUT/results.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
if [ "${1:-}" = pack ]; then
    source scripts/env.sh
    cargo build --release -p zrun --features cuda
    mkdir -p .gpu
    strip -o .gpu/zrun target/release/zrun
    # The CUDA extension's unit tests (check u), whose CUDA parts run only where a GPU is.
    tests="$(cargo test --release -p zrun-torch-ext --features cuda --lib --no-run \
        --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])')"
    strip -o .gpu/torch-ext-tests "$tests"
    ls -la .gpu/zrun .gpu/torch-ext-tests
    echo 'now: run(command="bash benches/gpu/run.sh", carry=[".gpu"])'
    exit 0
fi
PY=python3
TORCH_LIB="$($PY -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib"
# cudarc loads NCCL as libnccl.so; the nvidia-nccl wheel ships only libnccl.so.2.
NCCL_LIB="$($PY -c 'import nvidia.nccl as m;print(list(m.__path__)[0])')/lib"
mkdir -p /tmp/zrun-lib
ln -sf "$NCCL_LIB/libnccl.so.2" /tmp/zrun-lib/libnccl.so
export LD_LIBRARY_PATH="/tmp/zrun-lib:$TORCH_LIB:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-$ROOT/.gpu}"
nvidia-smi -L
exec $PY benches/gpu/checks.py --zrun .gpu/zrun --out "$OUT_DIR/results.json" \
    --only "${1:-u,x,a,i,l,j,p,c,m,n,e,K,k,d,b,g,f,h}"
