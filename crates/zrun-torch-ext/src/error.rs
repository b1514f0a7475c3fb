//! The crate's error type.

/// Everything that can go wrong in a call into the C++ shim.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tensor handed in holds no tensor at all (e.g. `Tensor::new()`).
    #[error("{op}: the tensor is undefined (e.g. Tensor::new()); pass a tensor that holds data")]
    Undefined {
        /// The call, with its arguments where they matter.
        op: String,
    },

    /// The shim refused the request before asking libtorch (the reason says why and what to do).
    #[error("{op}: refused: {reason}")]
    Refused {
        /// The call, with its arguments where they matter.
        op: String,
        /// Why, in libtorch's terms.
        reason: String,
    },

    /// libtorch raised a C++ exception; its message (without the C++ backtrace) is kept.
    #[error("{op}: libtorch raised: {message}")]
    Torch {
        /// The call, with its arguments where they matter.
        op: String,
        /// The exception's `what()`.
        message: String,
    },

    /// `grad` got a different number of outputs and output gradients.
    #[error(
        "grad: {outputs} outputs but {grad_outputs} grad_outputs; give exactly one gradient per output, of the output's shape"
    )]
    GradCount {
        /// Number of outputs.
        outputs: usize,
        /// Number of output gradients.
        grad_outputs: usize,
    },
}
