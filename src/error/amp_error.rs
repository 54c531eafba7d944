//! [`AmpError`]: one variant per thing a caller can do about a failure.
use std::path::PathBuf;

use tch::TchError;

use super::{ConfigError, Divergence, OpRefused, StateError, UsageError};
use crate::torch_io::TorchIoError;

/// Everything that can go wrong in tch-amp, grouped by what the caller can do about it: fix
/// the set-up ([`AmpError::Config`]), fix the training loop ([`AmpError::Usage`]), change an
/// op the O1 policy refuses ([`AmpError::OpRefused`]), stop or restart a run that diverged
/// ([`AmpError::Diverged`]), pick another checkpoint or state ([`AmpError::State`]), or look
/// at the file system or the file ([`AmpError::Io`], [`AmpError::File`]), at the other ranks
/// of a process group ([`AmpError::Distributed`]) or at libtorch ([`AmpError::Torch`]).
///
/// Messages are one line and name the remedy; each variant's docs explain more.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// The set-up is not valid: an opt level, option, cast list, parameter group or variable
    /// name. Returned by `initialize`, the builders and the optimizer factories before
    /// anything changes. Fix the configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A call the training loop made out of order or with arguments that cannot work (a loss
    /// that is not a scalar, an optimizer of another `Amp`, `step()` twice, ...). Nothing was
    /// changed. Fix the loop.
    #[error(transparent)]
    Usage(#[from] UsageError),
    /// The O1 cast policy refused an op (a banned op on fp16/bf16 inputs, or an fp32-list op
    /// in place on a low-precision tensor). Change the model's op, or the policy's settings.
    #[error(transparent)]
    OpRefused(#[from] OpRefused),
    /// Training diverged: the loss scaler collapsed at its floor. The step was skipped; look
    /// at the data, the loss and the learning rate, or restart from a checkpoint.
    #[error(transparent)]
    Diverged(#[from] Divergence),
    /// A checkpoint or state dict that does not fit what it is loaded into, or that is
    /// corrupt. Nothing was loaded.
    #[error(transparent)]
    State(#[from] StateError),
    /// Reading or writing a file failed. When writing, any previous file at `path` is intact
    /// and no temporary file is left behind.
    #[error("cannot {} {path}: {source}", verb(.writing))]
    Io {
        /// The file.
        path: PathBuf,
        /// Whether the file was being written (else read).
        writing: bool,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A `torch.save` file could not be read or written: the file system, or bytes that are
    /// not a file torch writes (the message names the place in the file). Nothing was loaded;
    /// a failed save leaves any previous file in place.
    #[error(transparent)]
    File(#[from] TorchIoError),
    /// A collective of a sharded optimizer failed (a peer died, timed out or called collectives
    /// in another order): the [`DistError`](crate::distributed::DistError) says which. `?` into a
    /// function returning `DistError` gives it back unwrapped, so
    /// [`DistError::is_peer_failure`](crate::distributed::DistError::is_peer_failure) sees it.
    #[error(transparent)]
    Distributed(Box<crate::distributed::DistError>),
    /// libtorch failed: an exception from a tch call or from tch-amp's C++ shim, a `VarStore`
    /// lock poisoned by a panic in another thread, or more tensors than one shim call can
    /// carry. The message is libtorch's (or says which limit).
    #[error("libtorch error while {context}: {source}")]
    Torch {
        /// What tch-amp was doing.
        context: &'static str,
        /// The error, as tch reports it.
        #[source]
        source: TchError,
    },
}

fn verb(writing: &bool) -> &'static str {
    if *writing {
        "write"
    } else {
        "read"
    }
}

/// `Result` with [`AmpError`].
pub type Result<T, E = AmpError> = std::result::Result<T, E>;

impl AmpError {
    /// [`AmpError::Torch`] for a failure found outside tch (the shim's C++ exceptions, a
    /// poisoned lock, a limit of the C interface), with `message` as tch's `Torch` error.
    pub(crate) fn torch(context: &'static str, message: impl Into<String>) -> Self {
        AmpError::Torch { context, source: TchError::Torch(message.into()) }
    }

    /// [`AmpError::Io`] for a failed read of `path`.
    pub(crate) fn read(path: &std::path::Path, source: std::io::Error) -> Self {
        AmpError::Io { path: path.to_path_buf(), writing: false, source }
    }

    /// [`AmpError::Io`] for a failed write of `path`.
    pub(crate) fn write(path: &std::path::Path, source: std::io::Error) -> Self {
        AmpError::Io { path: path.to_path_buf(), writing: true, source }
    }
}

/// Attaches a context to tch's errors.
pub(crate) trait TorchContext<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, TchError> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| AmpError::Torch { context, source })
    }
}

/// [`StateError::StateMismatch`] with `message`.
pub(crate) fn mismatch(message: impl Into<String>) -> AmpError {
    AmpError::State(StateError::StateMismatch { message: message.into() })
}

/// A tch error from a fallible call (`f_*`), in tch-amp or in user code that returns tch-amp's
/// `Result` (an [`crate::UpdateRule`]: `param.f_mul_(..)?`).
impl From<TchError> for AmpError {
    fn from(source: TchError) -> Self {
        AmpError::Torch { context: "a tch call", source }
    }
}

/// A failed collective; a `DistError` that carries an `AmpError` gives that error back.
impl From<crate::distributed::DistError> for AmpError {
    fn from(e: crate::distributed::DistError) -> Self {
        match e {
            crate::distributed::DistError::Amp { source } => source,
            other => AmpError::Distributed(Box::new(other)),
        }
    }
}

impl From<crate::config::ParseOptLevelError> for AmpError {
    fn from(e: crate::config::ParseOptLevelError) -> Self {
        AmpError::Config(ConfigError::UnknownOptLevel { name: e.name().to_string() })
    }
}
