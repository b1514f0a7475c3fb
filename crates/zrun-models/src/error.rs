//! The crate's error type.

use tch::TchError;

/// Everything that can go wrong in `zrun-models`.
///
/// Messages name the unit, parameter, config field or op involved and say what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `preset` function was given a name it does not know.
    #[error("unknown model preset `{name}`; allowed presets: {allowed}")]
    UnknownPreset {
        /// The name that was asked for.
        name: String,
        /// Comma-separated list of the allowed names.
        allowed: String,
    },

    /// A `GptConfig` or `LlamaConfig` field has a value the architecture cannot use.
    #[error("invalid model config: `{field}` = {value}: {reason}")]
    InvalidConfig {
        /// The offending field (as in the config file's `[model]` table).
        field: &'static str,
        /// Its value, formatted.
        value: String,
        /// Why it is rejected and what would be accepted.
        reason: String,
    },

    /// `Unit::forward` got the wrong number of parameter tensors.
    #[error(
        "unit `{unit}`: forward got {got} parameter tensors, expected {expected} ({names}); \
         pass one tensor per `Unit::params()` entry, in that order"
    )]
    ParamCount {
        /// Unit name.
        unit: String,
        /// Number of parameters the unit declares.
        expected: usize,
        /// Number of tensors passed.
        got: usize,
        /// The declared parameter names, comma-separated.
        names: String,
    },

    /// A parameter tensor passed to `Unit::forward` has the wrong shape.
    #[error(
        "unit `{unit}`: parameter `{param}` has shape {got:?}, expected {expected:?}; \
         pass one tensor per `Unit::params()` entry, in that order"
    )]
    ParamShape {
        /// Unit name.
        unit: String,
        /// Full parameter name.
        param: String,
        /// Declared shape.
        expected: Vec<i64>,
        /// Shape of the tensor passed.
        got: Vec<i64>,
    },

    /// The activation / token input of a unit has the wrong shape or dtype.
    #[error("unit `{unit}`: input has shape {got:?} and dtype {kind}, expected {expected}")]
    Input {
        /// Unit name.
        unit: String,
        /// Description of the expected input.
        expected: String,
        /// Shape of the input passed.
        got: Vec<i64>,
        /// Dtype of the input passed.
        kind: String,
    },

    /// The input sequence is longer than the position table.
    #[error(
        "unit `{unit}`: input sequence length {got} exceeds the model's seq_len {max}; \
         shorten the sequences or raise `seq_len`"
    )]
    SeqTooLong {
        /// Unit name.
        unit: String,
        /// Sequence length of the input.
        got: i64,
        /// The model's `seq_len`.
        max: i64,
    },

    /// `lm_loss` inputs do not fit together.
    #[error(
        "lm_loss: logits {logits:?} ({logits_kind}) and targets {targets:?} ({targets_kind}) \
         do not fit: {reason}"
    )]
    LossInput {
        /// Shape of the logits.
        logits: Vec<i64>,
        /// Dtype of the logits.
        logits_kind: String,
        /// Shape of the targets.
        targets: Vec<i64>,
        /// Dtype of the targets.
        targets_kind: String,
        /// What is wrong.
        reason: String,
    },

    /// `Unit::forward_cached` was asked for positions that do not follow its cache.
    #[error(
        "unit `{unit}`: forward_cached of {t} tokens at position {pos} with {cached} positions \
         cached: {reason}"
    )]
    KvCache {
        /// Unit name.
        unit: String,
        /// First position asked for.
        pos: i64,
        /// Number of new tokens.
        t: i64,
        /// Positions already in the cache.
        cached: i64,
        /// What is wrong and what to do.
        reason: String,
    },

    /// A Hugging Face `config.json` key is missing or has a value zrun cannot use.
    #[error("Hugging Face config key `{key}`: {reason}")]
    HfConfig {
        /// The key, dotted for nested ones (`rope_scaling.factor`).
        key: String,
        /// What is wrong and what would be accepted.
        reason: String,
    },

    /// Something this model or unit does not do.
    #[error("{0}")]
    Unsupported(String),

    /// A libtorch call failed.
    #[error("libtorch op `{op}` failed in `{place}`: {source}")]
    Torch {
        /// Unit name, parameter name or function where it happened.
        place: String,
        /// The op that failed.
        op: &'static str,
        /// libtorch's message.
        #[source]
        source: TchError,
    },

    /// A call of zrun's libtorch shim failed (the chunked loss).
    #[error("`{place}`: {source}")]
    Shim {
        /// Unit or function where it happened.
        place: String,
        /// The shim's error, naming its op.
        #[source]
        source: zrun_torch_ext::Error,
    },
}

/// Shorthand for `Result<T, zrun_models::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach the place and op to a `TchError`.
pub(crate) trait TorchCtx<T> {
    /// Map a `TchError` to `Error::Torch` naming `place` and `op`.
    fn ctx(self, place: &str, op: &'static str) -> Result<T>;
}

impl<T> TorchCtx<T> for std::result::Result<T, TchError> {
    fn ctx(self, place: &str, op: &'static str) -> Result<T> {
        self.map_err(|source| Error::Torch {
            place: place.to_string(),
            op,
            source,
        })
    }
}
