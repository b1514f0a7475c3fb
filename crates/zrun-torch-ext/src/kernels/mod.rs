//! zrun's own CUDA kernels, compiled at run time with NVRTC (the `libnvrtc` that torch's
//! wheel ships) and launched through the driver API on libtorch's stream: what ATen has no
//! fused op for.
//!
//! - `ce_rows` (ce_rows.cu): each row's softmax cross-entropy and its gradient written over
//!   the logits, behind [`crate::fused_linear_cross_entropy`]. Without it the same
//!   arithmetic runs through ATen's ops (fp32 temporaries a block of rows at a time).
//!
//! [`install`] compiles the kernels for one device, loads them, registers them with the shim
//! and checks them against ATen's path on that device before any training step uses them; a
//! kernel that fails to build or disagrees is not installed and the error says why. Nothing
//! here panics: a missing library is reported, not loaded (cudarc would panic).

use crate::Error;
use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nvrtc;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Mutex;
use tch::{Device, Kind, Tensor};

/// The source of the `ce_rows` kernels (one for fp32 logits, one for bf16).
pub const CE_ROWS_SOURCE: &str = include_str!("ce_rows.cu");

/// Threads per block of `ce_rows` (its `ZR_THREADS`).
const CE_ROWS_THREADS: u32 = 512;

fn fail(op: &str, reason: impl std::fmt::Display) -> Error {
    Error::Refused {
        op: op.to_string(),
        reason: reason.to_string(),
    }
}

/// Makes `libnvrtc` loadable by name: where the loader does not find it (torch's wheel keeps
/// it in `nvidia/cu13/lib` beside torch, which is not on the library path), it is opened
/// from there by its full path first, with its builtins, so that cudarc's load by name finds
/// it already loaded.
fn find_nvrtc() -> Result<(), Error> {
    // SAFETY: probing the loader; no symbol of the library is called here.
    if unsafe { nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let torch_lib = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| std::path::Path::new(p).parent().map(|d| d.to_path_buf()));
    let mut tried = Vec::new();
    if let Some(torch_lib) = torch_lib {
        let nvidia = torch_lib.join("../../nvidia");
        for sub in ["cu13/lib", "cuda_nvrtc/lib"] {
            let dir = nvidia.join(sub);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut names: Vec<_> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        (n.starts_with("libnvrtc.so.") || n.starts_with("libnvrtc-builtins.so."))
                            && !n.contains(".alt.")
                    })
                })
                .collect();
            // The builtins first: libnvrtc opens them by name when it compiles.
            names.sort_by_key(|p| !p.to_string_lossy().contains("builtins"));
            for path in names {
                let Ok(c) = CString::new(path.to_string_lossy().as_bytes()) else {
                    continue;
                };
                // SAFETY: a NUL-terminated path; the handle is kept open for the process.
                let handle =
                    unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
                tried.push(format!(
                    "{} ({})",
                    path.display(),
                    if handle.is_null() { "failed" } else { "loaded" }
                ));
            }
        }
    }
    // SAFETY: as above.
    if unsafe { nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    Err(fail(
        "load libnvrtc",
        format!(
            "NVRTC (libnvrtc.so.13, from the nvidia-cuda-nvrtc wheel torch depends on) was not found on the library path or beside torch (tried: {}); add its folder to LD_LIBRARY_PATH, or set ZRUN_FUSED_LOSS=0",
            if tried.is_empty() { "nothing".to_string() } else { tried.join(", ") }
        ),
    ))
}

/// PTX of [`CE_ROWS_SOURCE`] for compute capability `major.minor` (from 7.5 on).
pub fn compile_ce_rows(major: i32, minor: i32) -> Result<String, Error> {
    find_nvrtc()?;
    let arch = format!("--gpu-architecture=compute_{major}{minor}");
    let opts = nvrtc::CompileOptions {
        options: vec![arch, "--std=c++17".to_string()],
        name: Some("ce_rows.cu".to_string()),
        ..Default::default()
    };
    nvrtc::compile_ptx_with_opts(CE_ROWS_SOURCE, opts)
        .map(|ptx| ptx.to_src())
        .map_err(|e| fail("compile ce_rows.cu with NVRTC", format!("{e:?}")))
}

/// The kernels loaded into one device's primary context.
struct Loaded {
    device: i32,
    ctx: usize,
    f32: usize,
    bf16: usize,
}

static LOADED: Mutex<Vec<Loaded>> = Mutex::new(Vec::new());

fn driver(op: &str, e: cu::DriverError) -> Error {
    fail(op, format!("{e:?}"))
}

/// Compiles and loads the kernels into `device`'s primary context.
fn load(device: i32) -> Result<Loaded, Error> {
    // SAFETY: probing the loader.
    if !unsafe { cusys::is_culib_present() } {
        return Err(fail(
            "load libcuda",
            "the NVIDIA driver library was not found",
        ));
    }
    cu::init().map_err(|e| driver("cuInit", e))?;
    let dev = cu::device::get(device).map_err(|e| driver("cuDeviceGet", e))?;
    // SAFETY: `dev` came from cuDeviceGet; the attributes are plain integers.
    let (major, minor) = unsafe {
        (
            cu::device::get_attribute(
                dev,
                cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            ),
            cu::device::get_attribute(
                dev,
                cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            ),
        )
    };
    let (major, minor) = (
        major.map_err(|e| driver("cuDeviceGetAttribute", e))?,
        minor.map_err(|e| driver("cuDeviceGetAttribute", e))?,
    );
    let ptx = compile_ce_rows(major, minor)?;
    let image = CString::new(ptx).map_err(|e| fail("load ce_rows", e))?;
    // SAFETY: `dev` is valid; the primary context is retained for the process (never
    // released), made current before loading, and the image is NUL-terminated PTX.
    unsafe {
        let ctx =
            cu::primary_ctx::retain(dev).map_err(|e| driver("cuDevicePrimaryCtxRetain", e))?;
        cu::ctx::set_current(ctx).map_err(|e| driver("cuCtxSetCurrent", e))?;
        let module = cu::module::load_data(image.as_ptr().cast())
            .map_err(|e| driver("cuModuleLoadData(ce_rows)", e))?;
        let f32 =
            cu::module::get_function(module, CString::new("zr_ce_rows_f32").unwrap_or_default())
                .map_err(|e| driver("cuModuleGetFunction(zr_ce_rows_f32)", e))?;
        let bf16 =
            cu::module::get_function(module, CString::new("zr_ce_rows_bf16").unwrap_or_default())
                .map_err(|e| driver("cuModuleGetFunction(zr_ce_rows_bf16)", e))?;
        Ok(Loaded {
            device,
            ctx: ctx as usize,
            f32: f32 as usize,
            bf16: bf16 as usize,
        })
    }
}

/// Writes `msg` where the shim frees it with `free`.
fn report(err: *mut *mut c_char, msg: &str) -> c_int {
    if !err.is_null() {
        let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
        // SAFETY: `err` is the shim's out-pointer; strdup's copy is freed by the shim.
        unsafe { *err = libc::strdup(c.as_ptr()) };
    }
    1
}

/// The shim's `CeRowsKernel`: launches `ce_rows` for `n` rows of `v` logits on `stream`.
extern "C" fn launch_ce_rows(
    device: c_int,
    dtype: c_int,
    logits: *mut c_void,
    targets: *const c_void,
    coef: *const c_void,
    loss: *mut c_void,
    n: i64,
    v: i64,
    grad: c_int,
    stream: *mut c_void,
    err: *mut *mut c_char,
) -> c_int {
    let run = || -> Result<(), String> {
        let loaded = LOADED
            .lock()
            .map_err(|_| "the kernel table is poisoned".to_string())?;
        let k = loaded
            .iter()
            .find(|k| k.device == device)
            .ok_or_else(|| format!("no kernels were loaded for cuda:{device}"))?;
        let rows =
            u32::try_from(n).map_err(|_| format!("{n} rows are more than one launch takes"))?;
        let f = if dtype == 1 { k.bf16 } else { k.f32 } as cusys::CUfunction;
        let (mut logits, mut targets, mut coef, mut loss, mut v, mut grad) =
            (logits, targets, coef, loss, v, grad);
        let mut params: [*mut c_void; 6] = [
            (&raw mut logits).cast(),
            (&raw mut targets).cast(),
            (&raw mut coef).cast(),
            (&raw mut loss).cast(),
            (&raw mut v).cast(),
            (&raw mut grad).cast(),
        ];
        // SAFETY: the context and function are the loaded ones of this device; the params
        // point at locals of the kernel's argument types (pointers, long long, int), which
        // cuLaunchKernel copies before returning; the shim checked shapes and dtypes.
        unsafe {
            cu::ctx::set_current(k.ctx as cusys::CUcontext)
                .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
            cu::launch_kernel(
                f,
                (rows, 1, 1),
                (CE_ROWS_THREADS, 1, 1),
                0,
                stream as cusys::CUstream,
                &mut params,
            )
            .map_err(|e| format!("cuLaunchKernel(ce_rows, {n} x {v}): {e:?}"))
        }
    };
    match std::panic::catch_unwind(run) {
        Ok(Ok(())) => 0,
        Ok(Err(msg)) => report(err, &msg),
        Err(_) => report(err, "the launch panicked"),
    }
}

/// Compiles and loads the kernels for CUDA device `device`, checks them there against
/// ATen's path (bf16 and fp32, ignored rows, targets at both ends, rows longer and shorter
/// than a block) and registers them for every later [`crate::fused_linear_cross_entropy`].
/// Idempotent per device. On error nothing new is registered.
pub fn install(device: usize) -> Result<(), Error> {
    let index = i32::try_from(device).map_err(|e| fail("install kernels", e))?;
    {
        let mut loaded = LOADED
            .lock()
            .map_err(|_| fail("install kernels", "poisoned lock"))?;
        if !loaded.iter().any(|k| k.device == index) {
            let k = load(index)?;
            loaded.push(k);
        }
    }
    let previous = crate::ffi::set_ce_rows_kernel(Some(launch_ce_rows));
    if let Err(e) = self_check(Device::Cuda(device)) {
        crate::ffi::set_ce_rows_kernel(previous);
        return Err(e);
    }
    Ok(())
}

/// Removes the registered kernel (ATen's path from then on).
pub fn uninstall() {
    crate::ffi::set_ce_rows_kernel(None);
}

/// The kernel's rows against ATen's on `device`: losses within 1e-5 relative, gradients
/// within one rounding of the logits' dtype.
fn self_check(device: Device) -> Result<(), Error> {
    let _guard = tch::no_grad_guard();
    for (kind, tol) in [(Kind::Float, 1e-6), (Kind::BFloat16, 1.0 / 128.0)] {
        for (n, v) in [(5i64, 37i64), (7, 1000), (3, 50_257)] {
            let op = || format!("check ce_rows on {device:?} ({kind:?}, {n} x {v})");
            let opts = (Kind::Float, device);
            let logits =
                (Tensor::f_randn([n, v], opts).map_err(|e| fail(&op(), e))? * 3.0).to_kind(kind);
            let targets = Tensor::from_slice(&[0i64, v - 1, 1, v / 2, 2, 3, 4][..n as usize])
                .to_device(device);
            let coef = Tensor::from_slice(&[0.25f32, 0.0, 0.5, 0.125, 0.0, 1.0, 2.0][..n as usize])
                .to_device(device);
            let (a, b) = (logits.copy(), logits.copy());
            let got = crate::loss::ce_rows(&a, &targets, &coef, true, false)?;
            let want = crate::loss::ce_rows(&b, &targets, &coef, true, true)?;
            let loss_err = (&got - &want).abs().max().double_value(&[]);
            let loss_top = want.abs().max().double_value(&[]).max(1.0);
            let grad_err = (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
                .abs()
                .max()
                .double_value(&[]);
            let grad_top = b
                .to_kind(Kind::Float)
                .abs()
                .max()
                .double_value(&[])
                .max(f64::MIN_POSITIVE);
            if !(loss_err <= 1e-5 * loss_top && grad_err <= tol * grad_top) {
                return Err(fail(
                    &op(),
                    format!("the kernel disagrees with ATen: losses off by {loss_err:e} (of {loss_top:e}), gradients by {grad_err:e} (of {grad_top:e}); set ZRUN_FUSED_LOSS=0 to run without it"),
                ));
            }
        }
    }
    Ok(())
}
