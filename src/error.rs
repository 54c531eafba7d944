//! The crate's one error type.
use tch::{Kind, TchError};

use crate::opt_level::OptLevel;

/// Everything that can go wrong in tch-amp. Messages say what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// A libtorch call made through tch failed.
    #[error("libtorch error while {context}: {source}")]
    Torch {
        /// What tch-amp was doing.
        context: &'static str,
        /// tch's error.
        #[source]
        source: TchError,
    },
    /// A C++ exception caught in tch-amp's shim (the message is libtorch's).
    #[error("{what}: {message}")]
    Shim {
        /// The shim function that failed.
        what: &'static str,
        /// The C++ exception's message.
        message: String,
    },
    /// An opt level name that is not O0, O1, O2 or O3.
    #[error("unknown opt level {name:?}: expected \"O0\", \"O1\", \"O2\" or \"O3\" (the letter O, not the number zero)")]
    UnknownOptLevel {
        /// What was given.
        name: String,
    },
    /// An option that Apex rejects at this opt level.
    #[error("{option} cannot be set under {level}: {why}")]
    IncompatibleOption {
        /// The opt level.
        level: OptLevel,
        /// The option's name as in Apex's `amp.initialize`.
        option: &'static str,
        /// Why, and what to do instead.
        why: &'static str,
    },
    /// An option value that cannot be parsed or is out of range.
    #[error("invalid value {value:?} for {option}: {expected}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// What was given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A data file (opt level table, cast lists, state dict) that does not parse.
    #[error("cannot parse {what}: {message}")]
    Parse {
        /// What was being parsed.
        what: String,
        /// The parser's message.
        message: String,
    },
    /// A loss id outside `0..num_losses`.
    #[error("loss_id {loss_id} is out of range: initialize was given num_losses = {num_losses}")]
    LossIdOutOfRange {
        /// The id given.
        loss_id: usize,
        /// How many losses (and scalers) there are.
        num_losses: usize,
    },
    /// A tensor of an unexpected dtype.
    #[error("{name} has dtype {found:?}, expected {expected}")]
    DtypeMismatch {
        /// The variable or argument.
        name: String,
        /// What was expected, in words.
        expected: &'static str,
        /// What was found.
        found: Kind,
    },
    /// A state dict or checkpoint that does not match what it is loaded into; nothing was changed.
    #[error("state does not match: {message}; nothing was loaded")]
    StateMismatch {
        /// What differs.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An aten operator name that the dispatcher does not know.
    #[error("unknown aten op {name:?}: {message}")]
    UnknownOp {
        /// The name given.
        name: String,
        /// libtorch's message.
        message: String,
    },
    /// An op on O1's banned list (binary_cross_entropy) was called with fp16/bf16 inputs.
    #[error(
        "{op} is banned under O1 on fp16/bf16 inputs (its log saturates where a low-precision sigmoid \
         rounds to 0 or 1): pass the logits to binary_cross_entropy_with_logits (BCEWithLogitsLoss) \
         instead, or set O1Settings::allow_banned to run {op} in fp32"
    )]
    BannedOp {
        /// The aten op (`"binary_cross_entropy"`).
        op: String,
    },
    /// An op on O1's fp32 list was called in place on an fp16/bf16 tensor (Apex's in-place rule).
    #[error(
        "{op} cannot run in place on a {dtype:?} tensor under O1: the op is on the fp32 list, so its \
         result cannot be written back in low precision; call the out-of-place op, or cast the tensor \
         to fp32 first"
    )]
    InPlaceFp32OnHalf {
        /// The in-place aten op (`"exp_"`).
        op: String,
        /// The tensor's dtype.
        dtype: Kind,
    },
    /// Something the caller must do first (or must not do twice).
    #[error("{0}")]
    Usage(String),
}

/// `Result` with [`AmpError`].
pub type Result<T, E = AmpError> = std::result::Result<T, E>;

/// Attaches a context to tch's errors.
pub(crate) trait TorchContext<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, TchError> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| AmpError::Torch { context, source })
    }
}
