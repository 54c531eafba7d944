//! A port of Apex's `examples/imagenet/main_amp.py` that runs on a CPU: the same flags
//! (`--opt-level`, `--keep-batchnorm-fp32`, `--loss-scale` as strings parsed as Apex parses
//! them, `--epochs`, `-b/--batch-size`, `--lr` scaled by batch/256, `--momentum`,
//! `--weight-decay`, `-p/--print-freq`, `--resume`, `-e/--evaluate`; `--optimizer fused-sgd`
//! for apex.optimizers.FusedSGD instead of torch.optim.SGD), the same schedule (linear
//! warm-up, then ÷10 at epochs 30, 60 and 80), the same printout, but a ResNet-style CNN on
//! Fashion-MNIST (or any IDX data set via `--data`) instead of ResNet-50 on ImageNet.
//!
//! After each epoch it writes `checkpoint.safetensors` (model variables in fp32 — taken from
//! the fp32 masters under O2, so resuming is exact, unlike Apex — the optimizer's momentum
//! buffers and step counts, and the loss scaler) plus `checkpoint.json` (epoch, best Prec@1,
//! global step) into `--checkpoint-dir`, and copies both to `model_best.*` when Prec@1
//! improved. `--resume runs/imagenet/checkpoint.safetensors` continues from there.
//!
//! `--resume` also takes a checkpoint the Python script wrote (`.pt`, `.pth`, `.pth.tar`: any
//! `torch.save` container) in main_amp.py's layout, `{'epoch', 'arch', 'state_dict',
//! 'best_prec1', 'optimizer'}` with `module.` prefixes from its DDP model, plus an `'amp'` entry
//! (`amp.state_dict()`) when the script saved one (else the loss scaler starts afresh, as
//! main_amp.py's resume does). It is read with `tch_amp::torch_checkpoint` (the model must be the
//! one the file was written for). Under O2 the fp32 masters and the momentum buffers come
//! straight from the file's fp32 values (Apex's own resume rounds the momentum through fp16).
//!
//! Distributed mode, as Apex's (`args.distributed = WORLD_SIZE > 1`): launched by torchrun, each
//! process trains on its `DistributedSampler` shard with a per-process batch of `-b`, gradients
//! averaged by `tch_amp::distributed::DistributedDataParallel`, the learning rate scaled by
//! `batch * world_size / 256`, `--sync_bn` for SyncBatchNorm; rank 0 prints, logs and writes the
//! checkpoints, validation is sharded and its counts summed over the ranks.
//!
//! ```text
//! torchrun --no-python --nproc-per-node 2 target/release/examples/imagenet --opt-level O2 --sync_bn -b 64
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
use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{
    save_checkpoint_on_rank0, sync_batch_norm, DdpOptions, DistributedDataParallel, DistributedSampler, ProcessGroup,
    ReduceOp,
};
use tch_amp::load_torch_checkpoint;
use tch_amp::torch_checkpoint::TorchLoadOptions;
use tch_amp::torch_io::Value;
use tch_amp::{initialize, load_checkpoint, save_checkpoint, FusedSgd, OptimizerConfig, StepOutcome};

use common::cli::{AmpArgs, DataArgs};
use common::data::Split;
use common::log::{StepLog, StepRecord};
use common::model::{Norm, ResNetConfig, SmallResNet};
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
    /// The optimizer: `sgd` (torch.optim.SGD, as Apex's example) or `fused-sgd`
    /// (apex.optimizers.FusedSGD, the same update).
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    optimizer: OptimizerArg,
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
    /// Use SyncBatchNorm (distributed mode): batch statistics over all processes.
    #[arg(long = "sync_bn", visible_alias = "sync-bn")]
    sync_bn: bool,
    /// Accepted for torch.distributed.launch compatibility; torchrun sets LOCAL_RANK instead.
    #[arg(long = "local_rank", visible_alias = "local-rank")]
    local_rank: Option<usize>,
}

/// `--optimizer`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum OptimizerArg {
    /// torch.optim.SGD.
    Sgd,
    /// apex.optimizers.FusedSGD.
    FusedSgd,
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

/// The model as trained: the AMP model, or its DDP wrapper in distributed mode.
#[derive(Debug)]
struct Model(Box<dyn ModuleT>);

impl ModuleT for Model {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.0.forward_t(xs, train)
    }
}

/// Whether `--resume` names a `torch.save` file (`.pt`, `.pth`, `.pth.tar`, `.tar`, ...)
/// rather than tch-amp's own `.safetensors` checkpoint.
fn is_torch_file(path: &Path) -> bool {
    path.extension().map_or(true, |e| e != "safetensors")
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

fn validate(model: &impl ModuleT, test: &Split, batch_size: usize, pg: Option<&ProcessGroup>) -> Result<Eval> {
    let e = match pg {
        None => evaluate(model, test, batch_size),
        Some(pg) => validate_shard(model, test, batch_size, pg)?,
    };
    if pg.map_or(true, ProcessGroup::is_main) {
        println!(" * Prec@1 {:.3} Prec@5 {:.3}  (loss {:.4})", e.top1, e.top5, e.loss);
    }
    Ok(e)
}

/// Apex's distributed validation: each rank evaluates its `DistributedSampler` shard (no
/// shuffle; padded, so every rank runs the same number of batches), then loss and hit counts
/// are summed over the ranks.
fn validate_shard(model: &impl ModuleT, test: &Split, batch_size: usize, pg: &ProcessGroup) -> Result<Eval> {
    let _no_grad = tch::no_grad_guard();
    let shard = DistributedSampler::for_group(test.len(), pg)?.shuffle(false).indices()?;
    let mut sums = [0f64; 4]; // loss * n, top-1 hits, top-5 hits, n
    for idx in shard.chunks(batch_size.max(1)) {
        let (x, y) = test.batch(idx);
        let logits = model.forward_t(&x, false).to_kind(Kind::Float);
        let n = idx.len() as f64;
        sums[0] += logits.cross_entropy_for_logits(&y).double_value(&[]) * n;
        let k = logits.size()[1].min(5);
        let (_, pred) = logits.topk(k, 1, true, true);
        let hit = pred.eq_tensor(&y.unsqueeze(1));
        sums[1] += hit.narrow(1, 0, 1).sum(Kind::Float).double_value(&[]);
        sums[2] += hit.sum(Kind::Float).double_value(&[]);
        sums[3] += n;
    }
    let mut t = Tensor::from_slice(&sums);
    pg.all_reduce_(&mut t, ReduceOp::Sum)?;
    let s = Vec::<f64>::try_from(&t)?;
    let n = s[3].max(1.0);
    Ok(Eval { loss: s[0] / n, top1: 100.0 * s[1] / n, top5: 100.0 * s[2] / n })
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
    // Apex: args.distributed = int(os.environ['WORLD_SIZE']) > 1
    let distributed = std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse::<usize>().ok()).is_some_and(|w| w > 1);
    let pg = if distributed { Some(ProcessGroup::init_from_env().context("joining the process group")?) } else { None };
    let main_rank = pg.as_ref().map_or(true, ProcessGroup::is_main);
    let world_size = pg.as_ref().map_or(1, ProcessGroup::world_size);
    if args.sync_bn && pg.is_none() {
        println!("--sync_bn has no effect without distributed mode (WORLD_SIZE > 1): using BatchNorm");
    }
    if main_rank {
        println!("opt_level = {}", args.amp.opt_level);
        println!("keep_batchnorm_fp32 = {}", args.amp.keep_batchnorm_fp32.as_deref().unwrap_or("None"));
        println!("loss_scale = {}", args.amp.loss_scale.as_deref().unwrap_or("None"));
        if pg.is_some() {
            println!("distributed: world size {world_size}, sync_bn = {}", args.sync_bn);
        }
    }
    let config = args.amp.config()?;

    let data = args.data.load()?;
    let (h, w) = data.image_size();
    let arch = format!("small_resnet(width={}, stages={})", args.width, args.stages);
    if main_rank {
        println!("=> creating model '{arch}' for {h}x{w} images, {} classes", data.num_classes);
    }
    tch::manual_seed(args.data.seed as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg =
        ResNetConfig { in_channels: 1, num_classes: data.num_classes, width: args.width, stages: args.stages, pool: 1 };
    let net = match &pg {
        // Apex: model = apex.parallel.convert_syncbn_model(model)
        Some(pg) if args.sync_bn => SmallResNet::with_norm(&vs.root(), cfg, &|p: nn::Path, c: i64| -> Norm {
            Box::new(sync_batch_norm(p, pg, c, Default::default()))
        }),
        _ => SmallResNet::new(&vs.root(), cfg),
    };

    // Scale the learning rate by the global batch size, as Apex does.
    let base_lr = args.lr * (args.batch_size * world_size) as f64 / 256.0;
    let optim: OptimizerConfig = match args.optimizer {
        OptimizerArg::Sgd => {
            nn::Sgd { momentum: args.momentum, dampening: 0.0, wd: args.weight_decay, nesterov: false }.into()
        }
        OptimizerArg::FusedSgd => {
            FusedSgd { momentum: args.momentum, weight_decay: args.weight_decay, ..Default::default() }.into()
        }
    };
    let (model, mut optimizer, mut amp) = initialize(&vs, net, optim, base_lr, &config)?;

    let mut start_epoch = 0;
    let mut best_prec1 = 0.0;
    let mut global_step = 0u64;
    // A PyTorch checkpoint says its epoch, not the step count: set once the epoch length is known.
    let mut steps_from_epoch = false;
    if let Some(path) = &args.resume {
        if main_rank {
            println!("=> loading checkpoint '{}'", path.display());
        }
    }
    if let Some(path) = args.resume.as_ref().filter(|p| is_torch_file(p)) {
        // Apex: checkpoint = torch.load(args.resume); args.start_epoch = checkpoint['epoch'];
        // best_prec1 = checkpoint['best_prec1']; model.load_state_dict(checkpoint['state_dict']);
        // optimizer.load_state_dict(checkpoint['optimizer']) (+ amp.load_state_dict when saved).
        let report = load_torch_checkpoint(path, &vs, &mut [&mut optimizer], &mut amp, &TorchLoadOptions::main_amp())
            .with_context(|| format!("resuming from {}", path.display()))?;
        let entries = Value::Dict(report.entries);
        let epoch = entries.get("epoch").and_then(|e| e.as_usize()).with_context(|| {
            format!("{}: the checkpoint's epoch (main_amp.py's layout has 'epoch')", path.display())
        })?;
        best_prec1 = match entries.get("best_prec1") {
            Ok(v) => match v.value() {
                Value::Tensor(t) => t.f_double_value(&[]).context("best_prec1")?,
                _ => v.as_f64().context("best_prec1")?,
            },
            Err(_) => 0.0,
        };
        start_epoch = epoch;
        steps_from_epoch = true;
        if main_rank {
            let arch = entries.get("arch").ok().and_then(|a| a.as_str().ok().map(str::to_string));
            println!(
                "=> loaded checkpoint '{}' (epoch {epoch}, PyTorch format, arch {}, {}, loss scale {})",
                path.display(),
                arch.as_deref().unwrap_or("?"),
                if report.amp_loaded { "amp state restored" } else { "no amp state" },
                amp.loss_scale(0)?
            );
        }
    } else if let Some(path) = &args.resume {
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
        if main_rank {
            println!(
                "=> loaded checkpoint '{}' (epoch {}, written under {}, loss scale {})",
                path.display(),
                info.epoch,
                info.opt_level,
                amp.loss_scale(0)?
            );
        }
    }

    // Apex: model = DDP(model, delay_allreduce=True) after amp.initialize (and the resume):
    // rank 0's weights, buffers and fp32 masters go to every rank.
    let model = Model(match &pg {
        Some(pg) => {
            let options = DdpOptions::default().delay_allreduce(true);
            Box::new(DistributedDataParallel::new(pg, &vs, model, &mut [&mut optimizer], options)?)
        }
        None => Box::new(model),
    });

    if args.evaluate {
        validate(&model, &data.test, args.batch_size, pg.as_ref())?;
        return Ok(());
    }

    if main_rank {
        std::fs::create_dir_all(&args.checkpoint_dir)
            .with_context(|| format!("{}: cannot create the checkpoint folder", args.checkpoint_dir.display()))?;
    }
    let mut log = StepLog::create(if main_rank { args.log.as_deref() } else { None })?;
    let n = data.train.len();
    let mut sampler = match &pg {
        Some(pg) => Some(DistributedSampler::for_group(n, pg)?.seed(args.data.seed)),
        None => None,
    };
    let len_epoch = steps_per_epoch(sampler.as_ref().map_or(n, DistributedSampler::num_samples), args.batch_size);
    if steps_from_epoch {
        global_step = (start_epoch * len_epoch) as u64;
    }
    for epoch in start_epoch..args.epochs {
        // train for one epoch
        let mut end = Instant::now();
        let (mut loss_sum, mut prec_sum, mut seen, mut since_print) = (0.0, 0.0, 0usize, 0usize);
        let batches = match sampler.as_mut() {
            Some(s) => {
                s.set_epoch(epoch as u64);
                s.indices()?.chunks(args.batch_size).map(<[i64]>::to_vec).collect()
            }
            None => epoch_batches(n, args.batch_size, args.data.seed, epoch),
        };
        for (i, idx) in batches.into_iter().enumerate() {
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
                // Apex: reduce_tensor (the average over the ranks) of the printed statistics.
                let (mut avg_loss, mut avg_prec) = (loss_sum / seen as f64, prec_sum / seen as f64);
                if let Some(pg) = &pg {
                    let mut v = Tensor::from_slice(&[avg_loss, avg_prec]);
                    pg.all_reduce_(&mut v, ReduceOp::Avg)?;
                    (avg_loss, avg_prec) = (v.double_value(&[0]), v.double_value(&[1]));
                }
                if main_rank {
                    println!(
                        "Epoch: [{epoch}][{}/{len_epoch}]\tTime {t:.3}\tSpeed {:.1}\tLoss {l:.6} ({avg_loss:.4})\tPrec@1 ({avg_prec:.3})\tloss scale {}",
                        i + 1,
                        (world_size * args.batch_size) as f64 / t,
                        amp.loss_scale(0)?
                    );
                }
            }
        }
        // evaluate on validation set
        let prec1 = validate(&model, &data.test, args.batch_size, pg.as_ref())?.top1;
        // remember best prec@1 and save checkpoint
        let is_best = prec1 > best_prec1;
        best_prec1 = best_prec1.max(prec1);
        let ckpt = args.checkpoint_dir.join("checkpoint.safetensors");
        match &pg {
            // Every rank holds the same weights: rank 0 writes, all learn whether it worked.
            Some(pg) => save_checkpoint_on_rank0(pg, &ckpt, &vs, &[&optimizer], &amp)?,
            None => save_checkpoint(&ckpt, &vs, &[&optimizer], &amp)?,
        }
        if !main_rank {
            continue;
        }
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
