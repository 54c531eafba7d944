//! `cargo bench --bench amp` (or `make bench`): one table of step times, every figure a ratio
//! to the fp32 hand-written tch loop measured in the same run, plus PyTorch's own AMP on the
//! same model/batch/threads (scripts/bench_torch.py with the setup's torch 2.13 venv), the
//! fused unscale's throughput against a plain copy, and bytes per parameter.
//!
//! Flags: `--steps N` (20), `--batch B` (128), `--hidden H` (1024), `--native-steps N` (3:
//! native fp16 kernels are 50-170x slower on CPUs without fp16 units), `--no-python`.
use std::time::Instant;

use tch::nn::{self, ModuleT, OptimizerConfig as _, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{initialize, AmpConfig, OptLevel};

struct Args {
    steps: usize,
    native_steps: usize,
    batch: i64,
    hidden: i64,
    python: bool,
}

fn args() -> Args {
    let mut a = Args { steps: 20, native_steps: 3, batch: 128, hidden: 1024, python: true };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let next = |i: usize| {
            v.get(i + 1).and_then(|s| s.parse::<i64>().ok()).unwrap_or_else(|| panic!("{} needs a number", v[i]))
        };
        match v[i].as_str() {
            "--steps" => {
                a.steps = next(i) as usize;
                i += 1
            }
            "--native-steps" => {
                a.native_steps = next(i) as usize;
                i += 1
            }
            "--batch" => {
                a.batch = next(i);
                i += 1
            }
            "--hidden" => {
                a.hidden = next(i);
                i += 1
            }
            "--no-python" => a.python = false,
            _ => {} // cargo bench passes --bench
        }
        i += 1;
    }
    a
}

fn mlp(vs: &VarStore, hidden: i64) -> nn::SequentialT {
    let r = vs.root();
    nn::seq_t()
        .add(nn::linear(&r / "fc1", 784, hidden, Default::default()))
        .add(nn::batch_norm1d(&r / "bn1", hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "fc2", hidden, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "fc3", hidden, 10, Default::default()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn time_steps(steps: usize, mut step: impl FnMut()) -> f64 {
    for _ in 0..2 {
        step();
    }
    median(
        (0..steps.max(1))
            .map(|_| {
                let t = Instant::now();
                step();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

fn data(a: &Args) -> (Tensor, Tensor) {
    tch::manual_seed(0);
    (
        Tensor::randn([a.batch, 784], (Kind::Float, Device::Cpu)),
        Tensor::randint(10, [a.batch], (Kind::Int64, Device::Cpu)),
    )
}

fn hand_written_fp32(a: &Args) -> f64 {
    let (x, y) = data(a);
    let vs = VarStore::new(Device::Cpu);
    let net = mlp(&vs, a.hidden);
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    time_steps(a.steps, || {
        let loss = net.forward_t(&x, true).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
    })
}

/// Median ms per step, skipped steps, and bytes/param at step time.
fn amp_step(a: &Args, cfg: AmpConfig, steps: usize) -> (f64, u64, f64) {
    let (x, y) = data(a);
    let vs = VarStore::new(Device::Cpu);
    let net = mlp(&vs, a.hidden);
    let (model, mut opt, mut amp) = initialize(&vs, net, nn::Adam::default(), 1e-3, &cfg.verbosity(0)).unwrap();
    let mut bpp = 0.0;
    let ms = time_steps(steps, || {
        opt.zero_grad().unwrap();
        let loss = model.forward_t(&x, true).cross_entropy_for_logits(&y);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        bpp = opt.memory().bytes_per_param();
        opt.step().unwrap();
    });
    (ms, opt.step_counts().1, bpp)
}

fn unscale_vs_copy() -> (f64, f64) {
    let grads: Vec<Tensor> = (0..64).map(|_| Tensor::randn([256 * 1024], (Kind::Float, Device::Cpu))).collect();
    let dst: Vec<Tensor> = grads.iter().map(|g| g.zeros_like()).collect();
    let found_inf = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    let inv = Tensor::ones([1], (Kind::Float, Device::Cpu));
    let bytes = 64.0 * 256.0 * 1024.0 * 4.0;
    let unscale = time_steps(20, || tch_amp::unscale_(&grads, &found_inf, &inv).unwrap());
    let copy = time_steps(20, || {
        for (d, g) in dst.iter().zip(&grads) {
            d.shallow_clone().copy_(g);
        }
    });
    (bytes / unscale / 1e6, bytes / copy / 1e6) // GB/s
}

fn python(a: &Args) -> Option<serde_json::Value> {
    let py = std::env::var("TCH_AMP_PYTHON").ok()?;
    let out = std::process::Command::new(py)
        .args(["scripts/bench_torch.py", "--batch", &a.batch.to_string(), "--hidden", &a.hidden.to_string()])
        .args(["--steps", &a.steps.to_string(), "--native-steps", &a.native_steps.to_string()])
        .args(["--threads", &tch::get_num_threads().to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!("bench_torch.py failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

fn main() {
    let a = args();
    println!(
        "tch-amp benchmark: MLP 784-{h}-{h}-10 with batch norm, batch {b}, Adam, {t} threads, median of {s} steps",
        h = a.hidden,
        b = a.batch,
        t = tch::get_num_threads(),
        s = a.steps
    );
    let base = hand_written_fp32(&a);
    let mut rows: Vec<(String, f64, String)> =
        vec![("fp32 hand-written tch loop (tch nn::Adam)".into(), base, String::new())];
    let levels: Vec<(&str, AmpConfig, usize)> = vec![
        ("O0", AmpConfig::new(OptLevel::O0), a.steps),
        ("O1 fp16, emulation on", AmpConfig::new(OptLevel::O1), a.steps),
        ("O1 bf16, emulation on", AmpConfig::new(OptLevel::O1).low_precision_dtype(Kind::BFloat16), a.steps),
        ("O1 fp16, native kernels", AmpConfig::new(OptLevel::O1).emulate_low_precision_on_cpu(false), a.native_steps),
        ("O2, emulation on", AmpConfig::new(OptLevel::O2), a.steps),
        ("O2, native kernels", AmpConfig::new(OptLevel::O2).emulate_low_precision_on_cpu(false), a.native_steps),
        ("O3, emulation on", AmpConfig::new(OptLevel::O3), a.steps),
        ("O3, native kernels", AmpConfig::new(OptLevel::O3).emulate_low_precision_on_cpu(false), a.native_steps),
    ];
    let mut o2_ms = None;
    for (name, cfg, steps) in levels {
        let (ms, skipped, bpp) = amp_step(&a, cfg, steps);
        if name == "O2, emulation on" {
            o2_ms = Some(ms);
        }
        rows.push((format!("tch-amp {name}"), ms, format!("{skipped} skipped, {bpp:.1} B/param at step")));
    }
    if a.python {
        match python(&a) {
            Some(v) => {
                for (k, label) in [
                    ("fp32", "PyTorch fp32 (Python)"),
                    ("amp_fp16", "PyTorch autocast fp16 + GradScaler('cpu')"),
                    ("amp_bf16", "PyTorch autocast bf16"),
                ] {
                    if let Some(ms) = v[k].as_f64() {
                        let note = match (k, o2_ms) {
                            ("amp_fp16", Some(o2)) => format!("tch-amp O2 / this = {:.3}", o2 / ms),
                            _ => String::new(),
                        };
                        rows.push((label.into(), ms, note));
                    }
                }
            }
            None => eprintln!("(PyTorch rows skipped: TCH_AMP_PYTHON unset or the script failed; run `make setup`)"),
        }
    }
    println!("\n| configuration | ms/step | ratio to fp32 tch loop | notes |\n|---|---:|---:|---|");
    for (name, ms, note) in &rows {
        println!("| {name} | {ms:.2} | {:.3} | {note} |", ms / base);
    }
    let (unscale_gbs, copy_gbs) = unscale_vs_copy();
    println!(
        "\nfused unscale + inf/NaN check: {unscale_gbs:.2} GB/s vs plain copy {copy_gbs:.2} GB/s of the same bytes = {:.0} %",
        100.0 * unscale_gbs / copy_gbs
    );
    println!("host syncs per step: 1 with dynamic loss scaling (reading the overflow flag), 0 with a static scale");
}
