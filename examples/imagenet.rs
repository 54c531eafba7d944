//! A port of Apex's `examples/imagenet/main_amp.py` that runs on a CPU: the same flags
//! (`--opt-level`, `--keep-batchnorm-fp32`, `--loss-scale` as strings parsed as Apex parses
//! them, `--epochs`, `-b/--batch-size`, `--lr` scaled by batch/256, `--momentum`,
//! `--weight-decay`, `-p/--print-freq`, `--resume`, `-e/--evaluate`), the same schedule (linear
//! warm-up, then ÷10 at epochs 30, 60 and 80), the same printout, but a ResNet-style CNN on
//! Fashion-MNIST (or any IDX data set via `--data`) instead of ResNet-50 on ImageNet.
//!
//! After each epoch it writes `checkpoint.safetensors` (model variables in fp32 — taken from
//! the fp32 masters under O2, so resuming is exact, unlike Apex — the optimizer's momentum
//! buffers and step counts, and the loss scaler) plus `checkpoint.json` (epoch, best Prec@1,
//! global step) into `--checkpoint-dir`, and copies both to `model_best.*` when Prec@1
//! improved. `--resume runs/imagenet/checkpoint.safetensors` continues from there.
//!
//! ```text
//! cargo run --release --example imagenet -- --opt-level O2 --epochs 2 -b 128
//! cargo run --release --example imagenet -- --opt-level O2 --epochs 3 --resume runs/imagenet/checkpoint.safetensors
//! cargo run --release --example imagenet -- --opt-level O2 -e --resume runs/imagenet/model_best.safetensors
//! ```
mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use tch::nn::{self, ModuleT};
use tch::Device;
use tch_amp::{initialize, load_checkpoint, save_checkpoint, StepOutcome};

use common::cli::{AmpArgs, DataArgs};
use common::data::Split;
use common::log::{StepLog, StepRecord};
use common::model::{ResNetConfig, SmallResNet};
use common::train::{epoch_batches, evaluate, steps_per_epoch, Eval};

/// Apex's ImageNet AMP example, on Fashion-MNIST.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    amp: AmpArgs,
    /// Number of total epochs to run.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Mini-batch size.
    #[arg(short = 'b', long, default_value_t = 256)]
    batch_size: usize,
    /// Initial learning rate for a batch of 256 (scaled by batch-size/256, as in Apex).
    #[arg(long, visible_alias = "learning-rate", default_value_t = 0.1)]
    lr: f64,
    /// Momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Weight decay.
    #[arg(long, visible_alias = "wd", default_value_t = 1e-4)]
    weight_decay: f64,
    /// Epochs of linear learning-rate warm-up (Apex: 5, for 90 epochs).
    #[arg(long, default_value_t = 1)]
    warmup_epochs: usize,
    /// Print frequency (steps).
    #[arg(short = 'p', long, default_value_t = 10)]
    print_freq: usize,
    /// Path to a checkpoint (`checkpoint.safetensors`) to resume from.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Evaluate the model on the test set and exit.
    #[arg(short = 'e', long)]
    evaluate: bool,
    /// Where checkpoints are written.
    #[arg(long, default_value = "runs/imagenet")]
    checkpoint_dir: PathBuf,
    /// Channels after the stem (doubled by each stage).
    #[arg(long, default_value_t = 16)]
    width: i64,
    /// Residual stages (each halves the resolution).
    #[arg(long, default_value_t = 3)]
    stages: usize,
    /// JSON-lines log, one line per step.
    #[arg(long)]
    log: Option<PathBuf>,
}

/// What goes beside the tensors of a checkpoint.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct CheckpointInfo {
    /// Epochs completed.
    epoch: usize,
    best_prec1: f64,
    /// Optimizer steps taken so far (the next step's number in the log).
    step: u64,
    opt_level: String,
    arch: String,
}

fn info_path(checkpoint: &Path) -> PathBuf {
    checkpoint.with_extension("json")
}

/// Apex's `adjust_learning_rate`: ÷10 at epochs 30, 60 and 80, linear warm-up at the start.
fn adjust_learning_rate(args: &Args, base: f64, epoch: usize, step: usize, len_epoch: usize) -> f64 {
    let mut factor = epoch / 30;
    if epoch >= 80 {
        factor += 1;
    }
    let mut lr = base * 0.1f64.powi(factor as i32);
    if epoch < args.warmup_epochs {
        lr *= (1 + step + epoch * len_epoch) as f64 / (args.warmup_epochs * len_epoch) as f64;
    }
    lr
}

fn validate(model: &impl ModuleT, test: &Split, batch_size: usize) -> Eval {
    let e = evaluate(model, test, batch_size);
    println!(" * Prec@1 {:.3} Prec@5 {:.3}  (loss {:.4})", e.top1, e.top5, e.loss);
    e
}

fn write_info(path: &Path, info: &CheckpointInfo) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(info)?)
        .with_context(|| format!("{}: cannot write", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot write", path.display()))
}

fn main() -> std::process::ExitCode {
    common::main(run)
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.epochs == 0 || args.batch_size == 0 {
        bail!("--epochs and --batch-size must be at least 1");
    }
    println!("opt_level = {}", args.amp.opt_level);
    println!("keep_batchnorm_fp32 = {}", args.amp.keep_batchnorm_fp32.as_deref().unwrap_or("None"));
    println!("loss_scale = {}", args.amp.loss_scale.as_deref().unwrap_or("None"));
    let config = args.amp.config()?;

    let data = args.data.load()?;
    let (h, w) = data.image_size();
    let arch = format!("small_resnet(width={}, stages={})", args.width, args.stages);
    println!("=> creating model '{arch}' for {h}x{w} images, {} classes", data.num_classes);
    tch::manual_seed(args.data.seed as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg =
        ResNetConfig { in_channels: 1, num_classes: data.num_classes, width: args.width, stages: args.stages, pool: 1 };
    let net = SmallResNet::new(&vs.root(), cfg);

    // Scale the learning rate by the batch size, as Apex does.
    let base_lr = args.lr * args.batch_size as f64 / 256.0;
    let sgd = nn::Sgd { momentum: args.momentum, dampening: 0.0, wd: args.weight_decay, nesterov: false };
    let (model, mut optimizer, mut amp) = initialize(&vs, net, sgd, base_lr, &config)?;

    let mut start_epoch = 0;
    let mut best_prec1 = 0.0;
    let mut global_step = 0u64;
    if let Some(path) = &args.resume {
        println!("=> loading checkpoint '{}'", path.display());
        load_checkpoint(path, &vs, &mut [&mut optimizer], &mut amp)
            .with_context(|| format!("resuming from {}", path.display()))?;
        let ipath = info_path(path);
        let text = std::fs::read_to_string(&ipath)
            .with_context(|| format!("{}: cannot read the checkpoint's epoch and best Prec@1", ipath.display()))?;
        let info: CheckpointInfo =
            serde_json::from_str(&text).with_context(|| format!("{}: malformed", ipath.display()))?;
        start_epoch = info.epoch;
        best_prec1 = info.best_prec1;
        global_step = info.step;
        println!(
            "=> loaded checkpoint '{}' (epoch {}, written under {}, loss scale {})",
            path.display(),
            info.epoch,
            info.opt_level,
            amp.loss_scale(0)?
        );
    }

    if args.evaluate {
        validate(&model, &data.test, args.batch_size);
        return Ok(());
    }

    std::fs::create_dir_all(&args.checkpoint_dir)
        .with_context(|| format!("{}: cannot create the checkpoint folder", args.checkpoint_dir.display()))?;
    let mut log = StepLog::create(args.log.as_deref())?;
    let n = data.train.len();
    let len_epoch = steps_per_epoch(n, args.batch_size);
    for epoch in start_epoch..args.epochs {
        // train for one epoch
        let mut end = Instant::now();
        let (mut loss_sum, mut prec_sum, mut seen, mut since_print) = (0.0, 0.0, 0usize, 0usize);
        for (i, idx) in epoch_batches(n, args.batch_size, args.data.seed, epoch).into_iter().enumerate() {
            optimizer.set_lr(adjust_learning_rate(&args, base_lr, epoch, i, len_epoch))?;
            let (input, target) = data.train.batch(&idx);
            // compute output
            let output = model.forward_t(&input, true);
            let loss = output.cross_entropy_for_logits(&target);
            // compute gradient and do SGD step
            optimizer.zero_grad()?;
            let scaled = amp.scale_loss(&loss, &mut [&mut optimizer], |s| s.backward())?;
            let skipped = matches!(optimizer.step()?, StepOutcome::Skipped { .. });
            let l = loss.double_value(&[]);
            log.write(
                &StepRecord::new(global_step, l, scaled.loss_scale, skipped)
                    .with("epoch", epoch)
                    .with("lr", optimizer.lr()),
            )?;
            global_step += 1;
            let bs = idx.len();
            loss_sum += l * bs as f64;
            prec_sum += output.accuracy_for_logits(&target).double_value(&[]) * 100.0 * bs as f64;
            seen += bs;
            since_print += 1;
            if (i + 1) % args.print_freq.max(1) == 0 || i + 1 == len_epoch {
                let t = end.elapsed().as_secs_f64() / since_print as f64;
                end = Instant::now();
                since_print = 0;
                println!(
                    "Epoch: [{epoch}][{}/{len_epoch}]\tTime {t:.3}\tSpeed {:.1}\tLoss {l:.6} ({:.4})\tPrec@1 ({:.3})\tloss scale {}",
                    i + 1,
                    args.batch_size as f64 / t,
                    loss_sum / seen as f64,
                    prec_sum / seen as f64,
                    amp.loss_scale(0)?
                );
            }
        }
        // evaluate on validation set
        let prec1 = validate(&model, &data.test, args.batch_size).top1;
        // remember best prec@1 and save checkpoint
        let is_best = prec1 > best_prec1;
        best_prec1 = best_prec1.max(prec1);
        let ckpt = args.checkpoint_dir.join("checkpoint.safetensors");
        save_checkpoint(&ckpt, &vs, &[&optimizer], &amp)?;
        let info = CheckpointInfo {
            epoch: epoch + 1,
            best_prec1,
            step: global_step,
            opt_level: args.amp.opt_level.clone(),
            arch: arch.clone(),
        };
        write_info(&info_path(&ckpt), &info)?;
        if is_best {
            let best = args.checkpoint_dir.join("model_best.safetensors");
            std::fs::copy(&ckpt, &best).with_context(|| format!("{}: cannot write", best.display()))?;
            write_info(&info_path(&best), &info)?;
        }
        println!("=> saved checkpoint '{}' (epoch {})", ckpt.display(), epoch + 1);
    }
    log.flush()?;
    Ok(())
}
