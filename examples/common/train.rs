//! Training-loop plumbing: seeded batch order (independent of libtorch's RNG, so every opt
//! level sees the same batches), learning-rate schedules, evaluation.
use tch::nn::ModuleT;
use tch::Kind;

use super::data::Split;

/// SplitMix64: a small seeded generator for batch orders and synthetic data.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A permutation of `0..n` (Fisher-Yates) seeded with `seed`.
pub fn permutation(n: usize, seed: u64) -> Vec<i64> {
    let mut rng = SplitMix64::new(seed);
    let mut v: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// The batches of one epoch: a permutation of `0..n` seeded by `(seed, epoch)`, cut into
/// batches of `batch_size` (the last one may be smaller).
pub fn epoch_batches(n: usize, batch_size: usize, seed: u64, epoch: usize) -> Vec<Vec<i64>> {
    let perm = permutation(n, seed ^ (epoch as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    perm.chunks(batch_size.max(1)).map(<[i64]>::to_vec).collect()
}

/// Number of batches per epoch.
pub fn steps_per_epoch(n: usize, batch_size: usize) -> usize {
    n.div_ceil(batch_size.max(1))
}

/// Cosine decay from `base` to 0 over `total` steps, after a linear warm-up of `warmup` steps.
pub fn cosine_lr(base: f64, step: usize, total: usize, warmup: usize) -> f64 {
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    let t = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    base * 0.5 * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos())
}

/// Loss and accuracy of a classifier on a split.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Eval {
    /// Mean cross-entropy.
    pub loss: f64,
    /// Top-1 accuracy in percent.
    pub top1: f64,
    /// Top-5 accuracy in percent (100 with 5 classes or fewer).
    pub top5: f64,
}

/// Evaluates `model` (eval mode: batch norm uses its running statistics) on `split`, in
/// batches of `batch_size`, without gradients. The logits are taken in fp32.
pub fn evaluate(model: &impl ModuleT, split: &Split, batch_size: usize) -> Eval {
    let _no_grad = tch::no_grad_guard();
    let n = split.len() as i64;
    let bs = batch_size.max(1) as i64;
    let (mut loss, mut top1, mut top5) = (0.0, 0.0, 0.0);
    let mut start = 0;
    while start < n {
        let len = bs.min(n - start);
        let x = split.images.narrow(0, start, len);
        let y = split.labels.narrow(0, start, len);
        let logits = model.forward_t(&x, false).to_kind(Kind::Float);
        loss += logits.cross_entropy_for_logits(&y).double_value(&[]) * len as f64;
        let k = logits.size()[1].min(5);
        let (_, pred) = logits.topk(k, 1, true, true);
        let hit = pred.eq_tensor(&y.unsqueeze(1));
        top1 += hit.narrow(1, 0, 1).sum(Kind::Float).double_value(&[]);
        top5 += hit.sum(Kind::Float).double_value(&[]);
        start += len;
    }
    let n = n.max(1) as f64;
    Eval { loss: loss / n, top1: 100.0 * top1 / n, top5: 100.0 * top5 / n }
}
