//! Gradient accumulation under AMP: each optimizer step sums the gradients of
//! `--accum-steps` micro-batches. All but the last micro-batch go through `scale_loss` with
//! `delay_unscale: true`, so their gradients stay scaled and accumulate (in the model's
//! dtype: fp16 under O2) without being unscaled or checked; the last one unscales the sum
//! once into the fp32 master gradients, checks it for inf/NaN and updates the loss scale
//! (Apex's `delay_unscale`). An overflow anywhere in the accumulated gradient skips the step.
//!
//! Each micro-batch's loss is divided by `--accum-steps`, so one step sees the mean gradient
//! of an effective batch of `--batch-size × --accum-steps` examples.
//!
//! ```text
//! cargo run --release --example grad_accumulation -- --opt-level O2 --batch-size 32 --accum-steps 4
//! ```
mod common;

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Parser;
use tch::nn::{self, ModuleT};
use tch::Device;
use tch_amp::{initialize, ScaleLossOptions};

use common::cli::{AmpArgs, DataArgs};
use common::log::{StepLog, StepRecord};
use common::model::{ResNetConfig, SmallResNet};
use common::train::{cosine_lr, epoch_batches, evaluate};

/// Gradient accumulation with `delay_unscale`.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    amp: AmpArgs,
    /// Micro-batch size.
    #[arg(short = 'b', long, default_value_t = 32)]
    batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 4)]
    accum_steps: usize,
    /// Epochs.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Peak learning rate (SGD with Nesterov momentum, cosine decay).
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// Channels after the stem.
    #[arg(long, default_value_t = 16)]
    width: i64,
    /// Print every N optimizer steps.
    #[arg(short = 'p', long, default_value_t = 20)]
    print_freq: usize,
    /// JSON-lines log, one line per optimizer step.
    #[arg(long)]
    log: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    common::main(run)
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.epochs == 0 || args.batch_size == 0 || args.accum_steps == 0 {
        bail!("--epochs, --batch-size and --accum-steps must be at least 1");
    }
    let config = args.amp.config()?;
    let data = args.data.load()?;
    tch::manual_seed(args.data.seed as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = ResNetConfig { in_channels: 1, num_classes: data.num_classes, width: args.width, stages: 2, pool: 2 };
    let net = SmallResNet::new(&vs.root(), cfg);
    let sgd = nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 5e-4, nesterov: true };
    let (model, mut opt, mut amp) = initialize(&vs, net, sgd, args.lr, &config)?;

    let n = data.train.len();
    let effective = args.batch_size * args.accum_steps;
    let steps_per_epoch = n.div_ceil(effective);
    let total = steps_per_epoch * args.epochs;
    println!(
        "{} under {}: micro-batches of {}, {} per step (effective batch {effective}), {steps_per_epoch} steps per epoch",
        data.train.len(),
        args.amp.opt_level,
        args.batch_size,
        args.accum_steps
    );
    let mut log = StepLog::create(args.log.as_deref())?;
    let mut step = 0usize;
    for epoch in 0..args.epochs {
        // One permutation per epoch, cut into effective batches, each cut into micro-batches.
        let order: Vec<i64> = epoch_batches(n, n, args.data.seed, epoch).concat();
        for chunk in order.chunks(effective) {
            opt.set_lr(cosine_lr(args.lr, step, total, 0))?;
            opt.zero_grad()?;
            let micro: Vec<&[i64]> = chunk.chunks(args.batch_size).collect();
            let mut loss_sum = 0.0;
            let mut out = None;
            for (k, idx) in micro.iter().enumerate() {
                let (x, y) = data.train.batch(idx);
                // Divide by the number of micro-batches so the sum is the mean gradient.
                let loss = model.forward_t(&x, true).cross_entropy_for_logits(&y) / micro.len() as f64;
                let last = k + 1 == micro.len();
                let o = amp.scale_loss_with(
                    &loss,
                    &mut [&mut opt],
                    ScaleLossOptions { loss_id: 0, delay_unscale: !last },
                    |s| s.backward(),
                )?;
                loss_sum += loss.double_value(&[]);
                out = Some(o);
            }
            let Some(out) = out else { continue };
            let skipped = !opt.step()?.stepped();
            log.write(
                &StepRecord::new(step as u64, loss_sum, out.loss_scale, skipped)
                    .with("epoch", epoch)
                    .with("micro_batches", micro.len())
                    .with("overflow", out.overflow),
            )?;
            if step % args.print_freq.max(1) == 0 || skipped {
                println!(
                    "step {step}: loss {loss_sum:.4}, loss scale {} -> {}{}",
                    out.loss_scale,
                    out.new_loss_scale,
                    if skipped { " (overflow: step skipped)" } else { "" }
                );
            }
            step += 1;
        }
    }
    log.flush()?;
    let e = evaluate(&model, &data.test, 500);
    let (taken, skipped) = opt.step_counts();
    println!(
        "test accuracy {:.2}% (loss {:.4}); {taken} steps taken, {skipped} skipped; final loss scale {}",
        e.top1,
        e.loss,
        amp.loss_scale(0)?
    );
    Ok(())
}
