//! Language-model loss.

use tch::{Kind, Reduction, Tensor};

use crate::error::{Error, Result, TorchCtx};

/// Logits per chunk of [`linear_lm_loss`] unless configured otherwise: 2^24 (64 MiB in fp32).
pub const LOSS_CHUNK: i64 = 1 << 24;

/// Targets equal to this value are ignored by [`lm_loss`] (PyTorch's default).
pub const IGNORE_INDEX: i64 = -100;

/// Mean token cross-entropy of logits (B, T, V) against targets (B, T) int64 -> scalar.
///
/// Computed in fp32 whatever the logits' dtype (bf16/fp16 logits are upcast first, as
/// autocast does), so the result is an fp32 scalar. Targets equal to [`IGNORE_INDEX`] are
/// left out of the mean.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (ls, ts) = (logits.size(), targets.size());
    let bad = |reason: &str| Error::LossInput {
        logits: ls.clone(),
        logits_kind: format!("{:?}", logits.kind()),
        targets: ts.clone(),
        targets_kind: format!("{:?}", targets.kind()),
        reason: reason.to_string(),
    };
    if ls.len() != 3 || !logits.is_floating_point() {
        return Err(bad("logits must be floating point (B, T, V)"));
    }
    if ts.len() != 2 || targets.kind() != Kind::Int64 {
        return Err(bad("targets must be int64 (B, T)"));
    }
    if ls[..2] != ts[..] {
        return Err(bad("the (B, T) of logits and targets differ"));
    }
    let p = "lm_loss";
    let logits = match logits.kind() {
        Kind::Float | Kind::Double => logits.shallow_clone(),
        _ => logits.f_to_kind(Kind::Float).ctx(p, "to_kind")?,
    };
    let flat = logits.f_reshape([-1, ls[2]]).ctx(p, "reshape")?; // (B*T, V)
    let tgt = targets.f_reshape([-1]).ctx(p, "reshape")?; // (B*T)
    flat.f_cross_entropy_loss(&tgt, None::<Tensor>, Reduction::Mean, IGNORE_INDEX, 0.0)
        .ctx(p, "cross_entropy_loss")
}

/// Mean token cross-entropy of the logits `h @ w^T` against `targets` (B, T) int64, computed
/// about `chunk` logits at a time, so the logits (B, T, V) are never held whole; equal to
/// [`lm_loss`] of those logits (see `zrun_torch_ext::linear_cross_entropy` for how).
///
/// `h` (B, T, C) is the head's last hidden state, `w` (V, C) its output matrix, of one
/// floating dtype. The loss is fp32 (fp64 for fp64 inputs), with an autograd graph to `h`
/// and `w` in grad mode.
pub fn linear_lm_loss(h: &Tensor, w: &Tensor, targets: &Tensor, chunk: i64) -> Result<Tensor> {
    let p = "linear_lm_loss";
    let (flat, tgt) = flat_rows(h, w, targets)?;
    zrun_torch_ext::linear_cross_entropy(&flat, w, &tgt, IGNORE_INDEX, chunk).map_err(|source| {
        Error::Shim {
            place: p.to_string(),
            source,
        }
    })
}

/// Mean token cross-entropy of the logits `h @ w^T` against `targets` (B, T), on the full
/// logits with their gradient made in the forward and written over them
/// (`zrun_torch_ext::fused_linear_cross_entropy`: one kernel per step on CUDA). `h` (B, T,
/// C) and `w` (V, C) are bf16 or fp32 ([`fused_loss_applies`]).
pub fn fused_lm_loss(h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let p = "fused_lm_loss";
    let (flat, tgt) = flat_rows(h, w, targets)?;
    zrun_torch_ext::fused_linear_cross_entropy(&flat, w, &tgt, IGNORE_INDEX).map_err(|source| {
        Error::Shim {
            place: p.to_string(),
            source,
        }
    })
}

/// Whether a head whose input is `x` takes [`fused_lm_loss`] on the full logits: on CUDA, in
/// bf16 or fp32 (fp16 needs its loss scale before the logits' gradient is rounded), unless
/// `ZRUN_FUSED_LOSS=0` is set (PyTorch's cross_entropy on fp32 logits then, as on CPU).
pub fn fused_loss_applies(x: &Tensor) -> bool {
    fused_loss_on(x.device().is_cuda(), x.kind())
}

/// [`fused_loss_applies`] for a device and a compute dtype, without a tensor.
pub fn fused_loss_on(cuda: bool, kind: Kind) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("ZRUN_FUSED_LOSS").is_ok_and(|v| v.trim() == "0"));
    cuda && matches!(kind, Kind::BFloat16 | Kind::Float) && !off
}

/// `h` (B, T, C) and `targets` (B, T) as rows (B*T, C) and (B*T), after checking them
/// against `w` (V, C).
fn flat_rows(h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let (hs, ws, ts) = (h.size(), w.size(), targets.size());
    let bad = |reason: &str| Error::LossInput {
        logits: [hs.first(), hs.get(1), ws.first()]
            .iter()
            .map(|d| d.copied().unwrap_or(0))
            .collect(),
        logits_kind: format!(
            "{:?}, from hidden states {hs:?} and a matrix {ws:?}",
            h.kind()
        ),
        targets: ts.clone(),
        targets_kind: format!("{:?}", targets.kind()),
        reason: reason.to_string(),
    };
    if ws.len() != 2 || hs.len() != 3 || hs[2] != ws[1] || !h.is_floating_point() {
        return Err(bad(
            "hidden states must be floating point (B, T, C) and the matrix (V, C)",
        ));
    }
    if ts.len() != 2 || targets.kind() != Kind::Int64 {
        return Err(bad("targets must be int64 (B, T)"));
    }
    if hs[..2] != ts[..] {
        return Err(bad("the (B, T) of logits and targets differ"));
    }
    let p = "loss rows";
    let flat = h.f_reshape([-1, hs[2]]).ctx(p, "reshape")?; // (B*T, C)
    let tgt = targets.f_reshape([-1]).ctx(p, "reshape")?; // (B*T)
    Ok((flat, tgt))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain-Rust reference: mean over tokens of logsumexp(row) - row[target], in f64.
    fn reference(logits: &[f32], targets: &[i64], v: usize) -> f64 {
        let mut sum = 0.0;
        let mut n = 0;
        for (row, &t) in logits.chunks(v).zip(targets) {
            if t == IGNORE_INDEX {
                continue;
            }
            let m = row
                .iter()
                .fold(f64::NEG_INFINITY, |a, &x| a.max(f64::from(x)));
            let lse = m + row
                .iter()
                .map(|&x| (f64::from(x) - m).exp())
                .sum::<f64>()
                .ln();
            sum += lse - f64::from(row[t as usize]);
            n += 1;
        }
        sum / n as f64
    }

    #[test]
    fn matches_independent_logsumexp() {
        tch::manual_seed(0);
        let (b, t, v) = (3i64, 5i64, 11i64);
        let logits = Tensor::randn([b, t, v], (Kind::Float, tch::Device::Cpu)) * 3.0;
        let targets = Tensor::randint(v, [b, t], (Kind::Int64, tch::Device::Cpu));
        let lv: Vec<f32> = Vec::try_from(logits.reshape([-1])).unwrap();
        let mut tv: Vec<i64> = Vec::try_from(targets.reshape([-1])).unwrap();
        let got = lm_loss(&logits, &targets).unwrap();
        assert_eq!(got.size(), Vec::<i64>::new(), "scalar");
        let want = reference(&lv, &tv, v as usize);
        assert!(
            (got.double_value(&[]) - want).abs() < 1e-6,
            "{got} vs {want}"
        );

        // Ignored targets drop out of the mean.
        tv[0] = IGNORE_INDEX;
        tv[7] = IGNORE_INDEX;
        let targets = Tensor::from_slice(&tv).reshape([b, t]);
        let got = lm_loss(&logits, &targets).unwrap().double_value(&[]);
        let want = reference(&lv, &tv, v as usize);
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn bf16_logits_give_fp32_loss() {
        tch::manual_seed(1);
        let logits = Tensor::randn([2, 4, 9], (Kind::Float, tch::Device::Cpu));
        let targets = Tensor::randint(9, [2, 4], (Kind::Int64, tch::Device::Cpu));
        let low = logits.to_kind(Kind::BFloat16);
        let got = lm_loss(&low, &targets).unwrap();
        assert_eq!(got.kind(), Kind::Float);
        // Exactly the fp32 loss of the bf16-rounded logits.
        let want = lm_loss(&low.to_kind(Kind::Float), &targets).unwrap();
        assert_eq!(got.double_value(&[]), want.double_value(&[]));
    }

    #[test]
    fn rejects_mismatched_inputs() {
        let opt = (Kind::Float, tch::Device::Cpu);
        let logits = Tensor::zeros([2, 4, 9], opt);
        let t_ok = Tensor::zeros([2, 4], (Kind::Int64, tch::Device::Cpu));
        assert!(lm_loss(
            &logits,
            &Tensor::zeros([2, 5], (Kind::Int64, tch::Device::Cpu))
        )
        .is_err());
        assert!(lm_loss(&logits, &Tensor::zeros([2, 4], opt)).is_err());
        assert!(lm_loss(&Tensor::zeros([8, 9], opt), &t_ok).is_err());
        let msg = lm_loss(&logits, &t_ok.reshape([8]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("[2, 4, 9]") && msg.contains("[8]"), "{msg}");
    }
}
