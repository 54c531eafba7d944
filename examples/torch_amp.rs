//! PyTorch's typical mixed-precision loop (torch.amp, not Apex) on Fashion-MNIST: fp32 weights,
//! the forward under libtorch's autocast, the loss through a GradScaler, tch's own SGD. The
//! set-up comes from a Lightning precision flag: `bf16-mixed` (autocast bf16, no scaler),
//! `16-mixed` (autocast fp16 + GradScaler) or `32-true` (neither).
//!
//! ```text
//! cargo run --release --example torch_amp                          # bf16-mixed on the CPU
//! cargo run --release --example torch_amp -- --precision 16-mixed --device cuda
//! ```
//!
//! The Python it ports:
//! ```text
//! scaler = torch.amp.GradScaler(device)
//! for x, y in loader:
//!     opt.zero_grad()
//!     with torch.autocast(device, dtype=dtype):
//!         loss = F.cross_entropy(model(x), y)
//!     scaler.scale(loss).backward()
//!     scaler.step(opt)
//!     scaler.update()
//! ```
//! On a CPU without fast units for the type (bf16: AVX512_BF16 or AMX) libtorch's own bf16/fp16
//! GEMMs and convolutions are slow; there autocast computes them in fp32 on the rounded inputs
//! and rounds the outputs once, as the Apex path does (`CpuKernels::Auto`).
mod common;

use anyhow::{bail, Result};
use clap::Parser;
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch_amp::torch_amp::{GradScalerOptions, Precision};
use tch_amp::GradScaler;

use common::cli::DataArgs;
use common::model::{ResNetConfig, SmallResNet};
use common::train::{epoch_batches, evaluate};

/// torch.amp's typical loop.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    data: DataArgs,
    /// Lightning precision flag: bf16-mixed, 16-mixed or 32-true.
    #[arg(long, default_value = "bf16-mixed")]
    precision: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Batch size.
    #[arg(short = 'b', long, default_value_t = 64)]
    batch_size: usize,
    /// Epochs.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Learning rate (SGD with momentum 0.9).
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// Channels after the stem.
    #[arg(long, default_value_t = 16)]
    width: i64,
    /// Print every N steps.
    #[arg(short = 'p', long, default_value_t = 50)]
    print_freq: usize,
}

fn main() -> std::process::ExitCode {
    common::main(run)
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.epochs == 0 || args.batch_size == 0 {
        bail!("--epochs and --batch-size must be at least 1");
    }
    let device = common::cli::device(&args.device)?;
    let precision = Precision::parse(&args.precision)?;
    if !matches!(precision, Precision::Mixed { .. } | Precision::Fp32) {
        bail!("--precision {}: this example runs the torch.amp loop (bf16-mixed, 16-mixed or 32-true)", args.precision);
    }
    let mut data = args.data.load()?;
    for split in [&mut data.train, &mut data.test] {
        split.images = split.images.to_device(device);
        split.labels = split.labels.to_device(device);
    }
    tch::manual_seed(args.data.seed as i64);
    let vs = nn::VarStore::new(device);
    let cfg = ResNetConfig { in_channels: 1, num_classes: data.num_classes, width: args.width, stages: 2, pool: 2 };
    let model = SmallResNet::new(&vs.root(), cfg);
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, args.lr)?;
    let options = GradScalerOptions::default().enabled(precision.uses_grad_scaler());
    let mut scaler = GradScaler::with_options(device, options)?;
    let autocast = tch_amp::Autocast::new(device)
        .dtype(precision.autocast_dtype().unwrap_or(tch::Kind::BFloat16))
        .enabled(precision.autocast_dtype().is_some());
    println!("{} training images, {precision:?} on {device:?}", data.train.len());
    let (mut step, mut skipped) = (0usize, 0usize);
    for epoch in 0..args.epochs {
        for idx in epoch_batches(data.train.len(), args.batch_size, args.data.seed, epoch) {
            let (x, y) = data.train.batch(&idx);
            opt.zero_grad();
            let loss = autocast.run(|| model.forward_t(&x, true).cross_entropy_for_logits(&y))?;
            scaler.scale(&loss)?.backward();
            if !scaler.step(&mut opt)?.stepped() {
                skipped += 1;
            }
            scaler.update()?;
            if step % args.print_freq.max(1) == 0 {
                println!("epoch {epoch} step {step}: loss {:.4}, scale {}", loss.double_value(&[]), scaler.get_scale());
            }
            step += 1;
        }
    }
    let e = autocast.run(|| evaluate(&model, &data.test, 500))?;
    println!(
        "test accuracy {:.2}% (loss {:.4}); {step} steps, {skipped} skipped; final scale {}",
        e.top1,
        e.loss,
        scaler.get_scale()
    );
    Ok(())
}
