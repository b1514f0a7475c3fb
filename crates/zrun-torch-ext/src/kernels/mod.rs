//! zrun's own CUDA kernels, compiled at run time with NVRTC (the `libnvrtc` that torch's
//! wheel ships) and launched through the driver API on libtorch's stream: what ATen has no
//! fused op for.
//!
//! - `ce_rows` (ce_rows.cu): each row's softmax cross-entropy and its gradient written over
//!   the logits, behind [`crate::fused_linear_cross_entropy`]. Without it the same
//!   arithmetic runs through ATen's ops (fp32 temporaries a block of rows at a time).
//! - `swiglu` (swiglu.cu): SwiGLU's product and both its gradients in one pass each, behind
//!   [`crate::swiglu`] (ATen's silu and mul otherwise).
//! - `rope` (rope.cu): the rotary position embedding and its gradient in one pass each,
//!   behind [`crate::rope`] (ATen's mul, roll and add otherwise).
//! - `colsum` (colsum.cu): sums over rows of a gradient, in two passes of a fixed order,
//!   behind the bias gradient of [`crate::linear`] and the weight and bias gradients of
//!   [`crate::layer_norm`] (ATen's sum and LayerNorm backward otherwise).
//! - `adamw`, `cast_into` and `fresh_share` (optim.cu): an AdamW step that writes the bf16
//!   parameters too, bf16 gradients laid into an fp32 buffer, and the newest gradient's share
//!   of a split delayed update taken from the compute parameters in one pass, launched from
//!   Rust ([`optim`]; ATen's fused AdamW, cast, copies and element-wise ops otherwise).
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
use tch::Device;

mod check;

/// The source of every kernel, one NVRTC program: the shared helpers, then `ce_rows`,
/// `swiglu`, `rope`, `colsum` (an fp32 and a bf16 entry point each; rope.cu uses
/// swiglu.cu's block size) and the optimizer's.
pub const SOURCE: &str = concat!(
    include_str!("common.cuh"),
    include_str!("ce_rows.cu"),
    include_str!("swiglu.cu"),
    include_str!("rope.cu"),
    include_str!("colsum.cu"),
    include_str!("optim.cu")
);

/// The program's entry points, as `Loaded::functions` holds them: each kernel's fp32 entry,
/// then its bf16 one (the launches index them so); AdamW's are by its gradients' dtype, the
/// gradient layout has one, and the fresh share four (by the parameters' dtype, then the
/// gradients').
pub const ENTRIES: [&str; 19] = [
    "zr_ce_rows_f32",
    "zr_ce_rows_bf16",
    "zr_swiglu_fwd_f32",
    "zr_swiglu_fwd_bf16",
    "zr_swiglu_bwd_f32",
    "zr_swiglu_bwd_bf16",
    "zr_rope_f32",
    "zr_rope_bf16",
    "zr_colsum_part_f32",
    "zr_colsum_part_bf16",
    "zr_colsum_fin_f32",
    "zr_colsum_fin_bf16",
    "zr_adamw_f32",
    "zr_adamw_bf16",
    "zr_cast_into",
    "zr_fresh_share_f32_f32",
    "zr_fresh_share_f32_bf16",
    "zr_fresh_share_bf16_f32",
    "zr_fresh_share_bf16_bf16",
];

/// Each kernel's fp32 entry in [`ENTRIES`] (its bf16 entry is the next).
const CE_ROWS: usize = 0;
const SWIGLU_FWD: usize = 2;
const SWIGLU_BWD: usize = 4;
const ROPE: usize = 6;
const COLSUM_PART: usize = 8;
const COLSUM_FIN: usize = 10;

/// The kernel arguments of a launch: pointers to the named locals (which cuLaunchKernel copies
/// before it returns).
macro_rules! args {
    ($($a:ident),* $(,)?) => {
        [$((&raw mut $a).cast::<c_void>()),*]
    };
}

pub mod optim;

/// Blocks of [`EW_THREADS`] for `n` elements, enough to fill any GPU (the elementwise kernels
/// stride over the rest).
fn ew_blocks(n: i64) -> Result<u32, String> {
    let per = i64::from(EW_THREADS);
    u32::try_from(((n + per - 1) / per).clamp(1, 16_384)).map_err(|e| e.to_string())
}

/// Threads per block of the elementwise kernels (swiglu.cu's `ZR_EW_THREADS`).
const EW_THREADS: u32 = 256;

/// Threads per block of `colsum`'s passes (its `ZR_CS_THREADS`).
const COLSUM_THREADS: u32 = 256;

/// The bit of `launch_colsum`'s dtype that asks for GELU's backward first (colsum.h).
const COLSUM_GELU: c_int = 2;

/// Threads per block of `ce_rows` (its `ZR_THREADS`).
const CE_ROWS_THREADS: u32 = 512;

pub(crate) fn fail(op: &str, reason: impl std::fmt::Display) -> Error {
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
            "NVRTC (libnvrtc.so.13, from the nvidia-cuda-nvrtc wheel torch depends on) was not found on the library path or beside torch (tried: {}); add its folder to LD_LIBRARY_PATH, or set ZRUN_KERNELS=0 to run without zrun's kernels",
            if tried.is_empty() { "nothing".to_string() } else { tried.join(", ") }
        ),
    ))
}

/// PTX of [`SOURCE`] for compute capability `major.minor` (from 7.5 on).
pub fn compile(major: i32, minor: i32) -> Result<String, Error> {
    find_nvrtc()?;
    let arch = format!("--gpu-architecture=compute_{major}{minor}");
    let opts = nvrtc::CompileOptions {
        options: vec![arch, "--std=c++17".to_string()],
        name: Some("zrun_kernels.cu".to_string()),
        ..Default::default()
    };
    nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map(|ptx| ptx.to_src())
        .map_err(|e| fail("compile zrun's kernels with NVRTC", format!("{e:?}")))
}

/// The kernels loaded into one device's primary context.
struct Loaded {
    device: i32,
    ctx: usize,
    /// The functions of [`ENTRIES`], in order.
    functions: [usize; ENTRIES.len()],
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
    let ptx = compile(major, minor)?;
    let image = CString::new(ptx).map_err(|e| fail("load zrun's kernels", e))?;
    // SAFETY: `dev` is valid; the primary context is retained for the process (never
    // released), made current before loading, and the image is NUL-terminated PTX.
    unsafe {
        let ctx =
            cu::primary_ctx::retain(dev).map_err(|e| driver("cuDevicePrimaryCtxRetain", e))?;
        cu::ctx::set_current(ctx).map_err(|e| driver("cuCtxSetCurrent", e))?;
        let module = cu::module::load_data(image.as_ptr().cast())
            .map_err(|e| driver("cuModuleLoadData(zrun's kernels)", e))?;
        let mut functions = [0usize; ENTRIES.len()];
        for (f, name) in functions.iter_mut().zip(ENTRIES) {
            let c = CString::new(name).map_err(|e| fail("load zrun's kernels", e))?;
            *f = cu::module::get_function(module, c)
                .map_err(|e| driver(&format!("cuModuleGetFunction({name})"), e))?
                as usize;
        }
        Ok(Loaded {
            device,
            ctx: ctx as usize,
            functions,
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

/// Launches entry `ENTRIES[entry]` on `device`'s loaded program with `params` (pointers to the
/// kernel's arguments) on `stream`; `what` names the launch in an error.
fn launch(
    device: c_int,
    entry: usize,
    grid: u32,
    block: u32,
    stream: *mut c_void,
    params: &mut [*mut c_void],
    what: impl FnOnce() -> String,
) -> Result<(), String> {
    let loaded = LOADED
        .lock()
        .map_err(|_| "the kernel table is poisoned".to_string())?;
    let k = loaded
        .iter()
        .find(|k| k.device == device)
        .ok_or_else(|| format!("no kernels were loaded for cuda:{device}"))?;
    // SAFETY: the context and function are the loaded ones of this device; `params` point at
    // the caller's locals of the kernel's argument types, which cuLaunchKernel copies before
    // returning; the shim checked shapes and dtypes.
    unsafe {
        cu::ctx::set_current(k.ctx as cusys::CUcontext)
            .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        cu::launch_kernel(
            k.functions[entry] as cusys::CUfunction,
            (grid, 1, 1),
            (block, 1, 1),
            0,
            stream as cusys::CUstream,
            params,
        )
        .map_err(|e| format!("cuLaunchKernel({}): {e:?}", what()))
    }
}

/// Turns a launch's result into the shim's status and message.
fn status(run: impl FnOnce() -> Result<(), String>, err: *mut *mut c_char) -> c_int {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(Ok(())) => 0,
        Ok(Err(msg)) => report(err, &msg),
        Err(_) => report(err, "the launch panicked"),
    }
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
        let rows =
            u32::try_from(n).map_err(|_| format!("{n} rows are more than one launch takes"))?;
        let entry = CE_ROWS + usize::from(dtype == 1);
        let name = ENTRIES[entry];
        let (mut logits, mut targets, mut coef, mut loss, mut v, mut grad) =
            (logits, targets, coef, loss, v, grad);
        let mut params = args![logits, targets, coef, loss, v, grad];
        launch(
            device,
            entry,
            rows,
            CE_ROWS_THREADS,
            stream,
            &mut params,
            || format!("{name}, {n} x {v}"),
        )
    };
    status(run, err)
}

/// The shim's `SwigluKernel`: SwiGLU's forward (`out0`) or backward (`out0` = d(a), `out1` =
/// d(b) from `g`) over `n` contiguous values on `stream`.
extern "C" fn launch_swiglu(
    device: c_int,
    dtype: c_int,
    backward: c_int,
    a: *const c_void,
    b: *const c_void,
    g: *const c_void,
    out0: *mut c_void,
    out1: *mut c_void,
    n: i64,
    stream: *mut c_void,
    err: *mut *mut c_char,
) -> c_int {
    let run = || -> Result<(), String> {
        let blocks = ew_blocks(n)?;
        let (mut a, mut b, mut g, mut out0, mut out1, mut n) = (a, b, g, out0, out1, n);
        let bf16 = usize::from(dtype == 1);
        let values = n;
        let (mut bwd, mut fwd) = (args![a, b, g, out0, out1, n], args![a, b, out0, n]);
        let (entry, params): (usize, &mut [*mut c_void]) = if backward != 0 {
            (SWIGLU_BWD + bf16, &mut bwd)
        } else {
            (SWIGLU_FWD + bf16, &mut fwd)
        };
        launch(device, entry, blocks, EW_THREADS, stream, params, || {
            format!("{}, {values} values", ENTRIES[entry])
        })
    };
    status(run, err)
}

/// The shim's `RopeKernel`: the rotary embedding (or its gradient) of `n` contiguous values
/// of heads (B, `t`, `heads`, `hd`) on `stream`.
extern "C" fn launch_rope(
    device: c_int,
    dtype: c_int,
    backward: c_int,
    x: *const c_void,
    cos: *const c_void,
    sin: *const c_void,
    y: *mut c_void,
    n: i64,
    t: i64,
    heads: i64,
    hd: i64,
    stream: *mut c_void,
    err: *mut *mut c_char,
) -> c_int {
    let run = || -> Result<(), String> {
        let blocks = ew_blocks(n)?;
        let entry = ROPE + usize::from(dtype == 1);
        let name = ENTRIES[entry];
        let (mut x, mut cos, mut sin, mut y, mut n, mut t, mut heads, mut hd, mut backward) =
            (x, cos, sin, y, n, t, heads, hd, backward);
        let mut params = args![x, cos, sin, y, n, t, heads, hd, backward];
        launch(
            device,
            entry,
            blocks,
            EW_THREADS,
            stream,
            &mut params,
            || format!("{name}, {n} values"),
        )
    };
    status(run, err)
}

/// The shim's `ColsumKernel`: the sums over `rows` of `dy` (rows, `cols`) into `out_b`, and
/// with `x` those of dy (x - mean) rstd into `out_g`, through the fp32 scratch `part`: one
/// launch of `splits` blocks per span of columns, then one of a block per 32 columns. With
/// `dtype`'s bit [`COLSUM_GELU`] GELU's backward comes first: `x` is GELU's input h, `out_g`
/// (rows, cols) gets dy gelu'(h), and `out_b` the sums of that.
extern "C" fn launch_colsum(
    device: c_int,
    dtype: c_int,
    dy: *const c_void,
    x: *const c_void,
    mean: *const c_void,
    rstd: *const c_void,
    part: *mut c_void,
    out_b: *mut c_void,
    out_g: *mut c_void,
    rows: i64,
    cols: i64,
    splits: i64,
    per_split: i64,
    stream: *mut c_void,
    err: *mut *mut c_char,
) -> c_int {
    let run = || -> Result<(), String> {
        let bf16 = usize::from(dtype & 1 == 1);
        let gelu = dtype & COLSUM_GELU != 0;
        // colsum.cu's span: 32 threads of 16 bytes.
        let span = if bf16 == 1 { 256 } else { 128 };
        let spans = (cols + span - 1) / span;
        let blocks = u32::try_from(spans * splits)
            .map_err(|_| format!("{spans} x {splits} blocks are more than one launch takes"))?;
        let (mut dy, mut x, mut mean, mut rstd, mut part) = (dy, x, mean, rstd, part);
        let (mut out_b, mut rows, mut cols, mut splits, mut per_split) =
            (out_b, rows, cols, splits, per_split);
        // GELU's gradient goes to `out_g`; the second pass then has one half to add.
        let (mut dh, mut out_g) = if gelu {
            (out_g, std::ptr::null_mut())
        } else {
            (std::ptr::null_mut(), out_g)
        };
        let mut params = args![dy, x, mean, rstd, dh, part, rows, cols, per_split];
        let entry = COLSUM_PART + bf16;
        launch(
            device,
            entry,
            blocks,
            COLSUM_THREADS,
            stream,
            &mut params,
            || format!("{}, {rows} x {cols}", ENTRIES[entry]),
        )?;
        // colsum.cu's second pass: 32 columns a block.
        let fin = u32::try_from((cols + 31) / 32).map_err(|e| e.to_string())?;
        let mut params = args![part, out_b, out_g, splits, cols];
        let entry = COLSUM_FIN + bf16;
        launch(
            device,
            entry,
            fin,
            COLSUM_THREADS,
            stream,
            &mut params,
            || format!("{}, {cols} columns", ENTRIES[entry]),
        )
    };
    status(run, err)
}

/// What [`install`] left out: the optimizer's kernels are checked apart from the others, and
/// only they are left out when their check fails.
#[derive(Debug)]
pub struct Installed {
    /// Why the optimizer's kernels ([`optim`]) are not used, if they are not.
    pub optimizer_left_out: Option<Error>,
}

/// Compiles and loads the kernels for CUDA device `device`, checks each there against ATen's
/// path ([`check`]) and registers them for every later [`crate::fused_linear_cross_entropy`],
/// [`crate::swiglu`], [`crate::rope`], [`crate::linear`] and [`crate::layer_norm`], then
/// the optimizer's for [`optim::adamw_pieces`], [`optim::cast_into`] and
/// [`optim::fresh_share`]. Idempotent per device. On error nothing new is registered.
pub fn install(device: usize) -> Result<Installed, Error> {
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
    let dev = Device::Cuda(device);
    let ce = crate::ffi::set_ce_rows_kernel(Some(launch_ce_rows));
    let sw = crate::ffi::set_swiglu_kernel(Some(launch_swiglu));
    let ro = crate::ffi::set_rope_kernel(Some(launch_rope));
    let cs = crate::ffi::set_colsum_kernel(Some(launch_colsum));
    if let Err(e) = check_model(dev) {
        crate::ffi::set_ce_rows_kernel(ce);
        crate::ffi::set_swiglu_kernel(sw);
        crate::ffi::set_rope_kernel(ro);
        crate::ffi::set_colsum_kernel(cs);
        return Err(e);
    }
    optim::set_on(true);
    let optimizer_left_out = check_optimizer(dev).err();
    if optimizer_left_out.is_some() {
        optim::set_on(false);
    }
    Ok(Installed { optimizer_left_out })
}

/// Every kernel's check on `device`: what is registered there against ATen's ops, on inputs
/// drawn from no random generator (on CPU both sides are ATen's).
pub fn check_all(device: Device) -> Result<(), Error> {
    check_model(device).and_then(|()| check_optimizer(device))
}

/// The checks of the kernels the model's ops run.
fn check_model(device: Device) -> Result<(), Error> {
    check::ce_rows(device)
        .and_then(|()| check::swiglu(device))
        .and_then(|()| check::rope(device))
        .and_then(|()| check::colsum(device))
        .and_then(|()| check::gelu_colsum(device))
}

/// The checks of the optimizer's kernels.
fn check_optimizer(device: Device) -> Result<(), Error> {
    check::adamw(device)
        .and_then(|()| check::cast_into(device))
        .and_then(|()| check::fresh_share(device))
}

/// Removes the registered kernels (ATen's ops from then on).
pub fn uninstall() {
    crate::ffi::set_ce_rows_kernel(None);
    crate::ffi::set_swiglu_kernel(None);
    crate::ffi::set_rope_kernel(None);
    crate::ffi::set_colsum_kernel(None);
    optim::set_on(false);
}
