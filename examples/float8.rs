//! FP8 training of an MLP on Fashion-MNIST: torchao's `convert_to_float8_training` with a
//! recipe (tensorwise, rowwise, rowwise_with_gw_hp) or Transformer Engine's delayed scaling,
//! fp32 master weights (tch-amp's O0 optimizer), the forward under bf16 autocast or not, and a
//! checkpoint that holds the delayed-scaling state.
//!
//! ```text
//! cargo run --release --example float8                                   # tensorwise, fp32
//! cargo run --release --example float8 -- --recipe rowwise --autocast
//! cargo run --release --example float8 -- --recipe delayed --checkpoint fp8.safetensors
//! cargo run --release --example float8 -- --recipe delayed --resume fp8.safetensors
//! ```
//!
//! The Python it ports:
//! ```text
//! config = Float8LinearConfig.from_recipe_name("tensorwise")
//! convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "head")
//! for x, y in loader:
//!     opt.zero_grad()
//!     with torch.autocast("cpu", dtype=torch.bfloat16):
//!         loss = F.cross_entropy(model(x.flatten(1)), y)
//!     loss.backward()
//!     opt.step()
//! ```
//! (with `--recipe delayed`: TE's `fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=16))`
//! around `te.Linear` layers). The head's 10 outputs are no multiple of 16, so it would stay in
//! high precision anyway; the filter says so explicitly.
mod common;

use anyhow::{bail, Result};
use clap::Parser;
use tch::nn::{self, ModuleT};
use tch::{Kind, Tensor};
use tch_amp::checkpoint::{read_training_state, save_checkpoint_with, TrainingState};
use tch_amp::float8::{DelayedScaling, Float8Linear, Float8LinearConfig, Float8Training, LayerFilter};
use tch_amp::Autocast;
use tch_amp::{AmpConfig, OptLevel};

use common::cli::DataArgs;
use common::train::{epoch_batches, evaluate};

/// Float8 training of an MLP.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    data: DataArgs,
    /// tensorwise, rowwise, rowwise_with_gw_hp (torchao's recipes) or delayed (TE's).
    #[arg(long, default_value = "tensorwise")]
    recipe: String,
    /// Delayed scaling's amax history length.
    #[arg(long, default_value_t = 16)]
    amax_history_len: usize,
    /// Run the forward under bf16 autocast (the output GEMMs then return bf16).
    #[arg(long)]
    autocast: bool,
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
    /// Hidden width (a multiple of 16).
    #[arg(long, default_value_t = 256)]
    hidden: i64,
    /// Write a checkpoint (weights, optimizer, delayed-scaling state) here at the end.
    #[arg(long)]
    checkpoint: Option<std::path::PathBuf>,
    /// Start from this checkpoint.
    #[arg(long)]
    resume: Option<std::path::PathBuf>,
    /// Print every N steps.
    #[arg(short = 'p', long, default_value_t = 50)]
    print_freq: usize,
}

/// fc1 -> relu -> fc2 -> relu -> head.
#[derive(Debug)]
struct Mlp {
    layers: Vec<Float8Linear>,
}

impl ModuleT for Mlp {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let [fc1, fc2, head] = self.layers.as_slice() else { unreachable!("three layers") };
        xs.flatten(1, -1).apply(fc1).relu().apply(fc2).relu().apply(head)
    }
}

fn config(args: &Args) -> Result<Float8LinearConfig> {
    Ok(match args.recipe.as_str() {
        "delayed" => Float8LinearConfig::default()
            .delayed_scaling(DelayedScaling { amax_history_len: args.amax_history_len, ..DelayedScaling::default() }),
        name => Float8LinearConfig::from_recipe_name(name)?,
    })
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
    let mut data = args.data.load()?;
    for split in [&mut data.train, &mut data.test] {
        split.images = split.images.to_device(device);
        split.labels = split.labels.to_device(device);
    }
    tch::manual_seed(args.data.seed as i64);
    let vs = nn::VarStore::new(device);
    let fp8 = Float8Training::new(config(&args)?, LayerFilter::all().except(&["head"]))?;
    let root = vs.root();
    let (h, c) = (args.hidden, data.num_classes);
    let pixels = data.train.images.size()[1..].iter().product::<i64>();
    let model = Mlp {
        layers: vec![
            fp8.linear(&root / "fc1", pixels, h, Default::default())?,
            fp8.linear(&root / "fc2", h, h, Default::default())?,
            fp8.linear(&root / "head", h, c, Default::default())?,
        ],
    };
    let report = fp8.report();
    println!("float8 layers: {:?}; high precision: {:?}", report.converted, report.skipped);
    let (model, mut opt, mut amp) = tch_amp::initialize(
        &vs,
        model,
        nn::Sgd { momentum: 0.9, ..Default::default() },
        args.lr,
        &AmpConfig::new(OptLevel::O0).verbosity(0),
    )?;
    if let Some(path) = &args.resume {
        tch_amp::load_checkpoint(path, &vs, &mut [&mut opt], &mut amp)?;
        fp8.load_state_dict(&read_training_state(path)?.tree("float8"))?;
        println!("resumed from {}", path.display());
    }
    let autocast = Autocast::new(device).dtype(Kind::BFloat16).enabled(args.autocast);
    let mut step = 0usize;
    for epoch in 0..args.epochs {
        for idx in epoch_batches(data.train.len(), args.batch_size, args.data.seed, epoch) {
            let (x, y) = data.train.batch(&idx);
            opt.zero_grad()?;
            let logits = autocast.run(|| model.forward_t(&x, true))?;
            let loss = logits.to_kind(Kind::Float).cross_entropy_for_logits(&y);
            amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward())?;
            opt.step()?;
            if step % args.print_freq.max(1) == 0 {
                let scale = fp8.scales("fc1").and_then(|s| s.input).map(|s| s.mean(Kind::Float).double_value(&[]));
                println!("epoch {epoch} step {step}: loss {:.4}, fc1 input scale {scale:?}", loss.double_value(&[]));
            }
            step += 1;
        }
    }
    let e = autocast.run(|| evaluate(&model, &data.test, 500))?;
    println!("test accuracy {:.2}% (loss {:.4}); {step} steps, recipe {}", e.top1, e.loss, args.recipe);
    if let Some(path) = &args.checkpoint {
        let mut state = TrainingState::default();
        state.insert_tree("float8", &fp8.state_dict())?;
        save_checkpoint_with(path, &vs, &[&opt], &amp, &state)?;
        println!("checkpoint written to {}", path.display());
    }
    Ok(())
}
