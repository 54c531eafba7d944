//! The process group as the sharded optimizer's collectives ([`crate::AmpOptimizer::sharded`],
//! [`crate::Amp::sharded_optimizer`]: ZeRO stage 1, torch's `ZeroRedundancyOptimizer`).
use tch::Tensor;

use super::process_group::{ProcessGroup, ReduceOp};
use crate::error::{AmpError, Result};
use crate::optim::Collectives;

impl Collectives for ProcessGroup {
    fn rank(&self) -> usize {
        ProcessGroup::rank(self)
    }

    fn world_size(&self) -> usize {
        ProcessGroup::world_size(self)
    }

    fn all_reduce(&self, tensor: &mut Tensor, max: bool) -> Result<()> {
        self.all_reduce_(tensor, if max { ReduceOp::Max } else { ReduceOp::Sum }).map_err(AmpError::from)
    }

    fn broadcast(&self, tensors: &mut [Tensor], root: usize) -> Result<()> {
        self.broadcast_many_(tensors, root).map_err(AmpError::from)
    }
}
