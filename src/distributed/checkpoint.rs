//! Checkpoints in a process group: rank 0 writes, every rank loads, and all ranks learn
//! whether it worked.
use std::path::Path;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::error::{DistError, Result, TorchContext};
use super::process_group::{ProcessGroup, ReduceOp};
use crate::amp::Amp;
use crate::optim::AmpOptimizer;

/// Every rank says whether its part failed; returns the lowest failing rank, if any.
fn agree(pg: &ProcessGroup, failed: bool) -> Result<Option<usize>> {
    let world = pg.world_size();
    let code = if failed { (world - pg.rank()) as f64 } else { 0.0 };
    let mut flag = Tensor::f_full([1], code, (Kind::Double, Device::Cpu)).ctx("a status flag")?;
    pg.all_reduce_(&mut flag, ReduceOp::Max)?;
    let max = flag.f_double_value(&[0]).ctx("reading a status flag")?;
    Ok((max > 0.0).then(|| world - max as usize))
}

/// [`crate::save_checkpoint`] in a process group, as Apex's ImageNet example does it: rank 0
/// writes the file (all ranks hold the same weights under DDP), then every rank learns whether
/// the write worked. Collective: every rank calls it. A sharded optimizer's state is gathered on
/// rank 0 first (its `consolidate_state_dict(0)`), so the file holds the whole optimizer, as an
/// unsharded run's does, and loads into any world size.
///
/// # Errors
/// On rank 0, the save's own error ([`DistError::Amp`]); on the other ranks
/// [`DistError::RemoteFailure`] when rank 0 failed; [`DistError::Timeout`] /
/// [`DistError::PeerLost`].
pub fn save_checkpoint_on_rank0(
    pg: &ProcessGroup,
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &[&AmpOptimizer],
    amp: &Amp,
) -> Result<()> {
    let mut records = Vec::with_capacity(optimizers.len());
    for o in optimizers {
        let params = o.gather_params(0)?;
        if let Some(params) = params {
            let mut r = o.to_record();
            r.params = params;
            records.push(r);
        }
    }
    let local = if pg.is_main() {
        crate::checkpoint::file::save_records(
            path.as_ref(),
            vs,
            &records,
            amp,
            &crate::checkpoint::TrainingState::default(),
        )
    } else {
        Ok(())
    };
    let failed_rank = agree(pg, local.is_err())?;
    local?;
    match failed_rank {
        Some(rank) => Err(DistError::RemoteFailure { rank, what: "write the checkpoint" }),
        None => Ok(()),
    }
}

/// [`crate::load_checkpoint`] on every rank after rank 0 wrote it: a barrier first (so the file
/// is complete), then every rank loads it, then all ranks learn whether every load worked.
/// Collective.
///
/// # Errors
/// This rank's load error ([`DistError::Amp`], nothing changed), or
/// [`DistError::RemoteFailure`] when another rank failed; [`DistError::Timeout`] /
/// [`DistError::PeerLost`].
pub fn load_checkpoint_on_all(
    pg: &ProcessGroup,
    path: impl AsRef<Path>,
    vs: &VarStore,
    optimizers: &mut [&mut AmpOptimizer],
    amp: &mut Amp,
) -> Result<()> {
    pg.barrier()?;
    let local = crate::load_checkpoint(path, vs, optimizers, amp);
    let failed_rank = agree(pg, local.is_err())?;
    local?;
    match failed_rank {
        Some(rank) => Err(DistError::RemoteFailure { rank, what: "load the checkpoint" }),
        None => Ok(()),
    }
}
