//! The errors of distributed training. A peer that never shows up, stops answering or dies
//! surfaces here within the process group's timeout, never as a hang.
use std::time::Duration;

use tch::TchError;

use crate::error::AmpError;

/// Everything that can go wrong in [`crate::distributed`]. Messages say what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// An environment variable torchrun sets is missing.
    #[error(
        "environment variable {var} is not set: launch with torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, \
         MASTER_ADDR and MASTER_PORT), or call ProcessGroup::init with explicit InitOptions"
    )]
    MissingEnv {
        /// The variable.
        var: &'static str,
    },
    /// An environment variable that does not parse.
    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// An option value out of range.
    #[error("invalid value {value} for {option}: expected {expected}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// What was given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// The rendezvous (TCPStore, then the backend's connections) did not complete. Start every
    /// rank with the same `MASTER_ADDR`, `MASTER_PORT` and `WORLD_SIZE`, each with its own
    /// `RANK`, and make sure the port is free on rank 0.
    #[error(
        "rendezvous of rank {rank}/{world_size} at {addr}:{port} failed after {elapsed:?} (timeout {timeout:?} per \
         stage): {message}; check MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK on every rank"
    )]
    Rendezvous {
        /// MASTER_ADDR.
        addr: String,
        /// MASTER_PORT.
        port: u16,
        /// This process's rank.
        rank: usize,
        /// The group size expected.
        world_size: usize,
        /// The timeout in force. It bounds each stage of the rendezvous (the store's wait for
        /// every rank, then each of the backend's connection attempts), so a rendezvous that
        /// cannot complete (a WORLD_SIZE that differs between ranks, say) fails after a few
        /// times the timeout, as torch's does.
        timeout: Duration,
        /// How long it ran before failing.
        elapsed: Duration,
        /// libtorch's message.
        message: String,
    },
    /// A collective did not complete within the timeout.
    #[error(
        "{op} timed out after {timeout:?}: {message}; a peer is dead, stuck, or calling collectives in a \
         different order (every rank must make the same calls in the same order)"
    )]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The timeout in force.
        timeout: Duration,
        /// libtorch's message.
        message: String,
    },
    /// A peer closed its connection in the middle of a collective (it died or exited).
    #[error("{op} failed because a peer closed its connection: {message}; look at the other ranks' logs")]
    PeerLost {
        /// The operation.
        op: &'static str,
        /// libtorch's message.
        message: String,
    },
    /// A collective failed for another reason (mismatched shapes, dtypes, ...).
    #[error("{op} failed: {message}")]
    Collective {
        /// The operation.
        op: &'static str,
        /// libtorch's message.
        message: String,
    },
    /// Something this build or this backend cannot do.
    #[error("{what} is not supported: {message}")]
    Unsupported {
        /// The feature.
        what: &'static str,
        /// Why, and what to do instead.
        message: String,
    },
    /// A libtorch call made through tch failed.
    #[error("libtorch error while {context}: {source}")]
    Torch {
        /// What was being done.
        context: &'static str,
        /// tch's error.
        #[source]
        source: TchError,
    },
    /// An AMP operation (checkpoint save or load, a step) failed.
    #[error("{source}")]
    Amp {
        /// The AMP error.
        #[source]
        source: AmpError,
    },
    /// Another rank reported a failure of a step all ranks take together.
    #[error("rank {rank} failed to {what}; this rank stops too (see rank {rank}'s error)")]
    RemoteFailure {
        /// The rank that failed.
        rank: usize,
        /// What it failed to do.
        what: &'static str,
    },
    /// Something the caller must do first (or must not do).
    #[error("{message}")]
    Usage {
        /// What is wrong and what to do.
        message: String,
    },
}

/// An AMP error; one that carries a failed collective ([`AmpError::Distributed`], from a sharded
/// optimizer's step) gives that collective's error back.
impl From<AmpError> for DistError {
    fn from(e: AmpError) -> Self {
        match e {
            AmpError::Distributed(d) => *d,
            source => DistError::Amp { source },
        }
    }
}

/// `Result` with [`DistError`].
pub type Result<T, E = DistError> = std::result::Result<T, E>;

impl DistError {
    /// True for errors that mean a peer is gone or unresponsive ([`DistError::Timeout`],
    /// [`DistError::PeerLost`]).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, DistError::Timeout { .. } | DistError::PeerLost { .. })
    }

    /// Classifies a message from the shim: the c10d tag ("[store] ", "[network] ", ...) and
    /// gloo's wording tell a timeout from a lost peer.
    pub(crate) fn from_shim(op: &'static str, timeout: Duration, message: String) -> Self {
        let lower = message.to_ascii_lowercase();
        if let Some(rest) = message.strip_prefix("[unsupported] ") {
            return DistError::Unsupported { what: op, message: rest.to_string() };
        }
        let lost = ["closed by peer", "reset by peer", "broken pipe", "connection closed", "connection refused", "eof"];
        if lost.iter().any(|p| lower.contains(p)) {
            return DistError::PeerLost { op, message };
        }
        if lower.contains("timed out") || lower.contains("timeout") {
            return DistError::Timeout { op, timeout, message };
        }
        DistError::Collective { op, message }
    }
}

/// Attaches a context to tch's errors.
pub(crate) trait TorchContext<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, TchError> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| DistError::Torch { context, source })
    }
}
