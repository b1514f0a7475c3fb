//! What a unit's forward leaves in memory for its backward, counted from the ops it runs, so
//! memory can be estimated before anything is allocated.

/// Bytes of one unit's activations for a micro-batch of `b` sequences of `t` tokens.
///
/// Counts follow what libtorch's autograd keeps: each op saves the tensors its backward
/// reads (a linear its input, GELU its input, LayerNorm its input plus fp32 mean and rstd,
/// CPU/flash SDPA its q, k, v (views of the qkv output), its output and an fp32 logsumexp).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Activations {
    /// The unit's output: the next unit's input, or the logits of the head.
    pub output: i64,
    /// Kept by autograd between forward and backward, besides the input and output.
    pub saved: i64,
    /// The most the forward allocates at once beyond `saved` and `output` (temporaries
    /// freed before it returns; all of a checkpointed forward's intermediates but the largest
    /// pair are freed as it goes).
    pub forward_temp: i64,
    /// The most the backward allocates at once beyond the saved tensors, not counting the
    /// parameter gradients: the gradients of intermediate tensors.
    pub backward_temp: i64,
    /// The most a forward without autograd (evaluation, or the first forward of a
    /// checkpointed unit) holds at once beyond its input and output.
    pub no_grad_temp: i64,
}

/// The loss on logits (B, T, V): fp32 log-probabilities kept for the backward, the fp32 copy
/// of 16-bit logits made on the way, and the backward's gradients of both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LossBytes {
    /// fp32 log-probabilities kept for the backward.
    pub saved: i64,
    /// Alive at once while the loss is computed (the fp32 copy of 16-bit logits).
    pub forward_temp: i64,
    /// Gradients of the log-probabilities and of the logits, alive at once in the backward.
    pub backward_temp: i64,
}

impl LossBytes {
    /// For `tokens` positions over a vocabulary of `v` from hidden states of width `c`, the
    /// head's matmul and the loss computed `chunk` logits at a time (as
    /// `zrun_torch_ext::linear_cross_entropy` splits them: rows of the logits in the forward,
    /// columns in the backward). Nothing of the logits outlives the loss but each row's fp32
    /// logsumexp; a chunk's logits exist in the compute dtype and fp32 at once; with 16-bit
    /// logits the backward also sums the input's gradient in fp32.
    pub fn chunked(tokens: i64, v: i64, c: i64, elt: i64, chunk: i64) -> LossBytes {
        let piece = |other: i64, len: i64| {
            let mut n = (chunk / other.max(1)).max(1);
            if n >= 64 {
                n -= n % 64;
            }
            n.min(len.max(1))
        };
        let rows = piece(v, tokens);
        let cols = piece(tokens, v);
        let with_copy = if elt == 4 { 4 } else { 4 + elt };
        // Per row: the valid mask (bool), the target with ignored rows zeroed (int64), the
        // logsumexp (fp32).
        let per_row = tokens * (1 + 8 + 4);
        LossBytes {
            saved: per_row,
            forward_temp: rows * v * with_copy,
            // A chunk's logits, a few numbers per row (weight, one-hot column, hit), and with
            // 16-bit logits the fp32 sum of the input's gradient (in fp32 the sum is the
            // gradient itself, which the head's backward counts).
            backward_temp: tokens * cols * with_copy
                + tokens * 32
                + tokens * c * if elt == 4 { 0 } else { 4 },
        }
    }

    /// For `tokens` positions over a vocabulary of `v`, with logits of `elt` bytes, through
    /// `zrun_torch_ext::fused_linear_cross_entropy` with its CUDA kernel: the logits are the
    /// only (N, V) tensor, made by the head's matmul and overwritten by their gradient, kept
    /// for the backward; the forward holds a few numbers per row beside them (the valid mask,
    /// the targets with ignored rows zeroed, each row's weight and loss); the backward's two
    /// matmuls write straight into the gradients.
    pub fn fused(tokens: i64, v: i64, elt: i64) -> LossBytes {
        LossBytes {
            saved: tokens * v * elt,
            forward_temp: tokens * (1 + 8 + 4 + 4),
            backward_temp: 0,
        }
    }

    /// For `tokens` positions over a vocabulary of `v`, with logits of `elt` bytes.
    pub fn new(tokens: i64, v: i64, elt: i64) -> LossBytes {
        let fp32 = 4 * tokens * v;
        let copy = if elt == 4 { 0 } else { fp32 };
        LossBytes {
            saved: fp32,
            forward_temp: copy,
            // d(log-probs) and d(logits) in fp32, then d(logits) in the compute dtype.
            backward_temp: 2 * fp32 + if elt == 4 { 0 } else { tokens * v * elt },
        }
    }
}
