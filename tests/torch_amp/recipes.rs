//! PyTorch's "Automatic Mixed Precision examples" on CPU, tch-amp against torch bit for bit per
//! step (loss, scale, skip, gradients, weights): the typical loop, unscale_ then
//! clip_grad_norm_, gradient accumulation, two models / losses / optimizers with one scaler,
//! a gradient penalty through `autograd.grad(create_graph=True)`, and a region forced to fp32
//! inside autocast. bf16 and fp16 autocast both run libtorch's native CPU kernels (small
//! models: fast enough); the gradient penalty also runs with the CPU emulation, against the same
//! script with `F.linear` emulated in Python.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_amp::torch_amp::{clip_grad_norm_, GradScalerOptions};
use tch_amp::{diagnostics, Amp, AmpConfig, Autocast, CpuKernels, GradScaler, OptLevel};

use crate::common::{batch, deterministic_init};
use crate::support::{mlp, poisoned, torch_reference, Rows};

/// CPU autocast with libtorch's native kernels: torch.autocast's, bit for bit.
fn native() -> Autocast {
    Autocast::new(Device::Cpu).cpu_kernels(CpuKernels::Native)
}

fn dtype(arg: &str) -> Kind {
    match arg {
        "bf16" => Kind::BFloat16,
        "fp16" => Kind::Half,
        other => panic!("{other}"),
    }
}

/// fp16 starts at 2^20 so that the first steps overflow in the fp16 backward and back off.
fn scaler_for(arg: &str, growth_interval: i64) -> GradScaler {
    let init = if arg == "fp16" { 1048576.0 } else { 65536.0 };
    GradScaler::with_options(
        Device::Cpu,
        GradScalerOptions::default().init_scale(init).growth_interval(growth_interval),
    )
    .unwrap()
}

const TYPICAL: &str = r#"
DT = DTYPES[ARG]
model = mlp(); det_init(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20 if ARG == "fp16" else 2.0**16, growth_interval=3)
for step in range(10):
    x, y = batch(step, 8)
    if step == 6:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=DT):
        out = model(x)
        loss = F.mse_loss(out, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    scaler.update()
    push("out", out); push("loss", loss); push("scale", scaler._scale); push("stepped", int(found == 0))
    push("grad.fc1.weight", model.fc1.weight.grad); push_model("", model)
"#;

fn typical(arg: &str) {
    let torch = torch_reference(TYPICAL, arg);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs.root());
    deterministic_init(&vs);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = scaler_for(arg, 3);
    let mut rows = Rows::default();
    for step in 0..10 {
        let (mut x, y) = batch(step, 8);
        if step == 6 {
            x = poisoned(&x);
        }
        opt.zero_grad();
        let (out, loss) = native()
            .dtype(dtype(arg))
            .run(|| {
                let out = model.forward(&x);
                let loss = out.mse_loss(&y, tch::Reduction::Mean);
                (out, loss)
            })
            .unwrap();
        scaler.scale(&loss).unwrap().backward();
        let stepped = scaler.step(&mut opt).unwrap().stepped();
        scaler.update().unwrap();
        rows.push("out", &out);
        rows.push("loss", &loss);
        rows.push("scale", scaler.scale_tensor().unwrap());
        rows.push("stepped", &Tensor::from(i64::from(stepped)));
        rows.push("grad.fc1.weight", &model.fc1.ws.grad());
        rows.push_model("", &vs);
    }
    rows.assert_matches(&torch);
}

#[test]
fn typical_loop_bf16_matches_torch() {
    typical("bf16");
}

#[test]
fn typical_loop_fp16_matches_torch() {
    typical("fp16");
}

const CLIP: &str = r#"
DT = DTYPES[ARG]
model = mlp(); det_init(model)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20 if ARG == "fp16" else 2.0**16, growth_interval=3)
for step in range(8):
    x, y = batch(step, 8)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=DT):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    scaler.step(opt)
    scaler.update()
    push("loss", loss); push("norm", norm); push("scale", scaler._scale); push_model("", model)
"#;

#[test]
fn unscale_then_clip_grad_norm_matches_torch() {
    for arg in ["bf16", "fp16"] {
        let torch = torch_reference(CLIP, arg);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs.root());
        deterministic_init(&vs);
        let mut opt = nn::Sgd::default().build(&vs, 0.5).unwrap();
        let mut scaler = scaler_for(arg, 3);
        let mut rows = Rows::default();
        for step in 0..8 {
            let (x, y) = batch(step, 8);
            opt.zero_grad();
            let loss = native().dtype(dtype(arg)).run(|| model.forward(&x).mse_loss(&y, tch::Reduction::Mean)).unwrap();
            scaler.scale(&loss).unwrap().backward();
            scaler.unscale_(&opt).unwrap();
            // torch's parameter order (tch creates each bias before its weight): the norm sums
            // the per-tensor norms in this order.
            let params = [&model.fc1.ws, model.fc1.bs.as_ref().unwrap(), &model.fc2.ws, model.fc2.bs.as_ref().unwrap()]
                .map(Tensor::shallow_clone);
            let norm = clip_grad_norm_(&params, 0.25, 2.0).unwrap();
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            rows.push("loss", &loss);
            rows.push("norm", &norm);
            rows.push("scale", scaler.scale_tensor().unwrap());
            rows.push_model("", &vs);
        }
        rows.assert_matches(&torch);
    }
}

const ACCUMULATE: &str = r#"
model = mlp(); det_init(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", growth_interval=2)
for i in range(12):
    x, y = batch(i, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x), y) / 3
    scaler.scale(loss).backward()
    if (i + 1) % 3 == 0:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        push("scale", scaler._scale); push_model("", model)
    push("loss", loss)
"#;

#[test]
fn gradient_accumulation_matches_torch() {
    let torch = torch_reference(ACCUMULATE, "");
    let vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs.root());
    deterministic_init(&vs);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = GradScaler::with_options(Device::Cpu, GradScalerOptions::default().growth_interval(2)).unwrap();
    let mut rows = Rows::default();
    for i in 0..12 {
        let (x, y) = batch(i, 4);
        let loss = native().run(|| model.forward(&x).mse_loss(&y, tch::Reduction::Mean) / 3.0).unwrap();
        scaler.scale(&loss).unwrap().backward();
        if (i + 1) % 3 == 0 {
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            opt.zero_grad();
            rows.push("scale", scaler.scale_tensor().unwrap());
            rows.push_model("", &vs);
        }
        rows.push("loss", &loss);
    }
    rows.assert_matches(&torch);
}

/// Two models, two losses, two optimizers (torch.optim.SGD and SGD with momentum; on the Rust
/// side tch's optimizer and tch-amp's AmpOptimizer), one scaler; an inf at step 4.
const TWO_MODELS: &str = r#"
m0 = mlp(); det_init(m0); m1 = mlp(); det_init(m1)
opt0 = torch.optim.SGD(m0.parameters(), lr=0.1)
opt1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", growth_interval=2)
for step in range(8):
    x, y = batch(step, 8)
    if step == 4:
        x[0, 0] = float("inf")
    opt0.zero_grad(); opt1.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o0 = m0(x); o1 = m1(x)
        loss0 = F.mse_loss(2 * o0 + 3 * o1, y)
        loss1 = F.mse_loss(3 * o0 - 5 * o1, y)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.unscale_(opt0)
    scaler.step(opt0); scaler.step(opt1)
    scaler.update()
    push("loss0", loss0); push("loss1", loss1); push("scale", scaler._scale)
    push_model("m0.", m0); push_model("m1.", m1)
"#;

#[test]
fn two_models_losses_optimizers_one_scaler_match_torch() {
    let torch = torch_reference(TWO_MODELS, "");
    let (vs0, vs1) = (nn::VarStore::new(Device::Cpu), nn::VarStore::new(Device::Cpu));
    let (m0, m1) = (mlp(&vs0.root()), mlp(&vs1.root()));
    deterministic_init(&vs0);
    deterministic_init(&vs1);
    let mut opt0 = nn::Sgd::default().build(&vs0, 0.1).unwrap();
    let amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let sgd = nn::Sgd { momentum: 0.9, ..Default::default() };
    let mut opt1 = amp.optimizer(&vs1, sgd, 0.05).unwrap();
    let mut scaler = GradScaler::with_options(Device::Cpu, GradScalerOptions::default().growth_interval(2)).unwrap();
    let mut rows = Rows::default();
    for step in 0..8 {
        let (mut x, y) = batch(step, 8);
        if step == 4 {
            x = poisoned(&x);
        }
        opt0.zero_grad();
        opt1.zero_grad().unwrap();
        // torch keeps the graph for the second backward (retain_graph=True); tch's backward
        // frees it, so each loss gets its own (identical) forward.
        let losses = || {
            native()
                .run(|| {
                    let (o0, o1) = (m0.forward(&x), m1.forward(&x));
                    let loss0 = (&o0 * 2.0 + &o1 * 3.0).mse_loss(&y, tch::Reduction::Mean);
                    let loss1 = (&o0 * 3.0 - &o1 * 5.0).mse_loss(&y, tch::Reduction::Mean);
                    (loss0, loss1)
                })
                .unwrap()
        };
        let (loss0, _) = losses();
        scaler.scale(&loss0).unwrap().backward();
        let (_, loss1) = losses();
        scaler.scale(&loss1).unwrap().backward();
        scaler.unscale_(&opt0).unwrap();
        let s0 = scaler.step(&mut opt0).unwrap();
        let s1 = scaler.step(&mut opt1).unwrap();
        assert_eq!((s0.stepped(), s1.stepped()), (step != 4, step != 4));
        scaler.update().unwrap();
        rows.push("loss0", &loss0);
        rows.push("loss1", &loss1);
        rows.push("scale", scaler.scale_tensor().unwrap());
        rows.push_model("m0.", &vs0);
        rows.push_model("m1.", &vs1);
    }
    rows.assert_matches(&torch);
}

/// custom_fwd(cast_inputs=torch.float32): fc2 runs in fp32 inside a bf16 autocast region.
const FP32_REGION: &str = r#"
model = mlp(); det_init(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(5):
    x, y = batch(step, 8)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.act(model.fc1(x))
        with torch.autocast("cpu", enabled=False):
            out = model.fc2(h.float())
        loss = F.mse_loss(out, y)
    scaler.scale(loss).backward()
    scaler.step(opt); scaler.update()
    push("h", h); push("out", out); push("loss", loss); push_model("", model)
"#;

#[test]
fn fp32_region_inside_autocast_matches_torch() {
    let torch = torch_reference(FP32_REGION, "");
    let vs = nn::VarStore::new(Device::Cpu);
    let model = mlp(&vs.root());
    deterministic_init(&vs);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = GradScaler::new(Device::Cpu);
    let mut rows = Rows::default();
    for step in 0..5 {
        let (x, y) = batch(step, 8);
        opt.zero_grad();
        let (h, out, loss) = native()
            .run(|| {
                let h = model.fc1.forward(&x).relu();
                let out = native().enabled(false).run(|| model.fc2.forward(&h.to_kind(Kind::Float))).unwrap();
                let loss = out.mse_loss(&y, tch::Reduction::Mean);
                (h, out, loss)
            })
            .unwrap();
        assert_eq!((h.kind(), out.kind()), (Kind::BFloat16, Kind::Float));
        scaler.scale(&loss).unwrap().backward();
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        rows.push("h", &h);
        rows.push("out", &out);
        rows.push("loss", &loss);
        rows.push_model("", &vs);
    }
    rows.assert_matches(&torch);
}

/// PyTorch's gradient penalty recipe: `autograd.grad` of the scaled loss with
/// `create_graph=True`, the gradients unscaled by ordinary division (`1 / get_scale()`), their
/// norm added to the loss under autocast, then the usual scaled backward, step and update.
const GRADIENT_PENALTY: &str = r#"
DT = DTYPES[ARG]
model = mlp(); det_init(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20 if ARG == "fp16" else 2.0**16, growth_interval=3)
for step in range(8):
    x, y = batch(step, 8)
    if step == 5:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=DT):
        loss = F.mse_loss(model(x), y)
    scaled_grads = torch.autograd.grad(outputs=scaler.scale(loss), inputs=model.parameters(), create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with torch.autocast("cpu", dtype=DT):
        norm = 0
        for g in grads:
            norm += g.pow(2).sum()
        norm = norm.sqrt()
        loss = loss + norm
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    push("loss", loss); push("norm", norm); push("scale", scaler._scale); push_model("", model)
"#;

/// What tch-amp's CPU emulation does to `F.linear` under autocast, in Python: the arguments cast
/// to the autocast dtype as libtorch casts them, an fp32 linear of those values, the output
/// rounded once.
const EMULATED_LINEAR: &str = r#"
_linear = F.linear
def emulated_linear(x, w, b=None):
    if not torch.is_autocast_enabled("cpu"):
        return _linear(x, w, b)
    dt = torch.get_autocast_dtype("cpu")
    with torch.autocast("cpu", enabled=False):
        args = [None if t is None else t.to(dt).float() for t in (x, w, b)]
        return _linear(*args).to(dt)
F.linear = emulated_linear
"#;

#[test]
fn gradient_penalty_matches_torch() {
    gradient_penalty(CpuKernels::Native);
}

#[test]
fn gradient_penalty_emulated_matches_torch_with_emulated_linear() {
    gradient_penalty(CpuKernels::Emulate);
}

fn gradient_penalty(kernels: CpuKernels) {
    for arg in ["bf16", "fp16"] {
        // Whether native kernels give other numbers than the emulation depends on the CPU, so
        // the Rust side counts the ops its engine emulated instead.
        let torch = if kernels == CpuKernels::Emulate {
            torch_reference(&format!("{EMULATED_LINEAR}{GRADIENT_PENALTY}"), arg)
        } else {
            torch_reference(GRADIENT_PENALTY, arg)
        };
        let emulated_before = diagnostics::emulated_op_count(dtype(arg)).unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs.root());
        deterministic_init(&vs);
        // torch's `model.parameters()` order.
        let params: Vec<Tensor> = [&model.fc1, &model.fc2]
            .iter()
            .flat_map(|l| [l.ws.shallow_clone(), l.bs.as_ref().unwrap().shallow_clone()])
            .collect();
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let mut scaler = scaler_for(arg, 3);
        let mut rows = Rows::default();
        let autocast = Autocast::new(Device::Cpu).cpu_kernels(kernels).dtype(dtype(arg));
        for step in 0..8 {
            let (mut x, y) = batch(step, 8);
            if step == 5 {
                x = poisoned(&x);
            }
            opt.zero_grad();
            let loss = autocast.run(|| model.forward(&x).mse_loss(&y, tch::Reduction::Mean)).unwrap();
            let scaled_grads = Tensor::run_backward(&[scaler.scale(&loss).unwrap()], &params, true, true);
            let inv_scale = 1.0 / scaler.get_scale();
            let grads: Vec<Tensor> = scaled_grads.iter().map(|g| g * inv_scale).collect();
            let (loss, norm) = autocast
                .run(|| {
                    // `0 + first` is `first` exactly (a sum of squares is not -0).
                    let norm = grads.iter().map(|g| g.pow_tensor_scalar(2).sum(None)).reduce(|a, b| a + b).unwrap();
                    let norm = norm.sqrt();
                    (&loss + &norm, norm)
                })
                .unwrap();
            scaler.scale(&loss).unwrap().backward();
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            rows.push("loss", &loss);
            rows.push("norm", &norm);
            rows.push("scale", scaler.scale_tensor().unwrap());
            rows.push_model("", &vs);
        }
        rows.assert_matches(&torch);
        let emulated = diagnostics::emulated_op_count(dtype(arg)).unwrap() - emulated_before;
        assert_eq!(emulated > 0, kernels == CpuKernels::Emulate, "{arg}: {emulated} ops emulated with {kernels:?}");
    }
}
