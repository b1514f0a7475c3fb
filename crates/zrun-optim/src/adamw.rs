//! AdamW (decoupled weight decay) over one flat fp32 buffer, as `torch.optim.AdamW`.

use crate::segments::Segments;
use crate::{inplace, scalar, torch, Error, Result};
use tch::{Device, Kind, Tensor};
use zrun_torch_ext::scalar as sc;

/// Elements updated per kernel round: small enough that parameter, gradient, m, v and the
/// scratch stay in cache between the few kernels of one round.
const CHUNK: i64 = 1 << 18;

/// Hyper-parameters of AdamW (the learning rate comes per step, from the schedule).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Exponential decay of the first moment.
    pub beta1: f64,
    /// Exponential decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Decoupled weight decay, applied only inside the decay ranges.
    pub weight_decay: f64,
}

/// AdamW state for one rank's contiguous fp32 shard.
///
/// Weight decay applies to `decay_ranges` only (the matrices; the shard layout puts each
/// unit's matrices first so the ranges are few and long).
pub struct AdamW {
    cfg: AdamWConfig,
    m: Tensor,
    v: Tensor,
    scratch: Tensor,
    step: u64,
    numel: i64,
    decay_ranges: Vec<(i64, i64)>,
    /// On CUDA: libtorch's fused multi-tensor Adam (a few launches per step, where the
    /// chunked kernels below would launch thousands), with its step count and gradient scale
    /// on the device.
    fused: Option<[Tensor; 2]>,
    /// zrun's AdamW kernel's plan of the pieces it last ran over, with what they were cut
    /// from: the buffers of a run stay put, so a step reuses it instead of making and
    /// checking hundreds of views while the device waits for the update.
    /// `None` inside: the kernel does not take these buffers (fp16 parameters), so they are
    /// not cut again at every step either.
    kernel_plan: Option<(PartsKey, Option<zrun_torch_ext::AdamPlan>)>,
}

/// Each part's data address and size, in order: what a list of pieces was cut from.
type PartsKey = Vec<(usize, i64)>;

impl AdamW {
    /// Zero-initialised state for a shard of `numel` elements on `device`.
    /// `decay_ranges` are `(offset, len)` pairs inside the shard.
    pub fn new(
        numel: i64,
        device: Device,
        cfg: AdamWConfig,
        decay_ranges: Vec<(i64, i64)>,
    ) -> Result<AdamW> {
        let zeros = |what| torch(what, Tensor::f_zeros([numel], (Kind::Float, device)));
        // In shard order: the fused step walks them from the start.
        let mut decay_ranges = decay_ranges;
        decay_ranges.sort_unstable();
        Ok(AdamW {
            cfg,
            m: zeros("allocate AdamW m")?,
            v: zeros("allocate AdamW v")?,
            scratch: torch(
                "allocate AdamW scratch",
                Tensor::f_empty([CHUNK.min(numel.max(1))], (Kind::Float, device)),
            )?,
            step: 0,
            numel,
            decay_ranges,
            fused: match device {
                // One element each: the step count and gradient scale the fused kernel reads.
                Device::Cuda(_) => Some(Self::fused_state(device)?),
                _ => None,
            },
            kernel_plan: None,
        })
    }

    /// The fused kernel's step count and gradient scale on `device`.
    fn fused_state(device: Device) -> Result<[Tensor; 2]> {
        let one = || {
            torch(
                "allocate AdamW step",
                Tensor::f_zeros([1], (Kind::Float, device)),
            )
        };
        Ok([one()?, one()?])
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The first and second moments (for checkpoints and accounting).
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.m, &self.v)
    }

    /// Sets the count of steps taken (the bias corrections use it), for checkpoints.
    pub fn set_steps(&mut self, step: u64) {
        self.step = step;
    }

    /// Restores moments and step count (from a checkpoint); sizes must match.
    pub fn load(&mut self, m: &Tensor, v: &Tensor, step: u64) -> Result<()> {
        self.check("m", m)?;
        self.check("v", v)?;
        let _guard = tch::no_grad_guard();
        torch("load AdamW m", self.m.f_copy_(m))?;
        torch("load AdamW v", self.v.f_copy_(v))?;
        self.step = step;
        Ok(())
    }

    /// Bytes of optimizer state (m and v), the 8 bytes per element of the ZeRO formula.
    pub fn state_bytes(&self) -> i64 {
        2 * 4 * self.numel
    }

    /// Bytes of the scratch buffer (one chunk).
    pub fn scratch_bytes(&self) -> i64 {
        4 * self.scratch.numel() as i64
    }

    /// Bytes of the scratch buffer of an AdamW over `numel` elements, without building one.
    pub fn scratch_bytes_for(numel: i64) -> i64 {
        4 * CHUNK.min(numel.max(1))
    }

    fn check(&self, what: &'static str, t: &Tensor) -> Result<()> {
        let got = t.numel() as i64;
        if got != self.numel {
            return Err(Error::Size {
                what,
                got,
                expected: self.numel,
            });
        }
        Ok(())
    }

    /// One AdamW step on `param` (fp32, updated in place) with gradient `grad`, both
    /// contiguous shards.
    pub fn step(&mut self, param: &Tensor, grad: &Tensor, lr: f64) -> Result<()> {
        self.step_segments(
            std::slice::from_ref(param),
            std::slice::from_ref(grad),
            lr,
            1.0,
        )
    }

    /// One AdamW step where the shard's parameters and gradients are each given as 1-D views
    /// laid end to end (the rank's owned slice of every unit); both lists must total the
    /// shard size. Parameters are updated in place. The gradients are taken times
    /// `grad_factor` (clipping and loss-scale unscaling; 1.0: as they are), which may scale
    /// them in place.
    pub fn step_segments(
        &mut self,
        params: &[Tensor],
        grads: &[Tensor],
        lr: f64,
        grad_factor: f64,
    ) -> Result<()> {
        self.step_segments_into(params, grads, lr, grad_factor, None)
            .map(drop)
    }

    /// [`AdamW::step_segments`], which on CUDA with zrun's AdamW kernel installed
    /// (`zrun_torch_ext::kernels::install`) also writes the new parameters into `half`: the
    /// compute parameters in bf16, as 1-D views laid end to end like `params`. Returns whether
    /// it wrote them (false: `half` is untouched and the caller casts the master itself).
    pub fn step_segments_into(
        &mut self,
        params: &[Tensor],
        grads: &[Tensor],
        lr: f64,
        grad_factor: f64,
        half: Option<&[Tensor]>,
    ) -> Result<bool> {
        let (p, g) = (Segments::new(params), Segments::new(grads));
        let h = half.map(Segments::new);
        for (what, got) in [
            ("parameter shard", p.len()),
            ("gradient shard", g.len()),
            (
                "half-precision parameters",
                h.as_ref().map_or(self.numel, |h| h.len()),
            ),
        ] {
            if got != self.numel {
                return Err(Error::Size {
                    what,
                    got,
                    expected: self.numel,
                });
            }
        }
        let _guard = tch::no_grad_guard();
        self.step += 1;
        // Gradients of another dtype than the master (bf16 with `zero.reduce_dtype`): ATen's
        // fused AdamW takes one dtype, so unless zrun's kernel takes them the chunks below
        // read each one into the fp32 scratch first.
        let mixed = grads.iter().any(|t| t.kind() != self.m.kind());
        if self.fused.is_some() {
            if self.kernel_update(&p, &g, h.as_ref(), lr, grad_factor)? {
                return Ok(h.is_some());
            }
            if !mixed {
                self.fused_update(&p, &g, lr, grad_factor)?;
                return Ok(false);
            }
        }
        if grad_factor != 1.0 && !mixed {
            for t in grads {
                scalar("scale gradients", sc::mul_(t, grad_factor))?;
            }
        }
        let c = self.cfg;
        if c.weight_decay != 0.0 {
            let keep = 1.0 - lr * c.weight_decay;
            for &(off, len) in &self.decay_ranges {
                Segments::pieces(&[&p], off, len, |o, l| {
                    scalar("weight decay", sc::mul_(&p.view(o, l)?, keep))
                })?;
            }
        }
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2_sqrt = (1.0 - c.beta2.powi(self.step as i32)).sqrt();
        let step_size = lr / bc1;
        let mut off = 0;
        while off < self.numel {
            let len = CHUNK.min(self.numel - off);
            Segments::pieces(&[&p, &g], off, len, |o, l| {
                let (mut pv, gv) = (p.view(o, l)?, g.view(o, l)?);
                let m = self.m.f_narrow(0, o, l)?;
                let v = self.v.f_narrow(0, o, l)?;
                let mut d = self.scratch.f_narrow(0, 0, l)?;
                // m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2 (as lerps, no temporaries)
                if mixed {
                    // g in fp32 (exact from bf16 or fp16), scaled there as an fp32 buffer's
                    // would be: the same values as with fp32 gradients.
                    torch("AdamW gradient", d.f_copy_(&gv))?;
                    if grad_factor != 1.0 {
                        scalar("scale gradients", sc::mul_(&d, grad_factor))?;
                    }
                    scalar("AdamW m", sc::lerp_(&m, &d, 1.0 - c.beta1))?;
                    inplace("AdamW g^2", d.f_square_())?;
                } else {
                    scalar("AdamW m", sc::lerp_(&m, &gv, 1.0 - c.beta1))?;
                    inplace("AdamW g^2", gv.f_mul_out(&d, &gv))?;
                }
                scalar("AdamW v", sc::lerp_(&v, &d, 1.0 - c.beta2))?;
                // d = m / (sqrt(v) / sqrt(bc2) + eps);  p -= lr / bc1 * d
                inplace("AdamW denom", v.f_sqrt_out(&d))?;
                scalar("AdamW denom", sc::div_(&d, bc2_sqrt))?;
                scalar("AdamW denom", sc::add_(&d, c.eps))?;
                inplace("AdamW ratio", m.f_div_out(&d, &d))?;
                scalar("AdamW ratio", sc::mul_(&d, -step_size))?;
                inplace("AdamW update", pv.f_add_(&d))
            })?;
            off += len;
        }
        Ok(false)
    }
}

impl AdamW {
    /// The shard in order as `(offset, len, decayed)` spans: the decay ranges (when weight
    /// decay is on) and what lies between them, each element in one span (ranges do not
    /// overlap; were they to, the overlap would be decayed once).
    fn spans(&self) -> Vec<(i64, i64, bool)> {
        let ranges: &[(i64, i64)] = if self.cfg.weight_decay != 0.0 {
            &self.decay_ranges
        } else {
            &[]
        };
        let mut out = Vec::with_capacity(2 * ranges.len() + 1);
        let mut at = 0;
        for &(off, len) in ranges.iter().chain(&[(self.numel, 0)]) {
            if off > at {
                out.push((at, off - at, false));
            }
            let start = off.max(at);
            if off + len > start {
                out.push((start, off + len - start, true));
            }
            at = at.max(off + len);
        }
        out
    }

    /// The whole step by zrun's AdamW kernel (`zrun_torch_ext::adamw_pieces`), writing the
    /// bf16 parameters `h` too; false (nothing done) where it is not installed or does not
    /// take these tensors.
    fn kernel_update(
        &mut self,
        p: &Segments,
        g: &Segments,
        h: Option<&Segments>,
        lr: f64,
        grad_factor: f64,
    ) -> Result<bool> {
        if !zrun_torch_ext::kernels::optim::installed() {
            return Ok(false);
        }
        // What the pieces are cut from: each part's data and size, in order.
        let key: PartsKey = [Some(p), Some(g), h]
            .into_iter()
            .flatten()
            .flat_map(|s| s.parts().iter())
            .map(|t| (t.data_ptr() as usize, t.numel() as i64))
            .collect();
        let plan = match self.kernel_plan.take().filter(|(k, _)| *k == key) {
            Some((_, plan)) => plan,
            None => self.kernel_plan_of(p, g, h)?,
        };
        let Some(plan) = plan else {
            self.kernel_plan = Some((key, None));
            return Ok(false);
        };
        let c = self.cfg;
        let coeffs = zrun_torch_ext::AdamCoeffs {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: self.step,
            grad_factor,
        };
        let ran = plan.run(&coeffs).map_err(|e| Error::Fused {
            detail: e.to_string(),
        })?;
        self.kernel_plan = Some((key, Some(plan)));
        Ok(ran)
    }

    /// The kernel's plan of the shard: each span split where a part of `p`, `g` or `h` ends
    /// (`None`: the kernel does not take these tensors).
    fn kernel_plan_of(
        &self,
        p: &Segments,
        g: &Segments,
        h: Option<&Segments>,
    ) -> Result<Option<zrun_torch_ext::AdamPlan>> {
        let mut pieces = Vec::new();
        for (off, len, decay) in self.spans() {
            let lists: Vec<&Segments> = [p, g].into_iter().chain(h).collect();
            Segments::pieces(&lists, off, len, |o, l| {
                pieces.push(zrun_torch_ext::AdamPiece {
                    param: p.view(o, l)?,
                    grad: g.view(o, l)?,
                    exp_avg: torch("AdamW m", self.m.f_narrow(0, o, l))?,
                    exp_avg_sq: torch("AdamW v", self.v.f_narrow(0, o, l))?,
                    half: h.map(|h| h.view(o, l)).transpose()?,
                    decay,
                });
                Ok(())
            })?;
        }
        Ok(zrun_torch_ext::AdamPlan::new(&pieces))
    }

    /// The whole step by libtorch's fused kernel, over the pieces of the shard that are
    /// contiguous in parameters, gradients and moments alike: one call for the decay ranges
    /// with the decoupled weight decay folded in, one for the rest without, and the gradient
    /// factor applied as the kernel's `grad_scale` (it divides by 1 / `grad_factor`), so no
    /// pass of its own over the parameters or the gradients.
    fn fused_update(
        &mut self,
        p: &Segments,
        g: &Segments,
        lr: f64,
        grad_factor: f64,
    ) -> Result<()> {
        let c = self.cfg;
        let mut decayed = Pieces::default();
        let mut plain = Pieces::default();
        for (off, len, decay) in self.spans() {
            let pieces = if decay { &mut decayed } else { &mut plain };
            pieces.add(self, p, g, off, len)?;
        }
        let Some([step, scale]) = self.fused.as_mut() else {
            unreachable!("fused_update without fused state")
        };
        scalar("AdamW step count", sc::fill_(step, self.step as f64))?;
        let scale = if grad_factor != 1.0 {
            scalar("AdamW grad scale", sc::fill_(scale, 1.0 / grad_factor))?;
            Some(&*scale)
        } else {
            None
        };
        for (pieces, weight_decay) in [(decayed, c.weight_decay), (plain, 0.0)] {
            let hp = zrun_torch_ext::AdamStep {
                lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay,
            };
            let Pieces { p, g, m, v } = pieces;
            zrun_torch_ext::fused_adam(&p, &g, &m, &v, step, scale, hp).map_err(|e| {
                Error::Fused {
                    detail: e.to_string(),
                }
            })?;
        }
        Ok(())
    }
}

/// Views of the parameters, gradients and moments of some ranges of the shard, for one
/// fused call.
#[derive(Default)]
struct Pieces {
    p: Vec<Tensor>,
    g: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl Pieces {
    /// Elements `[off, off + len)`, split where the parameters' or gradients' parts end.
    fn add(&mut self, a: &AdamW, p: &Segments, g: &Segments, off: i64, len: i64) -> Result<()> {
        Segments::pieces(&[p, g], off, len, |o, l| {
            self.p.push(p.view(o, l)?);
            self.g.push(g.view(o, l)?);
            self.m.push(torch("AdamW m", a.m.f_narrow(0, o, l))?);
            self.v.push(torch("AdamW v", a.v.f_narrow(0, o, l))?);
            Ok(())
        })
    }
}

impl From<tch::TchError> for Error {
    fn from(source: tch::TchError) -> Self {
        Error::Torch {
            op: "tensor view",
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{errors, lcg, Reference};

    #[test]
    fn matches_reference_adamw_with_decay_ranges_over_many_steps() {
        // Longer than one chunk so the chunk loop and its tail are exercised.
        let n = (CHUNK + 1000) as usize;
        let ranges = vec![(10i64, 500i64), (CHUNK - 7, 300)];
        let in_ranges = |i: usize| {
            ranges
                .iter()
                .any(|&(o, l)| (i as i64) >= o && (i as i64) < o + l)
        };
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut seed = 7u64;
        let p0: Vec<f64> = (0..n).map(|_| lcg(&mut seed)).collect();
        let mut reference = Reference::new(p0.clone());
        let p32: Vec<f32> = p0.iter().map(|&x| x as f32).collect();
        let param = Tensor::from_slice(&p32);
        let mut opt = AdamW::new(n as i64, Device::Cpu, cfg, ranges.clone()).unwrap();
        for step in 0..20 {
            let g: Vec<f64> = (0..n).map(|_| lcg(&mut seed) * 0.1).collect();
            let g32: Vec<f32> = g.iter().map(|&x| x as f32).collect();
            let lr = 1e-2 * (1.0 + step as f64) / 20.0;
            let g64: Vec<f64> = g32.iter().map(|&x| x as f64).collect();
            reference.step(&g64, lr, &cfg, &in_ranges);
            opt.step(&param, &Tensor::from_slice(&g32), lr).unwrap();
        }
        let got = Vec::<f32>::try_from(&param).unwrap();
        let (worst_rel, worst_abs) = errors(&got, &reference.p);
        assert!(worst_rel < 1e-6, "max relative error {worst_rel}");
        assert!(worst_abs < 1e-7, "max absolute error {worst_abs}");
        assert_eq!(opt.steps(), 20);
    }

    #[test]
    fn bf16_gradients_update_exactly_as_their_fp32_values_do() {
        // `zero.reduce_dtype = "bf16"`: the gradients are bf16, the master and moments fp32.
        // Each chunk reads them into fp32, where an fp32 gradient would be scaled too.
        let n = CHUNK + 123;
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let ranges = vec![(3i64, 2000i64)];
        tch::manual_seed(2);
        let p0 = Tensor::randn([n], (Kind::Float, Device::Cpu));
        let (a_p, b_p) = (p0.copy(), p0.copy());
        let mut a = AdamW::new(n, Device::Cpu, cfg, ranges.clone()).unwrap();
        let mut b = AdamW::new(n, Device::Cpu, cfg, ranges).unwrap();
        for factor in [1.0, 0.37, 1.0 / 3.0] {
            let g16 = Tensor::randn([n], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
            let g32 = g16.to_kind(Kind::Float);
            let keep = g16.copy();
            a.step_segments(std::slice::from_ref(&a_p), &[g32], 1e-2, factor)
                .unwrap();
            b.step_segments(
                std::slice::from_ref(&b_p),
                &[g16.shallow_clone()],
                1e-2,
                factor,
            )
            .unwrap();
            assert!(
                a_p.equal(&b_p),
                "parameters after a step scaled by {factor}"
            );
            assert!(g16.equal(&keep), "the bf16 gradients are read, not written");
        }
        assert!(a.moments().0.equal(b.moments().0) && a.moments().1.equal(b.moments().1));
    }

    #[test]
    fn segmented_shards_update_exactly_like_a_contiguous_one() {
        let n = CHUNK + 77;
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.05,
        };
        let ranges = vec![(5i64, 1000i64), (CHUNK - 3, 50)];
        tch::manual_seed(1);
        let p0 = Tensor::randn([n], (Kind::Float, Device::Cpu));
        let whole = p0.copy();
        // The same values split differently for parameters and gradients.
        let split = p0.copy();
        let parts = vec![
            split.narrow(0, 0, 100),
            split.narrow(0, 100, CHUNK - 200),
            split.narrow(0, CHUNK - 100, n - CHUNK + 100),
        ];
        let mut a = AdamW::new(n, Device::Cpu, cfg, ranges.clone()).unwrap();
        let mut b = AdamW::new(n, Device::Cpu, cfg, ranges).unwrap();
        for _ in 0..3 {
            let g = Tensor::randn([n], (Kind::Float, Device::Cpu));
            let gparts = vec![g.narrow(0, 0, 999), g.narrow(0, 999, n - 999)];
            a.step(&whole, &g, 1e-2).unwrap();
            b.step_segments(&parts, &gparts, 1e-2, 1.0).unwrap();
        }
        assert!(whole.equal(&split), "segmented update differs");
        assert!(!whole.equal(&p0));
    }

    #[test]
    fn the_fused_update_equals_the_chunked_one() {
        // The CUDA path, run through libtorch's CPU fused kernel.
        let n = CHUNK + 77;
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let ranges = vec![(5i64, 1000i64), (CHUNK - 3, 50)];
        tch::manual_seed(2);
        let chunked = Tensor::randn([n], (Kind::Float, Device::Cpu));
        let fused = chunked.copy();
        let parts = vec![fused.narrow(0, 0, 100), fused.narrow(0, 100, n - 100)];
        let mut a = AdamW::new(n, Device::Cpu, cfg, ranges.clone()).unwrap();
        let mut b = AdamW::new(n, Device::Cpu, cfg, ranges).unwrap();
        b.fused = Some(AdamW::fused_state(Device::Cpu).unwrap());
        for step in 0..6 {
            let g = Tensor::randn([n], (Kind::Float, Device::Cpu));
            let gb = g.copy();
            let gparts = vec![gb.narrow(0, 0, 999), gb.narrow(0, 999, n - 999)];
            let lr = 1e-2 * (1.0 + step as f64);
            // Clipping's factor on some steps: the chunked side multiplies, the fused one
            // gives the kernel its inverse as grad_scale.
            let f = if step % 2 == 1 { 0.37 } else { 1.0 };
            a.step_segments(
                std::slice::from_ref(&chunked),
                std::slice::from_ref(&g),
                lr,
                f,
            )
            .unwrap();
            b.step_segments(&parts, &gparts, lr, f).unwrap();
        }
        let d = (&chunked - &fused).abs().max().double_value(&[]);
        assert!(d < 1e-6, "fused and chunked AdamW differ by {d}");
        let dv = (a.moments().1 - b.moments().1)
            .abs()
            .max()
            .double_value(&[]);
        assert!(dv < 1e-6, "second moments differ by {dv}");
    }

    #[test]
    fn the_bf16_parameters_are_left_to_the_caller_where_no_kernel_writes_them() {
        // On CPU (no zrun kernel) the update is the plain one and the bf16 list is untouched;
        // a list of another size is refused before anything is updated.
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let n = 40;
        let p = Tensor::randn([n], (Kind::Float, Device::Cpu));
        let (want, g) = (p.copy(), Tensor::randn([n], (Kind::Float, Device::Cpu)));
        let half = Tensor::zeros([n], (Kind::BFloat16, Device::Cpu));
        let halves = vec![half.narrow(0, 0, 15), half.narrow(0, 15, n - 15)];
        let mut a = AdamW::new(n, Device::Cpu, cfg, vec![(0, 15)]).unwrap();
        let mut b = AdamW::new(n, Device::Cpu, cfg, vec![(0, 15)]).unwrap();
        let short = [half.narrow(0, 0, n - 1)];
        let err = a
            .step_segments_into(&[p.shallow_clone()], &[g.copy()], 1e-2, 1.0, Some(&short))
            .unwrap_err()
            .to_string();
        assert!(err.contains("half-precision parameters"), "{err}");
        assert!(p.equal(&want), "a refused step updated the master");
        let wrote = a
            .step_segments_into(&[p.shallow_clone()], &[g.copy()], 1e-2, 1.0, Some(&halves))
            .unwrap();
        b.step(&want, &g, 1e-2).unwrap();
        assert!(!wrote);
        assert!(p.equal(&want), "the update differs from step_segments'");
        assert_eq!(half.abs().max().double_value(&[]), 0.0);
    }

    #[test]
    fn rejects_a_mis_sized_gradient() {
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut opt = AdamW::new(8, Device::Cpu, cfg, vec![]).unwrap();
        let err = opt
            .step(
                &Tensor::zeros([8], (Kind::Float, Device::Cpu)),
                &Tensor::zeros([7], (Kind::Float, Device::Cpu)),
                1e-3,
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gradient shard has 7 elements, expected 8"),
            "{err}"
        );
    }
}
