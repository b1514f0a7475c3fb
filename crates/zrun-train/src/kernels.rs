//! zrun's own CUDA kernels (`zrun_torch_ext::kernels`: the fused loss's rows, SwiGLU, the
//! rotary embedding, the sums over rows of bias and LayerNorm gradients, the optimizer's AdamW
//! and gradient layout) made ready when a rank starts on a GPU.

use crate::config::Config;

/// On a GPU, unless `ZRUN_KERNELS=0`: compiles zrun's CUDA kernels, checks each against
/// ATen's ops on the device and registers them. Rank 0 logs it and which loss runs; every
/// rank warns when they could not be installed, and the same arithmetic then runs through
/// ATen's ops (slower; the fused loss's rows with fp32 blocks of 2^24 logits beside the
/// logits, which the estimate does not count).
pub fn install(cfg: &Config, device: tch::Device, rank: usize) {
    let tch::Device::Cuda(index) = device else {
        return;
    };
    let kind = cfg.zero.precision.kind();
    let fused = cfg.train.loss_chunk() == 0 && zrun_models::fused_loss_on(true, kind);
    if rank == 0 && cfg.train.loss_chunk() == 0 {
        if fused {
            tracing::info!("loss: fused on the full logits, their gradient made in the forward (ZRUN_FUSED_LOSS=0: PyTorch's cross_entropy)");
        } else {
            tracing::info!(
                "loss: PyTorch's cross_entropy on the full logits in fp32 ({})",
                if kind == tch::Kind::Half {
                    "fp16 compute"
                } else {
                    "ZRUN_FUSED_LOSS=0"
                }
            );
        }
    }
    if std::env::var("ZRUN_KERNELS").is_ok_and(|v| v.trim() == "0") {
        if rank == 0 {
            tracing::info!("zrun's CUDA kernels: off (ZRUN_KERNELS=0), ATen's ops instead");
        }
        return;
    }
    let t0 = std::time::Instant::now();
    match zrun_torch_ext::kernels::install(index) {
        Ok(installed) => {
            if rank == 0 {
                tracing::info!(
                    "zrun's CUDA kernels (the fused loss's rows, SwiGLU, rotary embedding, sums over rows{}): compiled with NVRTC and checked against ATen in {:.2} s (ZRUN_KERNELS=0 turns them off)",
                    if installed.optimizer_left_out.is_none() {
                        ", AdamW with the bf16 parameters, gradient layout"
                    } else {
                        ""
                    },
                    t0.elapsed().as_secs_f64()
                );
            }
            if let Some(e) = installed.optimizer_left_out {
                tracing::warn!(
                    "rank {rank}: zrun's optimizer kernels are not installed ({e}); ATen's fused AdamW and copies run instead (slower)"
                );
            }
        }
        Err(e) => tracing::warn!(
            "rank {rank}: zrun's CUDA kernels are not installed ({e}); ATen's ops run instead (slower)"
        ),
    }
}
