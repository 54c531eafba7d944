//! `cargo bench --bench amp` (or `make bench`): one table per workload of training-step times,
//! tch-amp's opt levels against a hand-written fp32 tch loop and against PyTorch's own AMP on
//! the same model, batch and thread count (scripts/bench_torch.py, run as a server by the
//! setup's torch venv), with the fraction of this machine's fp32 GEMM peak each reaches.
//!
//! Workloads: an MLP (GEMM-bound), `make demo`'s small ResNet (convolution-bound, from
//! examples/common/model.rs) and a 2-block pre-LN transformer encoder (attention, LayerNorm,
//! GELU, softmax: where Apex's fp32 list matters). Every configuration runs in every round,
//! in turn (ABAB...), after a warm-up: one untimed step, then `--steps` timed steps, per round.
//! Each figure is the median over rounds of the per-round median, with the min/max over
//! rounds; each ratio is computed per round (both figures from the same round) and reported
//! the same way. It prints measurements, not verdicts.
//!
//! ```text
//! cargo bench --bench amp                                   # the full table (idle machine!)
//! cargo bench --bench amp -- --steps 2 --rounds 2 --warmup 1 --workloads mlp   # smoke run
//! cargo bench --bench amp -- --phases --memory              # + per-phase times, measured peak B/param
//! cargo bench --bench amp -- --device cuda                  # the same table on a GPU (+ TF32 rows)
//! cargo bench --bench amp -- --no-timing --step-memory --workloads cnn,transformer   # bytes per step
//! ```
//!
//! `--step-memory` adds, per workload, the peak bytes of a whole training step (activations
//! included) under O0-O3 and the torch.amp path, and the largest batch whose step fits
//! `--budget-gib`, found by bisection on measured peaks. The GradScaler section times
//! `unscale_` + `update` against torch's on each workload's gradients. The float8 section times an
//! MLP of `tch_amp::float8` layers (torchao's recipes, TE's delayed scaling) against the same
//! MLP in fp32 and under bf16 autocast (`--float8-rounds 0` skips it). The doctor section times
//! one `tch_amp::doctor::Doctor::run` on the cnn workload against a training step of the same
//! set-up (`--doctor-rounds 0` skips it).
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use tch::nn::{self, Module, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::CpuFeatures;
use tch_amp::diagnostics;
use tch_amp::{
    Amp, AmpConfig, AmpModel, AmpOptimizer, Autocast, CpuKernelChoice, CpuKernels, GradScaler, OpClass, OptLevel,
    OptimizerConfig,
};

#[allow(dead_code)]
#[path = "../examples/common/model.rs"]
mod resnet;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum, serde::Serialize)]
enum Workload {
    Mlp,
    Cnn,
    Transformer,
    /// GPU-sized: the MLP at width 4096, batch 2048.
    MlpBig,
    /// GPU-sized: torchvision's ResNet-50 (tch::vision::resnet), batch 128 of 3x224x224.
    Resnet50,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Mlp => "mlp",
            Workload::Cnn => "cnn",
            Workload::Transformer => "transformer",
            Workload::MlpBig => "mlp-big",
            Workload::Resnet50 => "resnet50",
        }
    }
    /// The operation classes whose CPU kernels this workload runs (its attention is written
    /// out with matmul).
    fn classes(self) -> &'static [OpClass] {
        match self {
            Workload::Cnn | Workload::Resnet50 => &[OpClass::Gemm, OpClass::Convolution],
            _ => &[OpClass::Gemm],
        }
    }
    fn describe(self) -> &'static str {
        match self {
            Workload::Mlp => "MLP 784-1024-1024-10 with batch norm, batch 128 (GEMM-bound)",
            Workload::Cnn => "make demo's ResNet (width 16, 2 stages, pool 7), batch 128 of 1x28x28 (convolution-bound)",
            Workload::Transformer => {
                "2 pre-LN encoder blocks (d 256, 4 heads, FF 1024, GELU), batch 8 x 64 tokens (attention, LayerNorm, softmax)"
            }
            Workload::MlpBig => "MLP 784-4096-4096-10 with batch norm, batch 2048 (GEMM-bound; for GPUs)",
            Workload::Resnet50 => "torchvision's ResNet-50, batch 128 of 3x224x224 (for GPUs)",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
enum Opt {
    /// Adam, lr 1e-3.
    Adam,
    /// SGD with momentum 0.9, lr 1e-2.
    Sgd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
enum AdamKernel {
    /// libtorch's fused Adam kernel everywhere: tch-amp's `OptimizerConfig::fused(true)`, the
    /// same kernel called by the hand-written loop, torch.optim.Adam(fused=True). The update
    /// is then the same code in every row, so ratios measure the AMP machinery alone.
    Fused,
    /// torch.optim's single-tensor algorithm (tch-amp's default Adam, torch's default on CPU);
    /// the hand-written loop writes it with tch's ops (one more temporary per parameter, as
    /// tch has no `addcmul_` with a value).
    Single,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
enum KernelRows {
    /// Only what `CpuKernels::Auto` chooses on this CPU.
    Chosen,
    /// Auto's rows, and native and emulated rows (every class) where they differ from Auto's.
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
enum Clock {
    /// Elapsed time.
    Wall,
    /// The calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID; Python: time.thread_time).
    Cpu,
}

/// tch-amp's training-step benchmark (see the file's doc).
#[derive(Parser, Debug, serde::Serialize)]
#[command(about, long_about = None)]
struct Args {
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Workloads to run (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "mlp,cnn,transformer")]
    workloads: Vec<Workload>,
    /// Timed steps per configuration per round.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Rounds (every configuration runs once per round, in turn).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Untimed warm-up steps per configuration before the first round.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// libtorch intra-op threads (default: libtorch's choice), the same in PyTorch.
    #[arg(long)]
    threads: Option<i32>,
    /// The update rule.
    #[arg(long, value_enum, default_value_t = Opt::Adam)]
    optimizer: Opt,
    /// Which Adam the baselines run: keep it the algorithm tch-amp's Adam runs.
    #[arg(long, value_enum, default_value_t = AdamKernel::Fused)]
    adam_kernel: AdamKernel,
    /// Low-precision rows: the kernels `Auto` chooses (per operation class), or also every class
    /// native and every class emulated where those differ from `Auto` (CPU only).
    #[arg(long, value_enum, default_value_t = KernelRows::Both)]
    kernels: KernelRows,
    /// Keep only the configurations whose label contains one of these (comma-separated; the
    /// fp32 loop always runs: it is the baseline), e.g. `--only "O0,O2 fp16 (emulated"`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Skip the PyTorch rows.
    #[arg(long)]
    no_python: bool,
    /// Also print where each step's time goes (zero_grad, forward, backward, unscale, step).
    #[arg(long)]
    phases: bool,
    /// Also measure the peak bytes per parameter from scale_loss's unscale to the end of the
    /// step with a counting CPU allocator (after the timings: it slows allocation down).
    #[arg(long)]
    memory: bool,
    /// Write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A configuration whose warm-up step is this many times the fp32 loop's runs one timed
    /// step per round (native fp16 kernels on CPUs without fp16 units are 50-170x slower).
    #[arg(long, default_value_t = 8.0)]
    slow_factor: f64,
    /// What a step's time is: `wall` clock, or `cpu` time of the calling thread (with
    /// `--threads 1` on a shared machine it leaves out the time other processes hold the core).
    #[arg(long, value_enum, default_value_t = Clock::Wall)]
    clock: Clock,
    /// Side of the square fp32 GEMM whose rate is the "peak" (0: skip it; the fraction column
    /// is then empty).
    #[arg(long, default_value_t = 1536)]
    gemm_size: i64,
    /// Rounds of the overflow-path measurement (clean against overflowing O2 steps on the MLP;
    /// 0 skips it).
    #[arg(long, default_value_t = 5)]
    overflow_rounds: usize,
    /// Skip the step-time tables (to run only `--step-memory` and the GradScaler comparison).
    #[arg(long)]
    no_timing: bool,
    /// Also measure the peak bytes of a whole training step, activations included, under O0-O3
    /// and the torch.amp path, and search the largest batch whose step fits `--budget-gib`
    /// (CPU only: the counting allocator; after the timings).
    #[arg(long)]
    step_memory: bool,
    /// The memory budget of `--step-memory`'s largest-batch search, in GiB.
    #[arg(long, default_value_t = 2.0)]
    budget_gib: f64,
    /// Rounds of the GradScaler comparison (`unscale_` + `update` on each workload's gradients,
    /// tch-amp against PyTorch; 0 skips it).
    #[arg(long, default_value_t = 5)]
    scaler_rounds: usize,
    /// Rounds of the float8 comparison (an MLP of float8 linear layers, torchao's recipes and
    /// TE's delayed scaling, against the same MLP in fp32 and under bf16 autocast; 0 skips it).
    #[arg(long, default_value_t = 3)]
    float8_rounds: usize,
    /// Rounds of the precision doctor's cost (`Doctor::run` on the cnn workload against a
    /// training step of O1, O2 and bf16 autocast; 0 skips it).
    #[arg(long, default_value_t = 3)]
    doctor_rounds: usize,
    /// Leave glibc's malloc at its defaults (freed multi-MiB blocks go back to the kernel and
    /// come back as fresh pages) instead of calling `tch_amp::cast::keep_freed_cpu_memory`
    /// before the first row.
    #[arg(long)]
    system_malloc: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

// ---------------------------------------------------------------------------------------------
// Models

/// Pre-LN transformer encoder block with attention written out (as in bench_torch.py).
#[derive(Debug)]
struct EncoderBlock {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    out: nn::Linear,
    ln2: nn::LayerNorm,
    ff1: nn::Linear,
    ff2: nn::Linear,
    heads: i64,
}

impl EncoderBlock {
    fn new(p: &nn::Path, d: i64, heads: i64, ff: i64) -> Self {
        Self {
            ln1: nn::layer_norm(p / "ln1", vec![d], Default::default()),
            qkv: nn::linear(p / "qkv", d, 3 * d, Default::default()),
            out: nn::linear(p / "out", d, d, Default::default()),
            ln2: nn::layer_norm(p / "ln2", vec![d], Default::default()),
            ff1: nn::linear(p / "ff1", d, ff, Default::default()),
            ff2: nn::linear(p / "ff2", ff, d, Default::default()),
            heads,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, s, d) = x.size3().expect("[batch, tokens, features]");
        let (h, dh) = (self.heads, d / self.heads);
        let qkv = self.qkv.forward(&self.ln1.forward(x)).view([b, s, 3, h, dh]).permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let att = (q.matmul(&k.transpose(-2, -1)) * (1.0 / (dh as f64).sqrt())).softmax(-1, None::<Kind>);
        let o = att.matmul(&v).transpose(1, 2).reshape([b, s, d]);
        let x = x + self.out.forward(&o);
        let f = self.ff2.forward(&self.ff1.forward(&self.ln2.forward(&x)).gelu("none"));
        x + f
    }
}

#[derive(Debug)]
struct Encoder {
    blocks: Vec<EncoderBlock>,
    ln: nn::LayerNorm,
    head: nn::Linear,
}

const TR_D: i64 = 256;
const TR_HEADS: i64 = 4;
const TR_FF: i64 = 1024;
const TR_LAYERS: i64 = 2;
const TR_BATCH: i64 = 8;
const TR_TOKENS: i64 = 64;

impl Encoder {
    fn new(p: &nn::Path) -> Self {
        Self {
            blocks: (0..TR_LAYERS)
                .map(|i| EncoderBlock::new(&(p / format!("block{i}")), TR_D, TR_HEADS, TR_FF))
                .collect(),
            ln: nn::layer_norm(p / "ln", vec![TR_D], Default::default()),
            head: nn::linear(p / "head", TR_D, 10, Default::default()),
        }
    }
}

/// The three workloads' networks behind one type (tch-amp's model wrapper is generic).
#[derive(Debug)]
enum Net {
    Mlp(nn::SequentialT),
    Cnn(resnet::SmallResNet),
    Transformer(Encoder),
    Other(Box<dyn ModuleT>),
}

impl ModuleT for Net {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        match self {
            Net::Mlp(m) => m.forward_t(xs, train),
            Net::Cnn(m) => m.forward_t(xs, train),
            Net::Other(m) => m.forward_t(xs, train),
            Net::Transformer(m) => {
                let mut x = xs.shallow_clone();
                for b in &m.blocks {
                    x = b.forward(&x);
                }
                m.head.forward(&m.ln.forward(&x).mean_dim(1, false, None::<Kind>))
            }
        }
    }
}

const MLP_BATCH: i64 = 128;
const MLP_HIDDEN: i64 = 1024;
const CNN_BATCH: i64 = 128;
const MLP_BIG_HIDDEN: i64 = 4096;
const MLP_BIG_BATCH: i64 = 2048;
const RESNET50_BATCH: i64 = 128;

fn build(w: Workload, vs: &VarStore) -> Net {
    let r = vs.root();
    match w {
        Workload::Mlp | Workload::MlpBig => {
            let h = if w == Workload::Mlp { MLP_HIDDEN } else { MLP_BIG_HIDDEN };
            Net::Mlp(
                nn::seq_t()
                    .add(nn::linear(&r / "fc1", 784, h, Default::default()))
                    .add(nn::batch_norm1d(&r / "bn1", h, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(&r / "fc2", h, h, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(&r / "fc3", h, 10, Default::default())),
            )
        }
        Workload::Resnet50 => Net::Other(Box::new(tch::vision::resnet::resnet50(&r, 1000))),
        Workload::Cnn => Net::Cnn(resnet::SmallResNet::new(
            &r,
            resnet::ResNetConfig { in_channels: 1, num_classes: 10, width: 16, stages: 2, pool: 7 },
        )),
        Workload::Transformer => Net::Transformer(Encoder::new(&r)),
    }
}

/// The workload's batch size (transformer: sequences of `TR_TOKENS` tokens).
fn batch_size(w: Workload) -> i64 {
    match w {
        Workload::Mlp => MLP_BATCH,
        Workload::Cnn => CNN_BATCH,
        Workload::Transformer => TR_BATCH,
        Workload::MlpBig => MLP_BIG_BATCH,
        Workload::Resnet50 => RESNET50_BATCH,
    }
}

fn data(w: Workload, device: Device) -> (Tensor, Tensor) {
    data_of(w, device, batch_size(w))
}

/// A seeded random batch of `n` examples for `w`.
fn data_of(w: Workload, device: Device, n: i64) -> (Tensor, Tensor) {
    tch::manual_seed(0);
    let shape: Vec<i64> = match w {
        Workload::Mlp | Workload::MlpBig => vec![n, 784],
        Workload::Cnn => vec![n, 1, 28, 28],
        Workload::Transformer => vec![n, TR_TOKENS, TR_D],
        Workload::Resnet50 => vec![n, 3, 224, 224],
    };
    (Tensor::randn(shape, (Kind::Float, device)), Tensor::randint(10, [n], (Kind::Int64, device)))
}

/// GEMM and convolution FLOPs of one training step: 3x the forward's (forward, and backward to
/// inputs and to weights); elementwise ops are not counted.
fn flops_per_step(w: Workload) -> f64 {
    let fwd = match w {
        Workload::Mlp => 2.0 * MLP_BATCH as f64 * (784.0 * 1024.0 + 1024.0 * 1024.0 + 1024.0 * 10.0),
        Workload::MlpBig => 2.0 * MLP_BIG_BATCH as f64 * (784.0 * 4096.0 + 4096.0 * 4096.0 + 4096.0 * 10.0),
        // torchvision's figure for ResNet-50: 4.09 GFLOP (multiply-adds counted twice) per image.
        Workload::Resnet50 => 4.09e9 * RESNET50_BATCH as f64,
        Workload::Cnn => {
            // (out channels, in channels, kernel, output side) of every convolution, and the head.
            let convs = [
                (16, 1, 3, 28),
                (16, 16, 3, 14),
                (16, 16, 3, 14),
                (16, 16, 1, 14),
                (32, 16, 3, 7),
                (32, 32, 3, 7),
                (32, 16, 1, 7),
            ];
            let per_image: f64 =
                convs.iter().map(|&(co, ci, k, s)| 2.0 * (co * ci * k * k * s * s) as f64).sum::<f64>()
                    + 2.0 * 1568.0 * 10.0;
            per_image * CNN_BATCH as f64
        }
        Workload::Transformer => {
            let tokens = (TR_BATCH * TR_TOKENS) as f64;
            let (d, f, s) = (TR_D as f64, TR_FF as f64, TR_TOKENS as f64);
            let per_layer = 2.0 * tokens * (4.0 * d * d + 2.0 * d * f) + 2.0 * 2.0 * tokens * s * d;
            TR_LAYERS as f64 * per_layer + 2.0 * TR_BATCH as f64 * d * 10.0
        }
    };
    3.0 * fwd
}

// ---------------------------------------------------------------------------------------------
// Configurations

#[derive(Debug, Clone, Copy, PartialEq)]
enum Config {
    /// Hand-written tch loop in fp32 (`tf32`: with TF32 on, CUDA only).
    Loop { tf32: bool },
    /// tch-amp at an opt level; `dtype` None for O0; `kernels` how every class of fp16/bf16 ops
    /// runs on CPU.
    Amp { level: OptLevel, dtype: Option<Kind>, kernels: CpuKernels },
    /// tch-amp's torch.amp path: fp32 weights and an O0 optimizer, the forward under
    /// `tch_amp::Autocast` with `dtype` and `kernels`, the loss through `tch_amp::GradScaler`.
    Autocast { dtype: Kind, kernels: CpuKernels },
    /// PyTorch in Python: "fp32", "tf32", "amp_bf16", "amp_bf16_scaler", "amp_fp16".
    Torch(&'static str),
}

fn dtype_name(k: Kind) -> &'static str {
    if k == Kind::BFloat16 {
        "bf16"
    } else {
        "fp16"
    }
}

/// Every class `mode`, or `None` where Auto's choice for `kind` mixes native and emulated.
fn uniform_auto(kind: Kind) -> Option<CpuKernels> {
    let auto = CpuFeatures::detect().auto_choice(kind);
    [CpuKernels::Native, CpuKernels::Emulate].into_iter().find(|m| auto == CpuKernelChoice::all(*m))
}

/// " (native)" / " (emulated, Auto's choice)" / " (Auto)" ...: how a CPU row's `kind` ops run
/// (Auto's per-class choice is in the header); "" on CUDA.
fn kernels_note(kind: Kind, kernels: CpuKernels, cuda: bool) -> String {
    if cuda {
        return String::new();
    }
    let which = |m: CpuKernels| if m == CpuKernels::Native { "native" } else { "emulated" };
    match (kernels, uniform_auto(kind)) {
        (CpuKernels::Auto, Some(m)) => format!(" ({}, Auto's choice)", which(m)),
        (CpuKernels::Auto, None) => " (Auto)".to_string(),
        (m, _) => format!(" ({})", which(m)),
    }
}

impl Config {
    fn label(&self, cuda: bool) -> String {
        match self {
            Config::Loop { tf32: false } => "fp32 hand-written tch loop".into(),
            Config::Loop { tf32: true } => "TF32 hand-written tch loop".into(),
            Config::Amp { level, dtype: None, .. } => format!("tch-amp {level}"),
            Config::Amp { level, dtype: Some(k), kernels } => {
                format!("tch-amp {level} {}{}", dtype_name(*k), kernels_note(*k, *kernels, cuda))
            }
            Config::Autocast { dtype, kernels } => {
                format!("tch-amp autocast {} + GradScaler{}", dtype_name(*dtype), kernels_note(*dtype, *kernels, cuda))
            }
            Config::Torch("fp32") => "PyTorch fp32".into(),
            Config::Torch("tf32") => "PyTorch TF32".into(),
            Config::Torch("amp_bf16") => "PyTorch autocast bf16".into(),
            Config::Torch("amp_bf16_scaler") => "PyTorch autocast bf16 + GradScaler".into(),
            Config::Torch("amp_fp16") => {
                if cuda {
                    "PyTorch autocast fp16 + GradScaler".into()
                } else {
                    "PyTorch autocast fp16 + GradScaler('cpu')".into()
                }
            }
            Config::Torch(m) => format!("PyTorch {m}"),
        }
    }

    fn amp_config(&self) -> Option<AmpConfig> {
        let Config::Amp { level, dtype, kernels, .. } = *self else { return None };
        let mut c = AmpConfig::new(level).verbosity(0).cpu_kernels(kernels);
        if let Some(k) = dtype {
            c = match level {
                OptLevel::O1 => c.low_precision_dtype(k),
                _ => c.cast_model_type(Some(k)),
            };
        }
        Some(c)
    }
}

fn configs(args: &Args, cuda: bool, python: bool) -> Vec<Config> {
    let mut v = vec![Config::Loop { tf32: false }];
    if cuda {
        v.push(Config::Loop { tf32: true });
    }
    v.push(Config::Amp { level: OptLevel::O0, dtype: None, kernels: CpuKernels::Auto });
    // Auto's rows; with `--kernels both` also every class native and every class emulated
    // where that is not what Auto chose.
    let kernels = |k: Kind| {
        let mut v = vec![CpuKernels::Auto];
        if !cuda && args.kernels == KernelRows::Both {
            v.extend([CpuKernels::Emulate, CpuKernels::Native].into_iter().filter(|m| uniform_auto(k) != Some(*m)));
        }
        v
    };
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for k in [Kind::Half, Kind::BFloat16] {
            for kernels in kernels(k) {
                v.push(Config::Amp { level, dtype: Some(k), kernels });
            }
        }
    }
    // The torch.amp path: Auto's rows (its default), and native rows, which run the kernels of
    // PyTorch's autocast rows.
    for dtype in [Kind::BFloat16, Kind::Half] {
        let mut ks = vec![CpuKernels::Auto];
        if !cuda && uniform_auto(dtype) != Some(CpuKernels::Native) {
            ks.push(CpuKernels::Native);
        }
        if !cuda && args.kernels == KernelRows::Both && uniform_auto(dtype).is_none() {
            ks.push(CpuKernels::Emulate);
        }
        for kernels in ks {
            v.push(Config::Autocast { dtype, kernels });
        }
    }
    if python {
        v.push(Config::Torch("fp32"));
        if cuda {
            v.push(Config::Torch("tf32"));
        }
        v.push(Config::Torch("amp_bf16"));
        v.push(Config::Torch("amp_bf16_scaler"));
        v.push(Config::Torch("amp_fp16"));
    }
    if !args.only.is_empty() {
        let keep = |c: &Config| {
            matches!(c, Config::Loop { tf32: false }) || args.only.iter().any(|o| c.label(cuda).contains(o.as_str()))
        };
        v.retain(keep);
    }
    v
}

fn optimizer_config(args: &Args) -> OptimizerConfig {
    match args.optimizer {
        Opt::Adam => OptimizerConfig::from(nn::Adam::default()).fused(args.adam_kernel == AdamKernel::Fused),
        Opt::Sgd => nn::Sgd { momentum: 0.9, ..Default::default() }.into(),
    }
}

fn lr(args: &Args) -> f64 {
    match args.optimizer {
        Opt::Adam => 1e-3,
        Opt::Sgd => 1e-2,
    }
}

// ---------------------------------------------------------------------------------------------
// Runners: one per configuration, each able to run a round of steps.

/// Per-step phase times in ms, by name, for `--phases`.
type Phases = BTreeMap<&'static str, Vec<f64>>;

/// A point in time on the benchmark's clock (`--clock`).
#[derive(Clone, Copy)]
struct Stamp(f64);

static CPU_CLOCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn now() -> Stamp {
    if CPU_CLOCK.load(std::sync::atomic::Ordering::Relaxed) {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the timespec we pass; the clock id is a constant.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        Stamp(ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6)
    } else {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        Stamp(START.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e3)
    }
}

fn ms_since(t: Stamp) -> f64 {
    now().0 - t.0
}

fn sync(device: Device) {
    if let Device::Cuda(n) = device {
        tch::Cuda::synchronize(n as i64);
    }
}

/// The hand-written loop's optimizer: the same update algorithm as tch-amp's.
enum HandOpt {
    FusedAdam { params: Vec<Tensor>, m: Vec<Tensor>, v: Vec<Tensor>, step: u64 },
    SingleAdam { params: Vec<Tensor>, m: Vec<Tensor>, v: Vec<Tensor>, step: u64 },
    Sgd { params: Vec<Tensor>, bufs: Vec<Option<Tensor>> },
}

impl HandOpt {
    fn new(args: &Args, vs: &VarStore) -> Self {
        let params = vs.trainable_variables();
        let zeros = || params.iter().map(Tensor::zeros_like).collect::<Vec<_>>();
        match (args.optimizer, args.adam_kernel) {
            (Opt::Adam, AdamKernel::Fused) => HandOpt::FusedAdam { m: zeros(), v: zeros(), params, step: 0 },
            (Opt::Adam, AdamKernel::Single) => HandOpt::SingleAdam { m: zeros(), v: zeros(), params, step: 0 },
            (Opt::Sgd, _) => HandOpt::Sgd { bufs: params.iter().map(|_| None).collect(), params },
        }
    }

    fn zero_grad(&self) {
        let params = match self {
            HandOpt::FusedAdam { params, .. } | HandOpt::SingleAdam { params, .. } | HandOpt::Sgd { params, .. } => {
                params
            }
        };
        for p in params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    fn step(&mut self, lr: f64) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        match self {
            HandOpt::FusedAdam { params, m, v, step } => {
                *step += 1;
                let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
                let steps: Vec<Tensor> =
                    params.iter().map(|p| Tensor::scalar_tensor(*step as f64, (Kind::Float, p.device()))).collect();
                diagnostics::fused_adam_(params, &grads, m, v, &steps, lr, 0.9, 0.999, 0.0, 1e-8, false)?;
            }
            HandOpt::SingleAdam { params, m, v, step } => {
                // torch.optim's _single_tensor_adam, op for op (weight decay 0).
                *step += 1;
                let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
                let bc1 = 1.0 - b1.powf(*step as f64);
                let bc2_sqrt = (1.0 - b2.powf(*step as f64)).sqrt();
                for ((p, m), v) in params.iter().zip(m.iter_mut()).zip(v.iter_mut()) {
                    let g = p.grad();
                    let _ = m.lerp_(&g, 1.0 - b1);
                    let _ = v.g_mul_scalar_(b2);
                    let _ = v.addcmul_(&g, &(&g * (1.0 - b2)));
                    let mut denom = v.sqrt() / bc2_sqrt;
                    let _ = denom.g_add_scalar_(eps);
                    let mut p = p.shallow_clone();
                    let _ = p.addcdiv_(&(&*m * (-lr / bc1)), &denom);
                }
            }
            HandOpt::Sgd { params, bufs } => {
                for (p, buf) in params.iter().zip(bufs.iter_mut()) {
                    let g = p.grad();
                    let b = match buf.take() {
                        None => g.detach_copy(),
                        Some(mut b) => {
                            let _ = b.g_mul_scalar_(0.9);
                            let _ = b.g_add_(&g);
                            b
                        }
                    };
                    let mut p = p.shallow_clone();
                    let _ = p.g_sub_(&(&b * lr));
                    *buf = Some(b);
                }
            }
        }
        Ok(())
    }
}

/// One tch-amp round's objects (made per round: an `Amp` activates its cast policy on this
/// thread for its lifetime, so only one configuration's may be alive at a time).
struct AmpSession {
    model: AmpModel<Net>,
    opt: AmpOptimizer,
    amp: Amp,
}

/// One torch.amp round's objects: an O0 `Amp` (fp32 weights, no casts) for the optimizer, so
/// that the update is the same algorithm as in every other row.
struct AutocastSession {
    opt: AmpOptimizer,
    _amp: Amp,
}

enum Runner {
    Loop {
        net: Net,
        _vs: VarStore,
        opt: HandOpt,
        tf32: bool,
    },
    Amp {
        cfg: Box<AmpConfig>,
        vs: VarStore,
        net: Option<Net>,
        session: Option<Box<AmpSession>>,
    },
    Autocast {
        dtype: Kind,
        kernels: CpuKernels,
        vs: VarStore,
        net: Net,
        scaler: GradScaler,
        session: Option<Box<AutocastSession>>,
    },
    Torch {
        workload: Workload,
        mode: &'static str,
    },
}

struct Bench {
    args: Args,
    device: Device,
    python: Option<Python>,
    /// Host reads (syncs on CUDA) tch-amp made in each step since the last `take`.
    syncs: std::cell::RefCell<Vec<f64>>,
}

impl Bench {
    fn make_runner(&self, w: Workload, c: Config) -> Result<Runner> {
        tch::manual_seed(0);
        let vs = VarStore::new(self.device);
        Ok(match c {
            Config::Loop { tf32 } => {
                let net = build(w, &vs);
                let opt = HandOpt::new(&self.args, &vs);
                Runner::Loop { net, _vs: vs, opt, tf32 }
            }
            Config::Amp { .. } => {
                let net = build(w, &vs);
                let cfg = c.amp_config().expect("an Amp config");
                Runner::Amp { cfg: Box::new(cfg), vs, net: Some(net), session: None }
            }
            Config::Autocast { dtype, kernels } => {
                let net = build(w, &vs);
                let scaler = GradScaler::new(self.device);
                Runner::Autocast { dtype, kernels, vs, net, scaler, session: None }
            }
            Config::Torch(mode) => Runner::Torch { workload: w, mode },
        })
    }

    fn begin_round(&self, r: &mut Runner) -> Result<()> {
        if let Runner::Amp { cfg, vs, net, session } = r {
            let amp = Amp::new(cfg)?;
            let model = amp.cast_model(vs, net.take().ok_or_else(|| anyhow!("model missing"))?)?;
            let opt = amp.optimizer(vs, optimizer_config(&self.args), lr(&self.args))?;
            *session = Some(Box::new(AmpSession { model, opt, amp }));
        }
        if let Runner::Autocast { vs, session, .. } = r {
            let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0))?;
            let opt = amp.optimizer(vs, optimizer_config(&self.args), lr(&self.args))?;
            *session = Some(Box::new(AutocastSession { opt, _amp: amp }));
        }
        if let Runner::Loop { tf32: true, .. } = r {
            diagnostics::set_allow_tf32(true)?;
        }
        Ok(())
    }

    fn end_round(&self, r: &mut Runner) -> Result<()> {
        if let Runner::Amp { net, session, .. } = r {
            if let Some(AmpSession { model, opt, amp }) = session.take().map(|b| *b) {
                drop(opt);
                *net = Some(model.into_inner());
                drop(amp);
            }
        }
        if let Runner::Autocast { session, .. } = r {
            *session = None;
        }
        diagnostics::set_allow_tf32(false)?;
        Ok(())
    }

    /// One training step; phase times go to `phases` when given. Never inlined: profilers
    /// (`valgrind --tool=callgrind --toggle-collect='*Bench::step*'`) select it by name.
    #[inline(never)]
    fn step(&self, r: &mut Runner, x: &Tensor, y: &Tensor, phases: Option<&mut Phases>) -> Result<()> {
        let d = self.device;
        let lr = lr(&self.args);
        match r {
            Runner::Loop { net, opt, .. } => {
                let t = now();
                opt.zero_grad();
                let t_zero = ms_since(t);
                let t = now();
                let loss = net.forward_t(x, true).cross_entropy_for_logits(y);
                sync(d);
                let t_fwd = ms_since(t);
                let t = now();
                loss.backward();
                sync(d);
                let t_bwd = ms_since(t);
                let t = now();
                opt.step(lr)?;
                sync(d);
                let t_step = ms_since(t);
                if let Some(p) = phases {
                    record(p, [("zero_grad", t_zero), ("forward", t_fwd), ("backward", t_bwd), ("step", t_step)]);
                }
            }
            Runner::Amp { session, .. } => {
                let s = session.as_mut().ok_or_else(|| anyhow!("round not begun"))?;
                let reads_before = diagnostics::host_reads();
                let t = now();
                s.opt.zero_grad()?;
                let t_zero = ms_since(t);
                let t = now();
                let loss = s.model.forward_t(x, true).cross_entropy_for_logits(y);
                sync(d);
                let t_fwd = ms_since(t);
                let mut t_bwd = 0.0;
                let t = now();
                s.amp.scale_loss(&loss, &mut [&mut s.opt], |scaled| {
                    let t = now();
                    scaled.backward();
                    sync(d);
                    t_bwd = ms_since(t);
                })?;
                let t_scale = ms_since(t);
                let t = now();
                s.opt.step()?;
                sync(d);
                let t_step = ms_since(t);
                let syncs = diagnostics::host_reads() - reads_before;
                self.syncs.borrow_mut().push(syncs as f64);
                if let Some(p) = phases {
                    record(
                        p,
                        [
                            ("zero_grad", t_zero),
                            ("forward", t_fwd),
                            ("backward", t_bwd),
                            ("unscale", t_scale - t_bwd),
                            ("step", t_step),
                        ],
                    );
                }
            }
            Runner::Autocast { dtype, kernels, net, scaler, session, .. } => {
                let s = session.as_mut().ok_or_else(|| anyhow!("round not begun"))?;
                let t = now();
                s.opt.zero_grad()?;
                let t_zero = ms_since(t);
                let t = now();
                let autocast = Autocast::new(d).dtype(*dtype).cpu_kernels(*kernels);
                let loss = autocast.run(|| net.forward_t(x, true).cross_entropy_for_logits(y))?;
                sync(d);
                let t_fwd = ms_since(t);
                let t = now();
                scaler.scale(&loss)?.backward();
                sync(d);
                let t_bwd = ms_since(t);
                let t = now();
                scaler.step(&mut s.opt)?;
                scaler.update()?;
                sync(d);
                let t_step = ms_since(t);
                if let Some(p) = phases {
                    record(p, [("zero_grad", t_zero), ("forward", t_fwd), ("backward", t_bwd), ("step", t_step)]);
                }
            }
            Runner::Torch { .. } => bail!("PyTorch steps run in rounds"),
        }
        Ok(())
    }

    /// One round of `steps` timed steps (after one untimed step): per-step milliseconds.
    fn round(
        &mut self,
        r: &mut Runner,
        x: &Tensor,
        y: &Tensor,
        steps: usize,
        mut phases: Option<&mut Phases>,
    ) -> Result<Vec<f64>> {
        if let Runner::Torch { workload, mode } = r {
            let py = self.python.as_mut().ok_or_else(|| anyhow!("PyTorch server not running"))?;
            let (ms, syncs) = py.run(*workload, mode, steps)?;
            if let Some(n) = syncs {
                self.syncs.borrow_mut().push(n);
            }
            return Ok(ms);
        }
        self.begin_round(r)?;
        let result = (|| {
            self.step(r, x, y, None)?;
            let mut ms = Vec::with_capacity(steps);
            for _ in 0..steps {
                let t = now();
                self.step(r, x, y, phases.as_deref_mut())?;
                ms.push(ms_since(t));
            }
            Ok(ms)
        })();
        self.end_round(r)?;
        result
    }
}

fn record<const N: usize>(p: &mut Phases, items: [(&'static str, f64); N]) {
    for (k, v) in items {
        p.entry(k).or_default().push(v);
    }
}

// ---------------------------------------------------------------------------------------------
// The PyTorch server (scripts/bench_torch.py --serve).

struct Python {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    version: String,
}

impl Python {
    fn start(args: &Args) -> Result<Option<Self>> {
        let Ok(py) = std::env::var("TCH_AMP_PYTHON") else {
            eprintln!("(PyTorch rows skipped: TCH_AMP_PYTHON unset; run `make setup`)");
            return Ok(None);
        };
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/bench_torch.py");
        let mut child = Command::new(py)
            .arg(script)
            .arg("--serve")
            .args(["--threads", &tch::get_num_threads().to_string()])
            .args(["--device", &args.device])
            .args(["--optimizer", if args.optimizer == Opt::Adam { "adam" } else { "sgd" }])
            .args(["--adam-kernel", if args.adam_kernel == AdamKernel::Fused { "fused" } else { "single" }])
            .args(["--clock", if args.clock == Clock::Cpu { "cpu" } else { "wall" }])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting scripts/bench_torch.py")?;
        let stdin = child.stdin.take().ok_or_else(|| anyhow!("no stdin"))?;
        let mut stdout = BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let ready: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("bench_torch.py did not start: {line:?}"))?;
        let version = ready["torch"].as_str().unwrap_or("?").to_string();
        Ok(Some(Self { child, stdin, stdout, version }))
    }

    /// Per-step milliseconds, and the host syncs per step PyTorch's sync debug mode counted
    /// (CUDA only).
    fn run(&mut self, w: Workload, mode: &str, steps: usize) -> Result<(Vec<f64>, Option<f64>)> {
        writeln!(self.stdin, "run {} {mode} {steps}", w.name())?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        let v: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("bench_torch.py: {line:?}"))?;
        let ms = v["ms"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .ok_or_else(|| anyhow!("bench_torch.py: no times in {line:?}"))?;
        Ok((ms, v["syncs"].as_f64()))
    }
}

impl Python {
    /// Per-iteration milliseconds of torch's GradScaler `unscale_` + `update` on `w`'s gradients.
    fn scaler(&mut self, w: Workload, iterations: usize) -> Result<Vec<f64>> {
        writeln!(self.stdin, "scaler {} {iterations}", w.name())?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        let v: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("bench_torch.py: {line:?}"))?;
        v["ms"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .ok_or_else(|| anyhow!("bench_torch.py: no times in {line:?}"))
    }
}

impl Drop for Python {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// Median, min and max.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(v: &[f64]) -> Self {
        let finite = || v.iter().copied().filter(|x| x.is_finite());
        Self {
            median: median(v),
            min: finite().fold(f64::INFINITY, f64::min),
            max: finite().fold(f64::NEG_INFINITY, f64::max),
        }
    }
    fn show(&self, digits: usize) -> String {
        format!("{:.d$} [{:.d$}–{:.d$}]", self.median, self.min, self.max, d = digits)
    }
}

/// A [`Spread`] as written to JSON, shown as [`Spread::show`] does ("-" where a figure is missing).
fn show_spread(v: &serde_json::Value, digits: usize) -> String {
    match (v["median"].as_f64(), v["min"].as_f64(), v["max"].as_f64()) {
        (Some(m), Some(a), Some(b)) => Spread { median: m, min: a, max: b }.show(digits),
        _ => "-".into(),
    }
}

/// The large fp32 GEMM whose rate is this run's "peak": GFLOP/s of the fastest of 3.
fn gemm_gflops(device: Device, n: i64) -> f64 {
    if n <= 0 {
        return f64::NAN;
    }
    let a = Tensor::randn([n, n], (Kind::Float, device));
    let b = Tensor::randn([n, n], (Kind::Float, device));
    let _ = a.mm(&b);
    sync(device);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = now();
        let _ = a.mm(&b);
        sync(device);
        best = best.min(ms_since(t) / 1e3);
    }
    2.0 * (n as f64).powi(3) / best / 1e9
}

// ---------------------------------------------------------------------------------------------
// The overflow path

/// What an overflowing step costs against a clean one (O2 fp16, the MLP): the per-parameter
/// inf/NaN scan and the scale-change record run only when `scale_loss` saw an overflow. Rounds
/// interleave clean and overflowing steps on a fresh `Amp` (so the scale never reaches its
/// floor); an overflowing step multiplies the loss by +inf.
fn overflow_cost(bench: &Bench, rounds: usize, steps: usize) -> Result<serde_json::Value> {
    let w = Workload::Mlp;
    let (x, y) = data(w, bench.device);
    let c = Config::Amp { level: OptLevel::O2, dtype: Some(Kind::Half), kernels: CpuKernels::Auto };
    let mut r = bench.make_runner(w, c)?;
    let (mut clean, mut over, mut scans_clean, mut scans_over) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        bench.begin_round(&mut r)?;
        let Runner::Amp { session: Some(s), .. } = &mut r else { bail!("round not begun") };
        let mut one = |overflow: bool| -> Result<(f64, u64)> {
            let scans = diagnostics::gradient_scans();
            let t = now();
            s.opt.zero_grad()?;
            let mut loss = s.model.forward_t(&x, true).cross_entropy_for_logits(&y);
            if overflow {
                loss *= f64::INFINITY;
            }
            s.amp.scale_loss(&loss, &mut [&mut s.opt], |scaled| scaled.backward())?;
            let stepped = s.opt.step()?;
            sync(bench.device);
            if stepped.stepped() == overflow {
                bail!("overflow injection did not behave: {stepped:?}");
            }
            Ok((ms_since(t), diagnostics::gradient_scans() - scans))
        };
        one(false)?; // warm-up
        let (mut c_ms, mut o_ms) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let (ms, n) = one(false)?;
            c_ms.push(ms);
            scans_clean.push(n as f64);
            let (ms, n) = one(true)?;
            o_ms.push(ms);
            scans_over.push(n as f64);
        }
        clean.push(median(&c_ms));
        over.push(median(&o_ms));
        bench.end_round(&mut r)?;
    }
    let ratio: Vec<f64> = over.iter().zip(&clean).map(|(o, c)| o / c).collect();
    let (clean, over, ratio) = (Spread::of(&clean), Spread::of(&over), Spread::of(&ratio));
    println!();
    println!("## The overflow path ({}, {})", w.name(), c.label(false));
    println!();
    println!("Clean and overflowing steps alternate (the overflowing loss is multiplied by +inf), {rounds} round(s) x {steps} of each on a fresh Amp; median over rounds [min–max].");
    println!();
    println!("| step | ms/step | gradient scans/step |");
    println!("|---|---:|---:|");
    println!("| clean (no diagnostics) | {} | {} |", clean.show(2), median(&scans_clean));
    println!(
        "| overflowing (skipped; inf/NaN counted per parameter, scale change recorded) | {} | {} |",
        over.show(2),
        median(&scans_over)
    );
    println!("| overflowing / clean | {} | |", ratio.show(3));
    Ok(serde_json::json!({
        "workload": w.name(),
        "clean_ms": clean,
        "overflow_ms": over,
        "overflow_vs_clean": ratio,
        "gradient_scans_clean": median(&scans_clean),
        "gradient_scans_overflow": median(&scans_over),
    }))
}

// ---------------------------------------------------------------------------------------------
// Memory

/// Peak bytes per parameter from the end of backward to the end of `step` (the unscale, the
/// master gradients and the update), measured with the counting allocator: everything
/// allocated since the model was made (`base`: the bytes held before) and still held then.
fn measure_memory(bench: &Bench, r: &mut Runner, x: &Tensor, y: &Tensor, base: i64) -> Result<Option<(f64, f64, f64)>> {
    let Runner::Amp { .. } = r else { return Ok(None) };
    bench.begin_round(r)?;
    let out = (|| {
        let Runner::Amp { session: Some(s), .. } = r else { bail!("round not begun") };
        for _ in 0..2 {
            s.opt.zero_grad()?;
            let loss = s.model.forward_t(x, true).cross_entropy_for_logits(y);
            s.amp.scale_loss(&loss, &mut [&mut s.opt], |l| l.backward())?;
            s.opt.step()?;
        }
        s.opt.zero_grad()?;
        let loss = s.model.forward_t(x, true).cross_entropy_for_logits(y);
        s.amp.scale_loss(&loss, &mut [&mut s.opt], |l| {
            l.backward();
            // What scale_loss does next; the peak starts after it.
            let _ = tch_amp::cast::clear_cast_cache();
            let _ = diagnostics::reset_cpu_memory_peak();
        })?;
        let state = s.opt.memory();
        // Everything allocated since this model was made counts (the batch is older).
        let other = base;
        s.opt.step()?;
        let after = diagnostics::cpu_memory()?;
        let params = state.params.max(1) as f64;
        let between = s.opt.memory().total() as f64 / params;
        Ok(Some(((after.peak - other) as f64 / params, state.bytes_per_param(), between)))
    })();
    bench.end_round(r)?;
    out
}

// ---------------------------------------------------------------------------------------------
// GradScaler: unscale_ + update against torch's

/// tch-amp's `GradScaler::unscale_` + `update` against torch's on the fp32 gradients of one
/// scaled backward of `w` (restored before each iteration, untimed), `rounds` rounds of
/// `iterations` each, tch-amp and PyTorch in turn.
fn scaler_cost(bench: &mut Bench, w: Workload, rounds: usize, iterations: usize) -> Result<serde_json::Value> {
    let device = bench.device;
    let (x, y) = data(w, device);
    tch::manual_seed(0);
    let vs = VarStore::new(device);
    let net = build(w, &vs);
    let opt = <nn::Adam as nn::OptimizerConfig>::build(nn::Adam::default(), &vs, 1e-3)?;
    let mut scaler = GradScaler::new(device);
    scaler.scale(&net.forward_t(&x, true).cross_entropy_for_logits(&y))?.backward();
    let params = vs.trainable_variables();
    let saved: Vec<Tensor> = params.iter().map(|p| p.grad().copy()).collect();
    let elements: i64 = saved.iter().map(Tensor::numel).map(|n| n as i64).sum();
    let restore = || {
        let _no_grad = tch::no_grad_guard();
        for (p, g) in params.iter().zip(&saved) {
            p.grad().copy_(g);
        }
    };
    restore();
    scaler.unscale_(&opt)?;
    scaler.update()?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let mut ms = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            restore();
            sync(device);
            let t = now();
            scaler.unscale_(&opt)?;
            scaler.update()?;
            sync(device);
            ms.push(ms_since(t));
        }
        ours.push(median(&ms));
        if let Some(py) = bench.python.as_mut() {
            theirs.push(median(&py.scaler(w, iterations)?));
        }
    }
    let ratio: Vec<f64> = ours.iter().zip(&theirs).map(|(a, b)| a / b).collect();
    Ok(serde_json::json!({
        "workload": w.name(),
        "tensors": saved.len(),
        "elements": elements,
        "tch_amp_ms": Spread::of(&ours),
        "pytorch_ms": (!theirs.is_empty()).then(|| Spread::of(&theirs)),
        "ratio": (!ratio.is_empty()).then(|| Spread::of(&ratio)),
    }))
}

fn print_scaler(rows: &[serde_json::Value], rounds: usize, iterations: usize) {
    let us = |v: &serde_json::Value| -> String {
        match (v["median"].as_f64(), v["min"].as_f64(), v["max"].as_f64()) {
            (Some(m), Some(a), Some(b)) => format!("{:.1} [{:.1}–{:.1}]", m * 1e3, a * 1e3, b * 1e3),
            _ => "-".into(),
        }
    };
    println!();
    println!("## GradScaler: unscale_ + update");
    println!();
    println!(
        "`scaler.unscale_(opt)` then `scaler.update()` on the fp32 gradients of one scaled backward of each workload \
         (gradients restored before each call, untimed); {rounds} round(s) x {iterations} calls, tch-amp and PyTorch in \
         turn; µs per call, median over rounds [min–max]; the ratio is per round."
    );
    println!();
    println!("| workload | gradients | tch-amp µs | PyTorch µs | tch-amp / PyTorch |");
    println!("|---|---:|---:|---:|---:|");
    for r in rows {
        let ratio = match (r["ratio"]["median"].as_f64(), r["ratio"]["min"].as_f64(), r["ratio"]["max"].as_f64()) {
            (Some(m), Some(a), Some(b)) => format!("{m:.3} [{a:.3}–{b:.3}]"),
            _ => "-".into(),
        };
        println!(
            "| {} | {} tensors, {} elements | {} | {} | {} |",
            r["workload"].as_str().unwrap_or("?"),
            r["tensors"],
            r["elements"],
            us(&r["tch_amp_ms"]),
            us(&r["pytorch_ms"]),
            ratio
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Float8 training against bf16 autocast

/// The float8 MLP's sizes: width and batch (GPU-sized on CUDA; small on CPU, where libtorch's
/// `_scaled_mm` with tensorwise scales is a slow reference loop).
fn float8_dims(device: Device) -> (i64, i64) {
    if device.is_cuda() {
        (4096, 2048)
    } else {
        (256, 64)
    }
}

/// One float8 configuration: a recipe (None: plain linear layers) and bf16 autocast or not.
const FLOAT8_ROWS: [(&str, Option<&str>, bool); 6] = [
    ("fp32", None, false),
    ("bf16 autocast", None, true),
    ("fp8 tensorwise", Some("tensorwise"), false),
    ("fp8 tensorwise + bf16 autocast", Some("tensorwise"), true),
    ("fp8 rowwise + bf16 autocast", Some("rowwise"), true),
    ("fp8 delayed (TE) + bf16 autocast", Some("delayed"), true),
];

/// The MLP 784-w-w-10 (ReLU) as float8 linear layers (the head stays high precision), a step of
/// SGD; per row the median step time of each round (libtorch's native bf16 kernels).
fn float8_cost(bench: &Bench, rounds: usize, steps: usize) -> Result<Vec<serde_json::Value>> {
    use tch_amp::float8::{DelayedScaling, Float8LinearConfig, Float8Training, LayerFilter};
    let device = bench.device;
    let (width, batch) = float8_dims(device);
    let x = Tensor::randn([batch, 784], (Kind::Float, device));
    let y = Tensor::randint(10, [batch], (Kind::Int64, device));
    struct Row {
        _vs: VarStore,
        layers: Vec<tch_amp::float8::Float8Linear>,
        opt: nn::Optimizer,
        autocast: Autocast,
    }
    let mut rows = Vec::new();
    for (_, recipe, autocast) in FLOAT8_ROWS {
        tch::manual_seed(0);
        let vs = VarStore::new(device);
        let config = match recipe {
            Some("delayed") => Float8LinearConfig::default().delayed_scaling(DelayedScaling::default()),
            Some(name) => Float8LinearConfig::from_recipe_name(name)?,
            None => Float8LinearConfig::default(),
        };
        let filter = if recipe.is_some() { LayerFilter::all() } else { LayerFilter::only(&["none"]) };
        let fp8 = Float8Training::new(config, filter)?;
        let root = vs.root();
        let layers = vec![
            fp8.linear(&root / "fc1", 784, width, Default::default())?,
            fp8.linear(&root / "fc2", width, width, Default::default())?,
            fp8.linear(&root / "head", width, 10, Default::default())?,
        ];
        let opt = <nn::Sgd as nn::OptimizerConfig>::build(nn::Sgd { momentum: 0.9, ..Default::default() }, &vs, 1e-3)?;
        let autocast = Autocast::new(device).dtype(Kind::BFloat16).cpu_kernels(CpuKernels::Native).enabled(autocast);
        rows.push(Row { _vs: vs, layers, opt, autocast });
    }
    let step = |r: &mut Row| -> Result<()> {
        r.opt.zero_grad();
        let logits = r.autocast.run(|| {
            let [fc1, fc2, head] = r.layers.as_slice() else { unreachable!() };
            x.apply(fc1).relu().apply(fc2).relu().apply(head)
        })?;
        logits.to_kind(Kind::Float).cross_entropy_for_logits(&y).backward();
        r.opt.step();
        Ok(())
    };
    for r in rows.iter_mut() {
        for _ in 0..bench.args.warmup.max(1) {
            step(r)?;
        }
    }
    let mut per_round = vec![Vec::new(); rows.len()];
    for round in 0..rounds {
        for (i, r) in rows.iter_mut().enumerate() {
            let mut ms = Vec::with_capacity(steps);
            for _ in 0..steps {
                sync(device);
                let t = now();
                step(r)?;
                sync(device);
                ms.push(ms_since(t));
            }
            per_round[i].push(median(&ms));
        }
        eprintln!("float8: round {}/{rounds} done", round + 1);
    }
    let bf16 = 1;
    Ok(FLOAT8_ROWS
        .iter()
        .enumerate()
        .map(|(i, (label, _, _))| {
            let ratio: Vec<f64> = per_round[i].iter().zip(&per_round[bf16]).map(|(a, b)| a / b).collect();
            serde_json::json!({ "label": label, "ms": Spread::of(&per_round[i]), "vs_bf16": Spread::of(&ratio) })
        })
        .collect())
}

fn print_float8(rows: &[serde_json::Value], bench: &Bench) {
    let (width, batch) = float8_dims(bench.device);
    println!();
    println!("## Float8 training (tch_amp::float8) against bf16 autocast");
    println!();
    println!(
        "MLP 784-{width}-{width}-10 (ReLU), batch {batch}, SGD; fc1 and fc2 float8 (the 10-wide head stays high \
         precision), weights fp32; bf16 rows on libtorch's native kernels. A report, not a verdict: on CPU \
         libtorch's `_scaled_mm` is far slower than its fp32 and bf16 GEMMs (with tensorwise scales most of all)."
    );
    println!();
    println!("| configuration | ms per step | vs bf16 autocast |");
    println!("|---|---:|---:|");
    for r in rows {
        println!(
            "| {} | {} | {} |",
            r["label"].as_str().unwrap_or("?"),
            show_spread(&r["ms"], 2),
            show_spread(&r["vs_bf16"], 3)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The precision doctor's cost against a training step

/// The set-ups whose doctor run is timed: O1 and O2 in fp16 and bf16 autocast, Auto's kernels.
const DOCTOR_ROWS: [Config; 3] = [
    Config::Amp { level: OptLevel::O1, dtype: Some(Kind::Half), kernels: CpuKernels::Auto },
    Config::Amp { level: OptLevel::O2, dtype: Some(Kind::Half), kernels: CpuKernels::Auto },
    Config::Autocast { dtype: Kind::BFloat16, kernels: CpuKernels::Auto },
];

/// On the cnn workload (the main job's network and batch): per set-up and round, the median of
/// `steps` training steps of that set-up and the median of `runs` calls of `Doctor::run` on
/// the same network (fp32 weights) and batch, and their ratio.
fn doctor_cost(bench: &mut Bench, rounds: usize, steps: usize, runs: usize) -> Result<Vec<serde_json::Value>> {
    use tch_amp::doctor::Doctor;
    let w = Workload::Cnn;
    let (x, y) = data(w, bench.device);
    let mut out = Vec::new();
    for c in DOCTOR_ROWS {
        let label = c.label(bench.device.is_cuda());
        let doctor = match c {
            Config::Autocast { dtype, kernels } => {
                Doctor::autocast(Autocast::new(bench.device).dtype(dtype).cpu_kernels(kernels))
            }
            _ => Doctor::apex(c.amp_config().ok_or_else(|| anyhow!("{label}: not an Amp set-up"))?),
        };
        let mut runner = bench.make_runner(w, c)?;
        tch::manual_seed(0);
        let vs = VarStore::new(bench.device);
        let net = build(w, &vs);
        let diagnose = || -> Result<()> {
            let report = doctor.run(&vs, |pass| pass.forward_t(&net, &x, true).cross_entropy_for_logits(&y))?;
            if !report.trains_fine() {
                eprintln!("doctor ({label}): {}", report.summary());
            }
            Ok(())
        };
        for _ in 0..bench.args.warmup.max(1) {
            diagnose()?;
        }
        let (mut step_ms, mut doctor_ms, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let s = median(&bench.round(&mut runner, &x, &y, steps, None)?);
            let mut ms = Vec::with_capacity(runs);
            for _ in 0..runs {
                sync(bench.device);
                let t = now();
                diagnose()?;
                sync(bench.device);
                ms.push(ms_since(t));
            }
            let d = median(&ms);
            step_ms.push(s);
            doctor_ms.push(d);
            ratio.push(d / s);
            eprintln!("doctor {label}: round {}/{rounds} done", round + 1);
        }
        out.push(serde_json::json!({
            "label": label,
            "step_ms": Spread::of(&step_ms),
            "doctor_ms": Spread::of(&doctor_ms),
            "doctor_vs_step": Spread::of(&ratio),
        }));
    }
    Ok(out)
}

fn print_doctor(rows: &[serde_json::Value]) {
    println!();
    println!("## The precision doctor (tch_amp::doctor) against one training step");
    println!();
    println!(
        "cnn workload ({}): one `Doctor::run` (the fp32 run and the target run, forward and backward, \
         per-op statistics) against one training step of the same set-up, Auto's kernels.",
        Workload::Cnn.describe()
    );
    println!();
    println!("| set-up | ms per training step | ms per doctor run | doctor / step |");
    println!("|---|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} |",
            r["label"].as_str().unwrap_or("?"),
            show_spread(&r["step_ms"], 2),
            show_spread(&r["doctor_ms"], 2),
            show_spread(&r["doctor_vs_step"], 3)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The bytes of a whole training step, and the largest batch within a budget

/// What the counting allocator saw during one training step.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct StepBytes {
    /// The most bytes held at once from before the forward to the end of the step, counting
    /// everything the configuration allocated (model, masters, optimizer state, the batch,
    /// activations, gradients, temporaries).
    peak: i64,
    /// Bytes the forward left allocated (what autograd saved for backward, and the loss).
    forward: i64,
    /// Weights, gradients, masters and optimizer state at the end of the step (tch-amp's count).
    state: i64,
}

/// One training step of `r` (its round begun) on `x`, `y`, with the peak reset before the
/// forward and read after the step. `base`: the bytes held before the configuration's model
/// was made.
fn step_bytes(bench: &Bench, r: &mut Runner, x: &Tensor, y: &Tensor, base: i64) -> Result<StepBytes> {
    let d = bench.device;
    match r {
        Runner::Amp { session: Some(s), .. } => {
            s.opt.zero_grad()?;
            let before = diagnostics::reset_cpu_memory_peak()?;
            let loss = s.model.forward_t(x, true).cross_entropy_for_logits(y);
            let forward = diagnostics::cpu_memory()?.current - before.current;
            s.amp.scale_loss(&loss, &mut [&mut s.opt], |l| l.backward())?;
            s.opt.step()?;
            drop(loss);
            let peak = diagnostics::cpu_memory()?.peak - base;
            Ok(StepBytes { peak, forward, state: s.opt.memory().total() as i64 })
        }
        Runner::Autocast { dtype, kernels, net, scaler, session: Some(s), .. } => {
            s.opt.zero_grad()?;
            let before = diagnostics::reset_cpu_memory_peak()?;
            let autocast = Autocast::new(d).dtype(*dtype).cpu_kernels(*kernels);
            let loss = autocast.run(|| net.forward_t(x, true).cross_entropy_for_logits(y))?;
            let forward = diagnostics::cpu_memory()?.current - before.current;
            scaler.scale(&loss)?.backward();
            scaler.step(&mut s.opt)?;
            scaler.update()?;
            drop(loss);
            let peak = diagnostics::cpu_memory()?.peak - base;
            Ok(StepBytes { peak, forward, state: s.opt.memory().total() as i64 })
        }
        _ => bail!("step_bytes: a tch-amp configuration with its round begun"),
    }
}

/// One configuration's row of the step-memory table.
#[derive(Debug, serde::Serialize)]
struct MemoryRow {
    label: String,
    batch: i64,
    at_batch: StepBytes,
    /// Wall milliseconds of the measured step at `batch` (the counting allocator adds a little).
    step_ms: f64,
    /// Peak bytes at each batch size measured, in order.
    probes: Vec<(i64, i64)>,
    /// The largest batch whose step peaked within the budget.
    largest_batch: i64,
    /// true: found by measuring (bisection); false: extrapolated from the peaks at `batch` and
    /// twice `batch` (the peak is affine in the batch size), for rows too slow to search.
    searched: bool,
}

/// The configurations of the step-memory table: O0, O1-O3 in fp16 with the kernels `Auto`
/// chooses, the torch.amp path in bf16 and fp16 with Auto's kernels, and on CPU O2 fp16 with
/// every class native and with every class emulated where they differ from Auto's.
fn memory_configs(cuda: bool) -> Vec<Config> {
    let mut v = vec![Config::Amp { level: OptLevel::O0, dtype: None, kernels: CpuKernels::Auto }];
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        v.push(Config::Amp { level, dtype: Some(Kind::Half), kernels: CpuKernels::Auto });
    }
    for dtype in [Kind::BFloat16, Kind::Half] {
        v.push(Config::Autocast { dtype, kernels: CpuKernels::Auto });
    }
    if !cuda {
        for kernels in [CpuKernels::Native, CpuKernels::Emulate] {
            if uniform_auto(Kind::Half) != Some(kernels) {
                v.push(Config::Amp { level: OptLevel::O2, dtype: Some(Kind::Half), kernels });
            }
        }
    }
    v
}

/// Whether `c` runs libtorch's native fp16/bf16 CPU kernels of a class of `w` known to be many
/// times slower than fp32 on this CPU (too slow to search large batches with).
fn runs_slow_kernels(c: Config, w: Workload, cuda: bool) -> bool {
    let slow = |k: Kind| w.classes().iter().any(|c| CpuFeatures::detect().native_slowdown(*c, k).is_some());
    !cuda
        && match c {
            Config::Amp { dtype: Some(k), kernels: CpuKernels::Native, .. } => slow(k),
            Config::Autocast { dtype, kernels: CpuKernels::Native } => slow(dtype),
            _ => false,
        }
}

/// The step-memory rows of `w`: each configuration's peak at the workload's batch, and the
/// largest batch within `budget` bytes, by bisection on measured peaks (rows that run
/// libtorch's slow native kernels: extrapolated from two measured batch sizes).
fn step_memory(bench: &Bench, w: Workload, budget: i64) -> Result<Vec<MemoryRow>> {
    let cuda = bench.device != Device::Cpu;
    diagnostics::track_cpu_memory()?;
    let b0 = batch_size(w);
    let mut rows: Vec<MemoryRow> = Vec::new();
    for c in memory_configs(cuda) {
        let base = diagnostics::cpu_memory()?.current;
        let mut r = bench.make_runner(w, c)?;
        bench.begin_round(&mut r)?;
        let out = (|| -> Result<MemoryRow> {
            let mut measure = |b: i64| -> Result<(StepBytes, f64)> {
                let (x, y) = data_of(w, bench.device, b);
                let t = Instant::now();
                let m = step_bytes(bench, &mut r, &x, &y, base)?;
                Ok((m, t.elapsed().as_secs_f64() * 1e3))
            };
            // The first step makes the optimizer state (and O2's masters' gradients).
            measure(b0)?;
            let (at, ms) = measure(b0)?;
            let (twice, _) = measure(2 * b0)?;
            let mut probes = vec![(b0, at.peak), (2 * b0, twice.peak)];
            let per_example = ((twice.peak - at.peak) as f64 / b0 as f64).max(1.0);
            let fixed = at.peak as f64 - per_example * b0 as f64;
            let estimate = ((budget as f64 - fixed) / per_example).floor().max(1.0) as i64;
            let row = |probes, largest_batch, searched| MemoryRow {
                label: c.label(cuda),
                batch: b0,
                at_batch: at,
                step_ms: ms,
                probes,
                largest_batch,
                searched,
            };
            if runs_slow_kernels(c, w, cuda) {
                return Ok(row(probes, estimate, false));
            }
            // Bracket the largest fitting batch around the estimate, then bisect to 1%.
            let mut fits = |b: i64| -> Result<bool> {
                let (m, _) = measure(b)?;
                probes.push((b, m.peak));
                Ok(m.peak <= budget)
            };
            let step = (estimate / 50).max(1);
            let (mut lo, mut hi);
            if fits(estimate)? {
                (lo, hi) = (estimate, estimate + step);
                while fits(hi)? {
                    lo = hi;
                    hi += 2 * (hi - estimate);
                }
            } else {
                (lo, hi) = ((estimate - step).max(1), estimate);
                while lo > 1 && !fits(lo)? {
                    hi = lo;
                    lo = (lo - 2 * (estimate - lo)).max(1);
                }
            }
            while hi - lo > (lo / 100).max(1) {
                let mid = lo + (hi - lo) / 2;
                if fits(mid)? {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            Ok(row(probes, lo, true))
        })();
        bench.end_round(&mut r)?;
        let row = out?;
        eprintln!("{}: step memory of {} done ({} probes)", w.name(), row.label, row.probes.len());
        rows.push(row);
    }
    Ok(rows)
}

fn print_step_memory(w: Workload, rows: &[MemoryRow], budget_gib: f64) {
    let mib = |b: i64| b as f64 / (1024.0 * 1024.0);
    let o0 = rows.first();
    println!();
    println!("## {}: bytes of a whole training step, and the largest batch in {budget_gib} GiB", w.name());
    println!();
    println!(
        "Counting CPU allocator (tch_amp::diagnostics::track_cpu_memory): peak reset before the forward and read after \
         the optimizer step, counting everything the configuration allocated (weights, masters, optimizer state, the \
         batch, activations, gradients, temporaries). Batch {} unless stated; \"after forward\": bytes the forward \
         left allocated (what autograd keeps for backward); \"state\": weights, gradients, masters and optimizer state \
         at the end of the step.",
        rows.first().map_or(0, |r| r.batch)
    );
    println!();
    println!("| configuration | peak MiB | peak / O0 | after forward MiB | state MiB | largest batch in {budget_gib} GiB | batch / O0 | found by |");
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    for r in rows {
        let (ratio, bratio) = match o0 {
            Some(o) => (
                format!("{:.3}", r.at_batch.peak as f64 / o.at_batch.peak as f64),
                format!("{:.2}", r.largest_batch as f64 / o.largest_batch as f64),
            ),
            None => ("-".into(), "-".into()),
        };
        let how = if r.searched {
            format!("bisection ({} batch sizes measured)", r.probes.len())
        } else {
            "linear extrapolation from 2 batch sizes (slow native kernels)".to_string()
        };
        println!(
            "| {} | {:.1} | {ratio} | {:.1} | {:.2} | {} | {bratio} | {how} |",
            r.label,
            mib(r.at_batch.peak),
            mib(r.at_batch.forward),
            mib(r.at_batch.state),
            r.largest_batch,
        );
    }
}

/// Per level and torch.amp row of `w`: time vs O0 (from the timing table, when it ran), peak of
/// a whole step and largest batch vs O0, against the CPU goals (Auto's rows: at most 1.2x O0's
/// step time; O2's peak at most 0.65x O0's on the CNN; O2's largest batch at least 1.6x O0's).
fn print_goals(w: Workload, rows: &[MemoryRow], times: &BTreeMap<(&'static str, String), f64>) {
    let Some(o0) = rows.first() else { return };
    println!();
    println!("### {}: per level, against O0", w.name());
    println!();
    println!("| configuration | time vs O0 | peak / O0 | largest batch / O0 |");
    println!("|---|---:|---:|---:|");
    let mut worst_time: Option<(f64, &str)> = None;
    for r in rows {
        let time = times.get(&(w.name(), r.label.clone())).copied();
        let auto_row = !r.label.contains("(native)") && !r.label.contains("(emulated)");
        if let (Some(t), true, false) = (time, auto_row, r.label.ends_with(" O0")) {
            if worst_time.map_or(true, |(m, _)| t > m) {
                worst_time = Some((t, &r.label));
            }
        }
        println!(
            "| {} | {} | {:.3} | {:.2} |",
            r.label,
            time.map_or("-".to_string(), |t| format!("{t:.3}")),
            r.at_batch.peak as f64 / o0.at_batch.peak as f64,
            r.largest_batch as f64 / o0.largest_batch as f64
        );
    }
    let o2 = rows.iter().find(|r| {
        r.label.starts_with("tch-amp O2 fp16") && !r.label.contains("(native)") && !r.label.contains("(emulated)")
    });
    println!();
    if let Some((t, label)) = worst_time {
        println!("- Goal: every Auto row at most 1.2x O0's step time: the slowest is {label} at {t:.3}x.");
    }
    if let Some(o2) = o2 {
        let peak = o2.at_batch.peak as f64 / o0.at_batch.peak as f64;
        let batch = o2.largest_batch as f64 / o0.largest_batch as f64;
        if w == Workload::Cnn {
            println!(
                "- Goal: O2's peak at most 0.65x O0's: {peak:.3}x ({}).",
                if peak <= 0.65 { "met" } else { "not met" }
            );
        }
        println!(
            "- Goal: O2's largest batch at least 1.6x O0's: {batch:.2}x ({}).",
            if batch >= 1.6 { "met" } else { "not met" }
        );
    }
    let cpu = CpuFeatures::detect();
    if !(cpu.avx512_bf16 || cpu.amx_bf16 || cpu.avx512_fp16 || cpu.amx_fp16) {
        println!(
            "- This CPU has no fp16/bf16 units: Auto emulates every class, which computes in fp32; \
             16-bit kernels cannot run faster than fp32 here."
        );
    }
}

// ---------------------------------------------------------------------------------------------
// tch-amp's torch.amp path against PyTorch's

/// Per-round ratios of tch-amp's torch.amp rows to PyTorch's matching rows.
fn print_torch_amp_pairs(cfgs: &[Config], per_round: &[Vec<f64>], cuda: bool) {
    let pairs = [(Kind::BFloat16, "amp_bf16_scaler"), (Kind::Half, "amp_fp16")];
    let mut lines = Vec::new();
    for (k, mode) in pairs {
        for kernels in [CpuKernels::Native, CpuKernels::Auto, CpuKernels::Emulate] {
            let ours = cfgs.iter().position(|c| *c == Config::Autocast { dtype: k, kernels });
            let theirs = cfgs.iter().position(|c| *c == Config::Torch(mode));
            if let (Some(a), Some(b)) = (ours, theirs) {
                let ratio: Vec<f64> = per_round[a].iter().zip(&per_round[b]).map(|(x, y)| x / y).collect();
                lines.push(format!(
                    "| {} / {} | {} |",
                    cfgs[a].label(cuda),
                    cfgs[b].label(cuda),
                    Spread::of(&ratio).show(3)
                ));
            }
        }
    }
    if lines.is_empty() {
        return;
    }
    println!();
    println!("The torch.amp path, tch-amp against PyTorch (same fused Adam; native rows: the same autocast kernels; per-round ratio of step times):");
    println!();
    println!("| rows | time ratio |");
    println!("|---|---:|");
    for l in lines {
        println!("{l}");
    }
}

// ---------------------------------------------------------------------------------------------

#[derive(serde::Serialize)]
struct RowOut {
    label: String,
    ms: Spread,
    vs_loop: Spread,
    vs_o0: Option<Spread>,
    gflops: f64,
    fraction_of_gemm_peak: f64,
    steps_per_round: usize,
    phases: BTreeMap<&'static str, f64>,
    memory_peak_bytes_per_param: Option<f64>,
    memory_at_step_bytes_per_param: Option<f64>,
    memory_between_steps_bytes_per_param: Option<f64>,
    /// tch-amp rows: host reads of device values per step (syncs on CUDA); PyTorch rows on
    /// CUDA: syncs its sync debug mode counted.
    host_syncs_per_step: Option<f64>,
}

#[derive(serde::Serialize)]
struct WorkloadOut {
    workload: Workload,
    description: &'static str,
    gflop_per_step: f64,
    rows: Vec<RowOut>,
}

fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Ok(Device::Cuda(n)),
            None => bail!("--device: expected cpu, cuda or cuda:N, got {other:?}"),
        },
    }
}

fn libtorch_version() -> String {
    let Ok(dir) = std::env::var("LIBTORCH") else { return "?".into() };
    std::fs::read_to_string(PathBuf::from(dir).join("version.py"))
        .ok()
        .and_then(|t| {
            t.lines().find(|l| l.starts_with("__version__")).and_then(|l| l.split(['\'', '"']).nth(1)).map(String::from)
        })
        .unwrap_or_else(|| "?".into())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = parse_device(&args.device)?;
    let cuda = device != Device::Cpu;
    if cuda && !tch::Cuda::is_available() {
        bail!("--device {}: no CUDA device here (tch::Cuda::is_available() is false)", args.device);
    }
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    if args.steps == 0 || args.rounds == 0 {
        bail!("--steps and --rounds must be at least 1");
    }
    if args.clock == Clock::Cpu {
        if tch::get_num_threads() != 1 {
            bail!("--clock cpu measures the calling thread only: use it with --threads 1");
        }
        CPU_CLOCK.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    // Every row in the same allocator setting, made before the first row runs.
    let kept = !args.system_malloc && tch_amp::cast::keep_freed_cpu_memory()?;
    let python = if args.no_python { None } else { Python::start(&args)? };
    let cpu = CpuFeatures::detect();
    println!("# tch-amp training-step benchmark");
    println!();
    println!("- device: {}{}", args.device, if cuda { "" } else { " (CPU)" });
    println!("- CPU: {} ({} physical cores): {}", cpu.name, cpu.physical_cores, cpu.summary());
    println!("- CpuKernels::Auto chooses, per operation class: {}", cpu.auto_summary());
    println!("- threads: {} (libtorch intra-op, both in tch and PyTorch)", tch::get_num_threads());
    println!(
        "- C allocator: {} (PyTorch rows: the Python process's own)",
        if kept { "freed memory kept for reuse (tch_amp::cast::keep_freed_cpu_memory)" } else { "glibc defaults" }
    );
    println!(
        "- versions: tch-amp {}, tch 0.26.0, libtorch {}, PyTorch {}",
        env!("CARGO_PKG_VERSION"),
        libtorch_version(),
        python.as_ref().map_or("(not run)".to_string(), |p| p.version.clone())
    );
    println!(
        "- optimizer: {:?}{}; loss scaling as each opt level defaults to (O1/O2 fp16: dynamic; O3 and bf16: static 1)",
        args.optimizer,
        if args.optimizer == Opt::Adam { format!(" ({:?} kernel)", args.adam_kernel) } else { String::new() }
    );
    if args.no_timing {
        println!("- step times: not measured (--no-timing)");
    } else {
        println!(
            "- {} round(s) x {} timed step(s) per configuration, after {} warm-up step(s); figures: median over rounds [min–max]; clock: {}",
            args.rounds,
            args.steps,
            args.warmup,
            if args.clock == Clock::Cpu { "CPU time of the training thread" } else { "wall" }
        );
    }
    let mut bench = Bench { args, device, python, syncs: std::cell::RefCell::new(Vec::new()) };
    let mut out = Vec::new();
    let mut gemm_rates: Vec<f64> = Vec::new();
    // Median time vs O0 of each (workload, row label), for the step-memory summary.
    let mut time_vs_o0: BTreeMap<(&'static str, String), f64> = BTreeMap::new();
    let timed = if bench.args.no_timing { Vec::new() } else { bench.args.workloads.clone() };
    for &w in &timed {
        let (x, y) = data(w, device);
        let cfgs = configs(&bench.args, cuda, bench.python.is_some());
        let mut runners: Vec<Runner> = cfgs.iter().map(|&c| bench.make_runner(w, c)).collect::<Result<_>>()?;
        // Warm-up, and the slow configurations (one timed step per round).
        let mut warm_ms = Vec::new();
        for r in runners.iter_mut() {
            let ms = bench.round(r, &x, &y, bench.args.warmup.max(1), None)?;
            warm_ms.push(*ms.last().unwrap_or(&f64::NAN));
        }
        let base_warm = warm_ms[0];
        let steps: Vec<usize> = warm_ms
            .iter()
            .map(|&m| if m > bench.args.slow_factor * base_warm { 1 } else { bench.args.steps })
            .collect();
        let mut per_round: Vec<Vec<f64>> = vec![Vec::new(); runners.len()];
        let mut phases: Vec<Phases> = vec![Phases::new(); runners.len()];
        let mut syncs: Vec<Vec<f64>> = vec![Vec::new(); runners.len()];
        for round in 0..bench.args.rounds {
            gemm_rates.push(gemm_gflops(device, bench.args.gemm_size));
            for (i, r) in runners.iter_mut().enumerate() {
                let want = bench.args.phases.then_some(&mut phases[i]);
                bench.syncs.borrow_mut().clear();
                let ms = bench.round(r, &x, &y, steps[i], want)?;
                per_round[i].push(median(&ms));
                syncs[i].extend(bench.syncs.borrow().iter().copied());
            }
            eprintln!("{}: round {}/{} done", w.name(), round + 1, bench.args.rounds);
        }
        let gemm = median(&gemm_rates);
        let flops = flops_per_step(w);
        let o0 = cfgs.iter().position(|c| matches!(c, Config::Amp { level: OptLevel::O0, .. }));
        let mut rows = Vec::new();
        for (i, c) in cfgs.iter().enumerate() {
            let ratio =
                |base: usize| -> Vec<f64> { per_round[i].iter().zip(&per_round[base]).map(|(a, b)| a / b).collect() };
            let ms = Spread::of(&per_round[i]);
            let gflops = flops / (ms.median / 1e3) / 1e9;
            let memory = if bench.args.memory && !cuda && matches!(c, Config::Amp { .. }) {
                // A fresh model and optimizer, made after the counter is installed, so that
                // the counter sees all of their tensors.
                diagnostics::track_cpu_memory()?;
                let base = diagnostics::cpu_memory()?.current;
                let mut fresh = bench.make_runner(w, *c)?;
                measure_memory(&bench, &mut fresh, &x, &y, base)?
            } else {
                None
            };
            rows.push(RowOut {
                label: c.label(cuda),
                ms,
                vs_loop: Spread::of(&ratio(0)),
                vs_o0: o0.map(|o| Spread::of(&ratio(o))),
                gflops,
                fraction_of_gemm_peak: gflops / gemm,
                steps_per_round: steps[i],
                phases: phases[i].iter().map(|(k, v)| (*k, median(v))).collect(),
                memory_peak_bytes_per_param: memory.map(|m| m.0),
                memory_at_step_bytes_per_param: memory.map(|m| m.1),
                memory_between_steps_bytes_per_param: memory.map(|m| m.2),
                host_syncs_per_step: (!syncs[i].is_empty()).then(|| median(&syncs[i])),
            });
        }
        for r in &rows {
            if let Some(v) = &r.vs_o0 {
                time_vs_o0.insert((w.name(), r.label.clone()), v.median);
            }
        }
        print_workload(w, flops, gemm, &rows, &bench.args);
        print_torch_amp_pairs(&cfgs, &per_round, cuda);
        out.push(WorkloadOut { workload: w, description: w.describe(), gflop_per_step: flops / 1e9, rows });
    }
    let mut step_memory_out = Vec::new();
    if bench.args.step_memory {
        if cuda {
            eprintln!("(--step-memory measures CPU memory: skipped on {})", bench.args.device);
        } else {
            let budget = (bench.args.budget_gib * 1024.0 * 1024.0 * 1024.0) as i64;
            for &w in &bench.args.workloads.clone() {
                let rows = step_memory(&bench, w, budget)?;
                print_step_memory(w, &rows, bench.args.budget_gib);
                print_goals(w, &rows, &time_vs_o0);
                step_memory_out.push(serde_json::json!({ "workload": w, "budget_bytes": budget, "rows": rows }));
            }
        }
    }
    let mut scaler_out = Vec::new();
    if bench.args.scaler_rounds > 0 {
        let (rounds, iterations) = (bench.args.scaler_rounds, bench.args.steps.max(10));
        for &w in &bench.args.workloads.clone() {
            scaler_out.push(scaler_cost(&mut bench, w, rounds, iterations)?);
        }
        print_scaler(&scaler_out, rounds, iterations);
    }
    let float8_out = if bench.args.float8_rounds > 0 {
        let rows = float8_cost(&bench, bench.args.float8_rounds, bench.args.steps)?;
        print_float8(&rows, &bench);
        rows
    } else {
        Vec::new()
    };
    let doctor_out = if bench.args.doctor_rounds > 0 {
        let (rounds, steps) = (bench.args.doctor_rounds, bench.args.steps);
        let rows = doctor_cost(&mut bench, rounds, steps, steps.div_ceil(3))?;
        print_doctor(&rows);
        rows
    } else {
        Vec::new()
    };
    let overflow = if bench.args.overflow_rounds > 0 {
        Some(overflow_cost(&bench, bench.args.overflow_rounds, bench.args.steps)?)
    } else {
        None
    };
    if let Some(path) = &bench.args.json {
        let json = serde_json::json!({
            "cpu": { "name": cpu.name, "summary": cpu.summary() },
            "threads": tch::get_num_threads(),
            "gemm_gflops": Spread::of(&gemm_rates),
            "args": &bench.args,
            "workloads": out,
            "overflow_path": overflow,
            "step_memory": step_memory_out,
            "grad_scaler": scaler_out,
            "float8": float8_out,
            "doctor": doctor_out,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn print_workload(w: Workload, flops: f64, gemm: f64, rows: &[RowOut], args: &Args) {
    println!();
    println!("## {}: {}", w.name(), w.describe());
    println!();
    println!(
        "{:.2} GFLOP per step (GEMMs and convolutions, forward and backward); fp32 GEMM peak of this run: {gemm:.0} GFLOP/s ({n}^3 mm, best of 3 per round, median of rounds)",
        flops / 1e9,
        n = args.gemm_size
    );
    println!();
    println!("| configuration | ms/step | time vs fp32 tch loop | time vs O0 | fraction of fp32 GEMM peak | notes |");
    println!("|---|---:|---:|---:|---:|---|");
    for r in rows {
        let mut notes = Vec::new();
        if r.steps_per_round == 1 && args.steps > 1 {
            notes.push("slow: 1 timed step per round".to_string());
        }
        if let Some(n) = r.host_syncs_per_step {
            notes.push(format!("{n} host sync(s)/step"));
        }
        if let (Some(peak), Some(at)) = (r.memory_peak_bytes_per_param, r.memory_at_step_bytes_per_param) {
            notes.push(format!("peak {peak:.2} B/param measured ({at:.0} counted at step)"));
        }
        println!(
            "| {} | {} | {} | {} | {:.3} | {} |",
            r.label,
            r.ms.show(2),
            r.vs_loop.show(3),
            r.vs_o0.map_or("-".into(), |s| s.show(3)),
            r.fraction_of_gemm_peak,
            notes.join("; ")
        );
    }
    if args.phases {
        let names: Vec<&'static str> = {
            let mut n: Vec<&'static str> = rows.iter().flat_map(|r| r.phases.keys().copied()).collect();
            n.sort();
            n.dedup();
            n
        };
        println!();
        println!("Where a step's time goes (ms, median over all timed steps):");
        println!();
        println!("| configuration | {} |", names.join(" | "));
        println!("|---|{}", "---:|".repeat(names.len()));
        for r in rows.iter().filter(|r| !r.phases.is_empty()) {
            let cells: Vec<String> =
                names.iter().map(|n| r.phases.get(n).map_or("-".into(), |v| format!("{v:.2}"))).collect();
            println!("| {} | {} |", r.label, cells.join(" | "));
        }
    }
}
