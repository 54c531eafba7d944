//! Which kernels run fp16/bf16 GEMMs, convolutions and attention on the CPU: libtorch's native
//! ones, or tch-amp's emulation in fp32 (`opt_levels/emulate_cpu.toml`), chosen per operation
//! class ([`OpClass`]) and 16-bit type.
//!
//! libtorch sends an fp16/bf16 GEMM or convolution to oneDNN when oneDNN supports the type on
//! the CPU; otherwise it runs a generic loop, many times slower than fp32. How fast oneDNN is
//! depends on the CPU's 16-bit units and on the kernels oneDNN has for them, and differs by class:
//! with AVX512_FP16 and no AMX_FP16, fp16 GEMMs run at fp32 speed while the weight gradient of an
//! fp16 convolution takes oneDNN's reference kernel, dozens of times slower. [`CpuFeatures`]
//! holds the table (measured per CPU kind, docs/cpu_emulation.md; unknown CPUs emulate), which
//! `Auto` follows; the emulation (inputs converted to fp32, the fp32 op, outputs rounded once)
//! runs at fp32 speed everywhere. Both follow the same numerical contract: inputs in the 16-bit
//! type, products accumulated in fp32, the output rounded once (`tests/o1/emulation.rs` checks
//! native against emulated on the CPU the tests run on). The choice is made from detected
//! features only, never from timings, so a setting gives the same kernels, and bits, at every run.
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

use once_cell::sync::OnceCell;
use tch::Kind;

use crate::error::{ConfigError, Result};
use crate::sys;

/// How fp16/bf16 ops of one operation class (the ops of `opt_levels/emulate_cpu.toml`) run on
/// the CPU under tch-amp's casts (O1's low-precision list, O2/O3's fp16/bf16 model) and
/// torch.amp's CPU autocast. No effect on CUDA, where libtorch's kernels always run.
///
/// Parsed from `"auto"`, `"emulate"` or `"native"` ([`ConfigError::InvalidOption`] otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum CpuKernels {
    /// Decided from the CPU ([`CpuFeatures::auto_choice`]): native where libtorch's kernels for
    /// the class and type were measured faster than fp32 on this kind of CPU, emulated elsewhere.
    #[default]
    Auto,
    /// Compute in fp32 on exact fp32 copies of the fp16/bf16 inputs and round the outputs once.
    Emulate,
    /// libtorch's own fp16/bf16 kernels (oneDNN where the CPU supports the type): what
    /// torch.autocast runs, bit for bit.
    Native,
}

impl CpuKernels {
    /// `"auto"`, `"emulate"` or `"native"`.
    pub fn name(self) -> &'static str {
        match self {
            CpuKernels::Auto => "auto",
            CpuKernels::Emulate => "emulate",
            CpuKernels::Native => "native",
        }
    }
}

impl fmt::Display for CpuKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpuKernels {
    type Err = ConfigError;

    fn from_str(s: &str) -> std::result::Result<Self, ConfigError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CpuKernels::Auto),
            "emulate" | "emulated" => Ok(CpuKernels::Emulate),
            "native" => Ok(CpuKernels::Native),
            _ => Err(ConfigError::InvalidOption {
                option: "CPU kernels",
                value: s.to_string(),
                expected: "\"auto\", \"emulate\" or \"native\"",
            }),
        }
    }
}

/// The classes of ops whose CPU kernels are chosen together (`opt_levels/emulate_cpu.toml`
/// lists their ops). Every other op always runs libtorch's kernel in its inputs' type: there is
/// nothing to emulate in elementwise ops, normalisations or reductions.
///
/// Parsed from `"gemm"`, `"convolution"` (or `"conv"`) and `"attention"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum OpClass {
    /// Matrix products: mm, addmm, bmm, baddbmm, addbmm, linear, matmul, mv, addmv, addr, dot.
    Gemm,
    /// Convolutions and transposed convolutions (1-3d), convolution, conv_tbc.
    Convolution,
    /// scaled_dot_product_attention (and its math path), as a whole.
    Attention,
}

impl OpClass {
    /// Every class, in this order.
    pub const ALL: [OpClass; 3] = [OpClass::Gemm, OpClass::Convolution, OpClass::Attention];

    /// `"gemm"`, `"convolution"` or `"attention"`.
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Gemm => "gemm",
            OpClass::Convolution => "convolution",
            OpClass::Attention => "attention",
        }
    }
}

impl fmt::Display for OpClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OpClass {
    type Err = ConfigError;

    fn from_str(s: &str) -> std::result::Result<Self, ConfigError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "gemm" => Ok(OpClass::Gemm),
            "conv" | "convolution" => Ok(OpClass::Convolution),
            "attention" => Ok(OpClass::Attention),
            _ => Err(ConfigError::InvalidOption {
                option: "CPU operation class",
                value: s.to_string(),
                expected: "\"gemm\", \"convolution\" (\"conv\") or \"attention\"",
            }),
        }
    }
}

/// How each operation class's ops run on the CPU for one 16-bit type.
///
/// Parsed from a mode for every class (`"emulate"`), or from `class=mode` items separated by
/// commas, after an optional mode for the classes not named (`"native,convolution=emulate"`;
/// without it they stay `auto`). An unknown class or mode, or a class named twice, is a
/// [`ConfigError::InvalidOption`].
///
/// ```
/// use tch_amp::{CpuKernelChoice, CpuKernels, OpClass};
/// let c: CpuKernelChoice = "native,conv=emulate".parse().unwrap();
/// assert_eq!(c.get(OpClass::Gemm), CpuKernels::Native);
/// assert_eq!(c.get(OpClass::Convolution), CpuKernels::Emulate);
/// assert_eq!(c.to_string(), "gemm native, convolution emulate, attention native");
/// assert!("gemm=fast".parse::<CpuKernelChoice>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct CpuKernelChoice {
    /// GEMM-like ops ([`OpClass::Gemm`]).
    pub gemm: CpuKernels,
    /// Convolutions ([`OpClass::Convolution`]).
    pub convolution: CpuKernels,
    /// Attention ([`OpClass::Attention`]).
    pub attention: CpuKernels,
}

impl CpuKernelChoice {
    /// `mode` for every class.
    pub fn all(mode: CpuKernels) -> Self {
        Self { gemm: mode, convolution: mode, attention: mode }
    }

    /// The mode of `class`.
    pub fn get(&self, class: OpClass) -> CpuKernels {
        match class {
            OpClass::Gemm => self.gemm,
            OpClass::Convolution => self.convolution,
            OpClass::Attention => self.attention,
        }
    }

    /// This choice with `class` set to `mode`.
    pub fn with(mut self, class: OpClass, mode: CpuKernels) -> Self {
        match class {
            OpClass::Gemm => self.gemm = mode,
            OpClass::Convolution => self.convolution = mode,
            OpClass::Attention => self.attention = mode,
        }
        self
    }

    /// `Auto` replaced by this CPU's choice for `kind` (`Half` or `BFloat16`), class by class.
    pub fn resolved(self, kind: Kind) -> Self {
        let auto = CpuFeatures::detect().auto_choice(kind);
        OpClass::ALL.iter().fold(self, |c, &class| match c.get(class) {
            CpuKernels::Auto => c.with(class, auto.get(class)),
            _ => c,
        })
    }

    /// Whether `class` is emulated for `kind` (`Auto` resolved).
    pub fn emulates(&self, class: OpClass, kind: Kind) -> bool {
        self.resolved(kind).get(class) == CpuKernels::Emulate
    }
}

impl fmt::Display for CpuKernelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = OpClass::ALL.iter().map(|c| format!("{c} {}", self.get(*c))).collect();
        f.write_str(&parts.join(", "))
    }
}

impl FromStr for CpuKernelChoice {
    type Err = ConfigError;

    fn from_str(s: &str) -> std::result::Result<Self, ConfigError> {
        let invalid = || ConfigError::InvalidOption {
            option: "CPU kernel choice",
            value: s.to_string(),
            expected: "a mode (auto, emulate, native), then class=mode items (gemm, convolution, attention), \
                       separated by commas, each class at most once",
        };
        let mut items: Vec<&str> = s.split(',').map(str::trim).collect();
        let mut choice = CpuKernelChoice::default();
        if let Some(first) = items.first().filter(|i| !i.contains('=')) {
            choice = CpuKernelChoice::all(first.parse()?);
            items.remove(0);
        }
        let mut named = Vec::new();
        for item in items {
            let (class, mode) = item.split_once('=').ok_or_else(invalid)?;
            let class: OpClass = class.parse()?;
            if named.contains(&class) {
                return Err(invalid());
            }
            named.push(class);
            choice = choice.with(class, mode.parse()?);
        }
        Ok(choice)
    }
}

/// What the CPU and libtorch's oneDNN offer for fp16/bf16, as ATen detects it
/// (`at::cpu::get_cpu_capabilities()`, cpuinfo) and as oneDNN checks it
/// (`torch.ops.mkldnn._is_mkldnn_bf16_supported` / `_fp16_`), and the table `Auto` follows.
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
    /// expected) gives no features, so `Auto` emulates every class (with a `log` warning).
    pub fn detect() -> &'static CpuFeatures {
        static DETECTED: OnceCell<CpuFeatures> = OnceCell::new();
        DETECTED.get_or_init(|| {
            Self::query().unwrap_or_else(|e| {
                log::warn!(
                    "tch-amp: the CPU's features could not be detected ({e}); CpuKernels::Auto emulates every class"
                );
                CpuFeatures::default()
            })
        })
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

    /// Whether libtorch's native `class` kernels for `kind` (`Half` or `BFloat16`) were measured
    /// faster than the emulation, for training (forward and backward), on CPUs with this CPU's
    /// features (docs/cpu_emulation.md has the measurements):
    /// - bf16 GEMMs and convolutions: native with AMX_BF16 (and oneDNN's bf16 support); with
    ///   AVX512_BF16 alone oneDNN's bf16 GEMMs are slower than fp32.
    /// - fp16 GEMMs: native with AVX512_FP16 or AMX_FP16 (and oneDNN's fp16 support), where
    ///   they run at fp32 speed or faster.
    /// - fp16 convolutions: never. With AVX512_FP16 and no AMX_FP16 oneDNN computes the weight
    ///   gradient with its reference kernel, dozens of times slower; CPUs with AMX_FP16 have not
    ///   been measured (force [`CpuKernels::Native`] after measuring them).
    /// - attention: never; libtorch's fp16/bf16 CPU attention was measured slower than fp32
    ///   even with AMX.
    /// - everything else, and CPUs without 16-bit units: emulated. libtorch's generic fp16/bf16
    ///   loops run many times slower than fp32, and the emulation is never much slower than
    ///   fp32, so an unknown CPU emulates.
    pub fn native_is_fast(&self, class: OpClass, kind: Kind) -> bool {
        match (class, kind) {
            (OpClass::Gemm | OpClass::Convolution, Kind::BFloat16) => self.onednn_bf16 && self.amx_bf16,
            (OpClass::Gemm, Kind::Half) => self.onednn_fp16 && (self.avx512_fp16 || self.amx_fp16),
            _ => false,
        }
    }

    /// How many times slower than fp32 libtorch's native `class` kernels for `kind` were
    /// measured on CPUs with this CPU's features, where that is 3x or more (what forcing
    /// [`CpuKernels::Native`] costs); `None` where they are not known to be that slow.
    pub fn native_slowdown(&self, class: OpClass, kind: Kind) -> Option<f64> {
        let units = match kind {
            Kind::BFloat16 => self.avx512_bf16 || self.amx_bf16,
            Kind::Half => self.avx512_fp16 || self.amx_fp16,
            _ => return None,
        };
        match (class, kind, units) {
            // No 16-bit units: libtorch's generic loops (BENCHMARKS.md, AVX2-only CPU).
            (OpClass::Gemm | OpClass::Attention, Kind::BFloat16, false) => Some(15.0),
            (OpClass::Gemm | OpClass::Attention, Kind::Half, false) => Some(20.0),
            (OpClass::Convolution, _, false) => Some(5.0),
            // oneDNN's reference kernel for the weight gradient.
            (OpClass::Convolution, Kind::Half, true) if !self.amx_fp16 => Some(50.0),
            (OpClass::Attention, _, true) => Some(3.0),
            _ => None,
        }
    }

    /// What [`CpuKernels::Auto`] resolves to for `kind`'s classes on this CPU
    /// ([`Self::native_is_fast`]).
    pub fn auto_choice(&self, kind: Kind) -> CpuKernelChoice {
        OpClass::ALL.iter().fold(CpuKernelChoice::default(), |c, &class| {
            c.with(class, if self.native_is_fast(class, kind) { CpuKernels::Native } else { CpuKernels::Emulate })
        })
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

    /// `Auto`'s choice for both types, e.g. `"fp16: gemm native, convolution emulate, attention
    /// emulate; bf16: gemm native, convolution native, attention emulate"`.
    pub fn auto_summary(&self) -> String {
        format!("fp16: {}; bf16: {}", self.auto_choice(Kind::Half), self.auto_choice(Kind::BFloat16))
    }
}

/// `Auto` resolved against this CPU, class by class.
pub(crate) fn resolve(choice: CpuKernelChoice, kind: Kind) -> CpuKernelChoice {
    choice.resolved(kind)
}

/// Logs, once per process and class and type, a warning for each class `choice` runs natively
/// in `kind` where libtorch's native kernels are known to be many times slower than fp32 on
/// this CPU ([`CpuFeatures::native_slowdown`]). `Auto` never chooses those.
pub(crate) fn warn_if_slow(choice: CpuKernelChoice, kind: Kind) {
    static WARNED: Warned = Warned::new();
    for message in slow_kernel_warnings(CpuFeatures::detect(), choice, kind, &WARNED) {
        log::warn!("{message}");
    }
}

/// The (type, class) pairs already warned about: fp16 then bf16, classes in [`OpClass::ALL`]'s
/// order.
struct Warned([[AtomicBool; 3]; 2]);

impl Warned {
    const fn new() -> Self {
        Self([
            [AtomicBool::new(false), AtomicBool::new(false), AtomicBool::new(false)],
            [AtomicBool::new(false), AtomicBool::new(false), AtomicBool::new(false)],
        ])
    }
}

/// The warnings [`warn_if_slow`] logs on a CPU with `cpu`'s features, each (type, class) pair
/// at most once per `warned`.
fn slow_kernel_warnings(cpu: &CpuFeatures, choice: CpuKernelChoice, kind: Kind, warned: &Warned) -> Vec<String> {
    let (row, name) = match kind {
        Kind::Half => (0, "fp16"),
        Kind::BFloat16 => (1, "bf16"),
        _ => return Vec::new(),
    };
    let mut messages = Vec::new();
    for (i, class) in OpClass::ALL.iter().enumerate() {
        if choice.get(*class) != CpuKernels::Native {
            continue;
        }
        let Some(factor) = cpu.native_slowdown(*class, kind) else { continue };
        if !warned.0[row][i].swap(true, Ordering::Relaxed) {
            messages.push(format!(
                "tch-amp: libtorch's native {name} {class} kernels were measured about {factor:.0}x slower than fp32 \
                 on CPUs like this one ({}); CpuKernels::Emulate (or Auto) computes them in fp32 from the {name} \
                 inputs with the same rounding points, at about fp32 speed",
                cpu.summary()
            ));
        }
    }
    messages
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU kinds of the table, as features (what `CpuFeatures::detect` reports on them).
    fn avx2_only() -> CpuFeatures {
        CpuFeatures { avx2: true, ..Default::default() }
    }

    fn sapphire_rapids() -> CpuFeatures {
        CpuFeatures {
            avx2: true,
            avx512: true,
            avx512_bf16: true,
            avx512_fp16: true,
            amx_tile: true,
            amx_bf16: true,
            onednn_bf16: true,
            onednn_fp16: true,
            ..Default::default()
        }
    }

    /// Forcing native kernels where they are known many times slower than fp32 warns once per
    /// type and class, naming the factor and the alternative; `Auto`, `Emulate` and fast native
    /// classes never warn.
    #[test]
    fn forced_slow_native_kernels_warn_once_per_type_and_class() {
        let warned = Warned::new();
        let native = CpuKernelChoice::all(CpuKernels::Native);
        let cpu = avx2_only();
        let first = slow_kernel_warnings(&cpu, native, Kind::BFloat16, &warned);
        assert_eq!(first.len(), 3, "{first:?}");
        assert!(first[0].contains("native bf16 gemm kernels were measured about 15x slower"), "{}", first[0]);
        assert!(first[1].contains("native bf16 convolution kernels were measured about 5x slower"), "{}", first[1]);
        assert!(first.iter().all(|m| m.contains("CpuKernels::Emulate") && m.contains("AVX2")), "{first:?}");
        assert!(slow_kernel_warnings(&cpu, native, Kind::BFloat16, &warned).is_empty(), "once");
        assert_eq!(slow_kernel_warnings(&cpu, native, Kind::Half, &warned).len(), 3, "fp16 is another type");
        for mode in [CpuKernels::Auto, CpuKernels::Emulate] {
            let fresh = Warned::new();
            assert!(slow_kernel_warnings(&cpu, CpuKernelChoice::all(mode), Kind::Half, &fresh).is_empty(), "{mode}");
        }
        // With 16-bit units: only the classes measured slow there.
        let cpu = sapphire_rapids();
        let fresh = Warned::new();
        assert!(slow_kernel_warnings(&cpu, native.with(OpClass::Attention, CpuKernels::Auto), Kind::BFloat16, &fresh)
            .is_empty());
        let half = slow_kernel_warnings(&cpu, native, Kind::Half, &fresh);
        assert_eq!(half.len(), 2, "{half:?}");
        assert!(half[0].contains("fp16 convolution kernels were measured about 50x slower"), "{}", half[0]);
        assert!(half[1].contains("fp16 attention kernels were measured about 3x slower"), "{}", half[1]);
        assert!(slow_kernel_warnings(&cpu, native, Kind::Float, &fresh).is_empty(), "fp32 has nothing to warn about");
    }

    /// `Auto` on the table's CPU kinds (and on a CPU with no features, as a failed detection
    /// gives): never a class it would warn about.
    #[test]
    fn auto_never_chooses_a_slow_native_class() {
        for cpu in [CpuFeatures::default(), avx2_only(), sapphire_rapids()] {
            for kind in [Kind::Half, Kind::BFloat16] {
                let auto = cpu.auto_choice(kind);
                for class in OpClass::ALL {
                    if cpu.native_slowdown(class, kind).is_some() {
                        assert_eq!(auto.get(class), CpuKernels::Emulate, "{kind:?} {class} on {}", cpu.summary());
                    }
                }
            }
        }
        let spr = sapphire_rapids();
        assert_eq!(spr.auto_summary(), "fp16: gemm native, convolution emulate, attention emulate; bf16: gemm native, convolution native, attention emulate");
        assert_eq!(CpuFeatures::default().auto_choice(Kind::BFloat16), CpuKernelChoice::all(CpuKernels::Emulate));
    }
}
