//! Gradients on the host only, ZeRO-Offload's placement of them: with the optimizer offloaded
//! at stages 2-3, every step one micro-step announced by [`Engine::prepare_step`]
//! ([`crate::EngineConfig::one_micro_step`]) and no out-of-memory recovery, a unit's gradient
//! shard is final as soon as its backward (and reduction) is done. It is made in a buffer of its
//! own on the device, handed to the host optimizer (copied into the host's gradients,
//! asynchronously on CUDA, where the copy's stream keeps the buffer from reuse until it has
//! read it) and dropped. The device keeps no gradient shard: for llama3.1-8b at W=1, 29.9 GiB
//! of fp32 gradients. The gradient norm is summed unit by unit as each goes (on the device
//! with CUDA, read back once at the step). The host's gradients are fp32, or bf16 where they
//! are exactly bf16 values ([`host_grad_kind`]), as is then the buffer on the device.
//!
//! With gradient accumulation the shards must be summed across micro-steps, and a step that
//! runs out of memory is dropped with its gradients: both keep the device's gradient shard.

use crate::engine::{EarlyStep, Engine};
use crate::{Context, Error, Offload, Precision, Result, ShardLayout, Stage};
use tch::{Kind, Tensor};

/// Whether gradients live on the host only for a run at `stage` with `offload`, every step
/// one announced micro-step (`one_micro_step`) and `oom_recovery` as given.
pub fn gradients_on_host(
    stage: Stage,
    offload: Offload,
    one_micro_step: bool,
    oom_recovery: bool,
) -> bool {
    offload == Offload::Cpu
        && one_micro_step
        && !oom_recovery
        && matches!(stage, Stage::Zero2 | Stage::Zero3)
}

/// The dtype of gradients on the host only: bf16 where every gradient is autograd's bf16
/// values laid out once (a rank alone without replicas, bf16 compute, no tied parameter:
/// nothing is summed), which bf16 holds exactly in half the bytes and half the copy; fp32
/// otherwise.
pub(crate) fn host_grad_kind(layout: &ShardLayout, precision: Precision, tied: bool) -> Kind {
    if layout.single_rank() && precision == Precision::Bf16 && !tied {
        Kind::BFloat16
    } else {
        Kind::Float
    }
}

/// Whether a split delayed update (`fresh.rs`, which keeps the gradient shard on the device
/// where it could live on the host only: `eligible`, [`gradients_on_host`]) holds gradients
/// that are exactly bf16 values ([`host_grad_kind`]): its device buffer and the host's copy
/// then hold them as bf16, `reduce_dtype = "bf16"`, which trains exactly as fp32 there (it
/// sums none), in half the bytes on both sides.
pub(crate) fn split_in_bf16(
    eligible: bool,
    fresh: bool,
    layout: &ShardLayout,
    precision: Precision,
    tied: bool,
) -> bool {
    fresh && eligible && host_grad_kind(layout, precision, tied) == Kind::BFloat16
}

/// The sum of the squares of the gradients handed to the host this step: in f64 on CPU; on
/// a CUDA device each unit's fp32 norm, one reduction each, squared and summed in fp64 at the
/// step (nothing read back until then).
#[derive(Default)]
pub(crate) struct Squares {
    host: f64,
    norms: Vec<Tensor>,
}

impl Squares {
    fn add(&mut self, g: &Tensor) -> Result<()> {
        if g.device().is_cuda() {
            let n = zrun_torch_ext::norm_f32(g).map_err(|e| Error::Kernel("gradient norm", e))?;
            self.norms.push(n);
        } else {
            self.host += crate::norm::sum_of_squares(g)?;
        }
        Ok(())
    }

    /// The sum so far (one read of the device), and from now on zero.
    pub(crate) fn take(&mut self) -> Result<f64> {
        let host = std::mem::take(&mut self.host);
        let norms = std::mem::take(&mut self.norms);
        if norms.is_empty() {
            return Ok(host);
        }
        let device = Tensor::f_stack(&norms, 0)
            .and_then(|t| t.f_to_kind(Kind::Double))
            .and_then(|t| t.f_square())
            .and_then(|t| t.f_sum(Kind::Double))
            .and_then(|t| t.f_double_value(&[]))
            .ctx("gradient norm", "-")?;
        Ok(host + device)
    }

    pub(crate) fn clear(&mut self) {
        *self = Squares::default();
    }
}

impl Engine {
    /// Refuses a micro-step not announced by [`Engine::prepare_step`]: with gradients on the
    /// host there is nowhere to accumulate it.
    pub(crate) fn check_announced(&self) -> Result<()> {
        if self.host_grads && self.early == EarlyStep::Off {
            return Err(Error::Unsupported(
                "gradients go to the host as they are made (offload at stage 2-3, one micro-step a step): announce every micro-step with prepare_step".into(),
            ));
        }
        Ok(())
    }

    /// Unit `u`'s gradient on the device while its backward makes it (host gradients):
    /// the one begun in this backward, or a new one, uninitialised; with whether it is new
    /// (to be overwritten, not added to).
    pub(crate) fn held_grads(&mut self, u: usize) -> Result<(bool, Tensor)> {
        if let Some(t) = &self.held[u] {
            return Ok((false, t.shallow_clone()));
        }
        let l = &self.mover.layout.units[u];
        let t = Tensor::f_empty([l.shard_len()], (self.held_kind, self.cfg.device))
            .ctx("allocate unit gradient", &l.unit)?;
        self.stale[u] = false;
        self.held[u] = Some(t.shallow_clone());
        Ok((true, t))
    }

    /// Stages 2-3 over a shard group of several ranks (host gradients): unit `u`'s reduced
    /// `shard` becomes its gradient, or is added into the part begun in this backward (a tied
    /// parameter's, which comes first); kept until `last`.
    pub(crate) fn hold_shard(&mut self, u: usize, shard: Tensor, last: bool) -> Result<Tensor> {
        let acc = match self.held[u].take() {
            Some(mut acc) => {
                let name = &self.mover.layout.units[u].unit;
                acc.f_add_(&shard).done("accumulate gradient shard", name)?;
                acc
            }
            None => shard,
        };
        self.stale[u] = false;
        if !last {
            self.held[u] = Some(acc.shallow_clone());
        }
        Ok(acc)
    }

    /// Unit `u`'s gradient `acc` is final and about to go to the host: its squares count
    /// towards the norm, and the engine holds it no longer.
    pub(crate) fn hand_over(&mut self, u: usize, acc: &Tensor) -> Result<()> {
        self.held[u] = None;
        self.squares.add(acc)
    }

    /// At the step, before anything else (host gradients): a unit whose gradient the
    /// backward did not complete hands the part it has to the host, one that got none hands
    /// zeros, as zeroing its region of the device's gradients would.
    pub(crate) fn settle_host_grads(&mut self) -> Result<()> {
        for u in 0..self.stale.len() {
            let acc = match self.held[u].take() {
                Some(part) => part,
                None if self.stale[u] => {
                    let l = &self.mover.layout.units[u];
                    Tensor::f_zeros([l.shard_len()], (self.held_kind, self.cfg.device))
                        .ctx("zero gradients of a unit without any", &l.unit)?
                }
                None => continue,
            };
            self.stale[u] = false;
            self.unit_final(u, &acc)?;
        }
        Ok(())
    }
}
