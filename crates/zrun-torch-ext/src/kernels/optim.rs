//! The optimizer's kernels (optim.cu), launched from Rust on libtorch's current stream once
//! [`super::install`] has checked them on the device:
//!
//! - [`adamw_pieces`]: AdamW over pieces of a shard that also writes the new bf16
//!   parameters, in place of ATen's fused AdamW followed by a cast of the whole master into
//!   the parameters;
//! - [`cast_into`]: bf16 gradients copied over (or added to) an fp32 buffer, one launch for
//!   many tensors, in place of ATen's casting copy (a launch per tensor of an unvectorized
//!   kernel);
//! - [`fresh_share`]: the newest gradient's share of a split delayed update taken from the
//!   compute parameters, one pass over them, their gradients and v in place of about five
//!   ATen passes with fp32 temporaries.
//!
//! Each returns `Ok(false)` without touching anything when the kernels are not installed or a
//! piece is not what they take; the caller then runs ATen's ops.

use super::{fail, launch, ENTRIES};
use crate::{ffi, Error};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use tch::{Device, Kind, Tensor};

/// Whether the kernels are installed (and checked).
static ON: AtomicBool = AtomicBool::new(false);

/// Turns the kernels on or off; returns whether they were on.
pub(super) fn set_on(on: bool) -> bool {
    ON.swap(on, Ordering::SeqCst)
}

/// Whether the kernels are installed: where not, [`adamw_pieces`] and [`cast_into`] do
/// nothing and a caller need not make their pieces.
pub fn installed() -> bool {
    ON.load(Ordering::SeqCst)
}

/// optim.cu's `ZR_PIECES`, `ZR_CHUNK` and `ZR_OPT_THREADS`.
const PIECES: usize = 48;
const CHUNK: i64 = 4096;
const THREADS: u32 = 256;

/// [`ENTRIES`]' AdamW with fp32 gradients (bf16 gradients: the next), the layout, and the
/// fresh share with fp32 parameters and gradients (then fp32 and bf16, bf16 and fp32, bf16
/// and bf16).
pub(super) const ADAMW: usize = 12;
pub(super) const CAST_INTO: usize = 14;
pub(super) const FRESH_SHARE: usize = 15;

/// optim.cu's `ZrAdamPiece`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AdamPieceRaw {
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    h: u64,
    n: i64,
    decay: i32,
    pad: i32,
}

/// optim.cu's `ZrCastPiece`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CastPieceRaw {
    dst: u64,
    src: u64,
    n: i64,
    add: i32,
    pad: i32,
}

/// optim.cu's `ZrSharePiece`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SharePieceRaw {
    p: u64,
    g: u64,
    v: u64,
    n: i64,
}

/// optim.cu's `ZrAdamTable`, `ZrCastTable` and `ZrShareTable`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Table<P: Copy> {
    piece: [P; PIECES],
    first: [i32; PIECES + 1],
    count: i32,
}

/// optim.cu's `ZrAdamHp`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamHp {
    grad_factor: f32,
    keep: f32,
    b1: f32,
    omb1: f32,
    b2: f32,
    omb2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

/// optim.cu's `ZrShareHp`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ShareHp {
    grad_factor: f32,
    b2: f32,
    omb2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

/// One contiguous piece of an AdamW step: fp32 `param` (the master), `grad` (fp32 or bf16,
/// the same for every piece of a call), fp32 moments, and the bf16 parameters to write; views
/// of the buffers they update.
pub struct AdamPiece {
    /// The fp32 master, updated in place.
    pub param: Tensor,
    /// The gradient.
    pub grad: Tensor,
    /// The first moment, updated in place.
    pub exp_avg: Tensor,
    /// The second moment, updated in place.
    pub exp_avg_sq: Tensor,
    /// The compute parameters the new values are written to in bf16 (none: not written).
    pub half: Option<Tensor>,
    /// Whether the decoupled weight decay applies.
    pub decay: bool,
}

/// The step's hyper-parameters; `step` counts from 1, `grad_factor` multiplies the
/// gradients (unscaling and clipping).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamCoeffs {
    /// Learning rate.
    pub lr: f64,
    /// Exponential decay of the first moment.
    pub beta1: f64,
    /// Exponential decay of the second moment.
    pub beta2: f64,
    /// Added to the bias-corrected denominator.
    pub eps: f64,
    /// Decoupled weight decay of the pieces that take it.
    pub weight_decay: f64,
    /// The step number, from 1 (the bias corrections use it).
    pub step: u64,
    /// Multiplies the gradients first.
    pub grad_factor: f64,
}

impl AdamCoeffs {
    /// The same step's hyper-parameters for ATen's fused AdamW ([`crate::fused_adam`]),
    /// with the weight decay only where `decay` (the gradient factor goes in its
    /// `grad_scale`, as its inverse).
    pub fn aten(&self, decay: bool) -> crate::AdamStep {
        crate::AdamStep {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: if decay { self.weight_decay } else { 0.0 },
        }
    }
}

/// One piece of a gradient layout: bf16 `src` copied over the fp32 `dst`, or added to it.
pub struct CastPiece<'a> {
    /// fp32 destination.
    pub dst: &'a Tensor,
    /// bf16 source of the same size.
    pub src: &'a Tensor,
    /// Added to `dst` rather than copied over it.
    pub add: bool,
}

/// The CUDA device every tensor is on, contiguous and of its kind (`None`: not so).
fn device_of<'a>(ts: impl IntoIterator<Item = (&'a Tensor, Kind)>) -> Option<usize> {
    let mut device = None;
    for (t, kind) in ts {
        let Device::Cuda(d) = t.device() else {
            return None;
        };
        if t.kind() != kind || !t.is_contiguous() || device.is_some_and(|x| x != d) {
            return None;
        }
        device = Some(d);
    }
    device
}

fn current_stream(device: usize) -> Result<*mut c_void, Error> {
    let mut out = std::ptr::null_mut();
    let mut err = std::ptr::null_mut();
    // SAFETY: out-pointers for the shim, which catches every C++ exception.
    let status = unsafe { ffi::zrun_ext_current_cuda_stream(device as i64, &mut out, &mut err) };
    ffi::check(status, err, || format!("current stream of cuda:{device}"))?;
    Ok(out)
}

/// Launches `entry` once per [`PIECES`] pieces of `raw` (pieces of no values left out), with
/// `extra` as the kernel's second argument where given.
fn launch_tables<P: Copy + Default, H: Copy>(
    device: usize,
    entry: usize,
    raw: &[(P, i64)],
    extra: Option<H>,
) -> Result<(), Error> {
    let stream = current_stream(device)?;
    let dev = device as i32;
    let what = ENTRIES[entry];
    let live: Vec<&(P, i64)> = raw.iter().filter(|(_, n)| *n > 0).collect();
    for group in live.chunks(PIECES) {
        let mut table = Table {
            piece: [P::default(); PIECES],
            first: [0; PIECES + 1],
            count: group.len() as i32,
        };
        let mut blocks: i64 = 0;
        for (k, (p, n)) in group.iter().enumerate() {
            table.piece[k] = *p;
            table.first[k] = i32::try_from(blocks).map_err(|e| fail(what, e))?;
            blocks += (n + CHUNK - 1) / CHUNK;
        }
        let grid = i32::try_from(blocks).map_err(|e| fail(what, e))?;
        table.first[group.len()] = grid;
        let name = || format!("{what}, {} pieces", group.len());
        let run = match extra {
            Some(mut hp) => {
                let mut params = args![table, hp];
                launch(dev, entry, grid as u32, THREADS, stream, &mut params, name)
            }
            None => {
                let mut params = args![table];
                launch(dev, entry, grid as u32, THREADS, stream, &mut params, name)
            }
        };
        run.map_err(|e| fail(what, e))?;
    }
    Ok(())
}

/// One AdamW step over `pieces` by optim.cu's kernel, queued on the current stream: the
/// master, m and v updated in place and, where given, the bf16 parameters written.
/// `Ok(false)` (nothing done) when the kernels are not installed or a piece does not fit
/// ([`AdamPlan::new`]).
pub fn adamw_pieces(pieces: &[AdamPiece], c: &AdamCoeffs) -> Result<bool, Error> {
    match AdamPlan::new(pieces) {
        Some(plan) => plan.run(c),
        None => Ok(false),
    }
}

/// AdamW pieces checked and laid out for optim.cu's kernel once, to run at every step over
/// the same buffers. It holds its tensors, so the memory it points at lives as long as it.
pub struct AdamPlan {
    device: usize,
    entry: usize,
    raw: Vec<(AdamPieceRaw, i64)>,
    _held: Vec<Tensor>,
}

impl AdamPlan {
    /// The plan of `pieces`; `None` when the kernels are not installed or a piece does not
    /// fit: fp32 master and moments, fp32 or bf16 gradients (one kind for all), bf16
    /// parameters, contiguous, one CUDA device, equal sizes.
    pub fn new(pieces: &[AdamPiece]) -> Option<AdamPlan> {
        if !installed() || pieces.is_empty() {
            return None;
        }
        let gkind = pieces[0].grad.kind();
        if !matches!(gkind, Kind::Float | Kind::BFloat16) {
            return None;
        }
        let f = Kind::Float;
        let tensors = pieces.iter().flat_map(|p| {
            [
                (&p.param, f),
                (&p.grad, gkind),
                (&p.exp_avg, f),
                (&p.exp_avg_sq, f),
            ]
            .into_iter()
            .chain(p.half.as_ref().map(|h| (h, Kind::BFloat16)))
        });
        let device = device_of(tensors)?;
        let mut raw = Vec::with_capacity(pieces.len());
        let mut held = Vec::with_capacity(5 * pieces.len());
        for p in pieces {
            let n = p.param.numel() as i64;
            let all = [&p.param, &p.grad, &p.exp_avg, &p.exp_avg_sq];
            if !all
                .into_iter()
                .chain(&p.half)
                .all(|t| t.numel() as i64 == n)
            {
                return None;
            }
            held.extend(all.into_iter().chain(&p.half).map(Tensor::shallow_clone));
            let ptr = |t: &Tensor| t.data_ptr() as u64;
            raw.push((
                AdamPieceRaw {
                    p: ptr(&p.param),
                    g: ptr(&p.grad),
                    m: ptr(&p.exp_avg),
                    v: ptr(&p.exp_avg_sq),
                    h: p.half.as_ref().map_or(0, ptr),
                    n,
                    decay: i32::from(p.decay),
                    pad: 0,
                },
                n,
            ));
        }
        Some(AdamPlan {
            device,
            entry: ADAMW + usize::from(gkind == Kind::BFloat16),
            raw,
            _held: held,
        })
    }

    /// Queues one step of the plan on the current stream; `Ok(false)` (nothing done) when
    /// the kernels have been uninstalled since or `c.step` is 0.
    pub fn run(&self, c: &AdamCoeffs) -> Result<bool, Error> {
        if !installed() || c.step == 0 {
            return Ok(false);
        }
        let t = c.step as i32;
        let hp = AdamHp {
            grad_factor: c.grad_factor as f32,
            keep: (1.0 - c.lr * c.weight_decay) as f32,
            b1: c.beta1 as f32,
            omb1: (1.0 - c.beta1) as f32,
            b2: c.beta2 as f32,
            omb2: (1.0 - c.beta2) as f32,
            step_size: (c.lr / (1.0 - c.beta1.powi(t))) as f32,
            bc2_sqrt: (1.0 - c.beta2.powi(t)).sqrt() as f32,
            eps: c.eps as f32,
        };
        launch_tables(self.device, self.entry, &self.raw, Some(hp))?;
        Ok(true)
    }
}

/// Each piece's bf16 `src` copied over its fp32 `dst` or added to it, by optim.cu's kernel
/// on the current stream. `Ok(false)` (nothing done) when the kernels are not installed or a
/// piece does not fit: contiguous, one CUDA device, equal sizes.
pub fn cast_into(pieces: &[CastPiece]) -> Result<bool, Error> {
    if !ON.load(Ordering::SeqCst) || pieces.is_empty() {
        return Ok(false);
    }
    let tensors = pieces
        .iter()
        .flat_map(|p| [(p.dst, Kind::Float), (p.src, Kind::BFloat16)]);
    let Some(device) = device_of(tensors) else {
        return Ok(false);
    };
    if pieces.iter().any(|p| p.dst.numel() != p.src.numel()) {
        return Ok(false);
    }
    let raw: Vec<(CastPieceRaw, i64)> = pieces
        .iter()
        .map(|p| {
            let n = p.dst.numel() as i64;
            let raw = CastPieceRaw {
                dst: p.dst.data_ptr() as u64,
                src: p.src.data_ptr() as u64,
                n,
                add: i32::from(p.add),
                pad: 0,
            };
            (raw, n)
        })
        .collect();
    launch_tables(device, CAST_INTO, &raw, None::<AdamHp>)?;
    Ok(true)
}

/// One contiguous piece of a split delayed update's fresh share: the compute parameters
/// (fp32 or bf16, updated in place), their gradients (fp32 or bf16) and v, the second moment
/// before the update (bf16); views of one size.
pub struct SharePiece<'a> {
    /// The compute parameters, updated in place.
    pub param: &'a Tensor,
    /// Their gradients.
    pub grad: &'a Tensor,
    /// The second moment before the update, bf16.
    pub v: &'a Tensor,
}

/// The fresh share's coefficients, in f64: each value loses
/// `step_size f g / (sqrt(b2 v + (1 - b2) (f g)^2) / sqrt(bc2) + eps)`, `f` = `grad_factor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShareCoeffs {
    /// Multiplies the gradients first (unscaling and clipping).
    pub grad_factor: f64,
    /// Exponential decay of the second moment.
    pub beta2: f64,
    /// Added to the bias-corrected denominator.
    pub eps: f64,
    /// `lr (1 - beta1) / (1 - beta1^t)`.
    pub step_size: f64,
    /// `1 - beta2^t`.
    pub bc2: f64,
}

/// The fresh share of every piece by optim.cu's kernel, queued on the current stream (one
/// launch per [`PIECES`] pieces). `Ok(false)` (nothing done) when the kernels are not
/// installed or a piece does not fit: fp32 or bf16 parameters (one kind for all), fp32 or
/// bf16 gradients (one kind for all), bf16 v, contiguous, one CUDA device, equal sizes.
pub fn fresh_share(pieces: &[SharePiece], c: &ShareCoeffs) -> Result<bool, Error> {
    if !installed() || pieces.is_empty() {
        return Ok(false);
    }
    let (pkind, gkind) = (pieces[0].param.kind(), pieces[0].grad.kind());
    let takes = |k: Kind| matches!(k, Kind::Float | Kind::BFloat16);
    if !takes(pkind) || !takes(gkind) {
        return Ok(false);
    }
    let tensors = pieces
        .iter()
        .flat_map(|p| [(p.param, pkind), (p.grad, gkind), (p.v, Kind::BFloat16)]);
    let Some(device) = device_of(tensors) else {
        return Ok(false);
    };
    let mut raw = Vec::with_capacity(pieces.len());
    for p in pieces {
        let n = p.param.numel();
        if p.grad.numel() != n || p.v.numel() != n {
            return Ok(false);
        }
        let ptr = |t: &Tensor| t.data_ptr() as u64;
        let n = n as i64;
        let piece = SharePieceRaw {
            p: ptr(p.param),
            g: ptr(p.grad),
            v: ptr(p.v),
            n,
        };
        raw.push((piece, n));
    }
    let hp = ShareHp {
        grad_factor: c.grad_factor as f32,
        b2: c.beta2 as f32,
        omb2: (1.0 - c.beta2) as f32,
        step_size: c.step_size as f32,
        bc2_sqrt: c.bc2.sqrt() as f32,
        eps: c.eps as f32,
    };
    let entry = FRESH_SHARE
        + 2 * usize::from(pkind == Kind::BFloat16)
        + usize::from(gkind == Kind::BFloat16);
    launch_tables(device, entry, &raw, Some(hp))?;
    Ok(true)
}
