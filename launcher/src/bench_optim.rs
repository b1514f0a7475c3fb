//! The optimizer's cases of `zrun bench kernels` (bench_kernels.rs): one AdamW step that
//! writes the bf16 parameters, the layout of bf16 gradients into an fp32 buffer, and the
//! fresh share of a split delayed update, each side on its own copy of the same inputs.
//! Where zrun's kernels are not installed (CPU) the zrun side runs ATen's ops, as a rank
//! would.

use crate::bench_kernels::Side;
use tch::{Device, Kind, Tensor};

/// The step's hyper-parameters on both sides.
const COEFFS: zrun_torch_ext::AdamCoeffs = zrun_torch_ext::AdamCoeffs {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
    step: 1,
    grad_factor: 0.5,
};

/// Views of `t` cut as `pieces` (numel, decayed), in order.
fn cut(t: &Tensor, pieces: &[(i64, bool)]) -> anyhow::Result<Vec<Tensor>> {
    let mut at = 0;
    let mut out = Vec::with_capacity(pieces.len());
    for &(n, _) in pieces {
        out.push(t.f_narrow(0, at, n)?);
        at += n;
    }
    Ok(out)
}

/// One side's AdamW state: master, gradient, moments and bf16 parameters, cut in pieces.
struct State {
    p: Vec<Tensor>,
    g: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    h: Vec<Tensor>,
    whole: [Tensor; 2],
}

impl State {
    fn new(pieces: &[(i64, bool)], base: &[Tensor; 4]) -> anyhow::Result<State> {
        let [p, g, m, v] = base.each_ref().map(Tensor::copy);
        let h = p.f_to_kind(Kind::BFloat16)?;
        Ok(State {
            p: cut(&p, pieces)?,
            g: cut(&g, pieces)?,
            m: cut(&m, pieces)?,
            v: cut(&v, pieces)?,
            h: cut(&h, pieces)?,
            whole: [p, h],
        })
    }

    /// ATen's step: the fused AdamW over the decayed pieces and over the rest, then the
    /// cast of the master into the bf16 parameters.
    fn aten(&self, decayed: &[bool], device: Device) -> anyhow::Result<()> {
        let full = |v: f64| zrun_torch_ext::scalar::full(&[1], v, (Kind::Float, device));
        let (step, scale) = (full(COEFFS.step as f64)?, full(1.0 / COEFFS.grad_factor)?);
        for decay in [true, false] {
            let pick = |ts: &[Tensor]| -> Vec<Tensor> {
                ts.iter()
                    .zip(decayed)
                    .filter(|(_, &d)| d == decay)
                    .map(|(t, _)| t.shallow_clone())
                    .collect()
            };
            let (p, g, m, v) = (pick(&self.p), pick(&self.g), pick(&self.m), pick(&self.v));
            let hp = COEFFS.aten(decay);
            zrun_torch_ext::fused_adam(&p, &g, &m, &v, &step, Some(&scale), hp)?;
        }
        self.whole[1].shallow_clone().f_copy_(&self.whole[0])?;
        Ok(())
    }

    fn outcome(&self) -> (f64, Vec<Tensor>) {
        (0.0, self.whole.each_ref().map(Tensor::shallow_clone).into())
    }
}

/// The `adamw` case: zrun's kernel against ATen's fused AdamW and cast.
pub(crate) fn adamw_sides(pieces: &[(i64, bool)], device: Device) -> anyhow::Result<(Side, Side)> {
    let n: i64 = pieces.iter().map(|p| p.0).sum();
    let opts = (Kind::Float, device);
    let base = [
        Tensor::f_randn([n], opts)? * 0.02,
        Tensor::f_randn([n], opts)? * 1e-3,
        Tensor::f_randn([n], opts)? * 1e-4,
        Tensor::f_rand([n], opts)? * 1e-6,
    ];
    let decayed: Vec<bool> = pieces.iter().map(|p| p.1).collect();
    let (zs, ts) = (State::new(pieces, &base)?, State::new(pieces, &base)?);
    let d2 = decayed.clone();
    Ok((
        Box::new(move || {
            let ps: Vec<zrun_torch_ext::AdamPiece> = (0..zs.p.len())
                .map(|i| zrun_torch_ext::AdamPiece {
                    param: zs.p[i].shallow_clone(),
                    grad: zs.g[i].shallow_clone(),
                    exp_avg: zs.m[i].shallow_clone(),
                    exp_avg_sq: zs.v[i].shallow_clone(),
                    half: Some(zs.h[i].shallow_clone()),
                    decay: decayed[i],
                })
                .collect();
            if !zrun_torch_ext::adamw_pieces(&ps, &COEFFS)? {
                zs.aten(&decayed, device)?;
            }
            Ok(zs.outcome())
        }),
        Box::new(move || {
            ts.aten(&d2, device)?;
            Ok(ts.outcome())
        }),
    ))
}

/// The `grad_layout` case: zrun's kernel against ATen's copy, one per tensor.
pub(crate) fn layout_sides(pieces: &[(i64, bool)], device: Device) -> anyhow::Result<(Side, Side)> {
    let n: i64 = pieces.iter().map(|p| p.0).sum();
    let src = Tensor::f_randn([n], (Kind::BFloat16, device))?;
    // Each gradient a tensor of its own, as autograd hands them over.
    let grads: Vec<Tensor> = cut(&src, pieces)?.iter().map(Tensor::copy).collect();
    let grads2: Vec<Tensor> = grads.iter().map(Tensor::shallow_clone).collect();
    let (dz, dt) = (
        Tensor::f_empty([n], (Kind::Float, device))?,
        Tensor::f_empty([n], (Kind::Float, device))?,
    );
    let (vz, vt) = (cut(&dz, pieces)?, cut(&dt, pieces)?);
    let copy_each = |dsts: &[Tensor], srcs: &[Tensor]| -> anyhow::Result<()> {
        for (d, s) in dsts.iter().zip(srcs) {
            d.shallow_clone().f_copy_(s)?;
        }
        Ok(())
    };
    Ok((
        Box::new(move || {
            let ps: Vec<zrun_torch_ext::CastPiece> = vz
                .iter()
                .zip(&grads)
                .map(|(dst, src)| zrun_torch_ext::CastPiece {
                    dst,
                    src,
                    add: false,
                })
                .collect();
            if !zrun_torch_ext::cast_into(&ps)? {
                copy_each(&vz, &grads)?;
            }
            Ok((0.0, vec![dz.shallow_clone()]))
        }),
        Box::new(move || {
            copy_each(&vt, &grads2)?;
            Ok((0.0, vec![dt.shallow_clone()]))
        }),
    ))
}

/// The `fresh_share` case: zrun's kernel (or its ATen path) against the share written out in
/// ATen's ops, on parameters and gradients of `kind` and a bf16 v, a tensor at a time.
pub(crate) fn share_sides(
    pieces: &[(i64, bool)],
    device: Device,
    kind: Kind,
) -> anyhow::Result<(Side, Side)> {
    let n: i64 = pieces.iter().map(|p| p.0).sum();
    let opts = (Kind::Float, device);
    let p = (Tensor::f_randn([n], opts)? * 0.02).f_to_kind(kind)?;
    let g = (Tensor::f_randn([n], opts)? * 1e-3).f_to_kind(kind)?;
    let v = (Tensor::f_rand([n], opts)? * 1e-6).f_to_kind(Kind::BFloat16)?;
    let c = zrun_torch_ext::ShareCoeffs {
        grad_factor: 0.5,
        beta2: 0.95,
        eps: 1e-8,
        step_size: 1e-3 * 0.1 / (1.0 - 0.9f64.powi(5)),
        bc2: 1.0 - 0.95f64.powi(5),
    };
    let (pz, pt) = (p.copy(), p);
    let (z_p, z_g, t_p, t_g) = (
        cut(&pz, pieces)?,
        cut(&g, pieces)?,
        cut(&pt, pieces)?,
        cut(&g, pieces)?,
    );
    let (z_v, t_v) = (cut(&v, pieces)?, cut(&v, pieces)?);
    Ok((
        Box::new(move || {
            let ps: Vec<zrun_torch_ext::SharePiece> = (0..z_p.len())
                .map(|i| zrun_torch_ext::SharePiece {
                    param: &z_p[i],
                    grad: &z_g[i],
                    v: &z_v[i],
                })
                .collect();
            if !zrun_torch_ext::fresh_share(&ps, &c)? {
                for ((p, g), v) in z_p.iter().zip(&z_g).zip(&z_v) {
                    zrun_torch_ext::fresh_share_aten(p, g, v, &c)?;
                }
            }
            Ok((0.0, vec![pz.shallow_clone()]))
        }),
        Box::new(move || {
            for ((p, g), v) in t_p.iter().zip(&t_g).zip(&t_v) {
                let g = g.f_to_kind(Kind::Float)? * c.grad_factor;
                let vn = v.f_to_kind(Kind::Float)? * c.beta2 + &g * &g * (1.0 - c.beta2);
                let d = vn.f_sqrt()? / c.bc2.sqrt() + c.eps;
                let wide = p.f_to_kind(Kind::Float)? - g * c.step_size / d;
                p.shallow_clone().f_copy_(&wide)?;
            }
            Ok((0.0, vec![pt.shallow_clone()]))
        }),
    ))
}
