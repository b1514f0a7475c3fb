# Environment for building and running zrun against the project's libtorch.
# Sourced by every make target and by .ci/run; never needs a manual export.
# libtorch comes from the torch==2.11.0 wheel in the project-local .venv.
ZRUN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ZRUN_ROOT
export VIRTUAL_ENV="$ZRUN_ROOT/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
# Puts a folder first on LD_LIBRARY_PATH once: sourcing this file again adds nothing.
zrun_ld_path() {
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$1:"*) ;;
        *) export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
}
# .venv/zrun-lib holds the libnccl.so link that scripts/setup.sh makes (cudarc loads NCCL by
# that name; pip's nvidia-nccl wheel ships only libnccl.so.2).
zrun_ld_path "$VIRTUAL_ENV/zrun-lib"
ZRUN_TORCH_LIB="$(ls -d "$VIRTUAL_ENV"/lib/python3*/site-packages/torch/lib 2>/dev/null | head -n 1)"
if [ -n "$ZRUN_TORCH_LIB" ]; then
    zrun_ld_path "$ZRUN_TORCH_LIB"
fi
unset -f zrun_ld_path
