//! Bytes held by training state: model variables, gradients, fp32 master weights and the
//! optimizer's buffers. Activations are not counted (they depend on the batch size and on
//! libtorch's allocator, not on the opt level's bookkeeping).
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
    /// Optimizer buffers (Adam's two moments, SGD's momentum), fp32 for fp16 parameters.
    pub optimizer_state: u64,
}

impl MemoryBytes {
    /// The sum.
    pub fn total(&self) -> u64 {
        self.weights + self.grads + self.masters + self.optimizer_state
    }
}

/// Counts the bytes of `vs` and `opt` with the library's [`AmpOptimizer::memory`], plus the
/// VarStore's non-trainable variables (batch-norm statistics). Call it after `scale_loss` and
/// before `step` so that the gradients are there (optimizer state exists after the first step).
pub fn measure(vs: &VarStore, opt: &AmpOptimizer) -> MemoryBytes {
    let r = opt.memory();
    let buffers: u64 = vs.variables().values().filter(|v| !v.requires_grad()).map(bytes).sum();
    MemoryBytes {
        weights: r.weights as u64 + buffers,
        grads: r.grads as u64,
        masters: r.masters as u64,
        optimizer_state: r.optimizer_state as u64,
    }
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
