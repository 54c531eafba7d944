//! Gradient clipping under AMP, the way Apex documents it: right after the `scale_loss`
//! block, clip `amp.master_params(optimizer)` — here `opt.clip_grad_norm(max, 2.0)`, which
//! clips the gradients the optimizer will use (the fp32 master gradients under O2, already
//! unscaled, so `--max-grad-norm` means the same at every opt level and loss scale). The total
//! norm is computed in fp32 and returned; after an overflow it is inf, the gradients are left
//! alone and the step is skipped anyway.
//!
//! ```text
//! cargo run --release --example clip_masters -- --opt-level O2 --max-grad-norm 1.0
//! ```
mod common;

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Parser;
use tch::nn::{self, ModuleT};
use tch::Device;
use tch_amp::initialize;

use common::cli::{AmpArgs, DataArgs};
use common::log::{StepLog, StepRecord};
use common::model::{ResNetConfig, SmallResNet};
use common::train::{cosine_lr, epoch_batches, evaluate, steps_per_epoch};

/// Clipping the master gradients.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    amp: AmpArgs,
    /// Largest total 2-norm of the gradients.
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// Batch size.
    #[arg(short = 'b', long, default_value_t = 128)]
    batch_size: usize,
    /// Epochs.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Peak learning rate (SGD with Nesterov momentum, cosine decay).
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// Channels after the stem.
    #[arg(long, default_value_t = 16)]
    width: i64,
    /// Print every N steps.
    #[arg(short = 'p', long, default_value_t = 20)]
    print_freq: usize,
    /// JSON-lines log, one line per step (with the gradient norm before clipping).
    #[arg(long)]
    log: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    common::main(run)
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.epochs == 0 || args.batch_size == 0 {
        bail!("--epochs and --batch-size must be at least 1");
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
    let total = steps_per_epoch(n, args.batch_size) * args.epochs;
    let mut log = StepLog::create(args.log.as_deref())?;
    let (mut step, mut clipped) = (0usize, 0usize);
    for epoch in 0..args.epochs {
        for idx in epoch_batches(n, args.batch_size, args.data.seed, epoch) {
            opt.set_lr(cosine_lr(args.lr, step, total, 10))?;
            let (x, y) = data.train.batch(&idx);
            let loss = model.forward_t(&x, true).cross_entropy_for_logits(&y);
            opt.zero_grad()?;
            let out = amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward())?;
            // Apex: torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)
            let norm = opt.clip_grad_norm(args.max_grad_norm, 2.0)?;
            let was_clipped = norm.is_finite() && norm > args.max_grad_norm;
            clipped += usize::from(was_clipped);
            let skipped = !opt.step()?.stepped();
            let l = loss.double_value(&[]);
            log.write(
                &StepRecord::new(step as u64, l, out.loss_scale, skipped)
                    .with("epoch", epoch)
                    .with("grad_norm", norm)
                    .with("clipped", was_clipped),
            )?;
            if step % args.print_freq.max(1) == 0 || skipped {
                println!(
                    "step {step}: loss {l:.4}, gradient norm {norm:.4}{}, loss scale {}{}",
                    if was_clipped { " (clipped)" } else { "" },
                    out.loss_scale,
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
        "test accuracy {:.2}% (loss {:.4}); {taken} steps taken, {skipped} skipped, {clipped} clipped; final loss scale {}",
        e.top1,
        e.loss,
        amp.loss_scale(0)?
    );
    Ok(())
}
