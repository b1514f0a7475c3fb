//! Compiles csrc/zrun_torch_ext.cpp, csrc/cpu_allocator.cpp, csrc/linear_loss.cpp, csrc/rms_norm.cpp, csrc/fused_loss.cpp, csrc/swiglu.cpp, csrc/colsum.cpp, csrc/rope.cpp and csrc/pinned.cpp against the same libtorch headers torch-sys (tch) uses.
//!
//! The libtorch install is located the way torch-sys 0.24 does it: with
//! `LIBTORCH_USE_PYTORCH` set, ask the active python (`python` inside a virtualenv, else
//! `python3`) for torch's include/lib dirs and its `_GLIBCXX_USE_CXX11_ABI`; otherwise use
//! `LIBTORCH` (with `LIBTORCH_INCLUDE`, `LIBTORCH_LIB`, `LIBTORCH_CXX11_ABI` overrides).

use std::env;
use std::path::PathBuf;
use std::process::Command;

const PYTHON_PRINT_TORCH: &str = r"
import torch
from torch.utils import cpp_extension
print('ZR_CXX11:', torch._C._GLIBCXX_USE_CXX11_ABI)
for p in cpp_extension.include_paths():
    print('ZR_INCLUDE:', p)
for p in cpp_extension.library_paths():
    print('ZR_LIB:', p)
";

struct Libtorch {
    includes: Vec<PathBuf>,
    lib_dir: PathBuf,
    cxx11_abi: &'static str,
}

fn env_rerun(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok()
}

fn from_python() -> Result<Libtorch, String> {
    let python = if env::var_os("VIRTUAL_ENV").is_some() {
        "python"
    } else {
        "python3"
    };
    let out = Command::new(python)
        .arg("-c")
        .arg(PYTHON_PRINT_TORCH)
        .output()
        .map_err(|e| format!("cannot run `{python}` to locate torch: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{python}` failed to import torch: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut includes = Vec::new();
    let mut lib_dir = None;
    let mut cxx11_abi = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(v) = line.strip_prefix("ZR_CXX11: ") {
            cxx11_abi = Some(if v == "True" { "1" } else { "0" });
        } else if let Some(p) = line.strip_prefix("ZR_INCLUDE: ") {
            includes.push(PathBuf::from(p));
        } else if let Some(p) = line.strip_prefix("ZR_LIB: ") {
            lib_dir.get_or_insert_with(|| PathBuf::from(p));
        }
    }
    Ok(Libtorch {
        includes,
        lib_dir: lib_dir.ok_or("python printed no torch library path")?,
        cxx11_abi: cxx11_abi.ok_or("python printed no _GLIBCXX_USE_CXX11_ABI")?,
    })
}

fn from_env() -> Result<Libtorch, String> {
    let root = env_rerun("LIBTORCH")
        .map(PathBuf::from)
        .or_else(|| {
            PathBuf::from("/usr/lib/libtorch.so")
                .exists()
                .then(|| PathBuf::from("/usr"))
        })
        .ok_or(
            "no libtorch found: set LIBTORCH_USE_PYTORCH=1 inside the project's virtualenv \
             (source scripts/env.sh) or LIBTORCH=/path/to/libtorch",
        )?;
    let inc = env_rerun("LIBTORCH_INCLUDE").map_or_else(|| root.clone(), PathBuf::from);
    let lib = env_rerun("LIBTORCH_LIB").map_or_else(|| root.clone(), PathBuf::from);
    let abi = match env_rerun("LIBTORCH_CXX11_ABI").as_deref() {
        Some("0") => "0",
        _ => "1",
    };
    Ok(Libtorch {
        includes: vec![
            inc.join("include"),
            inc.join("include/torch/csrc/api/include"),
        ],
        lib_dir: lib.join("lib"),
        cxx11_abi: abi,
    })
}

fn main() {
    println!("cargo:rerun-if-changed=csrc/zrun_torch_ext.cpp");
    println!("cargo:rerun-if-changed=csrc/cpu_allocator.cpp");
    println!("cargo:rerun-if-changed=csrc/linear_loss.cpp");
    println!("cargo:rerun-if-changed=csrc/linear_loss.h");
    println!("cargo:rerun-if-changed=csrc/rms_norm.cpp");
    println!("cargo:rerun-if-changed=csrc/fused_loss.cpp");
    println!("cargo:rerun-if-changed=csrc/fused_loss.h");
    println!("cargo:rerun-if-changed=csrc/swiglu.cpp");
    println!("cargo:rerun-if-changed=csrc/colsum.cpp");
    println!("cargo:rerun-if-changed=csrc/colsum.h");
    println!("cargo:rerun-if-changed=csrc/swiglu.h");
    println!("cargo:rerun-if-changed=csrc/rope.cpp");
    println!("cargo:rerun-if-changed=csrc/rope.h");
    println!("cargo:rerun-if-changed=csrc/pinned.cpp");
    println!("cargo:rerun-if-changed=csrc/stream.h");
    println!("cargo:rerun-if-changed=csrc/rms_norm.h");
    println!("cargo:rerun-if-changed=csrc/acc_type.h");
    println!("cargo:rerun-if-changed=build.rs");
    let torch = if env_rerun("LIBTORCH_USE_PYTORCH").is_some() {
        from_python()
    } else {
        from_env()
    };
    let torch = match torch {
        Ok(t) => t,
        Err(msg) => panic!("zrun-torch-ext: {msg}"),
    };
    // With feature `cuda` and a CUDA build of libtorch: keep libtorch_cuda.so linked (see
    // the anchor in csrc/), so libtorch sees the GPUs. It costs about 230 MiB of RSS per
    // process, so CPU builds (no feature) leave it out; ZRUN_TORCH_EXT_NO_CUDA=1 also does.
    let torch_cuda = std::env::var_os("CARGO_FEATURE_CUDA").is_some()
        && torch.lib_dir.join("libtorch_cuda.so").exists()
        && !matches!(env_rerun("ZRUN_TORCH_EXT_NO_CUDA").as_deref(), Some(v) if v != "0");
    let mut build = cc::Build::new();
    if torch_cuda {
        build.define("ZRUN_LINK_TORCH_CUDA", None);
    }
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .includes(&torch.includes)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={}", torch.cxx11_abi))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/zrun_torch_ext.cpp")
        .file("csrc/cpu_allocator.cpp")
        .file("csrc/linear_loss.cpp")
        .file("csrc/rms_norm.cpp")
        .file("csrc/fused_loss.cpp")
        .file("csrc/swiglu.cpp")
        .file("csrc/colsum.cpp")
        .file("csrc/rope.cpp")
        .file("csrc/pinned.cpp")
        .compile("zrun_torch_ext");
    // tch links these too; naming them after our static library keeps the link order right
    // whatever order the linker sees the crates in.
    println!("cargo:rustc-link-search=native={}", torch.lib_dir.display());
    // For the crates that depend on this one (DEP_ZRUN_TORCH_EXT_LIBTORCH_LIB): the zrun
    // binary records it as its RUNPATH.
    println!("cargo:libtorch_lib={}", torch.lib_dir.display());
    if torch_cuda {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
    }
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}
