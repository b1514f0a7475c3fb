# Environment for building and running zrun against the project's libtorch.
# Sourced by every make target and by .ci/run; never needs a manual export.
# libtorch comes from the torch==2.11.0 wheel in the project-local .venv.
ZRUN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ZRUN_ROOT
export VIRTUAL_ENV="$ZRUN_ROOT/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
ZRUN_TORCH_LIB="$(ls -d "$VIRTUAL_ENV"/lib/python3*/site-packages/torch/lib 2>/dev/null | head -n 1)"
if [ -n "$ZRUN_TORCH_LIB" ]; then
    export LD_LIBRARY_PATH="$ZRUN_TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
