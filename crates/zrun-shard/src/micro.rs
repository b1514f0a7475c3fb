//! One micro-step: forward unit by unit, backward unit by unit in reverse with one autograd
//! call per unit. Stage 3 gathers units ahead of use (prefetch), frees each unit's gathered
//! parameters as soon as its forward is done and gathers them again into the same storage
//! for its backward (autograd's saved views see them), without recomputing the forward.
//! Stages 2-3 reduce each unit's gradient as soon as its backward is done: a reduce-scatter
//! in the shard group, added into the rank's gradient shard. With hybrid sharding the shards
//! are summed locally over the step's micro-steps and all-reduced across the replica group
//! once per step, in place, unit by unit during the backward of the micro-step announced as
//! the last ([`Engine::last_micro_step`]; otherwise at the step): one reduce-scatter and one
//! all-reduce in flight. Activation checkpointing keeps only unit inputs and recomputes each
//! unit's forward in its backward.

use crate::delay::refresh_unit;
use crate::engine::{views, EarlyStep, Engine, Optimizer, Phase};
use crate::grads::{lay_out, pick};
use crate::state::{Collective, Mover, Pending};
use crate::{Context, Error, Result, Stage};
use std::collections::VecDeque;
use std::time::Instant;
use tch::{Device, Tensor};

/// The gradient reductions of a backward in flight (stages 2-3), oldest first:
/// reduce-scatters in the shard group, each with whether it completes its unit's gradient,
/// then (hybrid sharding, in the step's last micro-step) all-reduces of completed units'
/// shards across the replica group.
#[derive(Default)]
struct Reductions {
    scattering: VecDeque<(Pending, bool)>,
    replicating: VecDeque<Pending>,
    /// Whether this backward all-reduces each completed unit's shard across the replicas.
    replicate: bool,
}

/// What one unit's forward leaves for its backward.
struct Saved {
    /// The unit's input: a leaf (to get its gradient), or token ids for the first unit, or
    /// with checkpointing the plain input to recompute from.
    input: Tensor,
    /// Without checkpointing: the parameter leaves (the tied one last), the output and
    /// (stage 3) the gathered buffers (the unit's, then the tied owner's), whose storage is
    /// released until the backward.
    graph: Option<(Vec<Tensor>, Tensor, Vec<Option<Tensor>>)>,
}

/// Stage 3's gathers, issued `depth` units ahead of the unit computing, in a given order
/// (a unit with a tied parameter is preceded by its owner, gathered again); into new
/// buffers, or back into the released buffers of the forward (`refill`, by position).
struct Gathers {
    order: Vec<usize>,
    next: usize,
    pending: VecDeque<Pending>,
    depth: usize,
    refill: Option<Vec<Option<Tensor>>>,
}

impl Gathers {
    fn new(order: Vec<usize>, depth: usize) -> Gathers {
        Gathers {
            order,
            next: 0,
            pending: VecDeque::new(),
            depth,
            refill: None,
        }
    }

    fn refilling(order: Vec<usize>, depth: usize, buffers: Vec<Option<Tensor>>) -> Gathers {
        Gathers {
            refill: Some(buffers),
            ..Gathers::new(order, depth)
        }
    }

    /// The full parameters of the next unit in order: issues the gathers of the following
    /// `depth` units, then waits for this one, so communication overlaps the caller's
    /// compute. Returns the buffer and whether it was gathered (stage 3) or is resident.
    fn take(&mut self, mover: &mut Mover, params: &Tensor, stage: Stage) -> Result<(Tensor, bool)> {
        let u = self.order[self.next];
        self.next += 1;
        if !mover.gathers(stage) {
            return Ok((mover.unit_full(params, u)?, false));
        }
        let issued = self.next - 1 + self.pending.len();
        let wanted = (self.next + self.depth).saturating_sub(issued);
        for i in issued..(issued + wanted).min(self.order.len()) {
            let v = self.order[i];
            let into = self.refill.as_ref().and_then(|b| b[i].as_ref());
            self.pending.push_back(match into {
                Some(buf) => mover.start_gather_into(params, v, buf)?,
                None => mover.start_gather(params, v)?,
            });
        }
        let p = self
            .pending
            .pop_front()
            .expect("the gather of the current unit was issued");
        Ok((mover.finish_gather(p)?, true))
    }
}

/// The parameters of a unit as autograd leaves: views of its flat buffer (`flat`'s storage,
/// so a re-gathered buffer is what backward reads), each its own leaf, so each gets its own
/// gradient (no unit-sized zero-filled gradient per parameter, as views of one leaf would).
fn param_leaves(layout: &crate::layout::UnitLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    let base = flat.f_detach().ctx("detach", &layout.unit)?;
    Ok(views(layout, &base)?
        .into_iter()
        .map(|v| v.set_requires_grad(true))
        .collect())
}

/// The leaf of parameter `p` of a unit whose flat buffer is `flat` (a tied parameter).
fn tied_leaf(layout: &crate::layout::UnitLayout, flat: &Tensor, p: usize) -> Result<Tensor> {
    let base = flat.f_detach().ctx("detach", &layout.unit)?;
    let v = &layout.views[p];
    let t = base
        .f_narrow(0, v.offset, v.numel)
        .and_then(|t| t.f_view(v.shape.as_slice()))
        .ctx("view tied parameter", &layout.unit)?;
    Ok(t.set_requires_grad(true))
}

/// Forward order of the units: each unit with a tied parameter preceded by the owner.
fn forward_order(model: &dyn zrun_models::Model) -> Vec<usize> {
    let mut order = Vec::new();
    for (u, unit) in model.units().iter().enumerate() {
        if let Some(t) = unit.tied() {
            order.push(t.unit);
        }
        order.push(u);
    }
    order
}

impl Engine {
    /// One micro-step: forward unit by unit, then backward unit by unit in reverse, adding
    /// `weight` times each unit's gradient into this rank's gradients (averaged over the
    /// ranks per unit as soon as its backward is done at stages 2-3). Returns this rank's
    /// micro-batch mean loss. `inputs` and `targets` are (B, T) int64.
    pub fn forward_backward(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        weight: f64,
    ) -> Result<f64> {
        let model = self.model.clone();
        let units = model.units();
        let n = units.len();
        let (dev, stage, ckpt) = (
            self.cfg.device,
            self.cfg.stage,
            self.cfg.activation_checkpointing,
        );
        match self.early {
            EarlyStep::Armed { lr, max_norm } => {
                if let Optimizer::Host(h) = &mut self.optimizer {
                    h.begin_step()?;
                    self.early = EarlyStep::Submitted { lr, max_norm };
                }
            }
            EarlyStep::StageArmed => self.early = EarlyStep::Staged,
            EarlyStep::Submitted { .. } | EarlyStep::Staged => {
                return Err(Error::Unsupported(
                    "forward_backward after the micro-step announced as the last by prepare_step: call step first".into(),
                ))
            }
            EarlyStep::Off => self.check_announced()?,
        }
        if self.mover.replicates {
            return Err(Error::Unsupported(
                "forward_backward after the micro-step announced as the last by last_micro_step: call step first".into(),
            ));
        }
        let last = std::mem::take(&mut self.last_announced);
        let replicate =
            last && self.mover.replicated() && matches!(stage, Stage::Zero2 | Stage::Zero3);
        self.begin_micro_step(replicate);
        let (t0, w0) = (Instant::now(), self.mover.waited);
        let mut x = to_device(inputs, dev).ctx("move inputs to the device", "-")?;
        let targets = to_device(targets, dev).ctx("move targets to the device", "-")?;
        let order = forward_order(model.as_ref());
        let mut gathers = Gathers::new(order.clone(), self.cfg.prefetch);
        let mut saved: Vec<Saved> = Vec::with_capacity(n);
        let chunk = self.cfg.loss_chunk;
        // Each unit's output; the head's is the loss (its logits never leave it).
        let run = |u: usize, params: &[Tensor], input: &Tensor| {
            if u + 1 == n {
                units[u].loss(params, input, &targets, chunk)
            } else {
                units[u].forward(params, input)
            }
        };
        for (u, unit) in units.iter().enumerate() {
            let name = unit.name();
            // The head's forward is the loss (a norm, then the chunked matmul and loss).
            self.enter(
                if u + 1 == n {
                    Phase::Loss
                } else {
                    Phase::Forward
                },
                u,
            );
            if ckpt {
                let _guard = tch::no_grad_guard();
                let (params, buffers) = self.plain_params(&mut gathers, u)?;
                let out = run(u, &params, &x)?;
                drop(params);
                for b in &buffers {
                    self.mover.free(b)?;
                }
                saved.push(Saved {
                    input: std::mem::replace(&mut x, out),
                    graph: None,
                });
                continue;
            }
            let tied = match unit.tied() {
                Some(t) => Some((t, gathers.take(&mut self.mover, &self.params, stage)?)),
                None => None,
            };
            let (flat, gathered) = gathers.take(&mut self.mover, &self.params, stage)?;
            // The gathered buffers (stage 3), the unit's first: positions in the order.
            let mut buffers = vec![gathered.then(|| flat.shallow_clone())];
            if let Some((_, (tflat, tgathered))) = &tied {
                buffers.push(tgathered.then(|| tflat.shallow_clone()));
            }
            let mut leaves = param_leaves(&self.mover.layout.units[u], &flat)?;
            if let Some((t, (tflat, _))) = &tied {
                leaves.push(tied_leaf(&self.mover.layout.units[t.unit], tflat, t.param)?);
            }
            let input = if u == 0 {
                x.shallow_clone()
            } else {
                x.f_detach().ctx("detach", name)?.set_requires_grad(true)
            };
            let out = run(u, &leaves, &input)?;
            // Autograd keeps views of the gathered parameters: release their memory now.
            for b in buffers.iter().flatten() {
                self.mover.free(b)?;
            }
            x = out.shallow_clone();
            saved.push(Saved {
                input,
                graph: Some((leaves, out, buffers)),
            });
        }
        // Read once backward is queued: on CUDA a read here would idle the device meanwhile.
        let value = x.f_detach().ctx("keep loss", "head")?;
        let (t1, w1) = (Instant::now(), self.mover.waited);
        let loss_seed = weight * self.scaler.scale();
        drop(x);

        // Backward order: the forward's reversed (a tied owner right after its reader).
        let order: Vec<usize> = order.into_iter().rev().collect();
        let refill = self.mover.gathers(stage) && !ckpt;
        let mut gathers = if refill {
            let buffers = saved.iter().rev().flat_map(|s| {
                let g = s.graph.as_ref().map(|g| g.2.as_slice()).unwrap_or(&[]);
                g.iter().map(|b| b.as_ref().map(Tensor::shallow_clone))
            });
            Gathers::refilling(order, self.cfg.prefetch, buffers.collect())
        } else {
            Gathers::new(order, self.cfg.prefetch)
        };
        let mut upstream: Option<Tensor> = None;
        let mut reducing = Reductions {
            replicate,
            ..Reductions::default()
        };
        for u in (0..n).rev() {
            let s = saved.pop().expect("one saved entry per unit");
            let name = units[u].name();
            let tied = units[u].tied();
            self.enter(Phase::Backward, u);
            let (leaves, input, output, gathered) = match s.graph {
                Some((leaves, output, gathered)) => {
                    if refill {
                        // The parameters (and a tied owner's) are back in the same storage.
                        for _ in 0..gathered.len() {
                            drop(gathers.take(&mut self.mover, &self.params, stage)?);
                        }
                    }
                    (leaves, s.input, output, gathered)
                }
                None => {
                    // Checkpointed: gather again if sharded, recompute the forward with grad.
                    let (flat, gathered) = gathers.take(&mut self.mover, &self.params, stage)?;
                    let mut leaves = param_leaves(&self.mover.layout.units[u], &flat)?;
                    let mut buffers = vec![gathered.then_some(flat)];
                    if let Some(t) = tied {
                        let (tflat, tg) = gathers.take(&mut self.mover, &self.params, stage)?;
                        let owner = &self.mover.layout.units[t.unit];
                        leaves.push(tied_leaf(owner, &tflat, t.param)?);
                        buffers.push(tg.then_some(tflat));
                    }
                    let input = if u == 0 {
                        s.input
                    } else {
                        s.input.set_requires_grad(true)
                    };
                    let out = run(u, &leaves, &input)?;
                    (leaves, input, out, buffers)
                }
            };
            // Backward of this unit alone: from the weighted (and scaled) loss for the last
            // unit, otherwise from its output with the upstream gradient.
            let (root, seed) = match upstream.take() {
                Some(g) => (output, g),
                None => {
                    let seed = zrun_torch_ext::scalar::full(
                        &[],
                        loss_seed,
                        (output.kind(), output.device()),
                    )
                    .map_err(|e| Error::Kernel("loss seed", e))?;
                    (output, seed)
                }
            };
            let mut wrt: Vec<&Tensor> = leaves.iter().collect();
            if u > 0 {
                wrt.push(&input);
            }
            let mut g = zrun_torch_ext::grad(&[&root], &[&seed], &wrt)
                .map_err(|e| Error::Storage(name.into(), e))?;
            upstream = if u > 0 { g.pop() } else { None };
            drop((root, seed, leaves, input));
            for full in gathered.into_iter().flatten() {
                self.mover.free(&full)?;
            }
            // The tied parameter's gradient belongs to its owner, whose own backward comes
            // later: its update waits for that.
            if let (Some(t), Some(tg)) = (tied, tied.and_then(|_| g.pop())) {
                self.absorb_into(t.unit, Some(t.param), vec![tg], &mut reducing, false)?;
            }
            self.absorb_into(u, None, g, &mut reducing, true)?;
        }
        while let Some((p, last)) = reducing.scattering.pop_front() {
            self.retire(p, last, &mut reducing)?;
        }
        while let Some(p) = reducing.replicating.pop_front() {
            self.finish_replicate(p)?;
        }
        let value = value.f_double_value(&[]).ctx("read loss", "head")?;
        // The loss came from gathered parameters (stage 3): valid only if no gather was cut.
        self.mover.check()?;
        let (fwd_wait, bwd_wait) = (w1 - w0, self.mover.waited - w1);
        let t = &mut self.times;
        t.forward += (t1 - t0).saturating_sub(fwd_wait).as_secs_f64();
        t.backward += t1.elapsed().saturating_sub(bwd_wait).as_secs_f64();
        t.comm_wait += (fwd_wait + bwd_wait).as_secs_f64();
        Ok(value)
    }

    /// Adds unit `u`'s parameter gradients (in the unit's parameter order, or only parameter
    /// `only`'s) into the full gradients, or copies them over a stale region (stages 0-1,
    /// `grads.rs`; stages 2-3 too over a shard group of one without replicas, handing a
    /// completed unit's gradient on at once), or lays them out in one flat buffer of
    /// the reduce dtype (zeros elsewhere) and starts its reduce-scatter (stages 2-3),
    /// retiring older reductions so one stays in flight (and, replicated, one all-reduce).
    /// `last` says no more of unit `u`'s gradient follows in this micro-step.
    fn absorb_into(
        &mut self,
        u: usize,
        only: Option<usize>,
        grads: Vec<Tensor>,
        reducing: &mut Reductions,
        last: bool,
    ) -> Result<()> {
        let layout = &self.mover.layout.units[u];
        let name = layout.unit.clone();
        match self.cfg.stage {
            Stage::Zero0 | Stage::Zero1 => self.accumulate_full(u, only, &grads),
            // A shard group of one without replicas: the reduce-scatter is an identity and
            // the unit's shard is the whole unit, so the gradients go straight into it, as at
            // stages 0-1, with no flat buffer of their own and no copy of it.
            Stage::Zero2 | Stage::Zero3 if self.mover.layout.single_rank() => {
                self.accumulate_full(u, only, &grads)?;
                // Recorded as the identity reduce-scatter it stands for (the schedule).
                self.mover.issued.push((Collective::ReduceScatter, u));
                if last {
                    self.unit_final(u, &self.unit_grads(u)?)?;
                }
                Ok(())
            }
            Stage::Zero2 | Stage::Zero3 => {
                let kind = self.cfg.reduce_dtype.kind();
                let mut flat = Tensor::f_empty([layout.padded], (kind, self.cfg.device))
                    .ctx("allocate unit gradient", &name)?;
                if only.is_some() {
                    flat.f_zero_().done("zero unit gradient", &name)?;
                }
                // Each parameter's gradient straight into its place (cast on the way).
                lay_out(&pick(only, views(layout, &flat)?), &grads, false, &name)?;
                if layout.padded > layout.numel && only.is_none() {
                    flat.f_narrow(0, layout.numel, layout.padded - layout.numel)
                        .and_then(|mut pad| pad.f_zero_())
                        .done("zero gradient padding", &name)?;
                }
                drop(grads);
                let p = self.mover.start_reduce_scatter(flat, u)?;
                reducing.scattering.push_back((p, last));
                if reducing.scattering.len() > 1 {
                    let (p, last) = reducing.scattering.pop_front().expect("two in flight");
                    self.retire(p, last, reducing)?;
                }
                Ok(())
            }
        }
    }

    /// The next step of a reduce-scatter that is no longer the newest: its shard is added
    /// into the gradients. Without replicas a completed unit's gradient is then final; with
    /// them, in the step's last micro-step, the unit's summed shard is all-reduced across the
    /// replica group in place, and the all-reduce before it is finished, so one stays in
    /// flight; in the other micro-steps the shard is only summed.
    fn retire(&mut self, p: Pending, last: bool, reducing: &mut Reductions) -> Result<()> {
        let (u, shard) = self.mover.finish_reduce_scatter(p)?;
        let acc = if self.host_grads {
            self.hold_shard(u, shard, last)?
        } else {
            self.accumulate_shard(u, &shard)?
        };
        if !last {
            return Ok(());
        }
        if !self.mover.replicated() {
            return self.unit_final(u, &acc);
        }
        if reducing.replicate {
            reducing
                .replicating
                .push_back(self.mover.start_replicate(acc, u)?);
            if reducing.replicating.len() > 1 {
                let p = reducing.replicating.pop_front().expect("two in flight");
                self.finish_replicate(p)?;
            }
        }
        Ok(())
    }

    /// Waits for a unit's all-reduce across the replica group: its gradient is final.
    fn finish_replicate(&mut self, p: Pending) -> Result<()> {
        let (u, acc) = self.mover.finish_replicate(p)?;
        self.unit_final(u, &acc)
    }

    /// Unit `u`'s gradient shard `acc` is final for the step: hands it to an offloaded
    /// optimizer's early step.
    pub(crate) fn unit_final(&mut self, u: usize, acc: &Tensor) -> Result<()> {
        if self.host_grads {
            self.hand_over(u, acc)?;
        }
        if self.early == EarlyStep::Staged {
            let refresh = self.delay.behind && self.delay.submitted;
            if let Optimizer::Host(h) = &mut self.optimizer {
                h.stage_unit(&self.mover.layout, u, acc)?;
                if refresh {
                    // The running delayed update finished these units while this backward
                    // waited for it: their new parameters go to the device now, queued behind
                    // the backward of each (nothing later in this step reads them), instead of
                    // all at the step's end, where the next update waits for them.
                    for done in h.take_finished() {
                        let src = h.refreshed();
                        refresh_unit(&self.mover, &self.params, self.cfg.stage, src, done)?;
                        // A split update's v too (`fresh.rs`).
                        if let (Some(v), Some(d)) = (h.split_v(), &self.delay.v) {
                            crate::fresh::copy_v(&self.mover, d, v, done)?;
                        }
                    }
                }
            }
        }
        if let EarlyStep::Submitted { lr, .. } = self.early {
            // The unit's gradient is final: its update overlaps the rest of backward. The
            // parameters are written through an alias with its own version counter: autograd
            // still holds views of the earlier units, which share the parameters' counter.
            let dst = self
                .mover
                .owned_params(&self.params, u, self.cfg.stage)?
                .data();
            if let Optimizer::Host(h) = &mut self.optimizer {
                h.submit(&self.mover.layout, u, acc, lr, dst)?;
            }
        }
        Ok(())
    }

    /// Unit `u`'s forward inputs without autograd: views of its full parameters and of the
    /// tied one, and the gathered buffers (stage 3) to free after its forward.
    fn plain_params(
        &mut self,
        gathers: &mut Gathers,
        u: usize,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let stage = self.cfg.stage;
        let tied = self.model.units()[u].tied();
        let owner = match tied {
            Some(_) => Some(gathers.take(&mut self.mover, &self.params, stage)?),
            None => None,
        };
        let (flat, gathered) = gathers.take(&mut self.mover, &self.params, stage)?;
        let mut params = views(&self.mover.layout.units[u], &flat)?;
        let mut buffers: Vec<Tensor> = gathered.then_some(flat).into_iter().collect();
        if let (Some(t), Some((tflat, tgathered))) = (tied, owner) {
            params.push(views(&self.mover.layout.units[t.unit], &tflat)?.swap_remove(t.param));
            if tgathered {
                buffers.push(tflat);
            }
        }
        Ok((params, buffers))
    }

    /// This rank's mean loss of a batch, without gradients.
    pub fn eval_loss(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<f64> {
        // Evaluation is not part of a training step: its waits are not counted.
        let waited = self.mover.waited;
        let r = self.eval_inner(inputs, targets);
        self.mover.waited = waited;
        r
    }

    fn eval_inner(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<f64> {
        let targets = targets
            .f_to_device(self.cfg.device)
            .ctx("move targets to the device", "-")?;
        self.forward_plain(inputs, Some(&targets))?
            .f_double_value(&[])
            .ctx("read loss", "head")
    }

    /// The logits (B, T, V) of token ids (B, T), on the engine's device, without gradients
    /// (every rank calls it at stage 3, whose gathers need every rank).
    pub fn logits(&mut self, inputs: &Tensor) -> Result<Tensor> {
        self.forward_plain(inputs, None)
    }

    /// The model's forward without gradients: the logits, or with `targets` the mean loss
    /// (through the chunked head, as in training).
    fn forward_plain(&mut self, inputs: &Tensor, targets: Option<&Tensor>) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let model = self.model.clone();
        let units = model.units();
        let mut x = inputs
            .f_to_device(self.cfg.device)
            .ctx("move inputs to the device", "-")?;
        let mut gathers = Gathers::new(forward_order(model.as_ref()), self.cfg.prefetch);
        for (u, unit) in units.iter().enumerate() {
            self.enter(Phase::Eval, u);
            let (params, buffers) = self.plain_params(&mut gathers, u)?;
            x = match targets {
                Some(t) if u + 1 == units.len() => {
                    unit.loss(&params, &x, t, self.cfg.loss_chunk)?
                }
                _ => unit.forward(&params, &x)?,
            };
            drop(params);
            for b in &buffers {
                self.mover.free(b)?;
            }
        }
        Ok(x)
    }
}

/// `t` (a CPU tensor) on `dev`. To CUDA through pinned memory, queued without blocking the
/// host: the batch need not wait for the previous step's kernels to finish.
fn to_device(t: &Tensor, dev: Device) -> std::result::Result<Tensor, tch::TchError> {
    if !dev.is_cuda() || t.device() != Device::Cpu {
        return t.f_to_device(dev);
    }
    let Ok(mut pinned) = zrun_torch_ext::empty_pinned(t.numel() as i64, t.kind()) else {
        return t.f_to_device(dev);
    };
    pinned.f_copy_(&t.f_reshape([-1])?)?;
    let out = Tensor::f_empty(t.size(), (t.kind(), dev))?;
    match zrun_torch_ext::copy_async(&out.f_view([-1])?, &pinned) {
        Ok(()) => Ok(out),
        Err(_) => t.f_to_device(dev),
    }
}
