//! Names the backends built in for `zrun --version`, and records in the zrun binary's
//! RUNPATH the libtorch it was linked against (and, when the project's `.venv` has it, the
//! folder with the `libnccl.so` link that `make setup` makes), so the binary runs from any
//! shell without `scripts/env.sh`. A RUNPATH comes after `LD_LIBRARY_PATH`, which still
//! chooses another libtorch or NCCL where it is set (the GPU machine's, for a carried binary).

use std::path::Path;

fn rpath(dir: &Path) {
    // `-Xlinker` keeps a path with a comma in one piece (`-Wl,` would split it).
    for arg in ["-Xlinker", "--enable-new-dtags", "-Xlinker"] {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
    println!("cargo:rustc-link-arg-bins=-rpath={}", dir.display());
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // For `zrun --version`.
    let feature = |f: &str| std::env::var_os(format!("CARGO_FEATURE_{f}")).is_some();
    let mut backends = String::from("tcp");
    if feature("MPI") {
        backends.push_str(", mpi");
    }
    backends.push_str(if feature("CUDA") {
        ", nccl; CUDA"
    } else {
        "; CPU only"
    });
    println!("cargo:rustc-env=ZRUN_BACKENDS={backends}");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    if let Some(lib) = std::env::var_os("DEP_ZRUN_TORCH_EXT_LIBTORCH_LIB") {
        rpath(Path::new(&lib));
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        let nccl = Path::new(&venv).join("zrun-lib");
        if nccl.is_dir() {
            rpath(&nccl);
        }
    }
}
