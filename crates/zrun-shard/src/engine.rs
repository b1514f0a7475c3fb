//! The unit engine: forward unit by unit, backward unit by unit in reverse with one autograd
//! call per unit, gradients written into each unit's flat gradient buffer, and the AdamW
//! step over the rank's contiguous fp32 shard.
//!
//! This version runs world size 1 (stage 0): the compute parameters are views of the fp32
//! master buffer. The ZeRO stages plug in where the comments say "reduce" and "gather".

use crate::layout::{ShardLayout, UnitLayout};
use crate::{Context, Error, MemoryLedger, Precision, Result, Stage};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};
use zrun_models::{lm_loss, Model};
use zrun_optim::{clip_coefficient, AdamW, AdamWConfig};

/// What the engine needs to know, resolved from the config once.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// ZeRO stage.
    pub stage: Stage,
    /// Compute precision.
    pub precision: Precision,
    /// Device of compute and state.
    pub device: Device,
    /// Seed of the deterministic parameter init.
    pub seed: u64,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
}

/// Figures of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Factor the gradients were multiplied by (1 when not clipped).
    pub clip_coef: f64,
    /// False when the gradients held inf/NaN; the step was then not applied.
    pub applied: bool,
}

/// What one unit's forward leaves for its backward.
struct Saved {
    /// The unit's input as a leaf (None for the first unit, whose input is token ids).
    input: Option<Tensor>,
    /// The unit's flat parameters as a leaf whose gradient autograd computes.
    flat: Tensor,
    /// The unit's output (the loss for the last unit).
    output: Tensor,
}

/// Drives one rank's training step unit by unit.
pub struct Engine {
    model: Arc<dyn Model>,
    layout: ShardLayout,
    cfg: EngineConfig,
    /// fp32 master parameters owned by this rank, all units back to back.
    master: Tensor,
    /// fp32 gradients, same layout as `master`, accumulated over micro-steps.
    grads: Tensor,
    optimizer: AdamW,
    ledger: MemoryLedger,
}

impl Engine {
    /// Builds the engine for `model` at world size 1, initialising the parameters from
    /// `cfg.seed` directly into the flat buffers.
    pub fn new(model: Arc<dyn Model>, cfg: EngineConfig) -> Result<Engine> {
        if cfg.stage != Stage::Zero0 {
            return Err(Error::Unsupported(format!(
                "zero.stage = {} needs several ranks and the sharded engine, which this version \
                 does not have yet; use zero.stage = 0",
                cfg.stage
            )));
        }
        if cfg.precision != Precision::Fp32 {
            return Err(Error::Unsupported(format!(
                "zero.precision = \"{}\" is not available in this version; use \"fp32\"",
                cfg.precision
            )));
        }
        let layout = ShardLayout::new(model.units(), 0, 1);
        let n = layout.shard_numel();
        let master = init_master(model.as_ref(), &layout, cfg.seed)?
            .f_to_device(cfg.device)
            .ctx("move parameters to the device", "-")?;
        let grads =
            Tensor::f_zeros([n], (Kind::Float, cfg.device)).ctx("allocate gradients", "-")?;
        let optimizer = AdamW::new(n, cfg.device, cfg.adamw, layout.shard_decay_ranges())?;
        let ledger = MemoryLedger {
            params: 4 * n,
            grads: 4 * n,
            master: 0, // fp32 compute parameters are the master copy
            optimizer: optimizer.state_bytes(),
            buffers: optimizer.scratch_bytes(),
        };
        Ok(Engine {
            model,
            layout,
            cfg,
            master,
            grads,
            optimizer,
            ledger,
        })
    }

    /// The layout (view tables) of every unit.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// Bytes held, by category.
    pub fn memory(&self) -> MemoryLedger {
        self.ledger
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    fn unit_slice(&self, buf: &Tensor, u: usize) -> Result<Tensor> {
        let l = &self.layout.units[u];
        buf.f_narrow(0, self.layout.full_offsets[u], l.padded)
            .ctx("slice flat buffer", &l.unit)
    }

    /// Unit `u`'s flat fp32 gradient buffer (padded).
    pub fn unit_grad(&self, u: usize) -> Result<Tensor> {
        self.unit_slice(&self.grads, u)
    }

    /// Every parameter by name, as views of the master buffer (world size 1: full tensors).
    pub fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.named(&self.master)
    }

    /// Every accumulated gradient by name, as views of the gradient buffer.
    pub fn named_gradients(&self) -> Result<Vec<(String, Tensor)>> {
        self.named(&self.grads)
    }

    fn named(&self, buf: &Tensor) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for u in 0..self.layout.units.len() {
            let flat = self.unit_slice(buf, u)?;
            let l = &self.layout.units[u];
            out.extend(l.views.iter().map(|v| v.name.clone()).zip(views(l, &flat)?));
        }
        Ok(out)
    }

    /// One micro-step: forward unit by unit, then backward unit by unit in reverse, adding
    /// `loss_weight` times each unit's gradient into the gradient buffer. Returns the
    /// micro-batch's mean loss. `inputs` and `targets` are (B, T) int64.
    pub fn forward_backward(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        weight: f64,
    ) -> Result<f64> {
        let units = self.model.units();
        let dev = self.cfg.device;
        let mut x = inputs
            .f_to_device(dev)
            .ctx("move inputs to the device", "-")?;
        let targets = targets
            .f_to_device(dev)
            .ctx("move targets to the device", "-")?;
        let mut saved: Vec<Saved> = Vec::with_capacity(units.len());
        for (u, unit) in units.iter().enumerate() {
            let name = unit.name();
            let flat = self
                .unit_slice(&self.master, u)?
                .f_detach()
                .ctx("detach", name)?;
            let flat = flat.set_requires_grad(true);
            let input = if u == 0 {
                None
            } else {
                Some(x.f_detach().ctx("detach", name)?.set_requires_grad(true))
            };
            let params = views(&self.layout.units[u], &flat)?;
            let output = unit.forward(&params, input.as_ref().unwrap_or(&x))?;
            x = output.shallow_clone();
            saved.push(Saved {
                input,
                flat,
                output,
            });
        }
        let loss = lm_loss(&x, &targets)?;
        let loss_value = loss.f_double_value(&[]).ctx("read loss", "head")?;
        let mut upstream: Option<Tensor> = None;
        for u in (0..units.len()).rev() {
            let s = saved.pop().expect("one saved entry per unit");
            let name = units[u].name();
            // The root whose gradient flows into this unit: the weighted loss for the last
            // unit, otherwise <output, upstream gradient> (its gradient wrt output is upstream).
            let root = match &upstream {
                None => loss.f_mul_scalar(weight).ctx("scale loss", name)?,
                Some(g) => s
                    .output
                    .f_mul(g)
                    .and_then(|t| t.f_sum(Kind::Float))
                    .ctx("backward root", name)?,
            };
            let mut wrt = vec![&s.flat];
            wrt.extend(s.input.as_ref());
            let mut g =
                Tensor::f_run_backward(&[&root], &wrt, false, false).ctx("backward", name)?;
            let mut grad = self.unit_slice(&self.grads, u)?;
            grad.f_add_(&g[0]).done("accumulate gradient", name)?;
            upstream = if s.input.is_some() { g.pop() } else { None };
        }
        Ok(loss_value)
    }

    /// Mean loss of a batch without gradients.
    pub fn eval_loss(&self, inputs: &Tensor, targets: &Tensor) -> Result<f64> {
        let _guard = tch::no_grad_guard();
        let dev = self.cfg.device;
        let mut x = inputs
            .f_to_device(dev)
            .ctx("move inputs to the device", "-")?;
        for (u, unit) in self.model.units().iter().enumerate() {
            let flat = self.unit_slice(&self.master, u)?;
            x = unit.forward(&views(&self.layout.units[u], &flat)?, &x)?;
        }
        let targets = targets
            .f_to_device(dev)
            .ctx("move targets to the device", "-")?;
        lm_loss(&x, &targets)?
            .f_double_value(&[])
            .ctx("read loss", "head")
    }

    /// Clips the accumulated gradients to `max_norm` (<= 0: off), applies AdamW with `lr`
    /// and clears the gradients. A step whose gradients are not finite is not applied.
    pub fn step(&mut self, lr: f64, max_norm: f64) -> Result<StepStats> {
        let _guard = tch::no_grad_guard();
        let grad_norm = self
            .grads
            .f_norm()
            .and_then(|t| t.f_double_value(&[]))
            .ctx("gradient norm", "-")?;
        let applied = grad_norm.is_finite();
        let clip_coef = clip_coefficient(grad_norm, max_norm);
        if applied {
            if clip_coef < 1.0 {
                self.grads
                    .f_mul_scalar_(clip_coef)
                    .done("clip gradients", "-")?;
            }
            self.optimizer.step(&self.master, &self.grads, lr)?;
        }
        self.grads.f_zero_().done("zero gradients", "-")?;
        Ok(StepStats {
            grad_norm,
            clip_coef,
            applied,
        })
    }
}

/// The named parameter tensors of a unit as views of its flat buffer, in the unit's order.
fn views(layout: &UnitLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    layout
        .views
        .iter()
        .map(|v| {
            flat.f_narrow(0, v.offset, v.numel)
                .and_then(|t| t.f_view(v.shape.as_slice()))
        })
        .collect::<std::result::Result<_, _>>()
        .ctx("view parameters", &layout.unit)
}

/// This rank's fp32 master buffer, each owned slice filled by the models' deterministic
/// init, so no rank ever materialises more than its own shard.
fn init_master(model: &dyn Model, layout: &ShardLayout, seed: u64) -> Result<Tensor> {
    let n = layout.shard_numel();
    let master =
        Tensor::f_zeros([n], (Kind::Float, Device::Cpu)).ctx("allocate parameters", "-")?;
    // SAFETY: `master` is a freshly allocated, contiguous fp32 CPU tensor of `n` elements that
    // nothing else references until this function returns; the slice does not outlive it.
    let data = unsafe { std::slice::from_raw_parts_mut(master.data_ptr() as *mut f32, n as usize) };
    for ((unit, l), at) in model
        .units()
        .iter()
        .zip(&layout.units)
        .zip(&layout.shard_offsets)
    {
        let (start, len) = l.shard_range(layout.rank);
        let shard = &mut data[*at as usize..(*at + len) as usize];
        for (spec, v) in unit.params().iter().zip(&l.views) {
            // Intersection of this parameter [v.offset, v.offset + numel) with the shard.
            let lo = v.offset.max(start);
            let hi = (v.offset + v.numel).min(start + len);
            if lo < hi {
                let out = &mut shard[(lo - start) as usize..(hi - start) as usize];
                spec.init_into(seed, (lo - v.offset) as u64, out);
            }
        }
    }
    Ok(master)
}
