//! Data parallel training: Apex's `apex.parallel.DistributedDataParallel` (and torch's) over a
//! tch `VarStore`, on libtorch's `c10d::Reducer`.
use std::cell::Cell;

use serde::{Deserialize, Serialize};
use tch::nn::{ModuleT, VarStore};
use tch::{Kind, Tensor};

use super::error::{DistError, Result};
use super::process_group::ProcessGroup;
use super::sys;
use crate::optim::AmpOptimizer;

/// torch DDP's buffer for broadcasting module states (250 MiB).
pub const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

/// Apex DDP's default `message_size`: elements per allreduce bucket.
pub const DEFAULT_MESSAGE_SIZE: usize = 10_000_000;

/// Options of [`DistributedDataParallel`]: Apex DDP's where they apply, plus torch DDP's
/// `broadcast_buffers` and `find_unused_parameters`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DdpOptions {
    /// Apex `message_size`: a bucket closes once it holds this many elements (converted to
    /// bytes with the element size of the dtype most parameters have). Default 10,000,000.
    pub message_size: usize,
    /// torch `bucket_cap_mb` in bytes; overrides `message_size` when set.
    pub bucket_cap_bytes: Option<usize>,
    /// Apex `delay_allreduce`: one allreduce per dtype after the whole backward instead of
    /// buckets overlapping with it.
    pub delay_allreduce: bool,
    /// Apex `allreduce_always_fp32`: fp16/bf16 gradients are converted to fp32 for the
    /// allreduce and back (default: allreduced in their own dtype).
    pub allreduce_always_fp32: bool,
    /// Apex `gradient_predivide_factor`: gradients are divided by it before the allreduce and
    /// by `world_size / factor` after it (default 1.0: the whole division after the sum, as
    /// Apex). torch's DDP divides by the world size before the sum: set the factor to
    /// `world_size` to do the same, which also keeps the fp16 sum of O2 gradients from
    /// overflowing where one process would not (with 1.0 such a step is skipped on every rank,
    /// as under Apex), and is required to share a group with ranks running torch's DDP.
    pub gradient_predivide_factor: f64,
    /// Apex `gradient_average`: average (true, default) or sum the gradients.
    pub gradient_average: bool,
    /// torch `broadcast_buffers`: rank 0's buffers (batch-norm statistics) are broadcast before
    /// every forward (default true).
    pub broadcast_buffers: bool,
    /// torch `find_unused_parameters`: parameters that get no gradient in a backward are still
    /// reduced (the forward's output is traversed to find them). Default false.
    pub find_unused_parameters: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            message_size: DEFAULT_MESSAGE_SIZE,
            bucket_cap_bytes: None,
            delay_allreduce: false,
            allreduce_always_fp32: false,
            gradient_predivide_factor: 1.0,
            gradient_average: true,
            broadcast_buffers: true,
            find_unused_parameters: false,
        }
    }
}

impl DdpOptions {
    /// Sets `message_size` (elements).
    pub fn message_size(mut self, elements: usize) -> Self {
        self.message_size = elements;
        self
    }
    /// Sets a bucket size in bytes (torch's `bucket_cap_mb * 2^20`).
    pub fn bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.bucket_cap_bytes = Some(bytes);
        self
    }
    /// Sets `delay_allreduce`.
    pub fn delay_allreduce(mut self, on: bool) -> Self {
        self.delay_allreduce = on;
        self
    }
    /// Sets `allreduce_always_fp32`.
    pub fn allreduce_always_fp32(mut self, on: bool) -> Self {
        self.allreduce_always_fp32 = on;
        self
    }
    /// Sets `gradient_predivide_factor`.
    pub fn gradient_predivide_factor(mut self, factor: f64) -> Self {
        self.gradient_predivide_factor = factor;
        self
    }
    /// Sets `gradient_average`.
    pub fn gradient_average(mut self, on: bool) -> Self {
        self.gradient_average = on;
        self
    }
    /// Sets `broadcast_buffers`.
    pub fn broadcast_buffers(mut self, on: bool) -> Self {
        self.broadcast_buffers = on;
        self
    }
    /// Sets `find_unused_parameters`.
    pub fn find_unused_parameters(mut self, on: bool) -> Self {
        self.find_unused_parameters = on;
        self
    }

    fn check(&self) -> Result<()> {
        let f = self.gradient_predivide_factor;
        if !(f.is_finite() && f > 0.0) {
            return Err(DistError::InvalidOption {
                option: "gradient_predivide_factor",
                value: f.to_string(),
                expected: "a finite number > 0",
            });
        }
        if self.message_size == 0 || self.bucket_cap_bytes == Some(0) {
            return Err(DistError::InvalidOption {
                option: "message_size",
                value: "0".into(),
                expected: "at least 1 element (or byte)",
            });
        }
        Ok(())
    }
}

/// A model whose gradients are averaged across the ranks of a [`ProcessGroup`] during
/// backward, as Apex's `DistributedDataParallel(model)` (and torch's) does.
///
/// At construction, rank 0's parameters and buffers are broadcast to every rank (torch's
/// `_sync_module_states`, after checking the shapes agree), and so are the fp32 master
/// weights of the given [`AmpOptimizer`]s, which tch-amp creates at `initialize` (Apex
/// creates them lazily, after DDP's broadcast); a sharded optimizer's masters (on the ranks
/// that own them) are made again from the broadcast model where they do not round to it. Every forward with autograd on broadcasts rank
/// 0's buffers first (`broadcast_buffers`) and arms libtorch's `c10d::Reducer`: during the next
/// backward, gradients are copied into buckets, and each full bucket is allreduced while
/// backward goes on (the first iteration uses one bucket, then buckets are rebuilt in the order
/// gradients became ready, as in Apex and torch). Averaging follows Apex: divide by
/// `gradient_predivide_factor`, sum, divide by `world_size / gradient_predivide_factor`;
/// fp16 gradients are summed in fp16 unless `allreduce_always_fp32`.
///
/// With AMP nothing else changes: `amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward())`
/// runs backward, the averaged (scaled) gradients arrive in the model's `.grad` before tch-amp
/// unscales them, so an inf/NaN on one rank reaches every rank, every rank skips the same
/// steps and the loss scalers stay equal; `clip_grad_norm` sees the same (global) gradients on
/// every rank.
///
/// Build it after `initialize` (the model must already have its AMP dtypes) and before the
/// first forward. Gradient accumulation: run the forward and backward of every micro-batch but
/// the last under [`Self::no_sync`]; when AMP's `scale_loss` does not pass the loss straight
/// through (dynamic scaling, or O2's master weights), give those micro-batches
/// `delay_unscale: true`, as Apex's accumulation recipe does, so that the last, synchronized
/// backward reduces the accumulated gradient.
#[derive(Debug)]
pub struct DistributedDataParallel<M> {
    module: M,
    pg: ProcessGroup,
    reducer: sys::DdpHandle,
    buffers: Vec<Tensor>,
    options: DdpOptions,
    require_backward_grad_sync: Cell<bool>,
    require_forward_param_sync: Cell<bool>,
}

/// The trainable variables of `vs` in torch's `named_parameters()` order for a model built in
/// the order its Python twin registers submodules: modules in the order their first variable
/// was created, and within a module `weight` before `bias` (tch creates `bias` first) before
/// the rest in creation order. Then the other variables (buffers), sorted by name.
fn params_and_buffers(vs: &VarStore) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let v = vs.variables_.lock().map_err(|_| DistError::Usage { message: "the VarStore's lock is poisoned".into() })?;
    let name_of = |t: &Tensor| v.named_variables.iter().find(|(_, x)| x.is_set_to(t)).map(|(n, _)| n.clone());
    let mut modules: Vec<String> = Vec::new();
    let mut keyed: Vec<(usize, u8, usize, Tensor)> = Vec::new();
    for (i, var) in v.trainable_variables.iter().enumerate() {
        if !var.tensor.requires_grad() {
            continue;
        }
        let name = name_of(&var.tensor).unwrap_or_default();
        let (module, leaf) = name.rsplit_once('.').unwrap_or(("", name.as_str()));
        let m = match modules.iter().position(|x| x == module) {
            Some(m) => m,
            None => {
                modules.push(module.to_string());
                modules.len() - 1
            }
        };
        let rank = match leaf {
            "weight" => 0,
            "bias" => 1,
            _ => 2,
        };
        keyed.push((m, rank, i, var.tensor.shallow_clone()));
    }
    keyed.sort_by_key(|(m, rank, i, _)| (*m, *rank, *i));
    let params: Vec<Tensor> = keyed.into_iter().map(|(_, _, _, t)| t).collect();
    let mut names: Vec<&String> = v.named_variables.keys().collect();
    names.sort();
    let buffers = names
        .into_iter()
        .map(|n| &v.named_variables[n])
        .filter(|t| !v.trainable_variables.iter().any(|p| p.tensor.is_set_to(t)))
        .map(Tensor::shallow_clone)
        .collect();
    Ok((params, buffers))
}

/// Bytes per bucket: `message_size` elements of the dtype that holds most parameters.
fn bucket_bytes(params: &[Tensor], options: &DdpOptions) -> i64 {
    if options.delay_allreduce {
        return i64::MAX;
    }
    if let Some(b) = options.bucket_cap_bytes {
        return i64::try_from(b).unwrap_or(i64::MAX);
    }
    let mut by_kind: Vec<(Kind, usize)> = Vec::new();
    for p in params {
        match by_kind.iter_mut().find(|(k, _)| *k == p.kind()) {
            Some((_, n)) => *n += p.numel(),
            None => by_kind.push((p.kind(), p.numel())),
        }
    }
    let elt = by_kind.iter().max_by_key(|(_, n)| *n).map_or(4, |(k, _)| k.elt_size_in_bytes());
    i64::try_from(options.message_size.saturating_mul(elt)).unwrap_or(i64::MAX)
}

impl<M> DistributedDataParallel<M> {
    /// Wraps `module` (whose variables live in `vs`): checks that every rank has the same
    /// parameters, broadcasts rank 0's parameters, buffers and the fp32 masters of
    /// `optimizers`, and registers the gradient reduction. Collective: every rank calls it.
    ///
    /// # Errors
    /// [`DistError::InvalidOption`]; [`DistError::Usage`] when `vs` has no trainable variable;
    /// [`DistError::Collective`] when the ranks' parameters differ in number, shape or dtype;
    /// [`DistError::Timeout`] / [`DistError::PeerLost`].
    pub fn new(
        pg: &ProcessGroup,
        vs: &VarStore,
        module: M,
        optimizers: &mut [&mut AmpOptimizer],
        options: DdpOptions,
    ) -> Result<Self> {
        options.check()?;
        let (params, buffers) = params_and_buffers(vs)?;
        if params.is_empty() {
            return Err(DistError::Usage {
                message: "the VarStore has no trainable variable: build the model before wrapping it in DDP".into(),
            });
        }
        let cap = bucket_bytes(&params, &options);
        let cfg = sys::ReducerConfig {
            bucket_bytes: cap,
            first_bucket_bytes: cap,
            find_unused: options.find_unused_parameters,
            always_fp32: options.allreduce_always_fp32,
            predivide: options.gradient_predivide_factor,
            average: options.gradient_average,
        };
        let reducer = sys::ddp_new(pg.handle(), &params, cfg).map_err(|m| pg.err("DistributedDataParallel::new", m))?;
        let mut states: Vec<Tensor> = params.iter().chain(buffers.iter()).map(Tensor::shallow_clone).collect();
        pg.broadcast_coalesced_(&mut states, BROADCAST_BUCKET_BYTES, 0)?;
        let mut masters: Vec<Tensor> =
            optimizers.iter().filter(|o| !o.is_sharded()).flat_map(|o| o.masters()).collect();
        if !masters.is_empty() {
            pg.broadcast_coalesced_(&mut masters, BROADCAST_BUCKET_BYTES, 0)?;
        }
        // A sharded optimizer's masters live on their owners, not on rank 0: they follow the
        // broadcast model.
        for o in optimizers.iter().filter(|o| o.is_sharded()) {
            o.sync_masters_to_model()?;
        }
        Ok(Self {
            module,
            pg: pg.clone(),
            reducer,
            buffers,
            options,
            require_backward_grad_sync: Cell::new(true),
            require_forward_param_sync: Cell::new(true),
        })
    }

    /// The wrapped model.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The wrapped model, unwrapped (the gradient hooks go away with the wrapper).
    pub fn into_inner(self) -> M {
        self.module
    }

    /// The process group.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The options.
    pub fn options(&self) -> &DdpOptions {
        &self.options
    }

    /// Until the guard drops, forwards do not arm the gradient reduction: backward passes
    /// accumulate local gradients (torch's `no_sync()`). Put the forward inside it.
    pub fn no_sync(&self) -> NoSyncGuard<'_, M> {
        let previous = self.require_backward_grad_sync.replace(false);
        NoSyncGuard { ddp: self, previous }
    }

    /// Runs `f` under [`Self::no_sync`].
    pub fn without_sync<T>(&self, f: impl FnOnce() -> T) -> T {
        let _guard = self.no_sync();
        f()
    }

    /// Whether the next forward arms the gradient reduction.
    pub fn syncs_gradients(&self) -> bool {
        self.require_backward_grad_sync.get()
    }

    /// The forward of torch DDP: buffers from rank 0, `module.forward_t`, the reducer armed for
    /// the next backward (when autograd is on and not under [`Self::no_sync`]).
    ///
    /// # Errors
    /// [`DistError::Timeout`] / [`DistError::PeerLost`] from the buffer broadcast or the bucket
    /// rebuild; [`DistError::Collective`] when the previous backward did not reduce every
    /// gradient (a parameter got no gradient: set `find_unused_parameters`), as torch reports.
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor>
    where
        M: ModuleT,
    {
        let sync = self.require_backward_grad_sync.get();
        self.reducer.pre_forward(sync).map_err(|m| self.pg.err("DDP forward", m))?;
        if self.options.broadcast_buffers && self.require_forward_param_sync.get() && !self.buffers.is_empty() {
            let mut bufs: Vec<Tensor> = self.buffers.iter().map(Tensor::shallow_clone).collect();
            self.pg.broadcast_coalesced_(&mut bufs, BROADCAST_BUCKET_BYTES, 0)?;
        }
        let out = self.module.forward_t(xs, train);
        let grad = sys::grad_mode_enabled().map_err(|m| self.pg.err("DDP forward", m))?;
        if grad && sync {
            self.require_forward_param_sync.set(true);
            self.reducer.post_forward(std::slice::from_ref(&out)).map_err(|m| self.pg.err("DDP forward", m))?;
        } else {
            self.require_forward_param_sync.set(false);
        }
        Ok(out)
    }
}

impl<M: ModuleT> ModuleT for DistributedDataParallel<M> {
    /// [`DistributedDataParallel::f_forward_t`].
    ///
    /// # Panics
    /// When it fails (a peer is lost or times out); use `f_forward_t` to get the error.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Restores gradient synchronization when dropped; see [`DistributedDataParallel::no_sync`].
#[must_use = "gradient sync is back on as soon as the guard drops"]
#[derive(Debug)]
pub struct NoSyncGuard<'a, M> {
    ddp: &'a DistributedDataParallel<M>,
    previous: bool,
}

impl<M> Drop for NoSyncGuard<'_, M> {
    fn drop(&mut self) {
        self.ddp.require_backward_grad_sync.set(self.previous);
    }
}
