//! The host optimizer's long-lived buffers (the fp32 master shard, the fp32 gradient staging,
//! the 16-bit parameter staging) and the host bytes they hold.
//!
//! With CUDA they are pinned, allocated pinned (never pageable first and pinned after: that
//! would hold them twice), and of exactly their size ([`zrun_torch_ext::empty_pinned_exact`]):
//! libtorch's caching host allocator would round each up to a power of two bytes, 32 GiB for
//! the 29.9 GiB fp32 shard of an 8B model on one rank. Where the exact allocation fails they
//! come from that allocator after all, with a warning that names the bytes it adds, and the
//! engine reports what they hold.

use crate::{Context, Error, Result};
use std::sync::Once;
use tch::{Device, Kind, Tensor};

/// Allocates the host optimizer's long-lived buffers and counts what they hold.
#[derive(Default)]
pub(super) struct HostBuffers {
    /// Bytes asked for.
    asked: i64,
    /// Bytes held: more than asked where a buffer came from the caching host allocator.
    held: i64,
    /// Why the exact pinned allocation failed, the first time it did.
    refused: Option<String>,
}

/// The fallback's warning, once per process.
static WARNED: Once = Once::new();

impl HostBuffers {
    /// A zeroed host buffer of `numel` elements of `kind`, pinned and of exactly that size
    /// when `device` is CUDA (else, or where that fails, see the module's doc), and the host
    /// bytes it holds.
    pub(super) fn zeros(
        &mut self,
        numel: i64,
        kind: Kind,
        device: Device,
    ) -> Result<(Tensor, i64)> {
        let bytes = numel * kind.elt_size_in_bytes() as i64;
        self.asked += bytes;
        if !device.is_cuda() {
            self.held += bytes;
            let t =
                Tensor::f_zeros([numel], (kind, Device::Cpu)).ctx("allocate host buffer", "-")?;
            return Ok((t, bytes));
        }
        // libtorch must see the memory as pinned, or its non-blocking copies would block.
        let exact = zrun_torch_ext::empty_pinned_exact(numel, kind).and_then(|t| {
            match t.f_is_pinned(device) {
                Ok(true) => Ok(t),
                seen => Err(zrun_torch_ext::Error::Refused {
                    op: "empty_pinned_exact".into(),
                    reason: format!("libtorch does not see its memory as pinned ({seen:?})"),
                }),
            }
        });
        let (mut t, held) = match exact {
            Ok(t) => (t, bytes),
            Err(exact) => {
                let t = zrun_torch_ext::empty_pinned(numel, kind).map_err(|e| {
                    Error::Unsupported(format!(
                        "allocate {numel} elements of {kind:?} in pinned host memory: of the \
                         exact size: {exact}; through libtorch's caching host allocator: {e}"
                    ))
                })?;
                self.refused.get_or_insert_with(|| exact.to_string());
                (t, zrun_torch_ext::pinned_bytes(bytes))
            }
        };
        self.held += held;
        let t = t.f_zero_().ctx("zero pinned host buffer", "-")?;
        Ok((t, held))
    }

    /// Warns, once per process, where the buffers hold more than asked.
    pub(super) fn warn_if_rounded(&self) {
        let Some(why) = &self.refused else {
            return;
        };
        let gib = |b: i64| b as f64 / (1u64 << 30) as f64;
        WARNED.call_once(|| {
            tracing::warn!(
                "pinned buffers of the host optimizer fell back to libtorch's caching host \
                 allocator, which rounds each up to a power of two bytes: {:.2} GiB held for \
                 {:.2} GiB of buffers, {:.2} GiB ({} bytes) more than needed, because pinned \
                 memory of the exact size could not be allocated: {why}",
                gib(self.held),
                gib(self.asked),
                gib(self.held - self.asked),
                self.held - self.asked
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        estimate, EstimateConfig, Offload, Precision, ReduceDtype, ShardLayout, Stage, StateDtype,
    };
    use zrun_models::{Gpt, GptConfig, Model};

    /// With CUDA and the optimizer offloaded, the estimate's host memory is the buffers'
    /// exact bytes: master, moments, gradient staging and 16-bit staging, none rounded up.
    #[test]
    fn offloaded_host_bytes_on_cuda_are_exact() -> Result<()> {
        let m = Gpt::new(GptConfig {
            vocab_size: 96,
            seq_len: 8,
            n_layer: 3,
            n_head: 4,
            d_model: 64,
            init_std: 0.02,
            tied: false,
        })
        .map_err(|e| Error::Unsupported(e.to_string()))?;
        let layout = ShardLayout::new(m.units(), 0, 1);
        let shard = layout.shard_numel();
        assert!(
            !(4 * shard as u64).is_power_of_two(),
            "a shard whose fp32 bytes are a power of two would not tell rounding apart"
        );
        let cfg = EstimateConfig {
            stage: Stage::Zero3,
            precision: Precision::Bf16,
            reduce_dtype: ReduceDtype::Fp32,
            offload: Offload::Cpu,
            state_dtype: StateDtype::Bf16,
            activation_checkpointing: false,
            prefetch: 1,
            micro_batch: 1,
            seq_len: 8,
            eval_batch: 1,
            cuda: true,
            oom_recovery: false,
            one_micro_step: true,
            offload_delay_fresh: false,
            offload_delay: false,
            loss_chunk: 0,
            host_grads: false,
            tied: false,
        };
        // fp32 master 4, bf16 m and v 2 + 2, fp32 gradient staging 4, bf16 staging 2.
        let e = estimate(&m, &layout, &cfg);
        assert_eq!(e.ledger.host, (4 + 4) * shard);
        assert_eq!(e.host_bytes, (4 + 4 + 4 + 2) * shard);
        // fp32 moments: 4 + 4 more.
        let fp32 = EstimateConfig {
            state_dtype: StateDtype::Fp32,
            ..cfg
        };
        assert_eq!(
            estimate(&m, &layout, &fp32).host_bytes,
            (4 + 8 + 4 + 2) * shard
        );
        Ok(())
    }

    /// Buffers are zeroed and hold exactly their bytes: ordinary host memory without CUDA,
    /// pinned with it.
    #[test]
    fn buffers_are_zeroed_and_counted_exactly() -> Result<()> {
        let mut b = HostBuffers::default();
        let (t, held) = b.zeros(1001, Kind::BFloat16, Device::Cpu)?;
        assert_eq!(held, 2002);
        assert_eq!(t.abs().sum(Kind::Double).double_value(&[]), 0.0);
        let (_, held) = b.zeros(5, Kind::Float, Device::Cpu)?;
        assert_eq!(
            (held, b.asked, b.held, b.refused.is_none()),
            (20, 2022, 2022, true)
        );
        b.warn_if_rounded(); // nothing to warn about
        if tch::Cuda::is_available() {
            let dev = Device::Cuda(0);
            let (t, held) = b.zeros(1001, Kind::BFloat16, dev)?;
            assert!(t.is_pinned(dev));
            assert_eq!((held, b.held - b.asked), (2002, 0), "{:?}", b.refused);
        }
        Ok(())
    }
}
