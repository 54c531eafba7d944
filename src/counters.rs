//! Counters tch-amp increments and [`crate::diagnostics`] reads: a leaf of the module graph.
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

static HOST_READS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Gradient inspections beyond the overflow flag made on this thread.
    static GRADIENT_SCANS: Cell<u64> = const { Cell::new(0) };
}

/// Counts one read of a tensor value into host memory by tch-amp (on CUDA: a host sync).
pub(crate) fn note_host_read() {
    HOST_READS.fetch_add(1, Ordering::Relaxed);
}

/// Host reads in this process so far (every thread).
pub(crate) fn host_reads() -> u64 {
    HOST_READS.load(Ordering::Relaxed)
}

/// Counts one inspection of the gradients beyond the overflow flag on this thread.
pub(crate) fn note_gradient_scan() {
    GRADIENT_SCANS.with(|c| c.set(c.get() + 1));
}

/// Inspections beyond the overflow flag made on this thread so far.
pub(crate) fn gradient_scans() -> u64 {
    GRADIENT_SCANS.with(|c| c.get())
}
