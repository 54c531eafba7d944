//! Bytes held by training state: model variables, gradients, fp32 master weights and the
//! optimizer's buffers. Activations are not counted (they depend on the batch size and on
//! libtorch's allocator, not on the opt level's bookkeeping).
use std::collections::HashSet;

use tch::nn::VarStore;
use tch::Tensor;
use tch_amp::AmpOptimizer;

fn bytes(t: &Tensor) -> u64 {
    if t.defined() {
        t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
    } else {
        0
    }
}

/// The byte counts of one training setup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryBytes {
    /// Every variable of the VarStore (parameters and batch-norm statistics), in its dtype.
    pub weights: u64,
    /// Gradients held when the optimizer steps: model gradients still defined plus the
    /// master gradients.
    pub grads: u64,
    /// fp32 master copies that are not the model's own variables.
    pub masters: u64,
    /// Optimizer buffers: `buffers_per_param` tensors shaped and typed like each stepped
    /// parameter (Adam's two moments, SGD's momentum).
    pub optimizer_state: u64,
}

impl MemoryBytes {
    /// The sum.
    pub fn total(&self) -> u64 {
        self.weights + self.grads + self.masters + self.optimizer_state
    }
}

/// Counts the bytes of `vs` and `opt`. Call it after `scale_loss` and before `step` so that
/// the gradients are there.
pub fn measure(vs: &VarStore, opt: &AmpOptimizer, buffers_per_param: u64) -> MemoryBytes {
    let vars = vs.variables();
    let weights = vars.values().map(bytes).sum();
    let model_ptrs: HashSet<usize> = vars.values().map(|v| v.data_ptr() as usize).collect();
    let mut grads: u64 = vars.values().filter(|v| v.requires_grad()).map(|v| bytes(&v.grad())).sum();
    let mut masters = 0;
    let mut state = 0;
    for m in opt.master_params() {
        state += buffers_per_param * bytes(&m);
        if !model_ptrs.contains(&(m.data_ptr() as usize)) {
            masters += bytes(&m);
            grads += bytes(&m.grad());
        }
    }
    MemoryBytes { weights, grads, masters, optimizer_state: state }
}

/// `12345678` → `"11.8 MiB"`.
pub fn human(b: u64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}
