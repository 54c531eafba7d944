//! SyncBatchNorm: batch statistics over the batches of every rank (Apex's
//! `convert_syncbn_model`, torch's `nn.SyncBatchNorm`).
use std::borrow::Borrow;

use tch::nn::{self, BatchNormConfig, ModuleT};
use tch::Tensor;

use super::error::{DistError, Result, TorchContext};
use super::process_group::ProcessGroup;

/// A batch norm whose training-mode statistics cover the batches of all ranks. Its variables
/// are those of tch's `nn::batch_norm*d` (`weight`, `bias`, `running_mean`, `running_var`), so
/// checkpoints are interchangeable and AMP keeps it fp32 under O2 (`keep_batchnorm_fp32`).
///
/// Training forward: each rank's per-channel mean, biased variance and count are all-gathered
/// and combined into the statistics of the whole global batch, which normalize the input and
/// update the running statistics (unbiased variance, as batch norm). Backward all-reduces the
/// per-channel sums of `dy` and `dy * (x - mean)`, so input gradients are those of batch norm
/// over the global batch; weight and bias gradients stay local and are averaged by
/// [`super::DistributedDataParallel`], as with torch's SyncBatchNorm. On CUDA the kernels are
/// libtorch's `batch_norm_stats` / `batch_norm_gather_stats_with_counts` / `batch_norm_elemt` /
/// `batch_norm_backward_reduce` / `batch_norm_backward_elemt`; on CPU, where libtorch has no
/// kernels for them, the same formulas run as fp32 ATen ops (fp16 inputs are normalized in fp32
/// and the output cast back, as Apex's SyncBatchNorm does). Evaluation mode, and a group of
/// one rank, use the running statistics / plain batch norm like torch.
///
/// Every rank must run the same SyncBatchNorm layers in the same order (they communicate in
/// forward and backward).
#[derive(Debug)]
pub struct SyncBatchNorm {
    pg: ProcessGroup,
    config: BatchNormConfig,
    /// Running mean (a VarStore buffer).
    pub running_mean: Tensor,
    /// Running variance (a VarStore buffer).
    pub running_var: Tensor,
    /// Scale (`None` without affine).
    pub ws: Option<Tensor>,
    /// Shift (`None` without affine).
    pub bs: Option<Tensor>,
}

/// A [`SyncBatchNorm`] over `out_dim` channels with the variables `nn::batch_norm2d` would
/// create under `vs` (works for 2-d to 5-d inputs alike).
pub fn sync_batch_norm<'a, T: Borrow<nn::Path<'a>>>(
    vs: T,
    pg: &ProcessGroup,
    out_dim: i64,
    config: BatchNormConfig,
) -> SyncBatchNorm {
    SyncBatchNorm::from_batch_norm(nn::batch_norm2d(vs, out_dim, config), config, pg)
}

impl SyncBatchNorm {
    /// Apex's `convert_syncbn_model` for one layer: takes over the variables of a tch batch norm
    /// (`config` must be the one it was built with; tch keeps it private).
    pub fn from_batch_norm(bn: nn::BatchNorm, config: BatchNormConfig, pg: &ProcessGroup) -> Self {
        Self {
            pg: pg.clone(),
            config,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            ws: bn.ws,
            bs: bn.bs,
        }
    }

    /// The configuration (eps, momentum, affine, ...).
    pub fn config(&self) -> &BatchNormConfig {
        &self.config
    }

    /// The forward; see the type's doc.
    ///
    /// # Errors
    /// [`DistError::Timeout`] / [`DistError::PeerLost`] from the statistics' all-gather;
    /// [`DistError::Collective`] for an input without a channel dimension or with a channel
    /// count that differs between ranks; [`DistError::Torch`] in evaluation mode.
    pub fn f_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let c = &self.config;
        if !train || self.pg.world_size() == 1 {
            return Tensor::f_batch_norm(
                xs,
                self.ws.as_ref(),
                self.bs.as_ref(),
                Some(&self.running_mean),
                Some(&self.running_var),
                train,
                c.momentum,
                c.eps,
                c.cudnn_enabled,
            )
            .ctx("batch norm");
        }
        if xs.dim() < 2 {
            return Err(DistError::Usage {
                message: format!("SyncBatchNorm expects an input with a channel dimension, got shape {:?}", xs.size()),
            });
        }
        self.pg
            .handle()
            .sync_batch_norm(
                xs,
                self.ws.as_ref(),
                self.bs.as_ref(),
                Some(&self.running_mean),
                Some(&self.running_var),
                c.eps,
                c.momentum,
            )
            .map_err(|m| self.pg.err("SyncBatchNorm", m))
    }
}

impl ModuleT for SyncBatchNorm {
    /// [`SyncBatchNorm::f_forward_t`].
    ///
    /// # Panics
    /// When it fails (a peer is lost, a bad shape); use `f_forward_t` to get the error.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(xs, train).unwrap_or_else(|e| panic!("{e}"))
    }
}
