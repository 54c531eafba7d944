//! A port of Apex's `examples/dcgan/main_amp.py`: a DCGAN on Fashion-MNIST with two
//! optimizers and three losses, each loss with its own loss scaler (`num_losses = 3`):
//! `errD_real` (loss_id 0) and `errD_fake` (loss_id 1) accumulate into the discriminator's
//! gradients before `optimizerD` steps, `errG` (loss_id 2) trains the generator.
//!
//! Both networks live in one `VarStore`, under `netG` and `netD`; `amp.optimizer_for` builds
//! one optimizer per prefix (Apex's `amp.initialize([netD, netG], [optimizerD, optimizerG],
//! num_losses=3)`). The generator makes 28x28 images (transposed convolutions 1 → 7 → 14 →
//! 28), the discriminator mirrors it. Each epoch writes `real_samples.png`,
//! `fake_samples_epoch_NNN.png` and a checkpoint of both networks, both optimizers and the
//! three scalers into `--outf`.
//!
//! ```text
//! cargo run --release --example dcgan -- --opt-level O2 --niter 1
//! ```
mod common;

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Parser;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};
use tch_amp::{save_checkpoint, Amp, ScaleLossOptions};

use common::cli::{AmpArgs, DataArgs};
use common::log::{StepLog, StepRecord};
use common::plot::save_grid;
use common::train::epoch_batches;

/// Apex's DCGAN AMP example, on Fashion-MNIST.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    amp: AmpArgs,
    /// Input batch size.
    #[arg(short = 'b', long, visible_alias = "batchSize", default_value_t = 64)]
    batch_size: usize,
    /// Size of the latent z vector.
    #[arg(long, default_value_t = 100)]
    nz: i64,
    /// Generator width (Apex: 64).
    #[arg(long, default_value_t = 32)]
    ngf: i64,
    /// Discriminator width (Apex: 64).
    #[arg(long, default_value_t = 32)]
    ndf: i64,
    /// Number of epochs to train for.
    #[arg(long, visible_alias = "epochs", default_value_t = 1)]
    niter: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.0002)]
    lr: f64,
    /// beta1 for Adam.
    #[arg(long, default_value_t = 0.5)]
    beta1: f64,
    /// Folder for the sample images and the checkpoint.
    #[arg(long, default_value = "runs/dcgan")]
    outf: PathBuf,
    /// Print every N iterations.
    #[arg(long, default_value_t = 50)]
    print_freq: usize,
    /// JSON-lines log, one line per iteration.
    #[arg(long)]
    log: Option<PathBuf>,
}

// Apex's weights_init: conv weights N(0, 0.02), batch-norm weights N(1, 0.02), biases 0.
fn conv_init() -> nn::Init {
    nn::Init::Randn { mean: 0.0, stdev: 0.02 }
}

fn bn(p: nn::Path, c: i64) -> nn::BatchNorm {
    let cfg = nn::BatchNormConfig {
        ws_init: nn::Init::Randn { mean: 1.0, stdev: 0.02 },
        bs_init: nn::Init::Const(0.0),
        ..Default::default()
    };
    nn::batch_norm2d(p, c, cfg)
}

fn conv_t(p: nn::Path, cin: i64, cout: i64, k: i64, stride: i64, padding: i64) -> nn::ConvTranspose2D {
    let cfg = nn::ConvTransposeConfig { stride, padding, bias: false, ws_init: conv_init(), ..Default::default() };
    nn::conv_transpose2d(p, cin, cout, k, cfg)
}

fn conv(p: nn::Path, cin: i64, cout: i64, k: i64, stride: i64, padding: i64) -> nn::Conv2D {
    let cfg = nn::ConvConfig { stride, padding, bias: false, ws_init: conv_init(), ..Default::default() };
    nn::conv2d(p, cin, cout, k, cfg)
}

/// z `[B, nz, 1, 1]` → image `[B, 1, 28, 28]` in [-1, 1].
#[derive(Debug)]
struct Generator {
    c1: nn::ConvTranspose2D,
    b1: nn::BatchNorm,
    c2: nn::ConvTranspose2D,
    b2: nn::BatchNorm,
    c3: nn::ConvTranspose2D,
}

impl Generator {
    fn new(p: &nn::Path, nz: i64, ngf: i64) -> Self {
        Self {
            c1: conv_t(p / "c1", nz, ngf * 4, 7, 1, 0),
            b1: bn(p / "b1", ngf * 4),
            c2: conv_t(p / "c2", ngf * 4, ngf * 2, 4, 2, 1),
            b2: bn(p / "b2", ngf * 2),
            c3: conv_t(p / "c3", ngf * 2, 1, 4, 2, 1),
        }
    }
}

impl ModuleT for Generator {
    fn forward_t(&self, z: &Tensor, train: bool) -> Tensor {
        let x = self.b1.forward_t(&self.c1.forward(z), train).relu();
        let x = self.b2.forward_t(&self.c2.forward(&x), train).relu();
        self.c3.forward(&x).tanh()
    }
}

/// image `[B, 1, 28, 28]` → logit `[B]`.
#[derive(Debug)]
struct Discriminator {
    c1: nn::Conv2D,
    c2: nn::Conv2D,
    b2: nn::BatchNorm,
    c3: nn::Conv2D,
}

impl Discriminator {
    fn new(p: &nn::Path, ndf: i64) -> Self {
        Self {
            c1: conv(p / "c1", 1, ndf, 4, 2, 1),
            c2: conv(p / "c2", ndf, ndf * 2, 4, 2, 1),
            b2: bn(p / "b2", ndf * 2),
            c3: conv(p / "c3", ndf * 2, 1, 7, 1, 0),
        }
    }
}

impl ModuleT for Discriminator {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let x = self.c1.forward(x).leaky_relu();
        let x = self.b2.forward_t(&self.c2.forward(&x), train).leaky_relu();
        self.c3.forward(&x).view([-1])
    }
}

fn bce(logits: &Tensor, label: f64) -> Tensor {
    let target = logits.to_kind(Kind::Float).full_like(label);
    logits.binary_cross_entropy_with_logits::<Tensor>(&target, None, None, Reduction::Mean)
}

fn mean_prob(logits: &Tensor) -> f64 {
    logits.to_kind(Kind::Float).sigmoid().mean(Kind::Float).double_value(&[])
}

fn main() -> std::process::ExitCode {
    common::main(run)
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.niter == 0 || args.batch_size == 0 {
        bail!("--niter and --batch-size must be at least 1");
    }
    let config = args.amp.config()?.num_losses(3);
    // Images in [-1, 1], the generator's tanh range.
    let data = args.data.load_with(false)?;
    let (h, w) = data.image_size();
    if (h, w) != (28, 28) {
        bail!("{}: images are {h}x{w}; this DCGAN makes 28x28 images", args.data.data.display());
    }
    let images = data.train.images * 2.0 - 1.0;
    let n = images.size()[0] as usize;

    tch::manual_seed(args.data.seed as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let net_g = Generator::new(&(vs.root() / "netG"), args.nz, args.ngf);
    let net_d = Discriminator::new(&(vs.root() / "netD"), args.ndf);
    let count = |prefix: &str| -> usize {
        vs.variables().iter().filter(|(k, v)| k.starts_with(prefix) && v.requires_grad()).map(|(_, v)| v.numel()).sum()
    };
    println!("netG: {} parameters, netD: {} parameters", count("netG."), count("netD."));

    let mut amp = Amp::new(&config)?;
    // Casting the whole VarStore once covers both networks; each gets its own input/output casts.
    let net_g = amp.cast_model(&vs, net_g)?;
    let net_d = amp.cast_model(&vs, net_d)?;
    let adam = nn::Adam { beta1: args.beta1, beta2: 0.999, wd: 0.0, eps: 1e-8, amsgrad: false };
    let mut optimizer_d = amp.optimizer_for(&vs, &["netD"], adam, args.lr)?;
    let mut optimizer_g = amp.optimizer_for(&vs, &["netG"], adam, args.lr)?;

    std::fs::create_dir_all(&args.outf)?;
    let fixed_noise = Tensor::randn([64, args.nz, 1, 1], (Kind::Float, Device::Cpu));
    let mut log = StepLog::create(args.log.as_deref())?;
    let batches_per_epoch = n.div_ceil(args.batch_size);
    let mut step = 0u64;
    for epoch in 0..args.niter {
        for (i, idx) in epoch_batches(n, args.batch_size, args.data.seed, epoch).into_iter().enumerate() {
            let real = images.index_select(0, &Tensor::from_slice(&idx));
            let b = idx.len() as i64;
            // (1) Update D: maximize log(D(x)) + log(1 - D(G(z))).
            optimizer_d.zero_grad()?;
            let output = net_d.forward_t(&real, true);
            let err_d_real = bce(&output, 1.0);
            let s0 = amp.scale_loss_with(
                &err_d_real,
                &mut [&mut optimizer_d],
                ScaleLossOptions { loss_id: 0, ..Default::default() },
                |s| s.backward(),
            )?;
            let d_x = mean_prob(&output);
            let noise = Tensor::randn([b, args.nz, 1, 1], (Kind::Float, Device::Cpu));
            let fake = net_g.forward_t(&noise, true);
            let output = net_d.forward_t(&fake.detach(), true);
            let err_d_fake = bce(&output, 0.0);
            let s1 = amp.scale_loss_with(
                &err_d_fake,
                &mut [&mut optimizer_d],
                ScaleLossOptions { loss_id: 1, ..Default::default() },
                |s| s.backward(),
            )?;
            let d_g_z1 = mean_prob(&output);
            let skipped_d = !optimizer_d.step()?.stepped();

            // (2) Update G: maximize log(D(G(z))).
            optimizer_g.zero_grad()?;
            let output = net_d.forward_t(&fake, true);
            let err_g = bce(&output, 1.0);
            let s2 = amp.scale_loss_with(
                &err_g,
                &mut [&mut optimizer_g],
                ScaleLossOptions { loss_id: 2, ..Default::default() },
                |s| s.backward(),
            )?;
            let d_g_z2 = mean_prob(&output);
            let skipped_g = !optimizer_g.step()?.stepped();

            let (ed_r, ed_f, eg) =
                (err_d_real.double_value(&[]), err_d_fake.double_value(&[]), err_g.double_value(&[]));
            let scales = [s0.loss_scale, s1.loss_scale, s2.loss_scale];
            log.write(
                &StepRecord::new(
                    step,
                    ed_r + ed_f + eg,
                    scales.iter().copied().fold(f64::INFINITY, f64::min),
                    skipped_d || skipped_g,
                )
                .with("epoch", epoch)
                .with("err_d_real", ed_r)
                .with("err_d_fake", ed_f)
                .with("err_g", eg)
                .with("loss_scales", scales.to_vec())
                .with("skipped_d", skipped_d)
                .with("skipped_g", skipped_g),
            )?;
            step += 1;
            if i % args.print_freq.max(1) == 0 || i + 1 == batches_per_epoch {
                println!(
                    "[{epoch}/{}][{i}/{batches_per_epoch}] Loss_D: {:.4} Loss_G: {eg:.4} D(x): {d_x:.4} D(G(z)): {d_g_z1:.4} / {d_g_z2:.4}  loss scales {scales:?}",
                    args.niter,
                    ed_r + ed_f,
                );
            }
        }
        let to_unit = |t: &Tensor| (t.to_kind(Kind::Float) + 1.0) / 2.0;
        let n_show = (n as i64).min(64);
        save_grid(&args.outf.join("real_samples.png"), &to_unit(&images.narrow(0, 0, n_show)), 8)?;
        let fake = tch::no_grad(|| net_g.forward_t(&fixed_noise, false));
        save_grid(&args.outf.join(format!("fake_samples_epoch_{epoch:03}.png")), &to_unit(&fake), 8)?;
        save_checkpoint(args.outf.join("dcgan.safetensors"), &vs, &[&optimizer_d, &optimizer_g], &amp)?;
    }
    log.flush()?;
    println!(
        "loss scales: errD_real {}, errD_fake {}, errG {}; steps (taken, skipped): D {:?}, G {:?}",
        amp.loss_scale(0)?,
        amp.loss_scale(1)?,
        amp.loss_scale(2)?,
        optimizer_d.step_counts(),
        optimizer_g.step_counts()
    );
    Ok(())
}
