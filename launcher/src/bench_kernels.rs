//! `zrun bench kernels`: zrun's fused ops against PyTorch's ops on the same inputs, forward
//! and backward, interleaved: time, peak memory and how far the results are apart.
//!
//!     zrun bench kernels                       # on cuda:0 when there is a GPU, else CPU
//!     zrun bench kernels --device cpu --shapes small --rounds 3 --json
//!
//! Cases (the shapes of the GPU checks: gpt2-medium at 8 x 1024 tokens, llama3.2-1b at
//! 8 x 2048; `small` for CPUs):
//! - `loss`: the head's matmul and the mean cross-entropy, with the gradients of the hidden
//!   states and the matrix: `fused_linear_cross_entropy` (zrun's kernel on CUDA) against the
//!   logits in the compute dtype and PyTorch's cross_entropy on their fp32 copy;
//! - `loss_chunked`: the same with zrun's chunked loss (`linear_cross_entropy`, chunks of
//!   2^24 logits, the CPU default) on the zrun side;
//! - `swiglu`: silu(gate) * up and its two gradients: zrun's node against autograd's
//!   silu-then-mul;
//! - `rope`: the rotary embedding of heads of 64 over the shape's rows as one sequence, and its
//!   gradient: zrun's node against autograd over mul, roll and add;
//! - `bias_grad`: a bias's gradient, the sum over rows of the MLP's output gradient (rows x
//!   MLP width): zrun's column sums against ATen's sum;
//! - `gelu_bias_grad`: GELU's gradient at the MLP's pre-activation and the fc bias's gradient
//!   (the sum of it over rows): zrun's one pass (`gelu_colsum_raw`, behind `linear_gelu`)
//!   against ATen's gelu_backward and sum;
//! - `layer_norm`: LayerNorm over the width and its three gradients: zrun's node (column sums
//!   for the weight and bias) against autograd's layer_norm;
//! - `adamw`: one AdamW step over a model's parameters of the shape (GPT-2's blocks at its
//!   width, weight decay on the matrices) from an fp32 master, with the bf16 parameters
//!   written: zrun's kernel (`adamw_pieces`) against ATen's fused AdamW and a cast;
//! - `grad_layout`: the same parameters' bf16 gradients laid into an fp32 buffer: zrun's
//!   kernel (`cast_into`, one launch per 48 tensors) against ATen's copy, one per tensor;
//! - `fresh_share`: the newest gradient's share of a split delayed update taken from the same
//!   parameters in the compute dtype, with their gradients and a bf16 v: zrun's kernel
//!   (`fresh_share`; its ATen path, `fresh_share_aten`, where not installed) against the
//!   formula written out in ATen's ops, a tensor at a time.
//!
//! Each round runs every side once; the median over rounds is reported, with the side's peak
//! memory above what was allocated before it (CUDA's caching allocator, or on CPU zrun's
//! caching CPU allocator, which the bench installs as a rank does).

use std::time::Instant;

use tch::{Device, Kind, Reduction, Tensor};

/// Flags of `zrun bench kernels`.
#[derive(clap::Args, Debug, Clone)]
pub struct KernelsArgs {
    /// cuda or cpu; default cuda when a GPU is visible.
    #[arg(long)]
    pub device: Option<String>,
    /// Shapes: gpt2m, llama (the GPU checks'), small (a CPU's), comma-separated.
    #[arg(long)]
    pub shapes: Option<String>,
    /// Interleaved rounds (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = crate::bench::at_least_one::<usize>)]
    pub rounds: usize,
    /// Compute dtype: bf16 or fp32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "fp32"])]
    pub dtype: String,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One shape: rows, width, vocabulary, MLP width, and blocks of the optimizer's cases.
struct Shape {
    name: &'static str,
    n: i64,
    c: i64,
    v: i64,
    f: i64,
    layers: i64,
}

const SHAPES: [Shape; 3] = [
    Shape {
        name: "gpt2m",
        n: 8192,
        c: 1024,
        v: 50257,
        f: 4096,
        layers: 24,
    },
    Shape {
        name: "llama",
        n: 16384,
        c: 2048,
        v: 128_256,
        f: 8192,
        layers: 16,
    },
    Shape {
        name: "small",
        n: 512,
        c: 256,
        v: 8192,
        f: 1024,
        layers: 2,
    },
];

/// What one side of a case gives back: the loss (0 for SwiGLU) and its results.
pub(crate) type Outcome = (f64, Vec<Tensor>);

/// One side of a case: a forward and backward over inputs it holds.
pub(crate) type Side = Box<dyn Fn() -> anyhow::Result<Outcome>>;

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Runs `f` once, timed to the device's completion, with its peak memory above the start.
fn timed(
    device: Device,
    f: &dyn Fn() -> anyhow::Result<Outcome>,
) -> anyhow::Result<(f64, Option<u64>, Outcome)> {
    sync(device);
    let base = match device {
        Device::Cuda(i) => {
            zrun_torch_ext::reset_cuda_peak(i);
            zrun_torch_ext::cuda_memory(i).map(|m| m.allocated)
        }
        _ => {
            zrun_torch_ext::reset_cpu_peak();
            zrun_torch_ext::cpu_memory_stats().map(|m| m.allocated)
        }
    };
    let t0 = Instant::now();
    let out = f()?;
    sync(device);
    let dt = t0.elapsed().as_secs_f64();
    let peak = match (device, base) {
        (Device::Cuda(i), Some(b)) => {
            zrun_torch_ext::cuda_memory(i).map(|m| m.peak_allocated.saturating_sub(b))
        }
        (_, Some(b)) => {
            zrun_torch_ext::cpu_memory_stats().map(|m| m.peak_allocated.saturating_sub(b))
        }
        _ => None,
    };
    Ok((dt, peak, out))
}

/// Worst relative difference of `got` from `want`: the loss, then each gradient against
/// its largest element.
fn apart(got: &Outcome, want: &Outcome) -> f64 {
    let mut worst = (got.0 - want.0).abs() / want.0.abs().max(1e-12);
    for (g, w) in got.1.iter().zip(&want.1) {
        let (g, w) = (g.to_kind(Kind::Double), w.to_kind(Kind::Double));
        let top = w.abs().max().double_value(&[]).max(1e-30);
        worst = worst.max((g - w).abs().max().double_value(&[]) / top);
    }
    worst
}

/// The cases, in the order of the rows.
const CASES: [&str; 10] = [
    "loss",
    "loss_chunked",
    "swiglu",
    "rope",
    "bias_grad",
    "gelu_bias_grad",
    "layer_norm",
    "adamw",
    "grad_layout",
    "fresh_share",
];

/// A model's parameters at `s`'s width as `(numel, decayed)` in order: a decayed embedding
/// of the vocabulary, then `s.layers` of GPT-2's blocks (LayerNorms and biases not decayed).
fn param_pieces(s: &Shape) -> Vec<(i64, bool)> {
    let (c, f) = (s.c, s.f);
    let mut out = vec![(s.v * c, true)];
    for _ in 0..s.layers {
        out.extend([
            (2 * c, false),
            (3 * c * c, true),
            (3 * c, false),
            (c * c, true),
            (c, false),
            (2 * c, false),
            (f * c, true),
            (f, false),
            (f * c, true),
            (c, false),
        ]);
    }
    out
}

/// Runs `zrun bench kernels`.
pub fn run_kernels(args: &KernelsArgs) -> anyhow::Result<()> {
    let device = match args.device.as_deref() {
        Some("cpu") => Device::Cpu,
        Some("cuda") => Device::Cuda(0),
        Some(other) => {
            return Err(
                crate::launch::BadInput(format!("--device {other}: use cuda or cpu")).into(),
            )
        }
        None if tch::Cuda::is_available() => Device::Cuda(0),
        None => Device::Cpu,
    };
    if device.is_cuda() && !tch::Cuda::is_available() {
        anyhow::bail!("--device cuda: no GPU is visible to libtorch (this build needs --features cuda and a GPU)");
    }
    let kind = if args.dtype == "fp32" {
        Kind::Float
    } else {
        Kind::BFloat16
    };
    let shapes = args.shapes.clone().unwrap_or_else(|| {
        if device.is_cuda() {
            "gpt2m,llama"
        } else {
            "small"
        }
        .to_string()
    });
    let shapes: Vec<&Shape> = shapes
        .split(',')
        .map(|s| {
            SHAPES.iter().find(|x| x.name == s.trim()).ok_or_else(|| {
                crate::launch::BadInput(format!(
                    "--shapes: `{s}` is not one of gpt2m, llama, small"
                ))
                .into()
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let kernel = match device {
        Device::Cuda(i) => match zrun_torch_ext::kernels::install(i) {
            Ok(i) => match i.optimizer_left_out {
                None => "zrun's CUDA kernels".to_string(),
                Some(e) => format!("zrun's CUDA kernels but the optimizer's ({e})"),
            },
            Err(e) => format!("ATen's ops (zrun's kernels not installed: {e})"),
        },
        _ => "ATen's ops (CPU)".to_string(),
    };
    if !device.is_cuda() {
        // zrun's CPU ranks run on it; its figures give each side's peak.
        zrun_torch_ext::install_cpu_caching_allocator(None)?;
    }
    eprintln!("zrun bench kernels on {device:?}, {kind:?}, the zrun side through {kernel}");
    if !args.json {
        println!(
            "{:>12} {:>7} {:>10} {:>10} {:>10} {:>9} {:>12} {:>12} {:>10}",
            "case",
            "shape",
            "zrun_ms",
            "torch_ms",
            "ratio",
            "apart",
            "zrun_peak",
            "torch_peak",
            "peak_ratio"
        );
    }
    for shape in shapes {
        for case in CASES {
            row(args, device, kind, shape, case)?;
        }
    }
    Ok(())
}

/// One case at one shape: both sides `--rounds` times, interleaved, and the table row.
fn row(
    args: &KernelsArgs,
    device: Device,
    kind: Kind,
    s: &Shape,
    case: &str,
) -> anyhow::Result<()> {
    tch::manual_seed(0);
    let opts = (kind, device);
    let (zrun, torch): (Side, Side) = if case == "adamw" {
        crate::bench_optim::adamw_sides(&param_pieces(s), device)?
    } else if case == "grad_layout" {
        crate::bench_optim::layout_sides(&param_pieces(s), device)?
    } else if case == "fresh_share" {
        crate::bench_optim::share_sides(&param_pieces(s), device, kind)?
    } else if case.starts_with("loss") {
        let h = (Tensor::f_randn([s.n, s.c], opts)? * 0.5).set_requires_grad(true);
        let w = (Tensor::f_randn([s.v, s.c], opts)? * 0.05).set_requires_grad(true);
        let t = Tensor::f_randint(s.v, [s.n], (Kind::Int64, device))?;
        let (h2, w2, t2) = (h.shallow_clone(), w.shallow_clone(), t.shallow_clone());
        let chunked = case == "loss_chunked";
        (
            Box::new(move || {
                let loss = if chunked {
                    zrun_torch_ext::linear_cross_entropy(&h, &w, &t, -100, zrun_models::LOSS_CHUNK)?
                } else {
                    zrun_torch_ext::fused_linear_cross_entropy(&h, &w, &t, -100)?
                };
                let g = zrun_torch_ext::grad(&[&loss], &[&loss.ones_like()], &[&h, &w])?;
                Ok((loss.double_value(&[]), g))
            }),
            Box::new(move || {
                let loss = h2
                    .mm(&w2.tr())
                    .to_kind(Kind::Float)
                    .f_cross_entropy_loss::<Tensor>(&t2, None, Reduction::Mean, -100, 0.0)?;
                let g = zrun_torch_ext::grad(&[&loss], &[&loss.ones_like()], &[&h2, &w2])?;
                Ok((loss.double_value(&[]), g))
            }),
        )
    } else if case == "rope" {
        // One sequence of the shape's rows, heads of 64.
        let (t, hd) = (s.n, 64);
        let x = Tensor::f_randn([1, t, s.c / hd, hd], opts)?.set_requires_grad(true);
        let cos = Tensor::f_randn([t, hd], opts)?;
        let sin = Tensor::f_randn([t, hd], opts)?;
        let up = Tensor::f_randn([1, t, s.c / hd, hd], opts)?;
        let (x2, cos2, sin2, up2) = (
            x.shallow_clone(),
            cos.shallow_clone(),
            sin.shallow_clone(),
            up.shallow_clone(),
        );
        (
            Box::new(move || {
                let y = zrun_torch_ext::rope(&x, &cos, &sin)?;
                let g = zrun_torch_ext::grad(&[&y], &[&up], &[&x])?;
                Ok((0.0, std::iter::once(y.detach()).chain(g).collect()))
            }),
            Box::new(move || {
                let y = &x2 * cos2.unsqueeze(1) + x2.f_roll([hd / 2], [-1])? * sin2.unsqueeze(1);
                let g = zrun_torch_ext::grad(&[&y], &[&up2], &[&x2])?;
                Ok((0.0, std::iter::once(y.detach()).chain(g).collect()))
            }),
        )
    } else if case == "bias_grad" {
        let dy = Tensor::f_randn([s.n, s.f], opts)?;
        let dy2 = dy.shallow_clone();
        (
            Box::new(move || Ok((0.0, zrun_torch_ext::colsum_raw(&dy, None, false)?))),
            Box::new(move || Ok((0.0, vec![dy2.f_sum_dim_intlist(0, false, kind)?]))),
        )
    } else if case == "gelu_bias_grad" {
        let dy = Tensor::f_randn([s.n, s.f], opts)?;
        let h = (Tensor::f_randn([s.n, s.f], opts)? * 2.0).f_to_kind(kind)?;
        let (dy2, h2) = (dy.shallow_clone(), h.shallow_clone());
        (
            Box::new(move || Ok((0.0, zrun_torch_ext::gelu_colsum_raw(&dy, &h, false)?))),
            Box::new(move || {
                let dh = h2.f_gelu_backward(&dy2, "tanh")?;
                let db = dh.f_sum_dim_intlist(0, false, kind)?;
                Ok((0.0, vec![dh, db]))
            }),
        )
    } else if case == "layer_norm" {
        let c = s.c;
        let x = (Tensor::f_randn([s.n, c], opts)? * 2.0).set_requires_grad(true);
        let w = (Tensor::f_randn([c], opts)? + 1.0).set_requires_grad(true);
        let b = Tensor::f_randn([s.c], opts)?.set_requires_grad(true);
        let up = Tensor::f_randn([s.n, s.c], opts)?;
        let (x2, w2, b2, up2) = (
            x.shallow_clone(),
            w.shallow_clone(),
            b.shallow_clone(),
            up.shallow_clone(),
        );
        (
            Box::new(move || {
                let y = zrun_torch_ext::layer_norm(&x, &w, &b, 1e-5)?;
                let g = zrun_torch_ext::grad(&[&y], &[&up], &[&x, &w, &b])?;
                Ok((0.0, std::iter::once(y.detach()).chain(g).collect()))
            }),
            Box::new(move || {
                let y = x2.f_layer_norm([c].as_slice(), Some(&w2), Some(&b2), 1e-5, true)?;
                let g = zrun_torch_ext::grad(&[&y], &[&up2], &[&x2, &w2, &b2])?;
                Ok((0.0, std::iter::once(y.detach()).chain(g).collect()))
            }),
        )
    } else {
        let a = (Tensor::f_randn([s.n, s.f], opts)? * 2.0).set_requires_grad(true);
        let b = Tensor::f_randn([s.n, s.f], opts)?.set_requires_grad(true);
        let up = Tensor::f_randn([s.n, s.f], opts)?;
        let (a2, b2, up2) = (a.shallow_clone(), b.shallow_clone(), up.shallow_clone());
        (
            Box::new(move || {
                let y = zrun_torch_ext::swiglu(&a, &b)?;
                let g = zrun_torch_ext::grad(&[&y], &[&up], &[&a, &b])?;
                Ok((0.0, std::iter::once(y.detach()).chain(g).collect()))
            }),
            Box::new(move || {
                let y = a2.f_silu()? * &b2;
                let g = zrun_torch_ext::grad(&[&y], &[&up2], &[&a2, &b2])?;
                Ok((0.0, std::iter::once(y.detach()).chain(g).collect()))
            }),
        )
    };
    // One untimed round each (kernel loads, allocator warm-up).
    let (_, _, first_z) = timed(device, zrun.as_ref())?;
    let (_, _, first_t) = timed(device, torch.as_ref())?;
    let diff = apart(&first_z, &first_t);
    drop((first_z, first_t));
    let (mut tz, mut tt, mut pz, mut pt) = (Vec::new(), Vec::new(), None, None);
    for _ in 0..args.rounds.max(1) {
        let (d, p, _) = timed(device, zrun.as_ref())?;
        tz.push(d);
        pz = p.max(pz);
        let (d, p, _) = timed(device, torch.as_ref())?;
        tt.push(d);
        pt = p.max(pt);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (z, t) = (median(&mut tz), median(&mut tt));
    let mib = |b: Option<u64>| {
        b.map_or("-".to_string(), |b| {
            format!("{:.1}MiB", b as f64 / 1048576.0)
        })
    };
    let peak_ratio = match (pz, pt) {
        (Some(a), Some(b)) if b > 0 => format!("{:.3}", a as f64 / b as f64),
        _ => "-".to_string(),
    };
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "case": case, "shape": s.name, "device": format!("{device:?}"), "dtype": args.dtype,
                "zrun_s": z, "torch_s": t, "ratio": z / t, "apart": diff,
                "zrun_peak_bytes": pz, "torch_peak_bytes": pt,
            })
        );
    } else {
        println!(
            "{:>12} {:>7} {:>10.3} {:>10.3} {:>10.3} {:>9.2e} {:>12} {:>12} {:>10}",
            case,
            s.name,
            z * 1e3,
            t * 1e3,
            z / t,
            diff,
            mib(pz),
            mib(pt),
            peak_ratio
        );
    }
    Ok(())
}
