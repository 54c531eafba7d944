//! Each rank's share of a data set: torch's `DistributedSampler`.
use serde::{Deserialize, Serialize};

use super::error::{DistError, Result, TorchContext};
use super::process_group::ProcessGroup;
use super::sys;

/// torch's `torch.utils.data.DistributedSampler(dataset, num_replicas, rank, shuffle=True,
/// seed=0, drop_last=False)`: the index sequence of one rank, identical to torch's for the same
/// arguments and epoch.
///
/// Without `drop_last`, the (shuffled) indices are padded by repeating their beginning up to a
/// multiple of `num_replicas`; with it, the tail is cut. Rank `r` takes every
/// `num_replicas`-th index starting at `r`. With `shuffle`, the order of an epoch is
/// `torch.randperm(len, generator=torch.Generator().manual_seed(seed + epoch))`, computed by
/// libtorch's own `randperm` on a fresh CPU generator, so it matches torch bit for bit; call
/// [`Self::set_epoch`] at the start of every epoch, as with torch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DistributedSampler {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` items for `rank` of `num_replicas`: shuffle on, seed 0, no
    /// drop_last, epoch 0 (torch's defaults).
    ///
    /// # Errors
    /// [`DistError::InvalidOption`] when `num_replicas` is 0 or `rank >= num_replicas` (torch's
    /// ValueError).
    pub fn new(len: usize, num_replicas: usize, rank: usize) -> Result<Self> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(DistError::InvalidOption {
                option: "rank",
                value: format!("{rank} (num_replicas {num_replicas})"),
                expected: "0 <= rank < num_replicas",
            });
        }
        Ok(Self { len, num_replicas, rank, shuffle: true, seed: 0, drop_last: false, epoch: 0 })
    }

    /// A sampler for this process's rank in `pg`.
    ///
    /// # Errors
    /// As [`Self::new`] (not expected).
    pub fn for_group(len: usize, pg: &ProcessGroup) -> Result<Self> {
        Self::new(len, pg.world_size(), pg.rank())
    }

    /// Sets `shuffle`.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Sets `seed` (the same on every rank).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets `drop_last`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which reseeds the shuffle (torch's `set_epoch`).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Indices per rank (torch's `num_samples`).
    pub fn num_samples(&self) -> usize {
        if self.drop_last && self.len % self.num_replicas != 0 {
            // torch: ceil((len - replicas) / replicas), 0 when there are fewer items than ranks.
            self.len.saturating_sub(self.num_replicas).div_ceil(self.num_replicas)
        } else {
            self.len.div_ceil(self.num_replicas)
        }
    }

    /// Indices over all ranks (torch's `total_size`).
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.num_replicas
    }

    /// This rank's indices for the current epoch.
    ///
    /// # Errors
    /// [`DistError::Torch`] / [`DistError::Collective`] if libtorch's randperm fails (not
    /// expected).
    pub fn indices(&self) -> Result<Vec<i64>> {
        let n = i64::try_from(self.len).map_err(|_| DistError::InvalidOption {
            option: "len",
            value: self.len.to_string(),
            expected: "a length that fits in i64",
        })?;
        let mut all: Vec<i64> = if self.shuffle {
            let perm = sys::randperm_seeded(n, self.seed.wrapping_add(self.epoch))
                .map_err(|message| DistError::Collective { op: "randperm", message })?;
            Vec::<i64>::try_from(&perm).ctx("reading the permutation")?
        } else {
            (0..n).collect()
        };
        let total = self.total_size();
        if self.drop_last {
            all.truncate(total);
        } else if !all.is_empty() {
            let mut i = 0;
            while all.len() < total {
                all.push(all[i]);
                i += 1;
            }
        }
        Ok(all.into_iter().skip(self.rank).step_by(self.num_replicas).take(self.num_samples()).collect())
    }
}
