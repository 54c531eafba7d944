//! O2's slice-wise step, in its own process (it counts every CPU allocation): the fp32 master
//! gradients are made from the fp16 ones a slice at a time inside `step`, which must give
//! exactly what making them full-size before `step` gives (`master_params()` between
//! `scale_loss` and `step` does that, as clipping does), and holds at most 16 bytes per
//! parameter with Adam (2 fp16 weight + 4 fp32 master + 2 fp16 gradient + 8 Adam state) plus
//! one slice, measured with a counting CPU allocator, where the full-size path holds 18.
use std::sync::Mutex;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::clear_cast_cache;
use tch_amp::diagnostics::{cpu_memory, reset_cpu_memory_peak, track_cpu_memory};
use tch_amp::{
    initialize, AmpConfig, FusedAdagrad, FusedAdam, FusedLamb, FusedNovoGrad, FusedSgd, OptLevel, OptimizerConfig,
};

/// The tests count process-wide allocations: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn net(vs: &VarStore, width: i64) -> nn::Sequential {
    let r = vs.root();
    nn::seq()
        .add(nn::linear(&r / "a", 64, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "b", width, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "c", width, 8, Default::default()))
}

/// Bits of every variable and master and of the optimizer state after `steps` O2 steps; with
/// `full_size` the master gradients are made at once before each step.
fn train(opt_cfg: OptimizerConfig, full_size: bool, steps: usize) -> Vec<(String, Vec<i32>)> {
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    // 768 x 768 = 589,824 elements: three slices of at most 256 Ki, the last one partial.
    let model = net(&vs, 768);
    let amp_cfg = AmpConfig::new(OptLevel::O2).loss_scale(128.0);
    let (model, mut opt, mut amp) = initialize(&vs, model, opt_cfg, 1e-2, &amp_cfg).unwrap();
    let x = Tensor::randn([16, 64], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    for _ in 0..steps {
        opt.zero_grad().unwrap();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        if full_size {
            let masters = opt.master_params();
            assert!(masters.iter().all(|m| m.grad().defined()), "master_params() makes the master gradients");
        }
        assert!(opt.step().unwrap().stepped());
    }
    let bits = |t: &Tensor| -> Vec<i32> {
        let t = t.to_kind(Kind::Float).flatten(0, -1);
        Vec::<f32>::try_from(&t).unwrap().iter().map(|v| v.to_bits() as i32).collect()
    };
    let mut out: Vec<(String, Vec<i32>)> = Vec::new();
    let mut names: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, v) in names {
        assert_eq!(v.kind(), Kind::Half, "{name}: O2 casts the model");
        out.push((name, bits(&v)));
    }
    let record = opt.to_record();
    for p in record.params {
        out.push((format!("{} master", p.name), bits(p.master.as_ref().unwrap())));
        for (k, b) in p.buffers {
            out.push((format!("{} {k}", p.name), bits(&b)));
        }
    }
    out
}

/// Slices (three for the 768x768 weight, one for the others) and no slicing (master gradients
/// made full-size before `step`) give the same bits for every rule, including the first update
/// that creates the state.
#[test]
fn slice_wise_step_equals_full_size_step_bit_for_bit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let configs: Vec<(&str, OptimizerConfig)> = vec![
        ("adam", nn::Adam { wd: 1e-3, ..Default::default() }.into()),
        ("adamw amsgrad", nn::AdamW { amsgrad: true, ..Default::default() }.into()),
        ("adam fused", OptimizerConfig::from(nn::Adam { wd: 1e-3, ..Default::default() }).fused(true)),
        ("adamw fused amsgrad", OptimizerConfig::from(nn::AdamW { amsgrad: true, ..Default::default() }).fused(true)),
        ("adam maximize", OptimizerConfig::from(nn::Adam::default()).maximize(true)),
        ("sgd nesterov", nn::Sgd { momentum: 0.9, nesterov: true, wd: 1e-4, ..Default::default() }.into()),
        ("sgd dampening", nn::Sgd { momentum: 0.9, dampening: 0.3, ..Default::default() }.into()),
        ("rmsprop centered", nn::RmsProp { centered: true, momentum: 0.5, ..Default::default() }.into()),
        // Apex's elementwise rules run slice by slice too; LAMB and NovoGrad (per-tensor norms)
        // make every master gradient at once.
        (
            "fused sgd wd after momentum",
            FusedSgd { momentum: 0.9, weight_decay: 1e-4, wd_after_momentum: true, ..Default::default() }.into(),
        ),
        ("fused adam l2", FusedAdam { weight_decay: 1e-3, adam_w_mode: false, ..Default::default() }.into()),
        ("fused adagrad", FusedAdagrad { weight_decay: 1e-3, ..Default::default() }.into()),
        ("fused lamb", FusedLamb::default().into()),
        ("fused novograd", FusedNovoGrad { weight_decay: 1e-3, ..Default::default() }.into()),
    ];
    for (name, cfg) in configs {
        let full = train(cfg, true, 3);
        let sliced = train(cfg, false, 3);
        assert_eq!(full.len(), sliced.len());
        for ((a_name, a), (b_name, b)) in full.iter().zip(&sliced) {
            assert_eq!(a_name, b_name);
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            assert_eq!(differ, 0, "{name}: {a_name} differs in {differ} of {} values", a.len());
        }
    }
}

fn adam(fused: bool) -> OptimizerConfig {
    OptimizerConfig::from(nn::Adam::default()).fused(fused)
}

/// Peak bytes per parameter from the end of backward to the end of `step` (the unscale, the
/// master gradients, Adam, the copy into the model), measured with the counting allocator:
/// everything the process holds then except the batch (what the caller holds: the input and
/// target tensors; the loss and the 4x8 output are a few hundred bytes). Anything tch-amp keeps
/// (a cast cache, say) counts.
fn measured_peak(full_size: bool, fused: bool) -> (f64, f64) {
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let model = net(&vs, 1024);
    let (model, mut opt, mut amp) =
        initialize(&vs, model, adam(fused), 1e-3, &AmpConfig::new(OptLevel::O2).loss_scale(128.0)).unwrap();
    let x = Tensor::randn([4, 64], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    // Allocated after the counter was installed: the counter sees them (and the batch is
    // subtracted as the caller's).
    let mut step = |measure: bool| -> (f64, f64) {
        opt.zero_grad().unwrap();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| {
            s.backward();
            // What scale_loss does right after backward (under CPU emulation the cache holds
            // the forward's fp32 copies of the fp16 weights); the peak starts after it.
            clear_cast_cache().unwrap();
            reset_cpu_memory_peak().unwrap();
        })
        .unwrap();
        if full_size {
            let _ = opt.master_params();
        }
        let state = opt.memory();
        assert!(opt.step().unwrap().stepped());
        let after = cpu_memory().unwrap();
        let other = ((x.numel() + y.numel()) * 4) as i64;
        let params = state.params as f64;
        if measure {
            ((after.peak - other) as f64 / params, state.bytes_per_param())
        } else {
            (0.0, 0.0)
        }
    };
    step(false);
    step(false);
    step(true)
}

#[test]
fn o2_adam_peaks_at_16_bytes_per_param_measured() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    track_cpu_memory().unwrap();
    let params = (64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 8 + 8) as f64;
    // Fused Adam has no temporaries: 16 B/param of state plus one fp32 slice buffer.
    let slice = (1 << 18) as f64;
    let (peak, counted) = measured_peak(false, true);
    println!("slice-wise, fused Adam: {peak:.4} B/param measured at the peak, {counted} counted at step");
    assert_eq!(counted, 16.0, "fp16 weight 2 + master 4 + fp16 grad 2 + Adam 8, counted at step");
    assert!(peak <= 16.0 + (4.0 * slice + 2048.0) / params, "slice-wise: measured peak {peak:.5} B/param");
    assert!(peak >= 15.99, "the counter sees the training state: {peak:.4}");
    // torch.optim's single-tensor Adam (the default) makes two fp32 temporaries per update
    // (sqrt, then the division by the bias correction), here of one slice (256 Ki elements)
    // instead of one parameter (O0 makes them for the largest parameter, 1 Mi elements).
    let (peak_single, _) = measured_peak(false, false);
    println!("slice-wise, single-tensor Adam: {peak_single:.4} B/param measured at the peak");
    assert!(peak_single <= 16.0 + (2048.0 + 3.0 * 4.0 * slice) / params, "{peak_single:.4} B/param");
    // The full-size path (the fp32 master gradients made before step, fp16 ones freed one by
    // one) holds 18 at step.
    let (peak_full, counted_full) = measured_peak(true, true);
    println!("full-size, fused Adam: {peak_full:.4} B/param measured at the peak, {counted_full} counted at step");
    assert_eq!(counted_full, 18.0, "fp16 weight 2 + master 4 + fp32 master grad 4 + Adam 8");
    assert!(peak_full >= 17.99, "full-size: measured peak {peak_full:.4} B/param");
}
