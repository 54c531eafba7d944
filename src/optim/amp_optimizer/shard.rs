//! A sharded optimizer (ZeRO stage 1, torch's `ZeroRedundancyOptimizer`): the parameters are
//! partitioned across the ranks of a process group as torch partitions them; each rank keeps
//! the fp32 masters and the optimizer state of its shard only and updates it, then every rank
//! broadcasts its shard. Gradients stay whole on every rank (DDP averages them); those of other
//! ranks' parameters are released at `scale_loss`'s exit. What all ranks must decide alike is
//! agreed by a collective: the inf/NaN verdict (before anyone steps), the gradient norm of a
//! clip (and LAMB's), the collapse check. `consolidate_state_dict` gathers the whole state on
//! one rank for a checkpoint; a whole record loads into any world size.
use tch::{Device, Kind, Tensor};

use super::AmpOptimizer;
use crate::error::{AmpError, Result, TorchContext, UsageError};
use crate::optim::engine::total_of_norms;
use crate::optim::record::{OptimizerRecord, ParamRecord};

/// The collectives a sharded optimizer runs, on the process group it was made with
/// (`crate::distributed::ProcessGroup` implements them). Every rank makes the same calls in the
/// same order.
pub(crate) trait Collectives: std::fmt::Debug + Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// In place: the elementwise sum (or maximum) over the ranks.
    fn all_reduce(&self, tensor: &mut Tensor, max: bool) -> Result<()>;
    /// In place: every tensor takes rank `root`'s value (one collective per tensor, in order).
    fn broadcast(&self, tensors: &mut [Tensor], root: usize) -> Result<()>;
}

/// Which rank updates which parameter.
#[derive(Debug)]
pub(crate) struct Shard {
    comm: Box<dyn Collectives>,
    /// The rank that updates each entry.
    pub(super) owner: Vec<usize>,
    /// The entries in torch's partition order (group by group, each group's parameters largest
    /// first): the order the ranks broadcast their shards in.
    partition_order: Vec<usize>,
    /// The state of every parameter, gathered here by `consolidate_state_dict` (until the state
    /// changes again).
    gathered: Option<Vec<ParamRecord>>,
}

/// torch's `ZeroRedundancyOptimizer._partition_parameters`: each group in turn, its parameters
/// (`(entry, elements)` in the group's order) sorted by size, largest first (a stable sort), each
/// given to the rank with the fewest elements so far (the lowest such rank); `sizes` carries the
/// ranks' totals over the groups. Returns the `(entry, rank)` pairs in assignment order.
pub(crate) fn partition(sizes: &mut [usize], group: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut sorted = group.to_vec();
    sorted.sort_by_key(|&(_, numel)| std::cmp::Reverse(numel));
    sorted
        .into_iter()
        .map(|(entry, numel)| {
            let mut rank = 0;
            for (r, &s) in sizes.iter().enumerate() {
                if s < sizes[rank] {
                    rank = r;
                }
            }
            sizes[rank] += numel;
            (entry, rank)
        })
        .collect()
}

impl Shard {
    pub(super) fn new(comm: Box<dyn Collectives>) -> Self {
        Self { comm, owner: Vec::new(), partition_order: Vec::new(), gathered: None }
    }

    pub(super) fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Assigns `groups` (each `(entry, elements)` in torch's order within the group), after the
    /// parameters already assigned; `total` entries in all.
    pub(super) fn assign(&mut self, groups: &[Vec<(usize, usize)>], numel: &[usize]) {
        let world = self.comm.world_size().max(1);
        let mut sizes = vec![0usize; world];
        for (i, &r) in self.owner.iter().enumerate() {
            sizes[r] += numel[i];
        }
        self.owner.resize(numel.len(), 0);
        for g in groups {
            for (entry, rank) in partition(&mut sizes, g) {
                self.owner[entry] = rank;
                self.partition_order.push(entry);
            }
        }
    }

    pub(super) fn owns(&self, i: usize) -> bool {
        self.owner.get(i).is_some_and(|&r| r == self.comm.rank())
    }
}

impl AmpOptimizer {
    /// Whether this rank updates entry `i` (always, unsharded).
    pub(super) fn owns(&self, i: usize) -> bool {
        self.shard.as_ref().map_or(true, |s| s.owns(i))
    }

    /// Whether the optimizer is sharded over a process group.
    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// For each parameter (in [`Self::param_names`] order), the rank that updates it: torch's
    /// `ZeroRedundancyOptimizer` partition (each parameter group in turn, its parameters largest
    /// first, each to the rank holding the fewest elements so far). All 0 unsharded.
    pub fn param_ranks(&self) -> Vec<usize> {
        match &self.shard {
            Some(s) => s.owner.clone(),
            None => vec![0; self.entries.len()],
        }
    }

    /// The device flags and norms are exchanged on.
    fn comm_device(&self) -> Device {
        self.device().unwrap_or(Device::Cpu)
    }

    /// The state changed: a gathered copy is stale.
    pub(super) fn state_changed(&mut self) {
        if let Some(s) = self.shard.as_mut() {
            s.gathered = None;
        }
    }

    /// A sharded optimizer: `found_inf` (a 1-element fp32 flag, > 0 when this rank's shard had
    /// inf/NaN gradients) becomes the maximum over the ranks, so that every rank skips or steps
    /// alike. Nothing unsharded.
    pub(crate) fn agree_found_inf(&self, found_inf: &Tensor) -> Result<()> {
        let Some(s) = &self.shard else { return Ok(()) };
        let mut flag = found_inf.shallow_clone();
        s.comm.all_reduce(&mut flag, true)
    }

    /// [`crate::optim::Optimizer::agree_on_overflow`]: the per-device flags of this rank become
    /// one flag, the maximum over the ranks.
    pub(crate) fn agree_flags(&self, found_inf: &mut Vec<Tensor>) -> Result<()> {
        if self.shard.is_none() {
            return Ok(());
        }
        let device = self.comm_device();
        let mut flag = Tensor::f_zeros([1], (Kind::Float, device)).ctx("an inf flag")?;
        for f in found_inf.iter() {
            let f = f.f_to_device(device).and_then(|f| f.f_reshape([1])).ctx("an inf flag")?;
            flag = flag.f_maximum(&f).ctx("an inf flag")?;
        }
        self.agree_found_inf(&flag)?;
        *found_inf = vec![flag.f_reshape([] as [i64; 0]).ctx("an inf flag")?];
        Ok(())
    }

    /// A sharded optimizer: whether every rank's gradients are all zero (`local` this rank's
    /// verdict, `None` without gradients), agreed over the ranks. `local` unsharded.
    pub(crate) fn agree_all_zero(&self, local: Option<bool>) -> Result<Option<bool>> {
        let Some(s) = &self.shard else { return Ok(local) };
        let (has, nonzero): (f32, f32) = match local {
            None => (0.0, 0.0),
            Some(zero) => (1.0, if zero { 0.0 } else { 1.0 }),
        };
        let mut t = Tensor::f_from_slice(&[has, nonzero])
            .and_then(|t| t.f_to_device(self.comm_device()))
            .ctx("a zero-gradient flag")?;
        s.comm.all_reduce(&mut t, true)?;
        let v = Vec::<f32>::try_from(&t.f_to_device(Device::Cpu).ctx("a zero-gradient flag")?)
            .ctx("reading a zero-gradient flag")?;
        Ok((v[0] > 0.0).then_some(v[1] == 0.0))
    }

    /// The `ord`-norm over every rank's gradients of per-parameter norms `local` (this rank's,
    /// by entry), in the rule's order ([`crate::optim::engine::Engine::view_order`]): each norm
    /// goes into its parameter's slot of a vector that is summed over the ranks (each slot has one
    /// contributor, so the sum is exact), then the norms present are reduced in order. Bit for bit
    /// what one process holding every gradient computes.
    pub(super) fn global_norm(&self, local: Vec<(usize, Tensor)>, ord: f64) -> Result<Tensor> {
        let Some(s) = &self.shard else {
            return total_of_norms(local.into_iter().map(|(_, n)| n).collect(), ord);
        };
        let order = self.inner.view_order();
        let n = order.len();
        let device = self.comm_device();
        let mut slot = vec![usize::MAX; self.entries.len()];
        for (k, &i) in order.iter().enumerate() {
            slot[i] = k;
        }
        let zero = Tensor::f_zeros([1], (Kind::Float, device)).ctx("a gradient norm")?;
        let one = Tensor::f_ones([1], (Kind::Float, device)).ctx("a gradient norm")?;
        let mut values: Vec<Tensor> = (0..2 * n).map(|_| zero.shallow_clone()).collect();
        for (i, norm) in local {
            let k = slot[i];
            values[k] = norm.f_reshape([1]).and_then(|t| t.f_to_device(device)).ctx("a gradient norm")?;
            values[n + k] = one.shallow_clone();
        }
        let mut all = Tensor::f_cat(&values, 0).ctx("gradient norms")?;
        s.comm.all_reduce(&mut all, false)?;
        crate::counters::note_host_read();
        let present =
            all.f_narrow(0, n as i64, n as i64).and_then(|t| t.f_to_device(Device::Cpu)).ctx("gradient norms")?;
        let present = Vec::<f32>::try_from(&present).ctx("reading gradient norms")?;
        let idx: Vec<i64> = (0..n).filter(|&k| present[k] > 0.0).map(|k| k as i64).collect();
        if idx.is_empty() {
            return Tensor::f_zeros([], (Kind::Float, Device::Cpu)).ctx("a gradient norm");
        }
        let idx = Tensor::f_from_slice(&idx).and_then(|t| t.f_to_device(device)).ctx("gradient norms")?;
        let norms = all.f_narrow(0, 0, n as i64).and_then(|t| t.f_index_select(0, &idx)).ctx("gradient norms")?;
        crate::sys::vector_norm(&norms, ord)
    }

    /// A sharded optimizer after its update: every rank broadcasts the model variables of its
    /// shard (in torch's partition order, one collective each), so every rank holds the whole
    /// updated model.
    pub(super) fn broadcast_shards(&self) -> Result<()> {
        let Some(s) = &self.shard else { return Ok(()) };
        for root in 0..s.comm.world_size() {
            let mut vars: Vec<Tensor> = s
                .partition_order
                .iter()
                .filter(|&&i| s.owner[i] == root)
                .map(|&i| self.entries[i].model().shallow_clone())
                .collect();
            if !vars.is_empty() {
                s.comm.broadcast(&mut vars, root)?;
            }
        }
        Ok(())
    }

    /// The dtype parameter `i` is updated in on the rank that owns it: fp32 for a variable with
    /// an fp32 master there, else the variable's own.
    pub(super) fn target_kind(&self, i: usize) -> Kind {
        let e = &self.entries[i];
        let master = e.master().is_some()
            || (!self.owns(i) && self.setup.master_weights && crate::dtype::is_low_precision(e.model().kind()));
        if master {
            Kind::Float
        } else {
            e.model().kind()
        }
    }

    /// torch's `consolidate_state_dict(to)`: every rank sends the state and fp32 masters of its
    /// shard to rank `to`, which keeps the whole state until the next step (or load) for
    /// [`Self::consolidated_record`] and the checkpoint writers. Collective: every rank calls it,
    /// after the same steps. Unsharded: nothing to do.
    ///
    /// The other ranks receive each parameter's state as it passes (one parameter at a time,
    /// dropped at once), as torch broadcasts it.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`](crate::error::ConfigError::InvalidOption) for a rank outside
    /// the group; [`AmpError::Distributed`] when a collective fails.
    pub fn consolidate_state_dict(&mut self, to: usize) -> Result<()> {
        let gathered = self.gather_params(to)?;
        if let Some(s) = self.shard.as_mut() {
            s.gathered = gathered;
        }
        Ok(())
    }

    /// Every parameter's record (its owner's step count, state and master) on rank `to`, `None`
    /// elsewhere. Collective.
    pub(crate) fn gather_params(&self, to: usize) -> Result<Option<Vec<ParamRecord>>> {
        let Some(s) = &self.shard else { return Ok(Some(self.to_record().params)) };
        let (rank, world) = (s.comm.rank(), s.comm.world_size());
        if to >= world {
            return Err(AmpError::Config(crate::error::ConfigError::InvalidOption {
                option: "to",
                value: to.to_string(),
                expected: "a rank of the optimizer's process group",
            }));
        }
        let n = self.entries.len();
        let device = self.comm_device();
        let local = self.to_record().params;
        // Each parameter's step count and whether it has state yet, from its owner.
        let mut meta = vec![0i64; 2 * n];
        for (i, p) in local.iter().enumerate() {
            if s.owner[i] == rank {
                meta[i] = i64::try_from(p.step).unwrap_or(i64::MAX);
                meta[n + i] = i64::from(!p.buffers.is_empty());
            }
        }
        let mut meta_t = Tensor::f_from_slice(&meta).and_then(|t| t.f_to_device(device)).ctx("state metadata")?;
        s.comm.all_reduce(&mut meta_t, false)?;
        let meta = Vec::<i64>::try_from(&meta_t.f_to_device(Device::Cpu).ctx("state metadata")?)
            .ctx("reading state metadata")?;
        let groups = self.inner.groups();
        let group_of = self.inner.group_of();
        let mut out = Vec::with_capacity(if rank == to { n } else { 0 });
        for (i, mine) in local.into_iter().enumerate() {
            let owner = s.owner[i];
            let layout = if meta[n + i] != 0 { self.state_layout(i, &groups[group_of[i]].hyper) } else { Vec::new() };
            let model = self.entries[i].model();
            let with_master = self.target_kind(i) == Kind::Float && crate::dtype::is_low_precision(model.kind());
            let (buffers, master) = if owner == rank {
                (mine.buffers, mine.master)
            } else if rank == to {
                let empty = |kind: Kind, shape: &[i64]| Tensor::f_empty(shape, (kind, device)).ctx("receiving state");
                let buffers = layout
                    .iter()
                    .map(|(k, kind, shape)| Ok((k.clone(), empty(*kind, shape)?)))
                    .collect::<Result<_>>()?;
                let master = if with_master { Some(empty(Kind::Float, &model.size())?) } else { None };
                (buffers, master)
            } else {
                (Default::default(), None)
            };
            // The owner sends; every rank takes part (torch broadcasts too), unless it is `to`'s own.
            let mut list: Vec<Tensor> = Vec::new();
            if owner != to {
                if owner == rank || rank == to {
                    list.extend(buffers.values().map(Tensor::shallow_clone));
                    list.extend(master.iter().map(Tensor::shallow_clone));
                } else {
                    for (_, kind, shape) in &layout {
                        list.push(Tensor::f_empty(shape.as_slice(), (*kind, device)).ctx("receiving state")?);
                    }
                    if with_master {
                        list.push(Tensor::f_empty(model.size(), (Kind::Float, device)).ctx("receiving state")?);
                    }
                }
                if !list.is_empty() {
                    s.comm.broadcast(&mut list, owner)?;
                }
            }
            if rank == to {
                let step = u64::try_from(meta[i]).unwrap_or(0);
                out.push(ParamRecord { name: mine.name, step, buffers, master });
            }
        }
        Ok((rank == to).then_some(out))
    }

    /// The whole optimizer's record, what checkpoints save: [`Self::to_record`] unsharded; for a
    /// sharded optimizer, the state [`Self::consolidate_state_dict`] gathered on this rank (it
    /// is the same as the unsharded optimizer's record, and loads into a sharded optimizer of any
    /// world size, each rank keeping its shard).
    ///
    /// # Errors
    /// [`UsageError::NotConsolidated`] for a sharded optimizer whose state was not gathered here
    /// since its last step or load.
    pub fn consolidated_record(&self) -> Result<OptimizerRecord> {
        let Some(s) = &self.shard else { return Ok(self.to_record()) };
        let Some(gathered) = &s.gathered else {
            return Err(AmpError::Usage(UsageError::NotConsolidated { rank: s.rank() }));
        };
        let mut r = self.to_record();
        r.params = gathered
            .iter()
            .map(|p| ParamRecord {
                name: p.name.clone(),
                step: p.step,
                buffers: p.buffers.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect(),
                master: p.master.as_ref().map(Tensor::shallow_clone),
            })
            .collect();
        Ok(r)
    }

    /// A sharded optimizer wrapped in DDP after rank 0's model was broadcast: each master whose
    /// rounding is not the (broadcast) model variable is made again from it (rank 0 holds no
    /// master of other ranks' parameters to broadcast); masters a checkpoint set alike on every
    /// rank keep their bits.
    pub(crate) fn sync_masters_to_model(&self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for e in &self.entries {
            let Some(m) = e.master() else { continue };
            let rounded = m.f_to_kind(e.model().kind()).ctx("comparing a master with the model")?;
            if !rounded.equal(e.model()) {
                let mut m = m.shallow_clone();
                m.f_copy_(e.model()).ctx("remaking a master weight")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::partition;

    #[test]
    fn greedy_partition_is_torchs() {
        // torch: sorted largest first (stable), each to the rank with the fewest elements so
        // far, ties to the lowest rank; totals carry over groups.
        let mut sizes = vec![0; 2];
        let a = partition(&mut sizes, &[(0, 10), (1, 30), (2, 10), (3, 20)]);
        assert_eq!(a, vec![(1, 0), (3, 1), (0, 1), (2, 0)]);
        assert_eq!(sizes, vec![40, 30]);
        let b = partition(&mut sizes, &[(4, 5), (5, 5)]);
        assert_eq!(b, vec![(4, 1), (5, 1)]);
        let mut four = vec![0; 4];
        let c = partition(&mut four, &[(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]);
        assert_eq!(c, vec![(0, 0), (1, 1), (2, 2), (3, 3), (4, 0)]);
    }
}
