//! The process group: rendezvous from torchrun's environment or explicit options, and the
//! collectives on tch tensors.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::error::{DistError, Result};
use super::sys;

/// torch.distributed's default timeout for Gloo (`default_pg_timeout`, 30 minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The communication backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Backend {
    /// Gloo: CPU tensors (and CUDA tensors checked through the host).
    #[default]
    Gloo,
    /// NCCL: CUDA tensors. Needs a build with the `nccl` feature.
    Nccl,
}

impl Backend {
    /// The name torch.distributed uses (`"gloo"`, `"nccl"`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }

    /// Whether this build can create the backend (Gloo always; NCCL with the `nccl` feature).
    pub fn is_available(self) -> bool {
        match self {
            Backend::Gloo => true,
            Backend::Nccl => sys::has_nccl(),
        }
    }
}

/// A reduction of [`ProcessGroup::all_reduce_`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise mean over the ranks (sum, then division by the world size; floating tensors
    /// only). Gloo has no native average, so it is computed this way, as Apex DDP does.
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Elementwise product.
    Product,
}

impl ReduceOp {
    fn code(self) -> i32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Product => 4,
        }
    }
}

/// How to join a process group: torch.distributed's `init_process_group(backend, rank=...,
/// world_size=..., init_method="tcp://addr:port", timeout=...)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitOptions {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank within this machine (torchrun's LOCAL_RANK; selects the CUDA device under NCCL).
    pub local_rank: Option<usize>,
    /// Address of the TCPStore (rank 0's host, or torchrun's agent).
    pub master_addr: String,
    /// Port of the TCPStore.
    pub master_port: u16,
    /// Bound on the rendezvous and on every collective.
    pub timeout: Duration,
    /// Gloo or NCCL.
    pub backend: Backend,
    /// Whether this process hosts the TCPStore. `None`: rank 0 does, unless torchrun's agent
    /// hosts it (`TORCHELASTIC_USE_AGENT_STORE=True`), as torch.distributed decides.
    pub host_store: Option<bool>,
}

impl InitOptions {
    /// Explicit rank, size and address; Gloo, [`DEFAULT_TIMEOUT`].
    pub fn new(rank: usize, world_size: usize, master_addr: impl Into<String>, master_port: u16) -> Self {
        Self {
            rank,
            world_size,
            local_rank: None,
            master_addr: master_addr.into(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
            backend: Backend::Gloo,
            host_store: None,
        }
    }

    /// torchrun's environment (`env://`): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and
    /// LOCAL_RANK and TORCHELASTIC_USE_AGENT_STORE when set.
    ///
    /// # Errors
    /// [`DistError::MissingEnv`] / [`DistError::InvalidEnv`].
    pub fn from_env() -> Result<Self> {
        fn var(name: &'static str) -> Result<String> {
            std::env::var(name).map_err(|_| DistError::MissingEnv { var: name })
        }
        fn parse<T: std::str::FromStr>(name: &'static str, v: String, expected: &'static str) -> Result<T> {
            v.trim().parse().map_err(|_| DistError::InvalidEnv { var: name, value: v, expected })
        }
        let rank: usize = parse("RANK", var("RANK")?, "a non-negative integer")?;
        let world_size: usize = parse("WORLD_SIZE", var("WORLD_SIZE")?, "a positive integer")?;
        let master_port: u16 = parse("MASTER_PORT", var("MASTER_PORT")?, "a port number (0-65535)")?;
        let master_addr = var("MASTER_ADDR")?;
        let local_rank = match std::env::var("LOCAL_RANK") {
            Ok(v) => Some(parse("LOCAL_RANK", v, "a non-negative integer")?),
            Err(_) => None,
        };
        let agent_store = std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v == "True");
        let mut o = Self::new(rank, world_size, master_addr, master_port);
        o.local_rank = local_rank;
        if agent_store {
            o.host_store = Some(false);
        }
        Ok(o)
    }

    /// Sets the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the backend.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    fn check(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(DistError::InvalidOption { option: "world_size", value: "0".into(), expected: "at least 1" });
        }
        if self.rank >= self.world_size {
            return Err(DistError::InvalidOption {
                option: "rank",
                value: self.rank.to_string(),
                expected: "a rank below world_size",
            });
        }
        if self.timeout.is_zero() {
            return Err(DistError::InvalidOption {
                option: "timeout",
                value: format!("{:?}", self.timeout),
                expected: "a positive duration",
            });
        }
        if !self.backend.is_available() {
            return Err(DistError::Unsupported {
                what: "the NCCL backend",
                message: "this tch-amp was built without it: rebuild with `--features nccl`, or use Backend::Gloo"
                    .into(),
            });
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Inner {
    handle: sys::PgHandle,
    rank: usize,
    world_size: usize,
    local_rank: Option<usize>,
    backend: Backend,
    timeout: Mutex<Duration>,
}

/// A c10d process group (libtorch's own engine: TCPStore rendezvous, a Gloo or NCCL backend).
/// Cheap to clone (shared). Every rank must issue the same collectives in the same order.
///
/// The rendezvous uses the store keys of `torch.distributed.init_process_group` for the
/// default group, so a Python process running torch 2.13 can be one of the ranks.
#[derive(Debug, Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

impl ProcessGroup {
    /// Joins the group described by torchrun's environment ([`InitOptions::from_env`]), Gloo,
    /// [`DEFAULT_TIMEOUT`].
    ///
    /// # Errors
    /// As [`InitOptions::from_env`] and [`Self::init`].
    pub fn init_from_env() -> Result<Self> {
        Self::init(&InitOptions::from_env()?)
    }

    /// Rendezvous through a TCPStore at `master_addr:master_port`, then the backend connects
    /// every pair of ranks. Returns when all `world_size` ranks have joined.
    ///
    /// # Errors
    /// [`DistError::InvalidOption`]; [`DistError::Unsupported`] for NCCL in a build without it;
    /// [`DistError::Rendezvous`] when the ranks do not all arrive within the timeout (or the
    /// port is taken).
    pub fn init(options: &InitOptions) -> Result<Self> {
        options.check()?;
        let started = std::time::Instant::now();
        let is_server = options.host_store.unwrap_or(options.rank == 0);
        let handle = sys::init(
            &options.master_addr,
            options.master_port,
            options.rank,
            options.world_size,
            is_server,
            options.timeout,
            options.backend.name(),
        )
        .map_err(|message| match message.strip_prefix("[unsupported] ") {
            Some(m) => DistError::Unsupported { what: "the NCCL backend", message: m.to_string() },
            None => DistError::Rendezvous {
                addr: options.master_addr.clone(),
                port: options.master_port,
                rank: options.rank,
                world_size: options.world_size,
                timeout: options.timeout,
                elapsed: started.elapsed(),
                message,
            },
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                handle,
                rank: options.rank,
                world_size: options.world_size,
                local_rank: options.local_rank,
                backend: options.backend,
                timeout: Mutex::new(options.timeout),
            }),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// torchrun's LOCAL_RANK, when known.
    pub fn local_rank(&self) -> Option<usize> {
        self.inner.local_rank
    }

    /// Rank 0 (the one that prints and writes checkpoints).
    pub fn is_main(&self) -> bool {
        self.inner.rank == 0
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The bound on every collective.
    pub fn timeout(&self) -> Duration {
        *self.inner.timeout.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the bound on every later collective.
    ///
    /// # Errors
    /// [`DistError::InvalidOption`] for a zero duration.
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        if timeout.is_zero() {
            return Err(DistError::InvalidOption {
                option: "timeout",
                value: format!("{timeout:?}"),
                expected: "a positive duration",
            });
        }
        self.inner.handle.set_timeout(timeout).map_err(|m| self.err("set_timeout", m))?;
        *self.inner.timeout.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
        Ok(())
    }

    pub(crate) fn handle(&self) -> &sys::PgHandle {
        &self.inner.handle
    }

    pub(crate) fn err(&self, op: &'static str, message: String) -> DistError {
        DistError::from_shim(op, self.timeout(), message)
    }

    /// Turns the error of a backward pass that ran DDP's gradient reduction (from
    /// `Amp::f_scale_loss_with(.., |s| s.f_backward())`) into [`DistError::PeerLost`] or
    /// [`DistError::Timeout`] when a collective failed, [`DistError::Amp`] otherwise.
    pub fn backward_error(&self, error: crate::AmpError) -> DistError {
        if let crate::AmpError::Torch { source, .. } = &error {
            let e = self.err("backward (gradient allreduce)", source.to_string());
            if e.is_peer_failure() {
                return e;
            }
        }
        DistError::from(error)
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.world_size() {
            return Err(DistError::InvalidOption {
                option: "root",
                value: root.to_string(),
                expected: "a rank below world_size",
            });
        }
        Ok(())
    }

    /// Waits until every rank has called `barrier`.
    ///
    /// # Errors
    /// [`DistError::Timeout`] / [`DistError::PeerLost`] when a rank does not arrive.
    pub fn barrier(&self) -> Result<()> {
        self.inner.handle.barrier().map_err(|m| self.err("barrier", m))
    }

    /// In place: `tensor` takes rank `root`'s value.
    ///
    /// # Errors
    /// As [`Self::barrier`]; [`DistError::Collective`] when shapes or dtypes differ.
    pub fn broadcast_(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        self.broadcast_many_(std::slice::from_mut(tensor), root)
    }

    /// [`Self::broadcast_`] for several tensors (one collective each, all in flight together).
    ///
    /// # Errors
    /// As [`Self::broadcast_`].
    pub fn broadcast_many_(&self, tensors: &mut [Tensor], root: usize) -> Result<()> {
        self.check_root(root)?;
        let detached = detached(tensors)?;
        self.inner.handle.broadcast(&detached, root).map_err(|m| self.err("broadcast", m))
    }

    /// In place, as torch's DDP syncs module states: the tensors flattened into buffers of at
    /// most `buffer_bytes` and broadcast from `root` (`c10d::broadcast_coalesced`).
    ///
    /// # Errors
    /// As [`Self::broadcast_`].
    pub fn broadcast_coalesced_(&self, tensors: &mut [Tensor], buffer_bytes: usize, root: usize) -> Result<()> {
        self.check_root(root)?;
        let detached = detached(tensors)?;
        self.inner
            .handle
            .broadcast_coalesced(&detached, buffer_bytes.max(1), root)
            .map_err(|m| self.err("broadcast", m))
    }

    /// In place: `tensor` becomes the elementwise reduction over all ranks.
    ///
    /// # Errors
    /// As [`Self::barrier`]; [`DistError::Collective`] when shapes or dtypes differ, or for
    /// [`ReduceOp::Avg`] on an integer tensor.
    pub fn all_reduce_(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_many_(std::slice::from_mut(tensor), op)
    }

    /// [`Self::all_reduce_`] for several tensors (one collective each, all in flight together).
    ///
    /// # Errors
    /// As [`Self::all_reduce_`].
    pub fn all_reduce_many_(&self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        let detached = detached(tensors)?;
        self.inner.handle.allreduce(&detached, op.code()).map_err(|m| self.err("all_reduce", m))
    }

    /// `tensor` as every rank holds it, by rank (same shape and dtype everywhere).
    ///
    /// # Errors
    /// As [`Self::all_reduce_`].
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let t = tensor.f_detach().map_err(|source| DistError::Torch { context: "all_gather", source })?;
        self.inner.handle.allgather(&t, self.world_size()).map_err(|m| self.err("all_gather", m))
    }
}

/// Detached aliases (same storage) of `tensors`, so that collectives may write into leaf
/// variables that require grad, as torch.distributed's do.
fn detached(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    tensors
        .iter()
        .map(|t| {
            t.f_detach().map_err(|source| DistError::Torch { context: "detaching a tensor for a collective", source })
        })
        .collect()
}
