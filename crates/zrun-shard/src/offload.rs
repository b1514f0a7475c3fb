//! CPU offload of the optimizer: the fp32 master shard and AdamW m, v live in host memory
//! (pinned where CUDA is present); the rank's reduced gradient shard is copied to the host,
//! the CPU AdamW updates each unit's slice and writes the new parameters back in the compute
//! dtype (straight into the parameters when they are in host memory too).

use crate::layout::ShardLayout;
use crate::{Context, Error, Precision, Result, Stage};
use tch::{Device, Kind, Tensor};
use zrun_optim::{AdamWConfig, CpuAdamW, HalfKind, StateDtype};

/// The optimizer side of a rank whose optimizer state is offloaded to the host.
pub(crate) struct HostOptimizer {
    adam: CpuAdamW,
    /// fp32 master shard, units back to back in `shard_offsets` order.
    master: Tensor,
    /// fp32 gradient shard staged on the host, same layout.
    grads: Tensor,
    /// 16-bit copy of the new parameters when they must travel to a device.
    staging: Option<Tensor>,
    precision: Precision,
}

/// A host tensor, pinned when CUDA is present so device copies are asynchronous DMA.
fn host_tensor(numel: i64, kind: Kind, device: Device) -> Result<Tensor> {
    let t = Tensor::f_zeros([numel], (kind, Device::Cpu)).ctx("allocate host buffer", "-")?;
    if device.is_cuda() {
        return t.f_pin_memory(device).ctx("pin host buffer", "-");
    }
    Ok(t)
}

/// Elements `[off, off + len)` of the contiguous CPU tensor whose data starts at `base`.
///
/// # Safety
/// `base` must be the data of a contiguous CPU tensor whose elements are `T`, with
/// `off + len <= numel`, that outlives the slice; nothing else may access that range while
/// the slice lives.
unsafe fn slice_mut<'a, T>(base: *mut std::ffi::c_void, off: usize, len: usize) -> &'a mut [T] {
    // SAFETY: guaranteed by the caller (see above).
    unsafe { std::slice::from_raw_parts_mut((base as *mut T).add(off), len) }
}

impl HostOptimizer {
    /// Host state for `layout`'s rank, the master initialised from `master_init` (fp32 CPU).
    pub(crate) fn new(
        layout: &ShardLayout,
        master_init: Tensor,
        cfg: AdamWConfig,
        state: StateDtype,
        threads: usize,
        precision: Precision,
        device: Device,
    ) -> Result<HostOptimizer> {
        let n = layout.shard_numel();
        let master = host_tensor(n, Kind::Float, device)?;
        master
            .shallow_clone()
            .f_copy_(&master_init)
            .ctx("initialise host master", "-")?;
        let decay = layout
            .shard_decay_ranges()
            .into_iter()
            .map(|(o, l)| (o as usize, l as usize))
            .collect();
        let staging = match precision {
            Precision::Fp32 => None,
            _ if device.is_cuda() => Some(host_tensor(n, precision.kind(), device)?),
            _ => None,
        };
        Ok(HostOptimizer {
            adam: CpuAdamW::new(n as usize, cfg, decay, state, threads.max(1)),
            master,
            grads: host_tensor(n, Kind::Float, device)?,
            staging,
            precision,
        })
    }

    /// The host fp32 master shard.
    pub(crate) fn master(&self) -> &Tensor {
        &self.master
    }

    /// Host bytes of master and optimizer state.
    pub(crate) fn state_bytes(&self) -> i64 {
        4 * self.master.numel() as i64 + self.adam.state_bytes() as i64
    }

    /// Host bytes of staging buffers.
    pub(crate) fn buffer_bytes(&self) -> i64 {
        let bytes = |t: &Tensor| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
        bytes(&self.grads) + self.staging.as_ref().map_or(0, bytes)
    }

    /// One AdamW step: stages the owned gradient `segments` (any dtype and device, laid end
    /// to end in shard order) on the host, updates every unit's slice with `lr` and
    /// `grad_scale` (unscaling and clipping), and writes the new compute-dtype parameters into
    /// `params_of(u)`, this rank's slice of unit `u` in the compute parameters.
    pub(crate) fn step(
        &mut self,
        layout: &ShardLayout,
        segments: &[Tensor],
        lr: f64,
        grad_scale: f64,
        params_of: impl Fn(usize) -> Result<Tensor>,
    ) -> Result<()> {
        let mut at = 0;
        for g in segments {
            let n = g.numel() as i64;
            let mut dst = self.grads.f_narrow(0, at, n).ctx("stage gradients", "-")?;
            dst.f_copy_(g).ctx("copy gradients to the host", "-")?;
            at += n;
        }
        self.adam.begin_step();
        let half = match self.precision {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(HalfKind::Bf16),
            Precision::Fp16 => Some(HalfKind::Fp16),
        };
        for (u, l) in layout.units.iter().enumerate() {
            let (off, len) = (layout.shard_offsets[u] as usize, l.shard_len() as usize);
            let mut dst = params_of(u)?;
            // Where the 16-bit copy goes: straight into CPU parameters, else a host staging slice.
            let direct = dst.device() == Device::Cpu && dst.is_contiguous();
            let staged = match (half, direct) {
                (Some(_), false) => {
                    let st = self
                        .staging
                        .as_ref()
                        .ok_or_else(|| Error::Unsupported("no staging buffer".into()))?;
                    Some(
                        st.f_narrow(0, off as i64, len as i64)
                            .ctx("slice staging", &l.unit)?,
                    )
                }
                _ => None,
            };
            {
                // SAFETY: master and grads are contiguous fp32 host tensors of the shard size owned
                // here; `dst` (direct) is this rank's contiguous 16-bit CPU slice of unit `u`, and
                // the staging slice a contiguous 16-bit host tensor; nothing else touches them
                // during the update.
                let (m, g) = unsafe {
                    (
                        slice_mut::<f32>(self.master.data_ptr(), off, len),
                        slice_mut::<f32>(self.grads.data_ptr(), off, len),
                    )
                };
                let out = match (half, &staged) {
                    (Some(kind), Some(st)) => {
                        Some((unsafe { slice_mut::<u16>(st.data_ptr(), 0, len) }, kind))
                    }
                    (Some(kind), None) => {
                        Some((unsafe { slice_mut::<u16>(dst.data_ptr(), 0, len) }, kind))
                    }
                    (None, _) => None,
                };
                self.adam.update(off, m, g, lr, grad_scale as f32, out)?;
            }
            match (half, staged) {
                (None, _) => {
                    let src = self
                        .master
                        .f_narrow(0, off as i64, len as i64)
                        .ctx("slice master", &l.unit)?;
                    dst.f_copy_(&src).ctx("write parameters", &l.unit)?;
                }
                (Some(_), Some(st)) => dst
                    .f_copy_(&st)
                    .ctx("copy parameters to the device", &l.unit)?,
                (Some(_), None) => {} // written in place
            }
        }
        Ok(())
    }
}

/// Whether offload applies at `stage` (stages 1-3 shard the optimizer state).
pub(crate) fn supported(stage: Stage) -> bool {
    stage != Stage::Zero0
}
