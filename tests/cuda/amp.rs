//! GPU-only tests: `cargo test --features cuda-tests`. They fail (never skip) when no CUDA
//! device is present, so a run that claims GPU coverage really had one.

use crate::common::*;
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{initialize, load_checkpoint, save_checkpoint, AmpConfig, OptLevel};

fn cuda() -> Device {
    assert!(tch::Cuda::is_available(), "cuda-tests needs a CUDA device; none is available");
    Device::Cuda(0)
}

#[test]
fn o2_trains_on_cuda_with_masters_and_resumes_exactly() {
    let dev = cuda();
    tch::manual_seed(0);
    let vs = VarStore::new(dev);
    let net = Mlp::new(&vs.root());
    let (model, mut opt, mut amp) =
        initialize(&vs, net, nn::Adam::default(), 1e-2, &AmpConfig::new(OptLevel::O2)).unwrap();
    assert_eq!(vs.variables()["fc1.weight"].kind(), Kind::Half);
    let x = Tensor::randn([32, 8], (Kind::Float, dev));
    let y = Tensor::randn([32, 4], (Kind::Float, dev));
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..20 {
        let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
        last = loss.double_value(&[]);
        first.get_or_insert(last);
        opt.zero_grad().unwrap();
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(opt.step().unwrap().stepped());
        for (name, m) in opt.param_names().iter().zip(opt.master_params()) {
            let v = &vs.variables()[*name];
            assert!(same(v, &m.to_kind(v.kind())), "{name}");
        }
    }
    assert!(last < first.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cuda.safetensors");
    save_checkpoint(&path, &vs, &[&opt], &amp).unwrap();
    load_checkpoint(&path, &vs, &mut [&mut opt], &mut amp).unwrap();
}

#[test]
fn o2_overflow_on_cuda_skips_the_step() {
    let dev = cuda();
    let vs = VarStore::new(dev);
    let net = Mlp::new(&vs.root());
    let (model, mut opt, mut amp) =
        initialize(&vs, net, nn::Sgd::default(), 0.1, &AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    let x = Tensor::randn([4, 8], (Kind::Float, dev));
    let loss = model.forward_t(&x, true).sum(Kind::Float) * f64::INFINITY;
    let o = amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
    assert!(o.overflow);
    assert!(!opt.step().unwrap().stepped());
    assert_eq!(amp.loss_scale(0).unwrap(), 32768.0);
}

// ---------------------------------------------------------------------------------------
// Where the GPU path was thin (issue 14). These tests hold one lock: they compare runs bit
// for bit and must not share the device's streams with each other's work.

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// One training setup on CUDA: the common MLP (fc1 8→16, bn1, fc2 16→4) with deterministic
/// weights, Adam, `level`.
struct CudaRun {
    vs: VarStore,
    model: tch_amp::AmpModel<Mlp>,
    opt: tch_amp::AmpOptimizer,
    amp: tch_amp::Amp,
}

fn cuda_run(dev: Device, level: OptLevel, deterministic: bool) -> CudaRun {
    let vs = VarStore::new(dev);
    let net = Mlp::new(&vs.root());
    if deterministic {
        deterministic_init(&vs);
    }
    let amp = tch_amp::Amp::new(&AmpConfig::new(level).verbosity(0)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let opt = amp.optimizer(&vs, nn::Adam::default(), 1e-2).unwrap();
    CudaRun { vs, model, opt, amp }
}

/// The deterministic batch `i` (tests/common), on `dev`.
fn cuda_batch(i: i64, dev: Device) -> (Tensor, Tensor) {
    let (x, y) = batch(i, 32);
    (x.to_device(dev), y.to_device(dev))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Inject {
    /// `loss * inf`.
    Loss,
    /// One element of the fp16 `fc1.weight`'s model gradient set to inf after backward.
    Fp16Grad,
    /// One element of the fp32 `bn1.weight`'s gradient set to NaN after backward.
    Fp32Grad,
}

fn train_step(
    r: &mut CudaRun,
    i: i64,
    inject: Option<Inject>,
) -> (tch_amp::scaling::ScaleLossOutcome, tch_amp::StepOutcome) {
    let dev = r.vs.device();
    let (x, y) = cuda_batch(i, dev);
    r.opt.zero_grad().unwrap();
    let mut loss = r.model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
    if inject == Some(Inject::Loss) {
        loss *= f64::INFINITY;
    }
    let v = r.vs.variables();
    let out = r
        .amp
        .scale_loss(&loss, &mut [&mut r.opt], |s| {
            s.backward();
            match inject {
                Some(Inject::Fp16Grad) => {
                    let _ = v["fc1.weight"].grad().get(3).get(5).fill_(f64::INFINITY);
                }
                Some(Inject::Fp32Grad) => {
                    let _ = v["bn1.weight"].grad().get(7).fill_(f64::NAN);
                }
                _ => {}
            }
        })
        .unwrap();
    (out, r.opt.step().unwrap())
}

/// Trainable variables and masters: what a step changes (batch-norm running statistics move
/// in every forward, also one whose step is then skipped, as in Apex and PyTorch).
fn trained_state(r: &CudaRun) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> =
        r.vs.variables().into_iter().filter(|(_, v)| v.requires_grad()).map(|(k, v)| (k, v.copy())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, m) in r.opt.param_names().iter().zip(r.opt.master_params()) {
        out.push((format!("master:{name}"), m.copy()));
    }
    out
}

/// Every variable (batch-norm statistics included) and the masters. Adam's state is checked
/// by the steps that follow: it feeds every update.
fn full_state(r: &CudaRun) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = r.vs.variables().into_iter().map(|(k, v)| (k, v.copy())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, m) in r.opt.param_names().iter().zip(r.opt.master_params()) {
        out.push((format!("master:{name}"), m.copy()));
    }
    out
}

fn assert_bits(what: &str, a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        assert_eq!(ta.device(), tb.device(), "{what}: {na}");
        assert!(same(ta, tb), "{what}: {na} differs (max |diff| {})", max_abs_diff(ta, tb));
    }
}

/// O2 on CUDA with an inf or NaN injected at steps 2, 5, 6 and 10 (in the loss, in an fp16
/// model gradient, in an fp32 batch-norm gradient): exactly those steps are skipped, each
/// halves the scale (65536 → 4096), a skipped step changes no weight, master or Adam state,
/// and the run equals, bit for bit, a run that never saw the bad batches and had its scale set
/// to the same values at the same points.
#[test]
fn o2_inf_injected_on_cuda_skips_exactly_those_steps() {
    let _s = serial();
    let dev = cuda();
    let bad = [(2, Inject::Loss), (5, Inject::Fp16Grad), (6, Inject::Fp32Grad), (10, Inject::Loss)];
    let mut run = cuda_run(dev, OptLevel::O2, true);
    let mut reference = cuda_run(dev, OptLevel::O2, true);
    assert_eq!(run.vs.variables()["fc1.weight"].kind(), Kind::Half);
    assert_eq!(run.vs.variables()["bn1.weight"].kind(), Kind::Float);
    let mut scale = 65536.0;
    let mut skipped_at = Vec::new();
    for i in 0..12 {
        let inject = bad.iter().find(|(at, _)| *at == i).map(|(_, what)| *what);
        let before = trained_state(&run);
        let (out, step) = train_step(&mut run, i, inject);
        assert_eq!(out.loss_scale, scale, "step {i}");
        if let Some(what) = inject {
            scale /= 2.0;
            assert!(out.overflow, "step {i}: {what:?} not found on the device");
            assert_eq!(step, tch_amp::StepOutcome::Skipped { loss_id: 0, loss_scale: scale }, "step {i}");
            assert_bits(&format!("step {i} ({what:?}) skipped"), &before, &trained_state(&run));
            skipped_at.push(i as u64);
            // The reference never sees this batch; its scaler follows the run's.
            let state = serde_json::json!({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}});
            reference.amp.load_state_dict(&crate::common::value(state)).unwrap();
        } else {
            assert!(!out.overflow, "step {i}: a clean step reported an overflow");
            assert!(step.stepped(), "step {i}");
            let after = trained_state(&run);
            assert!(before.iter().zip(&after).any(|((_, a), (_, b))| !same(a, b)), "step {i} changed nothing");
            let (_, ref_step) = train_step(&mut reference, i, None);
            assert!(ref_step.stepped());
            assert_bits(&format!("step {i} vs the reference"), &trained_state(&reference), &after);
        }
        assert_eq!(run.amp.loss_scale(0).unwrap(), scale);
    }
    assert_eq!(run.opt.step_counts(), (8, 4));
    assert_eq!(scale, 4096.0);
    let history = run.amp.scaler(0).unwrap().history().to_vec();
    let overflows: Vec<u64> =
        history.iter().filter(|c| c.reason == tch_amp::scaling::ScaleChangeReason::Overflow).map(|c| c.pass).collect();
    assert_eq!(overflows, skipped_at);
    // The model is the masters rounded to fp16.
    for (name, m) in run.opt.param_names().iter().zip(run.opt.master_params()) {
        let v = &run.vs.variables()[*name];
        assert!(same(v, &m.to_kind(v.kind())), "{name}");
    }
}

/// A store on `dev` with one variable per floating dtype: fp16 (3 elements), bf16 (2), fp32 (4).
fn dtype_store(dev: Device) -> VarStore {
    let vs = VarStore::new(dev);
    let r = vs.root();
    let _h = r.add("h", Tensor::from_slice(&[1.0f32, 2.0, 3.0]).to_kind(Kind::Half).to_device(dev), true);
    let _b = r.add("b", Tensor::from_slice(&[4.0f32, 5.0]).to_kind(Kind::BFloat16).to_device(dev), true);
    let _f = r.add("f", Tensor::from_slice(&[6.0f32, 7.0, 8.0, 9.0]).to_device(dev), true);
    vs
}

/// d loss / d var[k] = (k + 1) / 64: distinct per element, exact in every dtype.
fn dtype_loss(vs: &VarStore) -> Tensor {
    let v = vs.variables();
    ["h", "b", "f"]
        .iter()
        .map(|n| {
            let t = &v[*n];
            let w = Tensor::arange(t.numel() as i64, (Kind::Float, vs.device())) + 1.0;
            (t.to_kind(Kind::Float) * w).sum(Kind::Float) / 64.0
        })
        .reduce(|a, b| a + b)
        .unwrap()
}

/// tests/unscale.rs on CUDA: scale_loss's fused unscale finds an inf, -inf or NaN in any
/// element of an fp16, bf16 or fp32 gradient, with and without masters, and unscales clean
/// gradients exactly ((k + 1) / 64).
#[test]
fn fused_unscale_finds_inf_and_nan_on_cuda() {
    let _s = serial();
    let dev = cuda();
    for master_weights in [false, true] {
        let cfg = AmpConfig::new(OptLevel::O0)
            .cast_model_type(None)
            .master_weights(master_weights)
            .loss_scale(tch_amp::LossScale::Dynamic)
            .verbosity(0);
        for bad in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
            for name in ["h", "b", "f"] {
                let n = dtype_store(dev).variables()[name].numel() as i64;
                for pos in 0..n {
                    let vs = dtype_store(dev);
                    let mut amp = tch_amp::Amp::new(&cfg).unwrap();
                    let mut opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
                    let vars = vs.variables();
                    let o = amp
                        .scale_loss(&dtype_loss(&vs), &mut [&mut opt], |s| {
                            s.backward();
                            let _ = vars[name].grad().get(pos).fill_(bad);
                        })
                        .unwrap();
                    assert!(o.overflow, "masters={master_weights}: {bad} in {name}[{pos}] not found");
                    assert!(!opt.step().unwrap().stepped());
                }
            }
        }
        let vs = dtype_store(dev);
        let mut amp = tch_amp::Amp::new(&cfg).unwrap();
        let mut opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
        let o = amp.scale_loss(&dtype_loss(&vs), &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(!o.overflow);
        assert_eq!(o.loss_scale, 65536.0);
        for (name, p) in opt.param_names().iter().zip(opt.master_params()) {
            let g = p.grad();
            assert_eq!(g.device(), dev, "{name}");
            let expected_kind = if master_weights { Kind::Float } else { vs.variables()[*name].kind() };
            assert_eq!(g.kind(), expected_kind, "{name}");
            let expected = (Tensor::arange(g.numel() as i64, (Kind::Float, Device::Cpu)) + 1.0) / 64.0;
            let g = g.to_kind(Kind::Float).to_device(Device::Cpu);
            assert!(g.equal(&expected), "masters={master_weights} {name}: {g}");
        }
    }
}

/// 150 fp16 gradients of 1000 elements, one fp32 of 300,000 and one bf16 of 70,000 on `dev`:
/// more tensors than one CUDA multi-tensor launch takes (110) and tensors longer than one
/// chunk (65,536 elements). Values are multiples of 16, so / 16 is exact in every dtype.
fn many_grads(dev: Device) -> Vec<Tensor> {
    let ints = |n: i64, offset: i64, modulo: i64| {
        (Tensor::arange(n, (Kind::Int64, Device::Cpu)) + offset).remainder(modulo) * 16
    };
    let mut grads: Vec<Tensor> = (0..150).map(|i| ints(1000, i, 97).to_kind(Kind::Half)).collect();
    grads.push(ints(300_000, 0, 1000).to_kind(Kind::Float));
    grads.push(ints(70_000, 3, 100).to_kind(Kind::BFloat16));
    grads.into_iter().map(|g| g.to_device(dev)).collect()
}

/// `unscale_` (libtorch's fused non-finite check and unscale) on CUDA: clean gradients are
/// unscaled exactly as on the CPU and the flag stays 0; one inf, -inf or NaN anywhere (the
/// first element, the last tensor of a second launch, past the first chunk of a long tensor)
/// sets it to 1.
#[test]
fn unscale_on_cuda_checks_every_tensor_and_chunk() {
    let _s = serial();
    let dev = cuda();
    let flag = || Tensor::zeros([1], (Kind::Float, dev));
    let inv = Tensor::full([1], 1.0 / 16.0, (Kind::Float, dev));
    let grads = many_grads(dev);
    let found = flag();
    tch_amp::optim::unscale_(&grads, &found, &inv).unwrap();
    assert_eq!(found.to_device(Device::Cpu).double_value(&[0]), 0.0);
    let cpu = many_grads(Device::Cpu);
    let cpu_found = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    let cpu_inv = Tensor::full([1], 1.0 / 16.0, (Kind::Float, Device::Cpu));
    tch_amp::optim::unscale_(&cpu, &cpu_found, &cpu_inv).unwrap();
    for (i, (g, c)) in grads.iter().zip(&cpu).enumerate() {
        assert_eq!(g.kind(), c.kind(), "grad {i}");
        assert!(same(&g.to_device(Device::Cpu), c), "grad {i}: CUDA and CPU unscale differ");
        assert!(c.max().double_value(&[]) < 1000.0, "grad {i} was not unscaled");
    }
    let spots = [
        (0usize, 0i64, f64::INFINITY),
        (137, 999, f64::NAN),
        (150, 250_001, f64::NEG_INFINITY),
        (151, 69_999, f64::NAN),
    ];
    for (tensor, element, bad) in spots {
        let grads = many_grads(dev);
        let _ = grads[tensor].get(element).fill_(bad);
        let found = flag();
        tch_amp::optim::unscale_(&grads, &found, &inv).unwrap();
        assert_eq!(found.to_device(Device::Cpu).double_value(&[0]), 1.0, "{bad} in grad {tensor}[{element}] not found");
    }
}

/// Save and resume on CUDA under O1 (casts at AutocastCUDA) and O2 (fp16 model, fp32
/// masters), Adam: a run restored at step 4 into a differently initialised model continues bit
/// for bit (weights, masters, batch-norm statistics, outputs, scaler), and everything stays on
/// the GPU.
#[test]
fn checkpoint_resume_on_cuda_is_bit_exact() {
    let _s = serial();
    let dev = cuda();
    let dir = tempfile::tempdir().unwrap();
    for level in [OptLevel::O1, OptLevel::O2] {
        let path = dir.path().join(format!("{level}.safetensors"));
        let mut run = cuda_run(dev, level, true);
        let mut restored: Option<CudaRun> = None;
        for i in 0..10 {
            let (x, _) = cuda_batch(i, dev);
            train_step(&mut run, i, None);
            if i == 4 {
                save_checkpoint(&path, &run.vs, &[&run.opt], &run.amp).unwrap();
                tch::manual_seed(1234);
                let mut r = cuda_run(dev, level, false);
                assert!(full_state(&r).iter().zip(full_state(&run)).any(|((_, a), (_, b))| !same(a, &b)));
                load_checkpoint(&path, &r.vs, &mut [&mut r.opt], &mut r.amp).unwrap();
                assert_bits(&format!("{level}: right after load"), &full_state(&run), &full_state(&r));
                assert_eq!(crate::common::json(&run.amp.state_dict()), crate::common::json(&r.amp.state_dict()));
                for m in r.opt.master_params() {
                    assert_eq!(m.device(), dev, "{level}: a master left the GPU");
                }
                restored = Some(r);
            } else if let Some(r) = restored.as_mut() {
                train_step(r, i, None);
                assert_bits(&format!("{level}: step {i}"), &full_state(&run), &full_state(r));
                let out = tch::no_grad(|| run.model.forward_t(&x, false));
                let out_r = tch::no_grad(|| r.model.forward_t(&x, false));
                assert_eq!(out.device(), dev);
                assert!(same(&out, &out_r), "{level}: outputs differ at step {i}");
                assert_eq!(crate::common::json(&run.amp.state_dict()), crate::common::json(&r.amp.state_dict()));
            }
        }
        assert_eq!(run.opt.step_counts(), (10, 0), "{level}");
    }
}
