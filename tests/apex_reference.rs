//! tch-amp against a step-by-step reference of Apex's algorithm, bit for bit, at every opt
//! level, with CPU emulation of fp16 GEMMs/convolutions off and on.
//!
//! The reference is scripts/reference/apex_reference.py (plain torch, run here with the venv's
//! python, `TCH_AMP_PYTHON`, written by `make setup`): its docstring spells out what each opt
//! level does. It runs at test time, on this machine, because GEMM and convolution results depend
//! on the CPU's kernels (summation order); both sides use one intra-op thread. Three
//! scenarios (an MLP with batch norm and SGD momentum, 32 steps; a small CNN with batch norm,
//! max-pool, global average pool and Adam, 16 steps; a pre-LN transformer encoder block with SGD
//! momentum, 16 steps), each under O0, O1, O2, O2 with keep_batchnorm_fp32=False, O2 with a
//! static loss scale of 128, and O3; runs with a dynamic scale get two injected overflows
//! (the loss is multiplied by 2^15 at two steps: those steps are skipped and the scale halves).
//! Compared at every step: the loss (fp32 bits), the loss scale, whether the step was skipped;
//! at the end: every model variable (weights, batch-norm running stats) and the fp32 masters.
//!
//! Emulation off is compared with the reference's native runs (libtorch's fp16 CPU kernels, as
//! the user's PyTorch script ran). Emulation on is compared with the reference's "+emulated"
//! runs, which compute linear, conv2d and matmul by the emulation contract (fp32 compute of the
//! rounded fp16 inputs, output rounded once; backward through the same casts): that checks the
//! whole emulated path (O1 casts, cast cache, emulation-only inner policy, backward rounding
//! points) bit for bit. Whether the emulated runs also equal the native ones depends on the CPU:
//! where libtorch's native fp16 kernel sums in another order than the fp32 kernel (on an
//! AVX512-FP16 CPU: oneDNN's fp16 batched matmul and convolution backward), a result near a
//! rounding midpoint rounds to the other fp16 neighbour and training drifts from there; the
//! test prints, per run, whether the two references agree.
//!
//! Gradient accumulation across losses and micro-batches (`accumulation_*`): the MLP with two
//! losses and a scaler each (`num_losses(2)`), both losses backward on each of two micro-batches,
//! the first micro-batch with `delay_unscale`, one step; at O1 and O2, without and with overflows
//! injected into delayed passes (Apex unscales loss 1's delayed gradient by loss 0's scale and
//! catches its overflow with scaler 0), and with `max_loss_scale(3000)`, where 1/scale is
//! inexact, so that the order and rounding of `new * (1/scale) + stashed` show (a fused
//! multiply-add gives other losses and weights there). A second scenario (`accumulation_shared_*`)
//! takes both losses from one forward per micro-batch (loss 0 backward with the graph retained,
//! loss 1 = 0.1 * mean(out^2)), clips the masters to norm 1 before each step (the per-parameter
//! norms summed in torch's parameter order, as Apex's `amp.master_params`), and injects an
//! overflow into loss 1 in the last micro-batch (scaler 1 catches it in the stash path) or in
//! the delayed one (scaler 0 catches it). Compared: every loss, scale and skip, the norm of every
//! stepped step, the final variables and masters, emulation off and on.
//!
//! O3 runs twice: as Apex does it (the user's optimizer on the fp16 parameters with fp16 state,
//! tch-amp's default; `o3_apex_fp16_optimizer_state`) and with
//! `AmpConfig::fp32_optimizer_state(true)` (fp32 update and state, "O3_fp32_state").
#[path = "common/mod.rs"]
mod common;

use std::sync::OnceLock;

use common::reference::{bits_equal, describe_diff, Fixture};
use tch::nn::{self, Module, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{Amp, AmpConfig, AmpOptimizer, OptLevel, OptimizerConfig, ScaleLossOptions};

const H: i64 = 2; // attention heads

use common::python::python;

/// The reference's output (safetensors bytes), computed once per test binary.
fn reference() -> &'static [u8] {
    static REF: OnceLock<Vec<u8>> = OnceLock::new();
    REF.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/reference/apex_reference.py");
        let out = std::process::Command::new(python())
            .args([script, "--out", "-", "--threads", "1"])
            .output()
            .expect("running scripts/reference/apex_reference.py");
        assert!(
            out.status.success(),
            "apex_reference.py failed (its venv needs requirements.txt: torch==2.13.0, safetensors): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    })
}

// ---- The models, as a tch user writes them ------------------------------------------------------

#[derive(Debug)]
struct Mlp {
    fc1: nn::Linear,
    bn1: nn::BatchNorm,
    fc2: nn::Linear,
}

impl Mlp {
    fn new(p: &nn::Path, classes: i64) -> Self {
        Self {
            fc1: nn::linear(p / "fc1", 16, 32, Default::default()),
            bn1: nn::batch_norm1d(p / "bn1", 32, Default::default()),
            fc2: nn::linear(p / "fc2", 32, classes, Default::default()),
        }
    }
}

impl ModuleT for Mlp {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.fc2.forward(&self.bn1.forward_t(&self.fc1.forward(xs), train).relu())
    }
}

#[derive(Debug)]
struct Cnn {
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
    conv2: nn::Conv2D,
    fc: nn::Linear,
}

impl Cnn {
    fn new(p: &nn::Path) -> Self {
        let pad = nn::ConvConfig { padding: 1, ..Default::default() };
        Self {
            conv1: nn::conv2d(p / "conv1", 3, 8, 3, pad),
            bn1: nn::batch_norm2d(p / "bn1", 8, Default::default()),
            conv2: nn::conv2d(p / "conv2", 8, 16, 3, pad),
            fc: nn::linear(p / "fc", 16, 10, Default::default()),
        }
    }
}

impl ModuleT for Cnn {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let h = self.bn1.forward_t(&self.conv1.forward(xs), train).relu();
        let h = h.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
        let h = self.conv2.forward(&h).relu();
        self.fc.forward(&h.mean_dim([2i64, 3].as_slice(), false, None))
    }
}

#[derive(Debug)]
struct Block {
    ln1: nn::LayerNorm,
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
    head: nn::Linear,
}

impl Block {
    fn new(p: &nn::Path) -> Self {
        let lin = |name: &str, i, o| nn::linear(p / name, i, o, Default::default());
        Self {
            ln1: nn::layer_norm(p / "ln1", vec![16], Default::default()),
            q: lin("q", 16, 16),
            k: lin("k", 16, 16),
            v: lin("v", 16, 16),
            proj: lin("proj", 16, 16),
            ln2: nn::layer_norm(p / "ln2", vec![16], Default::default()),
            fc1: lin("fc1", 16, 64),
            fc2: lin("fc2", 64, 16),
            head: lin("head", 16, 10),
        }
    }
}

impl ModuleT for Block {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let (b, t, d) = xs.size3().unwrap();
        let dh = d / H;
        let h = self.ln1.forward(xs);
        let heads = |l: &nn::Linear| l.forward(&h).reshape([b, t, H, dh]).transpose(1, 2);
        let (q, k, v) = (heads(&self.q), heads(&self.k), heads(&self.v));
        let scores = q.matmul(&k.transpose(-2, -1)) / (dh as f64).sqrt();
        let attn = scores.softmax(-1, None::<Kind>);
        let o = attn.matmul(&v).transpose(1, 2).reshape([b, t, d]);
        let x = xs + self.proj.forward(&o);
        let h = self.fc2.forward(&self.fc1.forward(&self.ln2.forward(&x)).gelu("none"));
        let x = &x + h;
        self.head.forward(&x.mean_dim(1, false, None))
    }
}

#[derive(Debug)]
enum Net {
    Mlp(Mlp),
    Cnn(Cnn),
    Block(Block),
}

impl ModuleT for Net {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        match self {
            Net::Mlp(m) => m.forward_t(xs, train),
            Net::Cnn(m) => m.forward_t(xs, train),
            Net::Block(m) => m.forward_t(xs, train),
        }
    }
}

// ---- One run --------------------------------------------------------------------------------

fn amp_config(run: &str) -> AmpConfig {
    match run {
        "O0" => AmpConfig::new(OptLevel::O0),
        "O1" => AmpConfig::new(OptLevel::O1),
        "O2" => AmpConfig::new(OptLevel::O2),
        "O2_keep_bn_fp16" => AmpConfig::new(OptLevel::O2).keep_batchnorm_fp32(false),
        "O2_static128" => AmpConfig::new(OptLevel::O2).loss_scale(128.0),
        "O3" => AmpConfig::new(OptLevel::O3),
        "O3_fp32_state" => AmpConfig::new(OptLevel::O3).fp32_optimizer_state(true),
        other => panic!("unknown run {other}"),
    }
}

/// The model `net` ("mlp", "cnn", "transformer") with the initial values the reference wrote
/// under `<scenario>/init/`.
fn build_model(fx: &Fixture, scenario: &str, net: &str, tag: &str) -> (VarStore, Net) {
    let vs = VarStore::new(Device::Cpu);
    let net = match net {
        "mlp" => Net::Mlp(Mlp::new(&vs.root(), fx.get(&format!("{scenario}/init/fc2.bias")).size()[0])),
        "cnn" => Net::Cnn(Cnn::new(&vs.root())),
        "transformer" => Net::Block(Block::new(&vs.root())),
        other => panic!("unknown model {other}"),
    };
    let vars = vs.variables();
    let init_prefix = format!("{scenario}/init/");
    let mut n_init = 0;
    tch::no_grad(|| {
        for (k, t) in &fx.tensors {
            if let Some(name) = k.strip_prefix(&init_prefix) {
                let mut v = vars.get(name).unwrap_or_else(|| panic!("{tag}: no variable {name}")).shallow_clone();
                v.copy_(t);
                n_init += 1;
            }
        }
    });
    assert_eq!(n_init, vars.len(), "{tag}: the reference does not initialize every variable");
    (vs, net)
}

/// The final model variables and fp32 masters against the reference's under `prefix`.
fn compare_final(fx: &Fixture, vs: &VarStore, opt: &AmpOptimizer, prefix: &str, tag: &str) -> Vec<String> {
    let mut failures = Vec::new();
    for (name, v) in &vs.variables() {
        let want = fx.get(&format!("{prefix}final/{name}"));
        if !bits_equal(v, want) {
            failures.push(format!("{tag}: final {name}: {}", describe_diff(v, want)));
        }
    }
    for (name, m) in opt.param_names().iter().zip(opt.master_params()) {
        let key = format!("{prefix}master/{name}");
        if fx.has(&key) && !bits_equal(&m, fx.get(&key)) {
            failures.push(format!("{tag}: master {name}: {}", describe_diff(&m, fx.get(&key))));
        }
    }
    failures
}

/// Runs `scenario` under `run` with tch-amp; returns the mismatches with the reference.
fn run_one(fx: &Fixture, scenario: &str, run: &str, emulate: bool) -> Vec<String> {
    let meta = &fx.meta_json("scenarios")[scenario];
    let steps = meta["steps"].as_i64().unwrap();
    let inject: Vec<i64> = meta["inject"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    let factor = meta["inject_factor"].as_f64().unwrap();
    let tag = format!("{scenario} {run} emulation {}", if emulate { "on" } else { "off" });

    let (vs, net) = build_model(fx, scenario, scenario, &tag);

    let config = amp_config(run).verbosity(0).emulate_low_precision_on_cpu(emulate);
    let dynamic = matches!(config.build().unwrap().loss_scale(), tch_amp::LossScale::Dynamic);
    let mut amp = Amp::new(&config).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let optim: OptimizerConfig = match meta["optimizer"].as_str().unwrap() {
        "SGD" => {
            nn::Sgd { momentum: meta["momentum"].as_f64().unwrap(), dampening: 0.0, wd: 0.0, nesterov: false }.into()
        }
        // torch.optim.Adam's defaults, as the script uses them.
        "Adam" => nn::Adam { beta1: 0.9, beta2: 0.999, wd: 0.0, eps: 1e-8, amsgrad: false }.into(),
        other => panic!("unknown optimizer {other}"),
    };
    let mut opt = amp.optimizer(&vs, optim, meta["lr"].as_f64().unwrap()).unwrap();

    // Emulation on follows tch-amp's emulation contract (fp32 compute of the rounded inputs,
    // rounded once): the reference's "+emulated" runs; O0 has nothing to emulate.
    let prefix =
        if emulate && run != "O0" { format!("{scenario}/{run}+emulated/") } else { format!("{scenario}/{run}/") };
    let (xs, ys) = (fx.get(&format!("{scenario}/x")), fx.get(&format!("{scenario}/y")));
    let (want_loss, want_scale, want_skip) =
        (fx.get(&format!("{prefix}loss")), fx.get(&format!("{prefix}scale")), fx.get(&format!("{prefix}skipped")));
    let mut failures = Vec::new();
    for step in 0..steps {
        opt.zero_grad().unwrap();
        let out = model.forward_t(&xs.get(step), true);
        let loss = out.cross_entropy_for_logits(&ys.get(step));
        let user_loss = if dynamic && inject.contains(&step) { &loss * factor } else { loss.shallow_clone() };
        let so = amp.scale_loss(&user_loss, &mut [&mut opt], |l| l.backward()).unwrap();
        let skipped = !opt.step().unwrap().stepped();
        let got = loss.detach().to_kind(Kind::Float);
        let want = want_loss.get(step);
        if !bits_equal(&got, &want) {
            let (g, w) = (got.double_value(&[]), want.double_value(&[]));
            failures.push(format!("{tag}: loss differs from step {step} (rel {:.1e})", ((g - w) / w).abs()));
        }
        if so.loss_scale != want_scale.double_value(&[step]) {
            failures.push(format!(
                "{tag}: step {step} loss scale {} vs {}",
                so.loss_scale,
                want_scale.double_value(&[step])
            ));
        }
        if i64::from(skipped) != want_skip.int64_value(&[step]) {
            failures.push(format!("{tag}: step {step} skipped {skipped} vs reference"));
        }
        if !failures.is_empty() {
            break;
        }
    }
    // Final variables (weights and batch-norm running stats) and masters.
    failures.extend(compare_final(fx, &vs, &opt, &prefix, &tag));
    failures
}

const RUNS: [&str; 6] = ["O0", "O1", "O2", "O2_keep_bn_fp16", "O2_static128", "O3_fp32_state"];

fn check(scenario: &str, emulate: bool, runs: &[&str]) {
    tch::set_num_threads(1);
    let fx = Fixture::parse(reference());
    let mut failures = Vec::new();
    for run in runs {
        let f = run_one(&fx, scenario, run, emulate);
        println!("{scenario} {run} emulation {emulate}: {}", if f.is_empty() { "bit for bit" } else { "DIFFERS" });
        if emulate && *run != "O0" {
            let native = format!("{scenario}/{run}/");
            let agree =
                fx.tensors.iter().filter(|(k, _)| k.starts_with(&native)).all(|(k, t)| {
                    bits_equal(t, fx.get(&k.replacen(&native, &format!("{scenario}/{run}+emulated/"), 1)))
                });
            println!(
                "  (reference: emulated and native fp16 kernels {} on this CPU)",
                if agree { "agree" } else { "differ" }
            );
        }
        failures.extend(f);
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn mlp_batchnorm_sgd_emulation_off() {
    check("mlp", false, &RUNS);
}

#[test]
fn mlp_batchnorm_sgd_emulation_on() {
    check("mlp", true, &RUNS);
}

#[test]
fn cnn_adam_emulation_off() {
    check("cnn", false, &RUNS);
}

#[test]
fn cnn_adam_emulation_on() {
    check("cnn", true, &RUNS);
}

#[test]
fn transformer_block_sgd_emulation_off() {
    check("transformer", false, &RUNS);
}

#[test]
fn transformer_block_sgd_emulation_on() {
    check("transformer", true, &RUNS);
}

/// Apex's O3: the user's optimizer on the fp16 parameters, fp16 state (Adam on the CNN turns
/// the weights to NaN at the second step, as under Apex).
#[test]
fn o3_apex_fp16_optimizer_state() {
    for scenario in ["mlp", "cnn", "transformer"] {
        for emulate in [false, true] {
            check(scenario, emulate, &["O3"]);
        }
    }
}

// ---- Gradient accumulation over two losses and two micro-batches ---------------------------------

/// Loss `kind` of the reference's accumulation scenarios on the model output `out`.
fn accum_loss(kind: &str, out: &Tensor, y: &Tensor) -> Tensor {
    match kind {
        "cross_entropy" => out.cross_entropy_for_logits(y),
        // Python: 0.1 * (out ** 2).mean()
        "square_mean" => out.pow_tensor_scalar(2).mean(None) * 0.1,
        other => panic!("unknown loss {other}"),
    }
}

/// The reference's accumulation run `scenario`/`run`: the MLP with SGD momentum and two losses,
/// each with its own scaler (`num_losses(2)`); per step both losses go backward on each of two
/// micro-batches, the first micro-batch's passes with `delay_unscale`, then (in "accum_shared")
/// `clip_grad_norm(1.0)` on the masters, then one `step`. In "accum" each loss has its own forward
/// and inputs; in "accum_shared" both come from one forward per micro-batch, loss 0 backward with
/// the graph retained. Returns the mismatches.
fn run_accum(fx: &Fixture, scenario: &str, run: &str, emulate: bool) -> Vec<String> {
    let meta = &fx.meta_json("accumulation")[scenario];
    let (steps, micro) = (meta["steps"].as_i64().unwrap(), meta["micro_batches"].as_i64().unwrap());
    let kinds: Vec<&str> = meta["losses"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
    let losses = kinds.len();
    let shared = meta["shared_forward"].as_bool().unwrap();
    let clip = meta["clip"].as_f64();
    let level = match meta["runs"][run]["level"].as_str().unwrap() {
        "O1" => OptLevel::O1,
        "O2" => OptLevel::O2,
        other => panic!("unknown level {other}"),
    };
    // (step, micro-batch, loss id) whose scale_loss gets the loss multiplied by the factor.
    let inject: Vec<(i64, i64, usize)> = meta["runs"][run]["inject"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_i64().unwrap(), p[1].as_i64().unwrap(), p[2].as_u64().unwrap() as usize))
        .collect();
    let factor = meta["inject_factor"].as_f64().unwrap();
    let tag = format!("{scenario} {run} emulation {}", if emulate { "on" } else { "off" });

    let (vs, net) = build_model(fx, scenario, "mlp", &tag);
    let config = AmpConfig::new(level)
        .num_losses(losses)
        .max_loss_scale(meta["runs"][run]["max_loss_scale"].as_f64().unwrap())
        .verbosity(0)
        .emulate_low_precision_on_cpu(emulate);
    let mut amp = Amp::new(&config).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let sgd = nn::Sgd { momentum: meta["momentum"].as_f64().unwrap(), dampening: 0.0, wd: 0.0, nesterov: false };
    let mut opt = amp.optimizer(&vs, sgd, meta["lr"].as_f64().unwrap()).unwrap();

    let prefix = if emulate { format!("{scenario}/{run}+emulated/") } else { format!("{scenario}/{run}/") };
    let (xs, ys) = (fx.get(&format!("{scenario}/x")), fx.get(&format!("{scenario}/y")));
    let (want_loss, want_scale, want_skip) =
        (fx.get(&format!("{prefix}loss")), fx.get(&format!("{prefix}scale")), fx.get(&format!("{prefix}skipped")));
    let mut failures = Vec::new();
    for step in 0..steps {
        opt.zero_grad().unwrap();
        for mb in 0..micro {
            let delay_unscale = mb + 1 < micro;
            // One forward per micro-batch, both losses from it (as the Python script computes
            // them), or one forward per loss.
            let batch_losses: Vec<Tensor> = if shared {
                let out = model.forward_t(&xs.get(step).get(mb), true);
                kinds.iter().map(|k| accum_loss(k, &out, &ys.get(step).get(mb))).collect()
            } else {
                Vec::new()
            };
            for loss_id in 0..losses {
                let at = [step, mb, loss_id as i64];
                let loss = if shared {
                    batch_losses[loss_id].shallow_clone()
                } else {
                    let out = model.forward_t(&xs.get(step).get(mb).get(loss_id as i64), true);
                    accum_loss(kinds[loss_id], &out, &ys.get(step).get(mb).get(loss_id as i64))
                };
                let user_loss =
                    if inject.contains(&(step, mb, loss_id)) { &loss * factor } else { loss.shallow_clone() };
                let options = ScaleLossOptions { loss_id, delay_unscale };
                let retain_graph = shared && loss_id + 1 < losses;
                let so = amp
                    .f_scale_loss_with(&user_loss, &mut [&mut opt], options, |l| {
                        tch_amp::optim::backward(l, retain_graph)
                    })
                    .unwrap();
                let got = loss.detach().to_kind(Kind::Float);
                let want = want_loss.get(step).get(mb).get(loss_id as i64);
                if !bits_equal(&got, &want) {
                    failures.push(format!("{tag}: loss at {at:?}: {}", describe_diff(&got, &want)));
                }
                if so.loss_scale != want_scale.double_value(&at) {
                    failures.push(format!(
                        "{tag}: loss scale at {at:?}: {} vs {}",
                        so.loss_scale,
                        want_scale.double_value(&at)
                    ));
                }
            }
        }
        if let Some(max_norm) = clip {
            // The reference keeps no norm at a skipped step (it reads gradients the skip drops).
            let will_skip = opt.will_skip();
            let norm = opt.clip_grad_norm(max_norm, 2.0).unwrap();
            let want = fx.get(&format!("{prefix}norm")).double_value(&[step]);
            if !will_skip && norm != want {
                failures.push(format!("{tag}: step {step} gradient norm {norm} vs {want}"));
            }
        }
        let skipped = !opt.step().unwrap().stepped();
        if i64::from(skipped) != want_skip.int64_value(&[step]) {
            failures.push(format!("{tag}: step {step} skipped {skipped} vs reference"));
        }
    }
    failures.extend(compare_final(fx, &vs, &opt, &prefix, &tag));
    failures
}

fn check_accum(scenario: &str, runs: &[&str]) {
    tch::set_num_threads(1);
    let fx = Fixture::parse(reference());
    let mut failures = Vec::new();
    for run in runs {
        for emulate in [false, true] {
            let f = run_accum(&fx, scenario, run, emulate);
            println!("{scenario} {run} emulation {emulate}: {}", if f.is_empty() { "bit for bit" } else { "DIFFERS" });
            if emulate {
                let (native, emulated) = (format!("{scenario}/{run}/"), format!("{scenario}/{run}+emulated/"));
                let agree = fx
                    .tensors
                    .iter()
                    .filter(|(k, _)| k.starts_with(&native))
                    .all(|(k, t)| bits_equal(t, fx.get(&k.replacen(&native, &emulated, 1))));
                println!(
                    "  (reference: emulated and native fp16 kernels {} on this CPU)",
                    if agree { "agree" } else { "differ" }
                );
            }
            failures.extend(f);
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// O1, two scalers, delay_unscale on the first micro-batch; with overflows injected into a
/// delayed pass of loss 1 (caught by scaler 0's exit, which halves scale 0 only) and of loss 0.
#[test]
fn accumulation_two_scalers_delay_unscale_o1() {
    check_accum("accum", &["O1", "O1_inject", "O1_max3000_inject"]);
}

/// As the O1 test, under O2 (fp16 model, fp32 masters, fp32 batch norm).
#[test]
fn accumulation_two_scalers_delay_unscale_o2() {
    check_accum("accum", &["O2", "O2_inject", "O2_max3000_inject"]);
}

/// Two losses of one forward per micro-batch (loss 0 backward with the graph retained), the
/// masters clipped to norm 1 before each step; an overflow injected into loss 1 of step 5 in the
/// last micro-batch (scaler 1's exit finds it while adding the new gradient to the stashed one)
/// or in the delayed one (scaler 0's exit finds it in the accumulated buffer). O1.
#[test]
fn accumulation_shared_forward_clipped_o1() {
    check_accum("accum_shared", &["O1", "O1_inject", "O1_inject_delayed"]);
}

/// As the O1 test, under O2: micro-batch 0's gradients and loss 0's of micro-batch 1 accumulate
/// in the fp16 model gradients and are unscaled together by 1/S0.
#[test]
fn accumulation_shared_forward_clipped_o2() {
    check_accum("accum_shared", &["O2", "O2_inject", "O2_inject_delayed"]);
}
