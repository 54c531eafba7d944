//! Which kernels run fp16/bf16 GEMMs and convolutions on the CPU: libtorch's native ones, or
//! tch-amp's emulation in fp32 (`opt_levels/emulate_cpu.toml`), chosen per dtype from what the
//! CPU and libtorch's oneDNN can do.
//!
//! libtorch sends an fp16/bf16 GEMM or convolution to oneDNN when oneDNN supports the type on
//! the CPU; otherwise it runs a generic loop, many times slower than fp32. oneDNN is only
//! fast where the CPU computes in that type (bf16: AVX512_BF16 dot products or AMX_BF16 tile
//! multiplies), and then only for the kernels it has: on AVX512_FP16 it has no fast fp16
//! convolution weight gradient. [`CpuFeatures::native_is_fast`] gives the rule (BENCHMARKS.md
//! the measurements behind it); the emulation (both operands converted to fp32, an fp32 GEMM, the
//! output rounded) runs at fp32 speed everywhere. Both follow the same numerical
//! contract: inputs in the 16-bit type, products accumulated in fp32, the output rounded once
//! (`tests/o1/emulation.rs` checks native against emulated on the CPU the tests run on).
use once_cell::sync::OnceCell;
use tch::Kind;

use crate::error::Result;
use crate::sys;

/// How fp16/bf16 GEMMs and convolutions (the ops of `opt_levels/emulate_cpu.toml`) run on the
/// CPU under tch-amp's casts (O1's low-precision list, O2/O3's fp16/bf16 model). No effect on
/// CUDA, where libtorch's kernels always run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum CpuKernels {
    /// Decide at initialize from the CPU ([`CpuFeatures::auto_choice`]): native where libtorch
    /// has fast kernels for the type on this CPU, emulated elsewhere.
    #[default]
    Auto,
    /// Compute in fp32 on exact fp32 copies of the fp16/bf16 inputs and round the outputs once.
    Emulate,
    /// libtorch's own fp16/bf16 kernels (oneDNN where the CPU supports the type).
    Native,
}

/// What the CPU and libtorch's oneDNN offer for fp16/bf16, as ATen detects it
/// (`at::cpu::get_cpu_capabilities()`, cpuinfo) and as oneDNN checks it
/// (`torch.ops.mkldnn._is_mkldnn_bf16_supported` / `_fp16_`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    /// The CPU's name as cpuinfo reports it ("" when unknown).
    pub name: String,
    /// AVX2.
    pub avx2: bool,
    /// AVX512F (the AVX-512 foundation).
    pub avx512: bool,
    /// AVX512_BF16: bf16 dot products.
    pub avx512_bf16: bool,
    /// AVX512_FP16: fp16 arithmetic.
    pub avx512_fp16: bool,
    /// AMX tiles.
    pub amx_tile: bool,
    /// AMX_BF16: bf16 tile matrix multiply.
    pub amx_bf16: bool,
    /// AMX_FP16: fp16 tile matrix multiply.
    pub amx_fp16: bool,
    /// oneDNN is built in, enabled, and supports bf16 on this CPU (it may emulate it with
    /// AVX512 or AVX-NE-CONVERT conversions).
    pub onednn_bf16: bool,
    /// oneDNN is built in, enabled, and supports fp16 on this CPU.
    pub onednn_fp16: bool,
    /// Physical cores (0 when unknown).
    pub physical_cores: usize,
}

impl CpuFeatures {
    /// The features of this machine, detected once per process. A failed detection (not
    /// expected) gives no features, so `Auto` emulates.
    pub fn detect() -> &'static CpuFeatures {
        static DETECTED: OnceCell<CpuFeatures> = OnceCell::new();
        DETECTED.get_or_init(|| Self::query().unwrap_or_default())
    }

    fn query() -> Result<Self> {
        let mut f = CpuFeatures::default();
        let (mut mkldnn, mut mkldnn_enabled, mut bf16, mut fp16) = (false, false, false, false);
        for line in sys::cpu::cpu_capabilities()? {
            let Some((key, value)) = line.split_once('=') else { continue };
            let on = value == "1";
            match key {
                "cpu_name" => f.name = value.to_string(),
                "avx2" => f.avx2 = on,
                "avx512_f" => f.avx512 = on,
                "avx512_bf16" => f.avx512_bf16 = on,
                "avx512_fp16" => f.avx512_fp16 = on,
                "amx_tile" => f.amx_tile = on,
                "amx_bf16" => f.amx_bf16 = on,
                "amx_fp16" => f.amx_fp16 = on,
                "num_physical_cores" => f.physical_cores = value.parse().unwrap_or(0),
                "mkldnn" => mkldnn = on,
                "mkldnn_enabled" => mkldnn_enabled = on,
                "mkldnn_bf16" => bf16 = on,
                "mkldnn_fp16" => fp16 = on,
                _ => {}
            }
        }
        f.onednn_bf16 = mkldnn && mkldnn_enabled && bf16;
        f.onednn_fp16 = mkldnn && mkldnn_enabled && fp16;
        Ok(f)
    }

    /// Whether libtorch's native kernels for `kind` (`Half` or `BFloat16`) are faster on this
    /// CPU than the emulation, for training (forward and backward); `cargo bench --bench amp`
    /// measures both (BENCHMARKS.md):
    /// - bf16: native when oneDNN supports bf16 and the CPU computes in it (AVX512_BF16 or
    ///   AMX_BF16): there oneDNN's bf16 kernels beat an fp32 computation. Without those units
    ///   oneDNN converts bf16 to fp32 as the emulation does, or libtorch falls back to generic
    ///   loops many times slower than fp32.
    /// - fp16: never. With AVX512_FP16 (and no AMX_FP16) oneDNN runs fp16 GEMMs at fp32 speed
    ///   but computes the weight gradient of an fp16 convolution with its reference kernel
    ///   (`ref:any`), far slower than the emulation. CPUs with AMX_FP16 have not been
    ///   measured; force [`CpuKernels::Native`] after measuring them. Without fp16 units
    ///   libtorch's fp16 GEMMs run generic loops many times slower than fp32.
    pub fn native_is_fast(&self, kind: Kind) -> bool {
        match kind {
            Kind::BFloat16 => self.onednn_bf16 && (self.avx512_bf16 || self.amx_bf16),
            _ => false,
        }
    }

    /// What [`CpuKernels::Auto`] resolves to for `kind` on this CPU.
    pub fn auto_choice(&self, kind: Kind) -> CpuKernels {
        if self.native_is_fast(kind) {
            CpuKernels::Native
        } else {
            CpuKernels::Emulate
        }
    }

    /// The low-precision-relevant flags, e.g. `"AVX2 AVX512 AVX512_BF16 AVX512_FP16 AMX_BF16;
    /// oneDNN bf16 fp16"` (absent flags are left out).
    pub fn summary(&self) -> String {
        let flags = [
            ("AVX2", self.avx2),
            ("AVX512", self.avx512),
            ("AVX512_BF16", self.avx512_bf16),
            ("AVX512_FP16", self.avx512_fp16),
            ("AMX_BF16", self.amx_bf16),
            ("AMX_FP16", self.amx_fp16),
        ];
        let mut s: Vec<&str> = flags.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect();
        if s.is_empty() {
            s.push("no AVX2");
        }
        let onednn: Vec<&str> = [("bf16", self.onednn_bf16), ("fp16", self.onednn_fp16)]
            .iter()
            .filter(|(_, on)| *on)
            .map(|(n, _)| *n)
            .collect();
        let onednn = if onednn.is_empty() { "none".to_string() } else { onednn.join(" ") };
        format!("{}; oneDNN low precision: {onednn}", s.join(" "))
    }
}

/// `Auto` resolved against this CPU; `Emulate`/`Native` unchanged.
pub(crate) fn resolve(mode: CpuKernels, kind: Kind) -> CpuKernels {
    match mode {
        CpuKernels::Auto => CpuFeatures::detect().auto_choice(kind),
        other => other,
    }
}

/// Sets the C allocator to keep freed memory for reuse, once per process; returns whether it is
/// in effect (false where the C library is not glibc). tch-amp never calls it: it is an opt-in
/// for the program that owns the process (the examples and the benchmark call it).
///
/// libtorch allocates CPU tensors with `posix_memalign`. glibc's malloc serves blocks above a
/// threshold (128 KiB at first, raised as such blocks are freed) with a fresh `mmap` and trims
/// the heap's free top back to the kernel, so a training loop that frees and reallocates the
/// same multi-MiB tensors every step (the fp32 copies of fp16 weights an emulated GEMM
/// multiplies, the weight gradients) gets them back as new pages, which the kernel maps and
/// zeroes one page at a time on first touch. PyTorch's own CPU performance guide recommends jemalloc or tcmalloc for the same
/// reason.
///
/// The setting: blocks up to 32 MiB come from the heap (`M_MMAP_THRESHOLD`), and the heap keeps
/// up to 1 GiB of free space at its top (`M_TRIM_THRESHOLD`). The process's resident memory
/// then stays at its peak instead of shrinking between steps, as with the CUDA caching
/// allocator. Process-wide, and it stays once made (`mallopt` has no way back to glibc's
/// adaptive defaults); `MALLOC_*`/`GLIBC_TUNABLES` settings of the environment are replaced by
/// it.
///
/// # Errors
/// [`AmpError::Torch`](crate::AmpError::Torch) if the shim call itself fails (not expected).
pub fn keep_freed_cpu_memory() -> Result<bool> {
    KEPT.get_or_try_init(sys::cpu::keep_freed_memory).copied()
}

/// Whether [`keep_freed_cpu_memory`] took effect (unset before its first call).
static KEPT: OnceCell<bool> = OnceCell::new();

/// Whether [`keep_freed_cpu_memory`] has been applied in this process and took effect.
pub fn freed_cpu_memory_kept() -> bool {
    KEPT.get().copied().unwrap_or(false)
}
