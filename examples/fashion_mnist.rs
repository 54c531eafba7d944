//! The main job (`make demo`): a small ResNet-style CNN with batch norm trained on
//! Fashion-MNIST under O0, O1, O2 and O3 in turn — same seed, same initial weights, same
//! batches — then a table per level: test accuracy, seconds per epoch and "time vs O0"
//! (seconds per epoch divided by O0's: 0.80x takes 20% less time), steps and training seconds
//! to the target test accuracy, what the GEMMs and convolutions compute in (fp32, or fp16/bf16
//! with libtorch's native kernels or tch-amp's fp32 emulation, as `CpuKernels::Auto` chose
//! per operation class for this CPU), the peak memory of one training step and its ratio to
//! O0's, the largest batch whose step fits `--budget-gib`, bytes of training state (weights +
//! gradients + fp32 masters + optimizer state), skipped steps and the final loss scale.
//! The rows `autocast-fp16` and `autocast-bf16` are PyTorch's own recipe through tch-amp: fp32
//! weights, the forward under `tch_amp::Autocast` in that type and a `GradScaler`
//! (`autocast` takes torch.autocast's default type: bf16 on CPU, fp16 on CUDA).
//!
//! Writes `curves.png` (six panels: loss per level, each level's loss minus O0's, the loss
//! scale over steps, test accuracy, seconds per epoch, peak memory per level) and
//! `record.json` (everything in the table, per-step losses and scales, the test accuracy every
//! `--eval-every` steps, the arguments) into `--out` (default `runs/fashion_mnist/`).
//!
//! ```text
//! cargo run --release --example fashion_mnist                      # O0-O3, autocast fp16 and bf16
//! cargo run --release --example fashion_mnist -- --levels O0,O2    # a selection
//! cargo run --release --example fashion_mnist -- --levels O0,autocast  # the device's default type
//! cargo run --release --example fashion_mnist -- --train-size 0 --epochs 5   # full data set
//! cargo run --release --example fashion_mnist -- --device cuda     # on the first GPU
//! ```
//!
//! `--device cpu|cuda|cuda:N` (default `cpu`) places the model and both splits of the data set
//! on that device; asking for a CUDA device that is not there is an error, never a silent
//! fallback to the CPU.
//!
//! Time to accuracy: every `--eval-every` steps the model is evaluated on the first
//! `--eval-size` test images (evaluation time is not counted); the first evaluation at or above
//! `--target-accuracy` gives the steps and the training seconds to reach it. The final test
//! accuracy uses the whole test split.
//!
//! Peak memory (CPU only): after every level has been timed, each level runs a few more training
//! steps on a fresh model with tch-amp's counting allocator installed
//! (`tch_amp::diagnostics::track_cpu_memory`), and the table gives the most bytes held during
//! a step at the batch size: weights, masters, optimizer state, the batch, activations and
//! gradients. The same at twice the batch size gives the bytes per example, and the largest batch
//! within `--budget-gib` follows (the peak is affine in the batch size). The counting allocator
//! is installed only then, so that it costs the timed epochs nothing.
//!
//! The autocast rows make the Apex levels' choice of CPU kernels (`CpuKernels::Auto`, per
//! operation class): libtorch's own fp16/bf16 kernels where they are fast on this kind of CPU,
//! the fp32 emulation elsewhere. BENCHMARKS.md has this example's figures per machine.
//!
//! SGD with Nesterov momentum and a cosine schedule is used rather than Adam: under O3 the
//! optimizer runs on the fp16 weights, and Adam's `eps` (1e-8) is zero in fp16, so a small
//! second moment divides by zero; SGD is what Apex's own examples use.
mod common;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};
use tch_amp::scaling::ScaleChange;
use tch_amp::{
    initialize, Amp, AmpConfig, AmpModel, AmpOptimizer, Autocast, CpuKernelChoice, CpuKernels, GradScaler, OpClass,
    OptLevel, StepOutcome,
};

use common::cli;
use common::data::{Dataset, Split, DEFAULT_DATA_DIR};
use common::log::{StepLog, StepRecord};
use common::memory::{human, measure, MemoryBytes};
use common::model::{ResNetConfig, SmallResNet};
use common::plot::{plot_levels_auto, LevelSummary};
use common::progress;
use common::train::{cosine_lr, epoch_batches, evaluate, steps_per_epoch, Eval};

/// What one row of the comparison trains with: an Apex opt level, or PyTorch's recipe
/// (autocast + GradScaler on fp32 weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Apex(OptLevel),
    /// The type given, or torch.autocast's default for the device.
    Autocast(Option<Kind>),
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Run::Apex(level) => write!(f, "{level}"),
            Run::Autocast(None) => f.write_str("autocast"),
            Run::Autocast(Some(Kind::Half)) => f.write_str("autocast-fp16"),
            Run::Autocast(Some(_)) => f.write_str("autocast-bf16"),
        }
    }
}

impl serde::Serialize for Run {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn parse_level(s: &str) -> Result<Run, String> {
    match s.trim() {
        "autocast" => Ok(Run::Autocast(None)),
        "autocast-fp16" => Ok(Run::Autocast(Some(Kind::Half))),
        "autocast-bf16" => Ok(Run::Autocast(Some(Kind::BFloat16))),
        other => other
            .parse::<OptLevel>()
            .map(Run::Apex)
            .map_err(|e| format!("{e} (or autocast, autocast-fp16, autocast-bf16)")),
    }
}

/// Fashion-MNIST under Apex's four opt levels, compared.
#[derive(Parser, Debug, serde::Serialize)]
#[command(version, about, long_about = None)]
struct Args {
    /// Folder with the four IDX files (gzip or plain) of Fashion-MNIST or an MNIST-like set.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data: PathBuf,
    /// Opt levels to train, in order (comma-separated); `autocast-fp16` / `autocast-bf16` are
    /// torch.amp's recipe (autocast + GradScaler on fp32 weights), `autocast` in the device's
    /// default type.
    #[arg(long, value_delimiter = ',', default_value = "O0,O1,O2,O3,autocast-fp16,autocast-bf16", value_parser = parse_level)]
    levels: Vec<Run>,
    /// Training examples used (a seeded random subset; 0 = all 60,000).
    #[arg(long, default_value_t = 30_000)]
    train_size: usize,
    /// Test examples used (the first N; 0 = all 10,000).
    #[arg(long, default_value_t = 0)]
    test_size: usize,
    /// Evaluate on the first `--eval-size` test images every this many steps (0: only at the end).
    #[arg(long, default_value_t = 50)]
    eval_every: usize,
    /// Test images of the periodic evaluations.
    #[arg(long, default_value_t = 2000)]
    eval_size: usize,
    /// Test accuracy (percent, on the periodic evaluations) whose first crossing is reported as
    /// steps and training seconds.
    #[arg(long, default_value_t = 88.0)]
    target_accuracy: f64,
    /// Epochs per level.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Batch size.
    #[arg(short = 'b', long, default_value_t = 128)]
    batch_size: usize,
    /// Peak learning rate (SGD with Nesterov momentum 0.9; linear warm-up, then cosine decay).
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// Weight decay.
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f64,
    /// Linear warm-up steps before the cosine decay.
    #[arg(long, default_value_t = 20)]
    warmup_steps: usize,
    /// Channels after the stem (doubled by each stage).
    #[arg(long, default_value_t = 16)]
    width: i64,
    /// Residual stages.
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Side of the average-pooled feature map fed to the classifier (1 = global average
    /// pooling; 7, the size of the last feature map, = no pooling).
    #[arg(long, default_value_t = 7)]
    pool: i64,
    /// Seed of the weights, the training subset and the batch order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output folder for curves.png and record.json.
    #[arg(long, default_value = "runs/fashion_mnist")]
    out: PathBuf,
    /// JSON-lines log, one line per step of every level.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Do not draw curves.png.
    #[arg(long)]
    no_plot: bool,
    /// Memory budget of the "largest batch" column, in GiB (CPU only).
    #[arg(long, default_value_t = 2.0)]
    budget_gib: f64,
    /// Device to train on: cpu, cuda (the first GPU) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = |s: &str| cli::parse_device(s).map(|_| s.trim().to_string()))]
    device: String,
}

/// A periodic evaluation.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct EvalPoint {
    /// Steps taken before it.
    step: usize,
    /// Training seconds before it (evaluations not counted).
    train_seconds: f64,
    /// Top-1 accuracy on the first `--eval-size` test images, percent.
    top1: f64,
}

/// The first evaluation at or above the target accuracy.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct TimeToTarget {
    target: f64,
    steps: usize,
    train_seconds: f64,
}

/// What one opt level produced.
#[derive(Debug, serde::Serialize)]
struct LevelResult {
    level: Run,
    test: Eval,
    epoch_seconds: Vec<f64>,
    seconds_per_epoch: f64,
    /// Seconds per epoch divided by O0's: below 1 is faster than O0.
    time_vs_o0: Option<f64>,
    /// What the level computes its GEMMs and convolutions in, and how on this CPU.
    kernels: String,
    memory: MemoryBytes,
    memory_total: u64,
    /// The largest batch whose step peaks within `--budget-gib`, extrapolated from the peaks at
    /// the batch size and twice it (CPU only).
    largest_batch: Option<u64>,
    /// The most bytes held during one training step (CPU only; measured after the timed runs).
    peak_step_bytes: Option<u64>,
    evals: Vec<EvalPoint>,
    time_to_target: Option<TimeToTarget>,
    steps: u64,
    skipped: u64,
    final_loss_scale: f64,
    scale_changes: Vec<ScaleChange>,
    losses: Vec<f64>,
    loss_scales: Vec<f64>,
}

/// One row's model, optimizer and scaler.
enum Trainer {
    /// tch-amp's Apex path at an opt level.
    Apex { model: AmpModel<SmallResNet>, opt: AmpOptimizer, amp: Amp },
    /// torch.amp's recipe: fp32 weights (an O0 `Amp`: no casts, the same SGD), the forward
    /// under autocast, the loss through a GradScaler.
    Autocast {
        model: AmpModel<SmallResNet>,
        opt: AmpOptimizer,
        _amp: Amp,
        scaler: GradScaler,
        autocast: Autocast,
        dtype: Kind,
    },
}

/// What a step reports.
struct StepReport {
    loss_scale: f64,
    new_loss_scale: f64,
    skipped: bool,
}

impl Trainer {
    fn new(args: &Args, data: &Dataset, run: Run, vs: &nn::VarStore) -> Result<Self> {
        let net = SmallResNet::new(&vs.root(), resnet_config(args, data));
        let sgd = nn::Sgd { momentum: 0.9, dampening: 0.0, wd: args.weight_decay, nesterov: true };
        let level = match run {
            Run::Apex(level) => level,
            Run::Autocast(_) => OptLevel::O0,
        };
        // verbosity 0: overflows are reported above the progress bar instead of by tch-amp.
        let (model, opt, amp) = initialize(vs, net, sgd, args.lr, &AmpConfig::new(level).verbosity(0))?;
        Ok(match run {
            Run::Apex(_) => Trainer::Apex { model, opt, amp },
            Run::Autocast(dtype) => {
                let device = vs.device();
                // torch.autocast's default type: bf16 on CPU, fp16 on CUDA.
                let dtype = dtype.unwrap_or(if device == Device::Cpu { Kind::BFloat16 } else { Kind::Half });
                let scaler = GradScaler::new(device);
                let autocast = Autocast::new(device).dtype(dtype);
                Trainer::Autocast { model, opt, _amp: amp, scaler, autocast, dtype }
            }
        })
    }

    fn opt(&self) -> &AmpOptimizer {
        match self {
            Trainer::Apex { opt, .. } | Trainer::Autocast { opt, .. } => opt,
        }
    }

    fn opt_mut(&mut self) -> &mut AmpOptimizer {
        match self {
            Trainer::Apex { opt, .. } | Trainer::Autocast { opt, .. } => opt,
        }
    }

    /// The loss of a batch (training mode).
    fn forward(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Trainer::Apex { model, .. } => model.forward_t(x, true).cross_entropy_for_logits(y),
            Trainer::Autocast { model, autocast, .. } => {
                autocast.run(|| model.forward_t(x, true).cross_entropy_for_logits(y))?
            }
        })
    }

    /// Backward of the scaled loss (Apex: `scale_loss`, which also unscales and checks for an
    /// overflow); returns the loss scale it used.
    fn backward(&mut self, loss: &Tensor) -> Result<f64> {
        match self {
            Trainer::Apex { opt, amp, .. } => Ok(amp.scale_loss(loss, &mut [&mut *opt], |s| s.backward())?.loss_scale),
            Trainer::Autocast { scaler, .. } => {
                let loss_scale = scaler.get_scale();
                scaler.scale(loss)?.backward();
                Ok(loss_scale)
            }
        }
    }

    /// The optimizer step (skipped on an overflow), and the scale for the next step.
    fn step(&mut self, loss_scale: f64) -> Result<StepReport> {
        match self {
            Trainer::Apex { opt, amp, .. } => {
                let skipped = matches!(opt.step()?, StepOutcome::Skipped { .. });
                Ok(StepReport { loss_scale, new_loss_scale: amp.loss_scale(0)?, skipped })
            }
            Trainer::Autocast { opt, scaler, .. } => {
                let skipped = !scaler.step(opt)?.stepped();
                scaler.update()?;
                Ok(StepReport { loss_scale, new_loss_scale: scaler.get_scale(), skipped })
            }
        }
    }

    fn evaluate(&self, split: &Split) -> Result<Eval> {
        Ok(match self {
            Trainer::Apex { model, .. } => evaluate(model, split, 500),
            Trainer::Autocast { model, autocast, .. } => autocast.run(|| evaluate(model, split, 500))?,
        })
    }

    fn final_loss_scale(&self) -> Result<f64> {
        Ok(match self {
            Trainer::Apex { amp, .. } => amp.loss_scale(0)?,
            Trainer::Autocast { scaler, .. } => scaler.get_scale(),
        })
    }

    fn scale_changes(&self) -> Result<Vec<ScaleChange>> {
        Ok(match self {
            Trainer::Apex { amp, .. } => amp.scaler(0)?.history().to_vec(),
            Trainer::Autocast { .. } => Vec::new(),
        })
    }
}

fn train_level(
    args: &Args,
    data: &Dataset,
    run: Run,
    device: Device,
    log: &mut StepLog,
    first_step: u64,
) -> Result<LevelResult> {
    tch::manual_seed(args.seed as i64);
    let vs = nn::VarStore::new(device);
    let mut trainer = Trainer::new(args, data, run, &vs)?;
    let kernels = kernels_of(&trainer, device);
    let eval_split = data.test.head(args.eval_size);

    let n = data.train.len();
    let per_epoch = steps_per_epoch(n, args.batch_size);
    let total = per_epoch * args.epochs;
    let pb = progress::bar(total as u64, &run.to_string());
    let mut losses = Vec::with_capacity(total);
    let mut scales = Vec::with_capacity(total);
    let mut epoch_seconds = Vec::new();
    let mut evals = Vec::new();
    let mut memory = MemoryBytes::default();
    let mut skipped_steps = 0u64;
    let mut step = 0usize;
    for epoch in 0..args.epochs {
        let mut seconds = 0.0;
        for idx in epoch_batches(n, args.batch_size, args.seed, epoch) {
            let t0 = Instant::now();
            trainer.opt_mut().set_lr(cosine_lr(args.lr, step, total, args.warmup_steps))?;
            let (x, y) = data.train.batch(&idx);
            trainer.opt_mut().zero_grad()?;
            let loss = trainer.forward(&x, &y)?;
            let loss_scale = trainer.backward(&loss)?;
            seconds += t0.elapsed().as_secs_f64();
            if memory.optimizer_state == 0 {
                // Between backward and step the gradients are there; optimizer state appears at
                // the first step taken: measure until it is there.
                memory = measure(&vs, trainer.opt());
            }
            let t0 = Instant::now();
            let out = trainer.step(loss_scale)?;
            seconds += t0.elapsed().as_secs_f64();
            if out.skipped {
                skipped_steps += 1;
                progress::println(
                    &pb,
                    format!(
                        "{run}: gradient overflow at step {step}, step skipped, loss scale {} -> {}",
                        out.loss_scale, out.new_loss_scale
                    ),
                );
            }
            let l = loss.double_value(&[]);
            losses.push(l);
            scales.push(out.loss_scale);
            log.write(
                &StepRecord::new(first_step + step as u64, l, out.loss_scale, out.skipped)
                    .with("level", run.to_string())
                    .with("epoch", epoch)
                    .with("lr", trainer.opt().lr()),
            )?;
            step += 1;
            pb.inc(1);
            if step % 10 == 0 {
                pb.set_message(format!("loss {l:.3} scale {}", out.new_loss_scale));
            }
            if args.eval_every > 0 && step % args.eval_every == 0 {
                let train_seconds = epoch_seconds.iter().sum::<f64>() + seconds;
                evals.push(EvalPoint { step, train_seconds, top1: trainer.evaluate(&eval_split)?.top1 });
            }
        }
        epoch_seconds.push(seconds);
    }
    pb.finish_and_clear();
    if !evals.last().is_some_and(|e| e.step == step) {
        let train_seconds = epoch_seconds.iter().sum::<f64>();
        evals.push(EvalPoint { step, train_seconds, top1: trainer.evaluate(&eval_split)?.top1 });
    }
    let time_to_target = evals.iter().find(|e| e.top1 >= args.target_accuracy).map(|e| TimeToTarget {
        target: args.target_accuracy,
        steps: e.step,
        train_seconds: e.train_seconds,
    });
    let test = trainer.evaluate(&data.test)?;
    let final_loss_scale = trainer.final_loss_scale()?;
    let seconds_per_epoch = epoch_seconds.iter().sum::<f64>() / epoch_seconds.len().max(1) as f64;
    println!(
        "{run}: test accuracy {:.2}%, test loss {:.4}, {seconds_per_epoch:.1} s/epoch, {skipped_steps} skipped steps, final loss scale {final_loss_scale}",
        test.top1, test.loss
    );
    Ok(LevelResult {
        level: run,
        test,
        epoch_seconds,
        seconds_per_epoch,
        time_vs_o0: None,
        kernels,
        memory,
        memory_total: memory.total(),
        peak_step_bytes: None,
        largest_batch: None,
        evals,
        time_to_target,
        steps: step as u64,
        skipped: skipped_steps,
        final_loss_scale,
        scale_changes: trainer.scale_changes()?,
        losses,
        loss_scales: scales,
    })
}

/// The most bytes held during one training step of `run` on the first `batch` examples of the
/// first epoch, on a fresh model, counted by tch-amp's counting CPU allocator: the peak is reset
/// after `zero_grad` and read after the optimizer step. None off the CPU.
fn peak_step_bytes(args: &Args, data: &Dataset, run: Run, device: Device, batch: usize) -> Result<Option<u64>> {
    if device != Device::Cpu {
        return Ok(None);
    }
    tch_amp::diagnostics::track_cpu_memory()?;
    let base = tch_amp::diagnostics::cpu_memory()?.current;
    tch::manual_seed(args.seed as i64);
    let vs = nn::VarStore::new(device);
    let mut trainer = Trainer::new(args, data, run, &vs)?;
    let order: Vec<i64> = epoch_batches(data.train.len(), 1, args.seed, 0).into_iter().flatten().collect();
    let (x, y) = data.train.batch(&order[..batch.min(order.len())]);
    // The first step makes the optimizer state; the second is measured.
    let mut peak = 0;
    for measured in [false, true] {
        trainer.opt_mut().zero_grad()?;
        if measured {
            tch_amp::diagnostics::reset_cpu_memory_peak()?;
        }
        let loss = trainer.forward(&x, &y)?;
        let loss_scale = trainer.backward(&loss)?;
        trainer.step(loss_scale)?;
        drop(loss);
        peak = tch_amp::diagnostics::cpu_memory()?.peak - base;
    }
    Ok(Some(peak.max(0) as u64))
}

/// The main job's network for `data` with the command line's width, stages and pooling.
fn resnet_config(args: &Args, data: &Dataset) -> ResNetConfig {
    ResNetConfig {
        in_channels: 1,
        num_classes: data.num_classes,
        width: args.width,
        stages: args.stages,
        pool: args.pool,
    }
}

/// One untimed forward and backward pass of a throwaway model, so that libtorch's one-time
/// setup (kernel selection, allocator growth) is not billed to the first level timed.
fn warm_up(args: &Args, data: &Dataset, device: Device) {
    tch::manual_seed(args.seed as i64);
    let vs = nn::VarStore::new(device);
    let net = SmallResNet::new(&vs.root(), resnet_config(args, data));
    let idx: Vec<i64> = (0..args.batch_size.min(data.train.len()) as i64).collect();
    let (x, y) = data.train.batch(&idx);
    net.forward_t(&x, true).cross_entropy_for_logits(&y).backward();
}

/// "fp32", or the 16-bit type and whether this network's GEMMs and convolutions run libtorch's
/// native kernels or tch-amp's fp32 emulation (`CpuKernels::Auto`, chosen per class from the
/// CPU): "fp16 emulated", "bf16 native", or per class ("fp16 gemm native, conv emulated").
fn kernels_of(trainer: &Trainer, device: Device) -> String {
    let name = |k: Kind| if k == Kind::Half { "fp16" } else { "bf16" };
    let how = |k: Kind, choice: CpuKernelChoice| {
        let word = |m: CpuKernels| if m == CpuKernels::Native { "native" } else { "emulated" };
        let (gemm, conv) = (choice.get(OpClass::Gemm), choice.get(OpClass::Convolution));
        if gemm == conv {
            format!("{} {}", name(k), word(gemm))
        } else {
            format!("{} gemm {}, conv {}", name(k), word(gemm), word(conv))
        }
    };
    match trainer {
        Trainer::Autocast { dtype, .. } if device != Device::Cpu => format!("{} (CUDA)", name(*dtype)),
        Trainer::Autocast { dtype, .. } => how(*dtype, tch_amp::cast::CpuFeatures::detect().auto_choice(*dtype)),
        Trainer::Apex { amp, .. } => {
            let props = amp.properties();
            match (props.low_precision_kind(), props.cpu_kernels()) {
                (None, _) | (_, None) => "fp32".into(),
                (Some(k), _) if device != Device::Cpu => format!("{} (CUDA)", name(k)),
                (Some(k), Some(choice)) => how(k, choice),
            }
        }
    }
}

fn print_table(results: &[LevelResult], target: f64, budget_gib: f64) {
    let to_target = format!("to {target}%");
    println!();
    println!(
        "{:<13} {:>9} {:>9} {:>11} {:>16} {:>30} {:>11} {:>8} {:>9} {:>11} {:>9} {:>11}",
        "level",
        "test acc",
        "s/epoch",
        "time vs O0",
        to_target,
        "GEMMs in",
        "peak step",
        "peak/O0",
        "max batch",
        "state",
        "skipped",
        "loss scale"
    );
    let o0 = results.iter().find(|r| r.level == Run::Apex(OptLevel::O0));
    for r in results {
        let ratio = r.time_vs_o0.map_or("-".to_string(), |x| format!("{x:.2}x"));
        let peak_ratio = match (r.peak_step_bytes, o0.and_then(|o| o.peak_step_bytes)) {
            (Some(p), Some(o)) if o > 0 => format!("{:.2}x", p as f64 / o as f64),
            _ => "-".to_string(),
        };
        let reached =
            r.time_to_target.map_or("not reached".to_string(), |t| format!("{} st, {:.1} s", t.steps, t.train_seconds));
        println!(
            "{:<13} {:>8.2}% {:>9.2} {:>11} {:>16} {:>30} {:>11} {:>8} {:>9} {:>11} {:>9} {:>11}",
            r.level.to_string(),
            r.test.top1,
            r.seconds_per_epoch,
            ratio,
            reached,
            r.kernels,
            r.peak_step_bytes.map_or("-".to_string(), human),
            peak_ratio,
            r.largest_batch.map_or("-".to_string(), |b| b.to_string()),
            human(r.memory_total),
            format!("{}/{}", r.skipped, r.steps),
            r.final_loss_scale
        );
    }
    println!(
        "time vs O0: seconds per epoch divided by O0's (0.80x = 20% less time than O0). {to_target}: steps and \
         training seconds until the periodic test evaluation first reached it. peak step: the most bytes held \
         during one training step (weights, masters, optimizer state, batch, activations, gradients; CPU only), \
         and its ratio to O0's. max batch: the largest batch whose step peaks within {budget_gib} GiB, from the \
         peaks at the batch size and twice it (the peak is affine in the batch size). state: weights, \
         gradients when the optimizer steps, fp32 masters and optimizer state. skipped: steps skipped after a \
         gradient overflow / steps."
    );
}

fn main() -> std::process::ExitCode {
    common::main(run)
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.levels.is_empty() {
        bail!("--levels: give at least one of O0, O1, O2, O3, autocast, autocast-fp16, autocast-bf16");
    }
    if args.epochs == 0 || args.batch_size == 0 {
        bail!("--epochs and --batch-size must be at least 1");
    }
    let device = cli::device(&args.device)?;
    let wall = Instant::now();
    let data = Dataset::load(&args.data)?.standardize();
    let on_device = |s: Split| Split { images: s.images.to_device(device), labels: s.labels.to_device(device) };
    let data = Dataset {
        train: on_device(data.train.subset(args.train_size, args.seed)),
        test: on_device(data.test.head(args.test_size)),
        num_classes: data.num_classes,
    };
    println!(
        "Fashion-MNIST from {} on {device:?}: {} training and {} test images, {} classes; {} epochs of {} steps \
         (batch {}); libtorch threads: {}",
        args.data.display(),
        data.train.len(),
        data.test.len(),
        data.num_classes,
        args.epochs,
        steps_per_epoch(data.train.len(), args.batch_size),
        args.batch_size,
        tch::get_num_threads()
    );
    let cpu = tch_amp::cast::CpuFeatures::detect();
    println!("CPU: {} ({} physical cores): {}", cpu.name, cpu.physical_cores, cpu.summary());
    if device == Device::Cpu {
        println!("CpuKernels::Auto chooses, per operation class: {}", cpu.auto_summary());
    }
    warm_up(&args, &data, device);
    let mut log = StepLog::create(args.log.as_deref())?;
    let mut results: Vec<LevelResult> = Vec::new();
    let mut first_step = 0;
    for &level in &args.levels {
        let r = train_level(&args, &data, level, device, &mut log, first_step)
            .with_context(|| format!("training under {level}"))?;
        first_step += r.losses.len() as u64;
        results.push(r);
    }
    log.flush()?;
    // After every timed run: the counting allocator stays installed once it is.
    let budget = (args.budget_gib * (1u64 << 30) as f64) as u64;
    for r in &mut results {
        let at = |b: usize| {
            peak_step_bytes(&args, &data, r.level, device, b)
                .with_context(|| format!("measuring the peak memory of a step under {}", r.level))
        };
        r.peak_step_bytes = at(args.batch_size)?;
        if let (Some(p1), Some(p2)) = (r.peak_step_bytes, at(2 * args.batch_size)?) {
            let per_example = (p2.saturating_sub(p1) as f64 / args.batch_size as f64).max(1.0);
            let fixed = p1 as f64 - per_example * args.batch_size as f64;
            r.largest_batch = Some(((budget as f64 - fixed) / per_example).floor().max(0.0) as u64);
        }
    }
    if let Some(base) = results.iter().find(|r| r.level == Run::Apex(OptLevel::O0)).map(|r| r.seconds_per_epoch) {
        for r in &mut results {
            r.time_vs_o0 = Some(r.seconds_per_epoch / base);
        }
    }
    print_table(&results, args.target_accuracy, args.budget_gib);

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("{}: cannot create the output folder", args.out.display()))?;
    if !args.no_plot {
        let levels: Vec<LevelSummary> = results
            .iter()
            .map(|r| LevelSummary {
                name: r.level.to_string(),
                color: match r.level {
                    Run::Apex(level) => level as usize,
                    Run::Autocast(Some(Kind::BFloat16)) => 5,
                    Run::Autocast(_) => 4,
                },
                losses: r.losses.clone(),
                scales: r.loss_scales.clone(),
                test_accuracy: r.test.top1,
                seconds_per_epoch: r.seconds_per_epoch,
                time_vs_o0: r.time_vs_o0,
                state_bytes: [r.memory.weights, r.memory.grads, r.memory.masters, r.memory.optimizer_state],
                peak_bytes: r.peak_step_bytes,
            })
            .collect();
        let png = args.out.join("curves.png");
        let title = format!(
            "Fashion-MNIST, {} training images, {} epochs: tch-amp's opt levels compared",
            data.train.len(),
            args.epochs
        );
        let text = plot_levels_auto(&png, &title, &levels)?;
        println!("wrote {}{}", png.display(), if text { "" } else { " (no font found: drawn without text)" });
    }
    let record = serde_json::json!({
        "example": "fashion_mnist",
        "args": &args,
        "train_examples": data.train.len(),
        "test_examples": data.test.len(),
        "num_classes": data.num_classes,
        "libtorch_threads": tch::get_num_threads(),
        "cpu": { "name": cpu.name, "physical_cores": cpu.physical_cores, "summary": cpu.summary() },
        "wall_seconds": wall.elapsed().as_secs_f64(),
        "results": &results,
    });
    let path = args.out.join("record.json");
    std::fs::write(&path, serde_json::to_string_pretty(&record)?)
        .with_context(|| format!("{}: cannot write", path.display()))?;
    println!("wrote {}", path.display());
    println!("wall time {:.1} s", wall.elapsed().as_secs_f64());
    Ok(())
}
