#!/usr/bin/env bash
# Idempotent setup: Debian packages (installed when root, otherwise the exact
# apt-get line is printed), then the project-local .venv with torch==2.11.0.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
TORCH_VERSION=2.11.0

missing=()
need() { # need PACKAGE CHECK-COMMAND...
    local pkg=$1; shift
    if ! "$@" >/dev/null 2>&1; then missing+=("$pkg"); fi
}
need g++ command -v g++
need make command -v make
need pkg-config command -v pkg-config
need python3 command -v python3
need python3-venv python3 -c 'import venv, ensurepip'
# `zrun plot` draws text with a TTF font read at run time (or $ZRUN_FONT).
need fonts-dejavu-core test -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
# MPI backend (cargo feature `mpi`): OpenMPI and libclang for bindgen.
need libopenmpi-dev command -v mpicc
need openmpi-bin command -v mpirun
# scripts/testbed.sh (two nodes on one machine): ip and tc.
need iproute2 command -v tc
need libclang-dev bash -c 'ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* 2>/dev/null | grep -q .'

if [ ${#missing[@]} -gt 0 ]; then
    line="apt-get install -y --no-install-recommends ${missing[*]}"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing Debian packages: ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get update -q
        DEBIAN_FRONTEND=noninteractive $line
    else
        echo "setup: missing Debian packages; run as root:" >&2
        echo "    sudo $line" >&2
        exit 1
    fi
fi

if ! command -v cargo >/dev/null; then
    echo "setup: cargo not found; install the Rust toolchain (https://rustup.rs) and retry" >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
fi
# pip_install WHAT PACKAGE...: PyPI downloads (torch's are a few GB) break now and then. A
# dropped connection resumes within one try; a failed try is repeated after a pause that
# doubles (15 s to 4 min, about 8 minutes in all), and what was downloaded stays in pip's cache.
pip_install() {
    local what=$1; shift
    local pause=15
    for attempt in 1 2 3 4 5 6; do
        # pip before 25.1 (what a new venv may start with) has no --resume-retries.
        local resume=()
        if .venv/bin/python -m pip install --help 2>/dev/null | grep -q -- --resume-retries; then
            resume=(--resume-retries 20)
        fi
        if .venv/bin/python -m pip install -q --retries 10 "${resume[@]}" "$@"; then
            return 0
        fi
        if [ "$attempt" = 6 ]; then
            echo "setup: installing $what failed $attempt times; check the connection to PyPI and run make setup again" >&2
            exit 1
        fi
        echo "setup: installing $what failed (attempt $attempt of 6); trying again in $pause s" >&2
        sleep "$pause"
        pause=$((pause * 2))
    done
}
if ! .venv/bin/python -c "import torch, numpy, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "setup: installing torch==$TORCH_VERSION into .venv (a few GB, once)"
    pip_install pip --upgrade pip
    pip_install "torch==$TORCH_VERSION" "torch==$TORCH_VERSION" numpy
fi
# The tests load consolidated checkpoints with safetensors.torch.
if ! .venv/bin/python -c "import safetensors.torch" 2>/dev/null; then
    echo "setup: installing safetensors into .venv"
    pip_install safetensors safetensors
fi
# The Hugging Face tests build tiny models with transformers and compare tokenizers' encoding.
if ! .venv/bin/python -c "import transformers, tokenizers" 2>/dev/null; then
    echo "setup: installing transformers into .venv"
    pip_install transformers "transformers>=4.46,<6" tokenizers
fi
# The prepare tests and benches/prepare_speed.py write Parquet and zstd inputs with pyarrow.
if ! .venv/bin/python -c "import pyarrow" 2>/dev/null; then
    echo "setup: installing pyarrow into .venv"
    pip_install pyarrow pyarrow
fi
# The nccl backend (feature `cuda`): cudarc loads NCCL as libnccl.so, but pip's nvidia-nccl
# wheel (a dependency of torch) ships only libnccl.so.2. Link it under cudarc's name in
# .venv/zrun-lib, which scripts/env.sh puts on LD_LIBRARY_PATH; it is the very file
# libtorch_cuda loads, so the process holds one NCCL. The link is relative to stay valid
# when the checkout moves.
nccl="$(ls .venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -n 1 || true)"
if [ -n "$nccl" ]; then
    mkdir -p .venv/zrun-lib
    ln -sfn "../${nccl#.venv/}" .venv/zrun-lib/libnccl.so
fi
